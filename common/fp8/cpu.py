"""CPU FP8 block-scaled GEMM, batch-invariant by construction.

For x codes xq (M, K) with per-token scales sx (M, KB) and weight codes wq
(N, K) with block scales sw (ceil(N/128), KB), KB = ceil(K/128):

    acc = 0                                                   fp32
    for b = 0, 1, ..., KB-1:                                  K blocks in increasing order
        p   = fl32(sum over k in block b of xq[i,k] * wq[j,k])     exact sum, one rounding
        s   = fl32(sx[i, b] * sw[j // 128, b])
        acc = fl32(acc + fl32(p * s))                         mul, then add (no FMA)
    y[i, j] = out_dtype(acc)                                  one rounding (bf16)

Why the block sum needs no fixed order: an e4m3 value is k * 2^-9 with
|k| <= 448 * 2^9 < 2^18, so a product is a multiple of 2^-18 below 2^36 * 2^-18,
and a sum of at most 128 products a multiple of 2^-18 below 2^43 * 2^-18 — 43
significant bits, which float64 (53) holds exactly.  Every partial sum, in any
order or grouping, is therefore exact, and so is an FMA.  The block dot is a
float64 ``torch.mm``: torch's CPU mm is not batch-invariant in general (DESIGN
§5) only because its roundings follow a shape-dependent blocking; here nothing
rounds until the single float64 -> fp32 conversion, so ``p`` is the correctly
rounded block dot whatever BLAS does.  The rest is element-wise (each element
rounds on its own), so row i's bits depend only on row i of x and on the
weight: the same for any batch size and row order.
(tests/test_fp8.py checks the exactness against a reversed-order element loop.)
"""
from __future__ import annotations

import torch

from .quant import BLOCK


def fp8_gemm_cpu(x_codes: torch.Tensor, x_scales: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor,
                 out_dtype: torch.dtype, row_chunk: int | None = None) -> torch.Tensor:
    """(M, K) e4m3 · (N, K) e4m3ᵀ with block scales -> (M, N) out_dtype.

    ``row_chunk`` splits the rows into independent calls, a launch-shape knob
    for the rung-2 checks that cannot change bits (module docstring).
    """
    M, K = x_codes.shape
    if row_chunk is not None and row_chunk < M:
        return torch.cat([fp8_gemm_cpu(xq, sx, w_codes, w_scale_inv, out_dtype)
                          for xq, sx in zip(x_codes.split(row_chunk), x_scales.split(row_chunk))])
    N = w_codes.shape[0]
    x64 = x_codes.double()  # exact: every e4m3 value is a double
    w64 = w_codes.double()
    sw_n = w_scale_inv.repeat_interleave(BLOCK, 0)[:N]  # (N, KB): row j holds block j // 128
    acc = torch.zeros(M, N, dtype=torch.float32)
    for b in range(x_scales.shape[1]):
        k = slice(b * BLOCK, min(b * BLOCK + BLOCK, K))
        p = torch.mm(x64[:, k], w64[:, k].t()).float()  # (M, N) exact block dot, rounded once
        s = x_scales[:, b : b + 1] * sw_n[:, b].unsqueeze(0)  # (M, N)
        acc.add_(p.mul_(s))
    return acc.to(out_dtype)
