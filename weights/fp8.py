"""Reading FP8 Hugging Face checkpoints (``quantization_config.quant_method ==
"fp8"``, 128x128 weight blocks): each ``X.weight`` stored as float8_e4m3fn
codes with ``X.weight_scale_inv`` reads as its dequantized fp32 value, so a
name map sees an ordinary checkpoint.  A unified-FP8 trainer keeps these as
FP32 masters and quantizes them again (for 128-aligned blocks with an exact
448 amax code this reproduces the stored codes)."""
from __future__ import annotations

from collections.abc import Mapping

import torch

from ..common.fp8 import dequantize_weight_fp8

SCALE_SUFFIX = "_scale_inv"


def is_fp8_checkpoint(config: Mapping) -> bool:
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return False
    block = q.get("weight_block_size")
    if block is not None and list(block) != [128, 128]:
        raise NotImplementedError(f"FP8 checkpoint with weight_block_size {block}; only [128, 128] blocks are supported")
    return True


class DequantizedSource:
    """An ``HFCheckpoint`` (or any source with keys/shape/get) whose FP8
    weights read as fp32; the scale tensors are consumed, not listed."""

    def __init__(self, source):
        self.source = source
        names = set(source.keys())
        self._fp8 = {n for n in names if n + SCALE_SUFFIX in names}
        self._keys = [n for n in source.keys() if not (n.endswith(SCALE_SUFFIX) and n[: -len(SCALE_SUFFIX)] in self._fp8)]

    def keys(self):
        return list(self._keys)

    def __contains__(self, name):
        return name in self._keys

    def shape(self, name):
        return self.source.shape(name)

    def is_float(self, name):
        return name in self._fp8 or self.source.is_float(name)

    def get(self, name):
        t = self.source.get(name)
        if name in self._fp8:
            return dequantize_weight_fp8(t, self.source.get(name + SCALE_SUFFIX), torch.float32)
        return t

    def __repr__(self):
        return f"{self.source!r} (FP8 weights dequantized: {len(self._fp8)})"
