"""Reading FP8 Hugging Face checkpoints (``quantization_config.quant_method ==
"fp8"``, 128x128 weight blocks): each ``X.weight`` stored as float8_e4m3fn
codes with ``X.weight_scale_inv`` reads as its dequantized fp32 value, so a
name map sees an ordinary checkpoint.  A unified-FP8 trainer keeps these as
FP32 masters and quantizes them again (for 128-aligned blocks with an exact
448 amax code this reproduces the stored codes).  The reader is
``formats.DequantizedSource`` under its default rule; other formats (E8M0
scales, MXFP4 experts) are rules of the same reader."""
from __future__ import annotations

from collections.abc import Mapping

from .formats import FP8_RULE, DequantizedSource

SCALE_SUFFIX = FP8_RULE.scale_suffix

__all__ = ["SCALE_SUFFIX", "DequantizedSource", "is_fp8_checkpoint"]


def is_fp8_checkpoint(config: Mapping) -> bool:
    q = config.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return False
    block = q.get("weight_block_size")
    if block is not None and list(block) != [128, 128]:
        raise NotImplementedError(f"FP8 checkpoint with weight_block_size {block}; only [128, 128] blocks are supported")
    return True
