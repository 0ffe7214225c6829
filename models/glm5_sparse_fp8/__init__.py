"""GLM-5 (``glm5_sparse_fp8``, transformers' ``glm_moe_dsa``): MLA attention whose
positions a DSA indexer selects ("full" layers run it, "shared" layers reuse the
last full layer's top-k), a sigmoid router with a correction bias over FP8 block
experts, shared experts, dense MLP layers first.  Config (``config.py``), trainer
(``train.py``) and server (``serve.py``) calling the same kernels, the Hugging
Face name map and FP8 block checkpoints (``weights.py``); loading, LoRA and
saving are the zoo's (``models/loading.py``).
"""
from __future__ import annotations

import functools

from .. import loading
from ..spec import ModelSpec
from .config import PRESETS, Glm5Config
from .serve import Glm5Server
from .train import NAME, Glm5Trainer
from .weights import FP32_NAMES, LORA_PARAM_ORDER, from_hf, lora_from_hf, lora_to_hf, to_hf


def init_weights(trainer: Glm5Trainer, seed: int = 0) -> None:
    """A seeded random model (``loading.init_weights``: matrices normal(0, 0.02), norms one), with
    transformers' zeros for the router's correction bias and the indexer's LayerNorm bias."""
    loading.init_weights(trainer, seed, fill={"moe.correction_bias.weight": 0.0, "indexer.k_norm.bias": 0.0})


def _vendor_server():
    from .serve_vendor import Glm5VendorServer

    return Glm5VendorServer


SPEC = ModelSpec(
    name=NAME, config_cls=Glm5Config, presets=PRESETS, trainer_cls=Glm5Trainer, server_cls=Glm5Server,
    vendor_server_cls=_vendor_server, from_hf=from_hf, to_hf=to_hf, lora_from_hf=lora_from_hf,
    lora_to_hf=lora_to_hf, init_weights=init_weights, fp32_names=FP32_NAMES,
    lora_param_order=LORA_PARAM_ORDER,
)

load = functools.partial(loading.load, SPEC)
build_trainer = functools.partial(loading.build_trainer, SPEC)
resolve_config = functools.partial(loading.resolve_config, SPEC)
save_pretrained = functools.partial(loading.save_pretrained, SPEC)
load_adapter = functools.partial(loading.load_adapter, SPEC)

__all__ = ["NAME", "PRESETS", "SPEC", "Glm5Config", "Glm5Server", "Glm5Trainer", "build_trainer", "load",
           "load_adapter", "resolve_config", "save_pretrained"]
