"""DeepSeek-V4 (``deepseek_v4_mhc_mxfp4``, transformers' ``deepseek_v4``): four mHC residual streams, shared-KV
MQA over a sliding window plus compressed history (C4 rows picked by an indexer, C128 rows read whole) with
per-head sinks, hash- and learned-routed experts (MXFP4 when the checkpoint's are) with a shared expert.
Config (``config.py``), trainer (``train.py``) and server (``serve.py``) calling the same kernels, the Hugging
Face and release name maps (``weights.py``); loading and saving are the zoo's (``models/loading.py``).  A release
checkpoint's FP8 linears load as code x scale (exact with its E8M0 scales) and its MXFP4 experts as stored, byte for
byte; a model with MXFP4 experts saves them the release's way, which transformers reads too.

Not yet in the registry (``alignzoo.models``): ``load`` builds a pair through ``models/loading.py``;
``tests/test_deepseek_v4.py`` holds its contract (and router / index replay), ``tests/test_deepseek_v4_lora.py``
its LoRA (the attention's q_a / q_b / kv / o_b and the routed experts; on MXFP4 experts separate only),
``serve_vendor.py`` is the misaligned server on torch's kernels.  ``fp8=True``: the attention's q_a / q_b / kv / o_b
and the shared expert train as FP32 masters read as FP8 block codes, requantized once a step (``train.py`` says
which linears stay in the model dtype); a release checkpoint's FP8 linears become those masters as code x scale in
fp32, and the codes are requantized from them (with E8M0 scales, not the stored codes byte for byte); they save
unquantized.  CUDA-graph decode is still to come.
"""
from __future__ import annotations

import functools

import torch

from ...common.moe import quantize_experts_mxfp4
from .. import loading
from ..moe_block import MXFP4
from ..spec import ModelSpec
from .config import PRESETS, DeepseekV4Config
from .serve import DeepseekV4Server
from .train import NAME, DeepseekV4Trainer
from .weights import FP32_NAMES, LORA_PARAM_ORDER, from_hf, lora_from_hf, lora_to_hf, saved_quantization, to_hf


def init_weights(trainer: DeepseekV4Trainer, seed: int = 0) -> None:
    """A seeded random model (``loading.init_weights``) with transformers' init where it differs: sinks and
    position biases zero, mHC bases zero and scales one, the correction bias zero; each hash table routes
    token v to experts (v k + j) mod E, distinct in a row (transformers' zeros would send every token to one)."""
    c = trainer.cfg
    E, k = c.n_routed_experts, c.num_experts_per_tok

    def table(p):
        return ((torch.arange(p.shape[0], device=p.device)[:, None] * k + torch.arange(k, device=p.device)) % E)

    loading.init_weights(trainer, seed, fill={"attn.sinks": 0.0, "position_bias": 0.0, ".base": 0.0, ".scale": 1.0,
                                              "moe.correction_bias.weight": 0.0, "moe.tid2eid.weight": table})
    g = torch.Generator(device=trainer.device).manual_seed(seed + 1)
    for layer in trainer.layers:  # MXFP4 experts are frozen codes, not parameters: random masters, quantized
        moe = layer.moe
        if moe.spec.experts is not MXFP4:
            continue
        gu, d = (torch.empty(s.weight.shape[:2] + (s.weight.shape[2] * 2,), device=trainer.device).normal_(
            0.0, 0.02, generator=g) for s in (moe.gate_up, moe.down))
        codes = quantize_experts_mxfp4(gu, d)
        for stack, (c, sc) in zip((moe.gate_up, moe.down), (codes[:2], codes[2:])):
            stack.weight.copy_(c)
            stack.weight_scale.copy_(sc)


def _vendor_server():
    from .serve_vendor import DeepseekV4VendorServer

    return DeepseekV4VendorServer


SPEC = ModelSpec(
    name=NAME, config_cls=DeepseekV4Config, presets=PRESETS, trainer_cls=DeepseekV4Trainer,
    server_cls=DeepseekV4Server, vendor_server_cls=_vendor_server, from_hf=from_hf, to_hf=to_hf,
    lora_from_hf=lora_from_hf, lora_to_hf=lora_to_hf, init_weights=init_weights, fp32_names=FP32_NAMES,
    lora_param_order=LORA_PARAM_ORDER,
)

load = functools.partial(loading.load, SPEC)
build_trainer = functools.partial(loading.build_trainer, SPEC)


def save_pretrained(trainer: DeepseekV4Trainer, directory, **kw) -> None:
    """``loading.save_pretrained``.  MXFP4 experts save as the release stores them (``weights.to_hf``: DeepSeek's
    names, int8 codes and float8_e8m0fnu scales, the trainer's bytes) under ``weights.saved_quantization``'s
    quantization_config; the other linears unquantized.  Adapters inside MXFP4 experts save as a PEFT adapter only
    (``adapter_only=True``): a merged W' would have to be requantized, and the codes are the checkpoint's."""
    if not kw.get("adapter_only") and any(layer.moe.spec.experts is MXFP4 for layer in trainer.layers):
        if any(layer.moe.experts_lora is not None for layer in trainer.layers):
            raise NotImplementedError("LoRA inside MXFP4 experts saves with adapter_only=True (a PEFT adapter over "
                                      "the frozen codes); a merged checkpoint would requantize W'")
        kw["quantization_config"] = saved_quantization(trainer.cfg)
    loading.save_pretrained(SPEC, trainer, directory, **kw)
load_adapter = functools.partial(loading.load_adapter, SPEC)

__all__ = ["NAME", "PRESETS", "SPEC", "DeepseekV4Config", "DeepseekV4Server", "DeepseekV4Trainer", "build_trainer",
           "load", "load_adapter", "save_pretrained"]
