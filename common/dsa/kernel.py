"""Triton kernel for the indexer's scores over the paged key pool, in ``cpu.py``'s order.

One program scores BLOCK_M query rows of one sequence chunk against BLOCK_N key positions, for every head:

    s[m, n]   = ((0 + q[m, h, 0] · k[n, 0]) + q[m, h, 1] · k[n, 1]) + ...    d left to right
    r[m, n]   = max(s · scale, 0) + 0.0                                       ReLU, -0.0 -> +0.0
    out[m, n] = ((0 + w[m, 0] · r_0) + w[m, 1] · r_1) + ...                   h left to right

every product and sum its own fp32 rounding (compiled with ``enable_fp_fusion=False``: no FMA), so each
element has the bits the element-wise CPU path gives it.  Key n of row m's sequence sits at slot
``block_table[seq, n // 64] * 64 + n % 64`` of the pool; positions past the row's are scored too and
masked by the selection, as on the CPU.  No tl.dot: a dot's order is the hardware's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import FP_FUSION

BLOCK_M, BLOCK_N = 16, 64


@triton.jit
def _paged_scores_kernel(
    q, k_cache, w, seq_idx, block_table, out,
    L, H, n_rows, stride_qm, stride_qh, stride_bt, stride_om, scale,
    D: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    o_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_m = o_m < n_rows
    m_n = o_n < L
    seq = tl.load(seq_idx + o_m, mask=m_m, other=0).to(tl.int64)
    page = tl.load(block_table + seq[:, None] * stride_bt + (o_n // PAGE)[None, :], mask=m_m[:, None] & m_n[None, :],
                   other=0).to(tl.int64)
    page = tl.maximum(page, 0)  # a -1 (given back) entry reads page 0; the selection masks it
    slot = page * PAGE + (o_n % PAGE)[None, :]  # (BLOCK_M, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for h in range(H):
        s = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for d in range(D):
            qv = tl.load(q + o_m.to(tl.int64) * stride_qm + h * stride_qh + d, mask=m_m, other=0.0).to(tl.float32)
            kv = tl.load(k_cache + slot * D + d, mask=m_m[:, None] & m_n[None, :], other=0.0).to(tl.float32)
            s = s + qv[:, None] * kv
        r = tl.maximum(s * scale, 0.0) + 0.0
        wv = tl.load(w + o_m.to(tl.int64) * H + h, mask=m_m, other=0.0)
        acc = acc + wv[:, None] * r
    tl.store(out + o_m.to(tl.int64)[:, None] * stride_om + o_n[None, :], acc, mask=m_m[:, None] & m_n[None, :])


def paged_index_scores_triton(q: torch.Tensor, k_cache: torch.Tensor, w: torch.Tensor, seq_idx: torch.Tensor,
                              block_table: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, D), k_cache (P, 64, 1, D), w (n, H) fp32, seq_idx (n,), block_table (B, W) -> (n, W·64) fp32:
    each row's scores against positions 0 .. W·64 - 1 of its sequence (``cpu.gather_keys`` then
    ``cpu.index_scores_cpu``, the same bits)."""
    n, H, D = q.shape
    P, page = k_cache.shape[:2]
    L = block_table.shape[1] * page
    q = q.contiguous()
    bt = block_table.contiguous()
    out = torch.empty(n, L, dtype=torch.float32, device=q.device)
    if n == 0 or L == 0:
        return out
    grid = (triton.cdiv(n, BLOCK_M), triton.cdiv(L, BLOCK_N))
    _paged_scores_kernel[grid](
        q, k_cache, w.contiguous(), seq_idx.contiguous(), bt, out,
        L, H, n, q.stride(0), q.stride(1), bt.stride(0), out.stride(0), float(scale),
        D=D, PAGE=page, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, enable_fp_fusion=FP_FUSION, num_warps=4,
    )
    return out
