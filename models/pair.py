"""An aligned pair: a model's trainer and its server, with weight sync.

``pair.trainer`` is an ``nn.Module`` with ``logprobs(sequences, prompt_lens,
sampling)``; ``pair.server`` is the engine (``generate``, ``score``) running the
model's ``ServeModel`` on its own copy of the weights; ``pair.sync()`` makes the
server's weights the trainer's and bumps the weight version that completions
carry.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Pair:
    name: str
    config: object
    trainer: nn.Module
    server: object  # common.engine.Engine

    def sync(self) -> int:
        """Copy the trainer's weights into the server's tensors in place (the
        CUDA graphs keep pointing at them) between engine steps; returns the
        new weight version."""
        weights = self.server.model.weights
        params = dict(self.trainer.named_parameters())
        missing = sorted(set(weights) - set(params))
        if missing:
            raise RuntimeError(f"the server holds weights the trainer lacks: {missing[:5]}")

        def apply():
            with torch.no_grad():
                for name, w in weights.items():
                    w.copy_(params[name])

        return self.server.update_weights(apply)

    def save_pretrained(self, directory, **kw) -> None:
        """Save the trainer's weights as a Hugging Face checkpoint."""
        from importlib import import_module

        import_module(f"alignzoo.models.{self.name}").save_pretrained(self.trainer, directory, **kw)
