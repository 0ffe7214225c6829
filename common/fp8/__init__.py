"""FP8 e4m3 block quantization (HF ``weight`` / ``weight_scale_inv`` layout) and a
batch-invariant FP8 block-scaled GEMM with a straight-through backward."""
from .naive import e4m3_round_ref, fp8_linear_ref, fp8_matmul_ref
from .op import (
    Fp8WeightCache,
    QuantizedCache,
    dequantize_weight_fp8,
    fp8_linear,
    fp8_matmul,
    fp8_matmul_bwd,
    fp8_matmul_fwd,
    quantize_act_fp8,
    quantize_weight_fp8,
)
from .quant import AMAX_FLOOR, BLOCK, FP8_MAX

__all__ = [
    "quantize_weight_fp8",
    "dequantize_weight_fp8",
    "quantize_act_fp8",
    "fp8_matmul",
    "fp8_linear",
    "fp8_matmul_fwd",
    "fp8_matmul_bwd",
    "Fp8WeightCache",
    "QuantizedCache",
    "fp8_matmul_ref",
    "fp8_linear_ref",
    "e4m3_round_ref",
    "BLOCK",
    "FP8_MAX",
    "AMAX_FLOOR",
]
