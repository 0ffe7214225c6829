"""The vendor's per-token recurrent decode (``vendor.py``): fla's fused recurrent gated delta rule
kernel, one step, with the state read and written in place at each sequence's slot."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import FP_FUSION


@triton.jit
def _recurrent_decode_kernel(q, k, v, g, beta, slots, state, o, H: tl.constexpr, HV: tl.constexpr,
                             K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    NV: tl.constexpr = (V + BV - 1) // BV
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    slot = tl.load(slots + i_n)
    if slot < 0:  # a padding row of a graph bucket
        tl.store(o + (i_n * HV + i_hv) * V + o_v, tl.zeros([BV], tl.float32), mask=m_v)
        return
    p_h = state + (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0)
    b_q = tl.load(q + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_k = tl.load(k + (i_n * H + i_h) * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + (i_n * HV + i_hv) * V + o_v, mask=m_v, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + i_n * HV + i_hv).to(tl.float32)
    b_h *= tl.exp(tl.load(g + i_n * HV + i_hv).to(tl.float32))
    b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
    b_h += b_k[:, None] * b_v[None, :]
    tl.store(o + (i_n * HV + i_hv) * V + o_v, tl.sum(b_h * b_q[:, None], 0), mask=m_v)
    tl.store(p_h, b_h, mask=m_h)


def recurrent_decode(q, k, v, g, beta, slots, state) -> torch.Tensor:
    """One token per sequence: q, k (B, H, K), v (B, HV, V), g, beta (B, HV); slots (B,) int64
    (-1: padding); state (S, HV, K, V) fp32, updated in place -> o (B, HV, V) fp32."""
    B, H, K = k.shape
    HV, V = v.shape[1:]
    o = torch.empty(B, HV, V, dtype=torch.float32, device=q.device)
    BV = min(8, triton.next_power_of_2(V))  # fla's choice: small value tiles, many programs
    grid = (triton.cdiv(V, BV) * B * HV,)
    _recurrent_decode_kernel[grid](q, k, v, g, beta, slots, state, o, H, HV, K, V, triton.next_power_of_2(K), BV,
                                   num_warps=1, num_stages=3, enable_fp_fusion=FP_FUSION)
    return o
