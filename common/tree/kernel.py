"""Triton kernel for the fixed-order reduction tree.

Each program loads the N contributions of BLOCK elements into a
(BLOCK, N_POW2) float64 tile, pads contributors N..N_POW2-1 with -0.0, and
halves it log2(N_POW2) times by adding contributors (2i, 2i+1).  -0.0 is the exact additive
identity (x + -0.0 == x for every x, signed zeros included), so padding
pairs reproduce "an odd one is carried up unchanged" bit for bit; each level
is one float64 add per element; the result is rounded once to the output
dtype.  Elements never mix, so the bits do not depend on the tensor's size.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION


@triton.jit
def _tree_kernel(p_in, p_out, N, numel, N_POW2: tl.constexpr, LOG2_N: tl.constexpr, BLOCK: tl.constexpr):
    o_e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    o_n = tl.arange(0, N_POW2)
    mask = (o_e[:, None] < numel) & (o_n[None, :] < N)
    b_x = tl.load(p_in + o_n[None, :] * numel + o_e[:, None], mask=mask, other=0.0).to(tl.float64)  # (BLOCK, N_POW2)
    # -0.0 from its bit pattern: a float literal or a unary minus may become +0.0
    b_neg0 = tl.full((BLOCK, N_POW2), -9223372036854775808, tl.int64).to(tl.float64, bitcast=True)
    b_x = tl.where(o_n[None, :] < N, b_x, b_neg0)
    for i in tl.static_range(LOG2_N):
        # contributors 2j and 2j+1 -> one explicit add (a tl.sum could start from +0.0)
        b_even, b_odd = tl.split(tl.reshape(b_x, (BLOCK, N_POW2 >> (i + 1), 2)))
        b_x = b_even + b_odd
    b_y = tl.reshape(b_x, (BLOCK,))
    tl.store(p_out + o_e, b_y.to(p_out.dtype.element_ty), mask=o_e < numel)


def tree_reduce_triton(parts: torch.Tensor, out_dtype: torch.dtype, block: int | None = None) -> torch.Tensor:
    N = parts.shape[0]
    flat = parts.reshape(N, -1)
    numel = flat.shape[1]
    out = torch.empty(parts.shape[1:], dtype=out_dtype, device=parts.device)
    if numel == 0:
        return out
    n_pow2 = next_power_of_2(N)
    BLOCK = block or max(16, min(1024, 4096 // n_pow2))
    _tree_kernel[(cdiv(numel, BLOCK),)](flat, out, N, numel, N_POW2=n_pow2, LOG2_N=n_pow2.bit_length() - 1,
        BLOCK=BLOCK, enable_fp_fusion=FP_FUSION, num_warps=4)
    return out
