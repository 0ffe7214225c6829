"""Ladder rungs 1-2 and accuracy for the FP8 GEMM and quantizers (``alignzoo check fp8``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, bitwise_equal, rung1_repeat, rung2_rows
from .naive import fp8_matmul_ref
from .op import fp8_matmul_bwd, fp8_matmul_fwd
from .quant import quantize_act, quantize_weight


def launch_configs(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [{}, {"block_m": 64, "block_n": 64, "num_warps": 4},
                {"block_m": 128, "block_n": 256, "num_warps": 8, "num_stages": 3},
                {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 2}]
    return [{}, {"row_chunk": 5}]


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    M, K, N = (48, 1000, 300) if device.type == "cpu" else (300, 4000, 1000)  # K, N: not multiples of 128
    x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device)
    dy = torch.randn(M, N, generator=g).to(device, torch.bfloat16)
    codes, scale_inv = quantize_weight(w)

    def dx_only(dy, x):
        return fp8_matmul_bwd(x, codes, scale_inv, dy, need_dw=False)[0]

    rows = [
        ("gemm", rung1_repeat("fp8", fp8_matmul_fwd, x, codes, scale_inv)),
        ("weight quant", rung1_repeat("fp8", quantize_weight, w)),
        ("bwd", rung1_repeat("fp8", fp8_matmul_bwd, x, codes, scale_inv, dy)),
        ("gemm", rung2_rows("fp8", fp8_matmul_fwd, (x,), shared={"w_codes": codes, "w_scale_inv": scale_inv},
                            configs=launch_configs(device))),
        ("act quant", rung2_rows("fp8", quantize_act, (x,))),
        ("bwd dX", rung2_rows("fp8", dx_only, (dy, x))),
    ]
    out = []
    for name, r in rows:
        r.check = f"{name}: {r.check}"
        out.append(r)
    if device.type == "cuda":  # one quantizer for trainer and server: same bytes on both devices
        same = [bitwise_equal(a.cpu(), b) for a, b in zip((*quantize_weight(w), *quantize_act(x)),
                                                            (*quantize_weight(w.cpu()), *quantize_act(x.cpu())))]
        out.append(RungResult("fp8", 1, "quantizers: cuda == cpu", all(same), len(same), same.count(False)))
    y = fp8_matmul_fwd(x, codes, scale_inv)
    out += [
        # one bf16 output rounding (2^-9) over exact-operand float64
        accuracy("fp8", y, fp8_matmul_ref(x, codes, scale_inv), 5e-3, "bf16 vs float64 (dequantized operands)"),
        # the quantization itself: e4m3 keeps 2^-4 relative per element (measured ~0.04)
        accuracy("fp8", y, x.double() @ w.double().t(), 0.1, "bf16 vs float64 (unquantized operands)"),
    ]
    return out
