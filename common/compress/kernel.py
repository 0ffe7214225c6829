"""Triton kernel for the compressors' rows, in ``cpu.py``'s order, reading each window's slots where
they are (this call's kv/gate rows, the slot's ring, or padding) instead of gathering them first.

One program builds BLOCK_D channels of one row, in three passes over the window's S slots, j = 0..S-1:

    pass 1  m   = max_j l_j,  l_j = fp32(gate_j) + position_bias_j, -inf on a pad slot
    pass 2  s   = ((0 + e_0) + e_1) + ...,  e_j = exp(l_j - m)
    pass 3  acc = ((0 + fp32(dt(kv_0 * dt(div_rn(e_0, s))))) + ...) ,  row = dt(acc)

A token that completes no group writes zeros and skips the passes.  Every op rounds where
``cpu.group_rows`` rounds (compiled with ``enable_fp_fusion=False``: no FMA; ``div_rn``: an IEEE
division).  No cross-lane reduction: a lane is one channel, so ``num_warps`` and
BLOCK_D never change a bit.  exp is libdevice's on CUDA (torch's CUDA exp, so the kernel keeps the bits
of the element-wise path run on CUDA tensors); under the interpreter the tests patch in torch's exp and
the kernel gives the CPU path's bits.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import FP_FUSION
from ..gdn.kernel import _exp, _launch_opts
from .cpu import token_coords


@triton.jit
def _slot(p_kv, p_gate, p_pb, p_rkv, p_rgate, j, t, local, pos, slot, o_d, m_d, C, B_RING,
          RATE: tl.constexpr, S: tl.constexpr, D: tl.constexpr, H2: tl.constexpr, RING: tl.constexpr):
    """Slot j of the window closed by token t -> (kv in its dtype, fp32 logit), as ``cpu.window_slots``."""
    back = S - 1 - j
    half = j // RATE if H2 == 2 else 0  # slots 0..RATE-1: the previous group's [:D], then this group's [D:]
    z = o_d.to(tl.int64) * 0  # the scalars as (BLOCK_D,) blocks: the masks stay int1 blocks
    q = pos - back + z
    pad = q < 0
    in_call = (local - back + z) >= 0
    before = (local - back + z) < 0
    col = half * D + o_d
    row = tl.maximum(t - back, 0)
    b_kv = tl.load(p_kv + row * C + col, mask=m_d & in_call, other=0.0)
    b_g = tl.load(p_gate + row * C + col, mask=m_d & in_call, other=0.0)
    if RING:
        old = before & (q >= 0)
        r = (slot * B_RING + tl.maximum(q, 0) % B_RING) * C + col
        b_kv = tl.where(old, tl.load(p_rkv + r, mask=m_d & old, other=0.0), b_kv)
        b_g = tl.where(old, tl.load(p_rgate + r, mask=m_d & old, other=0.0), b_g)
    else:
        pad = pad | before
    b_pb = tl.load(p_pb + (j - half * RATE) * C + col, mask=m_d, other=0.0)
    b_l = tl.where(pad, float("-inf"), b_g.to(tl.float32) + b_pb)
    return b_kv, b_l


@triton.jit
def _rows_kernel(p_kv, p_gate, p_pb, p_at, p_local, p_pos, p_slot, p_rkv, p_rgate, p_out, C, B_RING,
                 RATE: tl.constexpr, S: tl.constexpr, D: tl.constexpr, H2: tl.constexpr, BLOCK_D: tl.constexpr,
                 RING: tl.constexpr, LIB: tl.constexpr):
    i_g = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    t = tl.load(p_at + i_g).to(tl.int64)
    local = tl.load(p_local + i_g).to(tl.int64)
    pos = tl.load(p_pos + i_g).to(tl.int64)
    slot = tl.load(p_slot + i_g).to(tl.int64)
    b_acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    if (pos + 1) % RATE == 0:  # decode builds every token's window: 1 in RATE completes one
        b_m = tl.full((BLOCK_D,), float("-inf"), tl.float32)
        for j in range(S):
            _, b_l = _slot(p_kv, p_gate, p_pb, p_rkv, p_rgate, j, t, local, pos, slot, o_d, m_d, C, B_RING,
                           RATE, S, D, H2, RING)
            b_m = tl.maximum(b_m, b_l)
        b_s = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(S):
            _, b_l = _slot(p_kv, p_gate, p_pb, p_rkv, p_rgate, j, t, local, pos, slot, o_d, m_d, C, B_RING,
                           RATE, S, D, H2, RING)
            b_s = b_s + _exp(b_l - b_m, LIB)
        for j in range(S):
            b_kv, b_l = _slot(p_kv, p_gate, p_pb, p_rkv, p_rgate, j, t, local, pos, slot, o_d, m_d, C, B_RING,
                              RATE, S, D, H2, RING)
            b_w = tl.math.div_rn(_exp(b_l - b_m, LIB), b_s).to(p_kv.dtype.element_ty)
            b_acc = b_acc + (b_kv.to(tl.float32) * b_w.to(tl.float32)).to(p_kv.dtype.element_ty).to(tl.float32)
    tl.store(p_out + i_g * D + o_d, b_acc.to(p_out.dtype.element_ty), mask=m_d)


def compress_rows_triton(kv, gate, position_bias, cu_seqlens, at, *, rate, overlap, starts=None, slots=None,
                         ring_kv=None, ring_gate=None, block_d: int | None = None) -> torch.Tensor:
    """``cpu.compress_rows_cpu`` in one launch -> rows (G, D); reads the ring, never
    writes it (``cpu.ring_update`` does).  No host reads.  ``block_d`` never changes a bit."""
    T, C = kv.shape
    H2 = 2 if overlap else 1
    D = C // H2
    G = at.shape[0]
    out = torch.empty(G, D, dtype=kv.dtype, device=kv.device)
    if G == 0:
        return out
    _, local, pos = token_coords(at, cu_seqlens, starts)
    ring = ring_kv is not None
    if ring:
        seq = torch.searchsorted(cu_seqlens.long()[1:], at, right=True).clamp(max=max(cu_seqlens.shape[0] - 2, 0))
        slot = slots.long().clamp(min=0)[seq]
    else:
        slot = torch.zeros_like(at)
    BLOCK_D = block_d or min(128, triton.next_power_of_2(D))
    lib, opts = _launch_opts(kv)
    _rows_kernel[(G, triton.cdiv(D, BLOCK_D))](
        kv, gate, position_bias.contiguous(), at.contiguous(), local.contiguous(), pos.contiguous(), slot.contiguous(),
        ring_kv if ring else kv, ring_gate if ring else gate, out, C, ring_kv.shape[1] if ring else 1,
        RATE=rate, S=2 * rate if overlap else rate, D=D, H2=H2, BLOCK_D=BLOCK_D, RING=ring, LIB=lib, **opts,
        enable_fp_fusion=FP_FUSION, num_warps=4,
    )
    return out
