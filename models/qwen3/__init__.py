"""Qwen3 (dense): config, trainer (``train.py``) and server (``serve.py``)
calling the same kernels, and the Hugging Face name map (``weights.py``).
Loading, LoRA (merged, separate, several adapters), FP8 and saving are the
zoo's (``models/loading.py``); ``SPEC`` is what this folder tells it.
"""
from __future__ import annotations

import functools

from .. import loading
from ..spec import ModelSpec
from .config import PRESETS, Qwen3Config
from .serve import Qwen3Server
from .train import Qwen3Trainer
from .weights import MODEL_TYPE as NAME, from_hf, lora_from_hf, lora_to_hf, to_hf


def _vendor_server():
    from .serve_vendor import Qwen3VendorServer

    return Qwen3VendorServer


SPEC = ModelSpec(
    name=NAME, config_cls=Qwen3Config, presets=PRESETS, trainer_cls=Qwen3Trainer, server_cls=Qwen3Server,
    vendor_server_cls=_vendor_server, from_hf=from_hf, to_hf=to_hf, lora_from_hf=lora_from_hf,
    lora_to_hf=lora_to_hf, init_weights=loading.init_weights,
)

load = functools.partial(loading.load, SPEC)
build_trainer = functools.partial(loading.build_trainer, SPEC)
resolve_config = functools.partial(loading.resolve_config, SPEC)
save_pretrained = functools.partial(loading.save_pretrained, SPEC)
load_adapter = functools.partial(loading.load_adapter, SPEC)

__all__ = ["NAME", "PRESETS", "SPEC", "Qwen3Config", "Qwen3Server", "Qwen3Trainer", "build_trainer", "load",
           "load_adapter", "resolve_config", "save_pretrained"]
