"""An aligned pair: a model's trainer and its server, with weight sync.

``pair.trainer`` is an ``nn.Module`` with ``logprobs(sequences, prompt_lens,
sampling)`` and ``forward_weights()`` (the exact tensors its forward reads:
parameters, or cached FP8 codes and scales); ``pair.server`` is the engine
(``generate``, ``score``) running the model's ``ServeModel`` on its own copy of
those tensors; ``pair.sync()`` publishes the blocks that changed since the
last sync and applies them between engine steps (``alignzoo.sync``), refusing
NaN/Inf weights.  What the checkpoint ships beside its weights rides along
(``models/text.py``): ``pair.tokenizer`` (None: token ids only), the EOS ids the
server stops at, ``generation_config.json``'s sampling defaults
(``pair.sampling_params(**overrides)``) and the chat template.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..common.sampling import SamplingParams
from ..sync import Publisher, Receiver, SyncStats, apply_between_steps, weights_checksum
from .text import CheckpointText


@dataclass
class Pair:
    name: str
    config: object
    trainer: object  # nn.Module with logprobs() and forward_weights()
    server: object  # common.engine.Engine
    text: CheckpointText = field(default_factory=CheckpointText)
    last_sync: SyncStats | None = field(default=None, init=False)

    def __post_init__(self):
        self._publisher = Publisher(self.trainer.forward_weights, check_finite=True)
        self._receiver = Receiver(self.server.model.weights, version=self.server.weight_version, check_finite=True)
        self.sync()  # v1: everything; later syncs ship changed blocks only

    def sync(self, *, full: bool = False) -> int:
        """Make the server's weights the bytes the trainer's next forward
        reads; returns the new weight version (completions carry it).  Only
        blocks changed since the last sync travel; ``full=True`` ships every
        block (a full resync), which ``sync()`` also does by itself when the
        server did not take the last version (a refused payload) or holds none
        (its weights changed out of band).  Every check, the end state's
        included, runs before anything is written: a refused sync raises
        ``alignzoo.sync.SyncError`` (``NonFiniteWeights`` names the trainer's
        tensors holding NaN/Inf) and the server keeps its weights and version.

        Call it after every optimizer step: it is the point where the
        trainer's derived weights (FP8 codes, merged LoRA W') are rebuilt from
        the masters (``invalidate_caches``), so even optimizer kernels that
        bypass torch's version counter (``fused=True``) reach both sides."""
        invalidate = getattr(self.trainer, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()
        full = bool(full) or self._receiver.version != self._publisher.version
        payload = self._publisher.publish(full=full)
        version = apply_between_steps(self.server, self._receiver, payload)
        self.last_sync = payload.stats
        return version

    @property
    def tokenizer(self):
        """The checkpoint's transformers tokenizer (its chat template included), or None."""
        return self.text.tokenizer

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids every generated request stops at unless ``SamplingParams.ignore_eos``."""
        return self.server.eos_token_ids

    @property
    def generation_defaults(self) -> dict:
        """``SamplingParams`` fields from the checkpoint's generation_config.json ({} without one)."""
        return dict(self.text.generation_defaults)

    def sampling_params(self, **overrides) -> SamplingParams:
        """``SamplingParams`` with the checkpoint's generation defaults under ``overrides``."""
        return SamplingParams(**{**self.text.generation_defaults, **overrides})

    def weights_match(self) -> bool:
        """The server holds exactly the trainer's forward weights (device-side checksum)."""
        return weights_checksum(self.server.model.weights) == weights_checksum(self.trainer.forward_weights())

    def save_pretrained(self, directory, **kw) -> None:
        """Save the trainer's weights as a Hugging Face checkpoint, with the tokenizer and
        generation_config.json the pair was loaded with (not for ``adapter_only``)."""
        import json
        import os
        from importlib import import_module

        import_module(f"alignzoo.models.{self.name}").save_pretrained(self.trainer, directory, **kw)
        if kw.get("adapter_only"):
            return
        if self.text.tokenizer is not None:
            self.text.tokenizer.save_pretrained(os.fspath(directory))
        if self.text.generation_config is not None:
            with open(os.path.join(directory, "generation_config.json"), "w") as f:
                json.dump(self.text.generation_config, f, indent=2)
