"""Qwen3.5-MoE (``qwen35_gdn``): Gated DeltaNet and gated attention layers,
each followed by a MoE block.  Config (``config.py``), trainer (``train.py``)
and server (``serve.py``) calling the same kernels, the Hugging Face name map
(``weights.py``); loading, LoRA and saving are the zoo's (``models/loading.py``).
"""
from __future__ import annotations

import functools

import torch

from .. import loading
from ..spec import ModelSpec
from .config import PRESETS, Qwen35GdnConfig
from .serve import Qwen35GdnServer
from .train import NAME, Qwen35GdnTrainer
from .weights import LORA_PARAM_ORDER, from_hf, lora_from_hf, lora_to_hf, to_hf


def _a_log(p: torch.Tensor) -> torch.Tensor:
    return torch.linspace(1.0, 16.0, p.numel(), device=p.device).log()


def init_weights(trainer: Qwen35GdnTrainer, seed: int = 0) -> None:
    """A seeded random model (``loading.init_weights``): matrices normal(0, 0.02)
    (the conv taps 0.3, so the mixer's signal survives four taps), zero-centred
    norm weights 0 (the norm reads 1 + w), the gated norm 1, dt_bias 1, A_log =
    log of 1..16 spread over the heads, as transformers' init does in distribution."""
    loading.init_weights(trainer, seed, vector=0.0, std={"gdn.conv.weight": 0.3},
                         fill={"gdn.A_log.weight": _a_log, "gdn.dt_bias.weight": 1.0, "gdn.norm.weight": 1.0})


def _vendor_server():
    from .serve_vendor import Qwen35GdnVendorServer

    return Qwen35GdnVendorServer


SPEC = ModelSpec(
    name=NAME, config_cls=Qwen35GdnConfig, presets=PRESETS, trainer_cls=Qwen35GdnTrainer,
    server_cls=Qwen35GdnServer, vendor_server_cls=_vendor_server, from_hf=from_hf, to_hf=to_hf,
    lora_from_hf=lora_from_hf, lora_to_hf=lora_to_hf, init_weights=init_weights, lora_param_order=LORA_PARAM_ORDER,
)

load = functools.partial(loading.load, SPEC)
build_trainer = functools.partial(loading.build_trainer, SPEC)
resolve_config = functools.partial(loading.resolve_config, SPEC)
save_pretrained = functools.partial(loading.save_pretrained, SPEC)
load_adapter = functools.partial(loading.load_adapter, SPEC)

__all__ = ["NAME", "PRESETS", "SPEC", "Qwen35GdnConfig", "Qwen35GdnServer", "Qwen35GdnTrainer", "build_trainer",
           "load", "load_adapter", "resolve_config", "save_pretrained"]
