"""Triton FP8 block-scaled GEMM ``y = dequant(xq) · dequant(wq)ᵀ`` (DeepSeek-V3 recipe).

Inputs: x codes (M, K) e4m3 with per-token scales (M, KB) fp32 (1×128 groups),
weight codes (N, K) e4m3 with block scales (ceil(N/128), KB) fp32 (128×128),
KB = ceil(K/128).  Reduction order and rounding points (the contract):

    acc = 0                                                      fp32 registers
    for b = 0, 1, ..., KB-1:                                     one K block per iteration
        p   = tl.dot(xq[:, block b], wq[:, block b]ᵀ)            fresh fp32 accumulator
        s   = fl32(sx[i, b] * sw[j // 128, b])
        acc = fl32(acc + fl32(p * s))                            CUDA-core mul, then add
    y = out_dtype(acc)                                           one rounding

BLOCK_K is the quantization group, 128, and is not a knob: each iteration's
``p`` is one ``tl.dot`` over exactly that block (on Hopper four chained k32 fp8
wgmma steps in the tensor core's limited-precision accumulator, about 22 bits
per DeepSeek-V3 §3.3.2), and the scaled partials are promoted to the fp32
``acc`` every 128 elements, DeepSeek's promotion interval.  So ``p`` is *not*
the correctly rounded block dot the CPU path computes: CPU and CUDA bits
differ (DESIGN: each device keeps the contract on its own).

Bit-neutral knobs (expected; the gpu tests and ``alignzoo check fp8`` vary
them): BLOCK_M (>= 64 so Hopper always runs wgmma; smaller tiles lower to
mma.sync, whose in-instruction summation is not promised equal), BLOCK_N
(any power of two >= 64: weight scales are gathered per column as n // 128,
so a tile may straddle a weight block), num_warps, num_stages, GROUP_M and
the grid order — every output element sees the same per-element sequence
above.  Not neutral: BLOCK_K, the scale product order (sx * sw first), and
FMA contraction — kernels launch with ``enable_fp_fusion=False`` so
``acc + p * s`` stays a mul and an add.  ``p * s`` also keeps Triton from
folding ``acc + dot`` into the dot's accumulator, which would regroup adds.
There is no split-K: a row's K walk never depends on M.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._launch import FP_FUSION
from .quant import BLOCK


@triton.jit
def _tile_coords(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """Grouped tile order for L2 reuse; which program computes a tile never touches a sum."""
    first_m = (tile // (GROUP_M * n_n)) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % (GROUP_M * n_n)) // size_m


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(p_xq, p_xs, p_wq, p_ws, p_y, M, N, K, KB,
                     stride_xm, stride_xsm, stride_wn, stride_wsn, stride_ym,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     GROUP_M: tl.constexpr):
    i_m, i_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_m = o_m < M
    m_n = o_n < N
    p_x_rows = p_xq + o_m.to(tl.int64)[:, None] * stride_xm  # (BM, 1), K contiguous
    p_w_cols = p_wq + o_n.to(tl.int64)[None, :] * stride_wn  # (1, BN), K contiguous: K-major B for fp8 wgmma
    p_xs_rows = p_xs + o_m * stride_xsm  # (BM,)
    p_ws_cols = p_ws + (o_n // BLOCK_K) * stride_wsn  # (BN,): weight block row n // 128
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i_kb in range(0, KB):
        o_kk = i_kb * BLOCK_K + o_k
        m_k = o_kk < K
        b_x = tl.load(p_x_rows + o_kk[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)  # (BM, BK) e4m3
        b_w = tl.load(p_w_cols + o_kk[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)  # (BK, BN) e4m3
        b_p = tl.dot(b_x, b_w, out_dtype=tl.float32)  # (BM, BN), from zero
        b_sx = tl.load(p_xs_rows + i_kb, mask=m_m, other=0.0)
        b_sw = tl.load(p_ws_cols + i_kb, mask=m_n, other=0.0)
        b_acc = b_acc + b_p * (b_sx[:, None] * b_sw[None, :])
    tl.store(p_y + o_m.to(tl.int64)[:, None] * stride_ym + o_n[None, :], b_acc.to(p_y.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def launch_config(M: int, N: int, K: int) -> dict:
    """Bit-neutral tile shape for speed (not swept)."""
    if M <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}


def fp8_gemm_triton(x_codes: torch.Tensor, x_scales: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor,
                    out_dtype: torch.dtype, *, block_m: int | None = None, block_n: int | None = None,
                    num_warps: int | None = None, num_stages: int | None = None) -> torch.Tensor:
    """(M, K) e4m3 · (N, K) e4m3ᵀ with block scales -> (M, N) out_dtype.

    ``block_m`` (>= 64), ``block_n``, ``num_warps`` and ``num_stages`` are free
    launch knobs (defaults from ``launch_config``); none changes a bit.
    All four inputs must be contiguous (the launcher in op.py makes them so).
    """
    M, K = x_codes.shape
    N = w_codes.shape[0]
    lc = launch_config(M, N, K)
    BM, BN = block_m or lc["BLOCK_M"], block_n or lc["BLOCK_N"]
    nw, ns = num_warps or lc["num_warps"], num_stages or lc["num_stages"]
    if BM < 64:
        raise ValueError("block_m below 64 would change the MMA instruction (and bits) on Hopper")
    y = torch.empty((M, N), dtype=out_dtype, device=x_codes.device)
    if M == 0 or N == 0:
        return y
    grid = (cdiv(M, BM) * cdiv(N, BN),)
    _fp8_gemm_kernel[grid](
        x_codes, x_scales, w_codes, w_scale_inv, y, M, N, K, x_scales.shape[1],
        x_codes.stride(0), x_scales.stride(0), w_codes.stride(0), w_scale_inv.stride(0), y.stride(0),
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BLOCK, GROUP_M=8, num_warps=nw, num_stages=ns, enable_fp_fusion=FP_FUSION)
    return y
