"""Triton decode step of the gated delta rule: one new row per sequence from its
slot's open-chunk cache, static shapes, no host reads (graph-capturable).

The arithmetic, its order and its rounding points are ``cpu.py``'s, written
out the same way: every sum is the fixed pairwise tree (``tl.reshape`` to
pairs of adjacent elements and ``tl.sum`` over the pair axis: a sum of two
is one IEEE add in any implementation), padded with -0.0 (a K lane past K,
a row j not yet present), so the kernel gives the CPU path's bits whenever
exp does.  Two launches:

* ``_gdn_row_kernel``, grid (B, Hv): G_i, kk_i, qk_i, E_i, the substitution
  step x_i = [u_i | w_i], v_new_i, o_i; writes row r = pos % 64 of the slot
  (k only from the first value head of a group, n from head 0).  V is taken
  in blocks of BV_ROW columns (u, v_new and o of a column need w_i and S0's
  column only).
* ``_gdn_state_kernel``, grid (B, Hv, K blocks x V blocks): at position 0 a
  zero state (S0 of the first chunk, as ``cpu.decode_step`` writes); at r == 63 the
  next state, S0 * exp(G_63) + tree_j(k'_j v_new_j^T), the 64-leaf tree as
  eight 8-leaf subtrees (levels 1-3) combined by levels 4-6: the same tree,
  a (8, BKS, BVS) tile at a time.

Launched with ``enable_fp_fusion=False`` (no mul + add becomes an FMA: the
CPU path rounds each product) and, on CUDA, exp from libdevice (``expf``,
what torch's CUDA exp runs; ``enable_reflect_ftz=False`` keeps subnormals as
torch does), so that on the GPU this kernel is meant to give the bits of
the torch path on CUDA tensors (``cpu.py`` run there).  Not yet checked on a
GPU: ``tests/test_gdn.py``'s gpu-marked tests do.  Under Triton's
interpreter exp is numpy's (``tl.exp``); the interpreted test feeds decays
whose exps numpy and torch agree on.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._host import cdiv, next_power_of_2
from .cpu import CHUNK

BV_ROW = 32  # V columns per step of the row kernel (a launch knob: columns are independent)
BKS, BVS = 32, 32  # state tile of the state kernel (a launch knob)


@triton.jit
def _exp(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def _pairs_last(x, M: tl.constexpr, N: tl.constexpr):
    """(M, N) -> (M, N // 2): x[:, 2m] + x[:, 2m + 1]."""
    return tl.sum(tl.reshape(x, (M, N // 2, 2)), axis=2)


@triton.jit
def _tree_last(x, M: tl.constexpr, N: tl.constexpr):
    """(M, N), N a power of two <= 256 -> (M,): the pairwise tree over the last axis."""
    if N >= 256:
        x = _pairs_last(x, M, 256)
    if N >= 128:
        x = _pairs_last(x, M, 128)
    if N >= 64:
        x = _pairs_last(x, M, 64)
    if N >= 32:
        x = _pairs_last(x, M, 32)
    if N >= 16:
        x = _pairs_last(x, M, 16)
    if N >= 8:
        x = _pairs_last(x, M, 8)
    if N >= 4:
        x = _pairs_last(x, M, 4)
    if N >= 2:
        x = _pairs_last(x, M, 2)
    return tl.reshape(x, (M,))


@triton.jit
def _pairs_first(x, M: tl.constexpr, N: tl.constexpr):
    """(M, N) -> (M // 2, N): x[2m] + x[2m + 1]."""
    return tl.sum(tl.reshape(x, (M // 2, 2, N)), axis=1)


@triton.jit
def _tree_first(x, M: tl.constexpr, N: tl.constexpr):
    """(M, N), M a power of two <= 256 -> (N,): the pairwise tree over the first axis."""
    if M >= 256:
        x = _pairs_first(x, 256, N)
    if M >= 128:
        x = _pairs_first(x, 128, N)
    if M >= 64:
        x = _pairs_first(x, 64, N)
    if M >= 32:
        x = _pairs_first(x, 32, N)
    if M >= 16:
        x = _pairs_first(x, 16, N)
    if M >= 8:
        x = _pairs_first(x, 8, N)
    if M >= 4:
        x = _pairs_first(x, 4, N)
    if M >= 2:
        x = _pairs_first(x, 2, N)
    return tl.reshape(x, (N,))


@triton.jit
def _gdn_row_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_pos, p_slot,
    p_state, p_kc, p_gc, p_xc, p_vc, p_nc, p_o,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    W: tl.constexpr = V + K
    pos = tl.load(p_pos + i_b)
    slot = tl.load(p_slot + i_b)
    valid = slot >= 0
    s = tl.maximum(slot, 0).to(tl.int64)
    r = pos % C
    o_j = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    here = o_j == r
    causal = o_j <= r
    strict = o_j < r

    b_k = tl.load(p_k + (i_b * Hk + i_hk) * K + o_k, mask=m_k, other=0.0)
    b_q = tl.load(p_q + (i_b * Hk + i_hk) * K + o_k, mask=m_k, other=0.0)
    b_kc = tl.load(p_kc + ((s * C + o_j[:, None]) * Hk + i_hk) * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_kc = tl.where(here[:, None], b_k[None, :], b_kc)  # (C, BK)
    b_gc = tl.load(p_gc + (s * C + o_j) * Hv + i_h)  # (C,)
    G_prev = tl.load(p_gc + (s * C + r - 1) * Hv + i_h, mask=r > 0, other=-0.0)
    b_g = tl.load(p_g + i_b * Hv + i_h)
    b_beta = tl.load(p_beta + i_b * Hv + i_h)
    G_i = G_prev + b_g
    b_gc = tl.where(here, G_i, b_gc)

    b_kk = _tree_last(tl.where(m_k[None, :], b_k[None, :] * b_kc, -0.0), C, BK)  # (C,)
    b_qk = _tree_last(tl.where(m_k[None, :], b_q[None, :] * b_kc, -0.0), C, BK)
    b_E = _exp(tl.where(causal, G_i - b_gc, float("-inf")), LIBDEVICE)
    b_L = (b_beta * b_kk) * b_E  # (C,)
    e_G = _exp(G_i, LIBDEVICE)

    p_xrow = p_xc + ((s * C + o_j[:, None]) * Hv + i_h) * W  # (C, 1) rows of x
    b_xw = tl.load(p_xrow + V + o_k[None, :], mask=m_k[None, :], other=0.0)
    b_t = tl.where(strict[:, None], b_L[:, None] * b_xw, -0.0)
    b_w = (b_k * b_beta) * e_G - _tree_first(b_t, C, BK)  # (BK,)
    b_qe = b_q * e_G
    fresh = pos == 0
    # masks that carry a scalar flag are written as o < where(flag, n, 0): the interpreter
    # refuses a vector mask & a scalar bool
    n_k = tl.where(valid, K, 0)
    n_v = tl.where(valid, V, 0)
    tl.store(p_xc + ((s * C + r) * Hv + i_h) * W + V + o_k, b_w, mask=o_k < n_k)

    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        b_S = tl.load(p_state + ((s * Hv + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_S = tl.where(fresh, 0.0, b_S)  # (BK, BV)
        b_vv = tl.load(p_v + (i_b * Hv + i_h) * V + o_v, mask=m_v, other=0.0)
        b_xu = tl.load(p_xrow + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_u = b_vv * b_beta - _tree_first(tl.where(strict[:, None], b_L[:, None] * b_xu, -0.0), C, BV)
        b_vn = b_u - _tree_first(tl.where(m_k[:, None], b_w[:, None] * b_S, -0.0), BK, BV)
        b_inter = _tree_first(tl.where(m_k[:, None], b_qe[:, None] * b_S, -0.0), BK, BV)
        b_vc = tl.load(p_vc + ((s * C + o_j[:, None]) * Hv + i_h) * V + o_v[None, :], mask=m_v[None, :], other=0.0)
        b_vc = tl.where(here[:, None], b_vn[None, :], b_vc)
        b_intra = _tree_first(tl.where(causal[:, None], (b_qk * b_E)[:, None] * b_vc, -0.0), C, BV)
        b_o = b_inter + b_intra
        tl.store(p_o + (i_b * Hv + i_h) * V + o_v, tl.where(valid, b_o, 0.0), mask=m_v)
        tl.store(p_xc + ((s * C + r) * Hv + i_h) * W + o_v, b_u, mask=o_v < n_v)
        tl.store(p_vc + ((s * C + r) * Hv + i_h) * V + o_v, b_vn, mask=o_v < n_v)
    o_1 = tl.arange(0, 2)  # scalar stores as masked 2-lane stores (the interpreter refuses scalar masks)
    tl.store(p_gc + (s * C + r) * Hv + i_h + o_1, tl.zeros([2], tl.float32) + G_i, mask=o_1 < tl.where(valid, 1, 0))
    tl.store(p_kc + ((s * C + r) * Hk + i_hk) * K + o_k, b_k, mask=o_k < tl.where(valid & (i_h % (Hv // Hk) == 0), K, 0))
    tl.store(p_nc + s + o_1, tl.zeros([2], tl.int64) + ((r + 1) % C).to(tl.int64),
             mask=o_1 < tl.where(valid & (i_h == 0), 1, 0))


@triton.jit
def _leaf8(p_kc, p_vc, p_gc, s, j0, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk,
           Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BKS: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Rows j0..j0+7: the level-3 node tree_8((k_j exp(G_last - G_j)) v_j^T) -> (BKS, BVS)."""
    o_j = j0 + tl.arange(0, 8)
    b_g = tl.load(p_gc + (s * C + o_j) * Hv + i_h)
    b_kc = tl.load(p_kc + ((s * C + o_j[:, None]) * Hk + i_hk) * K + o_kb[None, :], mask=m_k[None, :], other=0.0)
    b_kd = b_kc * _exp(G_last - b_g, LIBDEVICE)[:, None]  # (8, BKS)
    b_vc = tl.load(p_vc + ((s * C + o_j[:, None]) * Hv + i_h) * V + o_vb[None, :], mask=m_v[None, :], other=0.0)
    x = b_kd[:, :, None] * b_vc[:, None, :]  # (8, BKS, BVS)
    x = tl.sum(tl.reshape(x, (4, 2, BKS, BVS)), axis=1)
    x = tl.sum(tl.reshape(x, (2, 2, BKS, BVS)), axis=1)
    x = tl.sum(tl.reshape(x, (1, 2, BKS, BVS)), axis=1)
    return tl.reshape(x, (BKS, BVS))


@triton.jit
def _gdn_state_kernel(
    p_pos, p_slot, p_state, p_kc, p_gc, p_vc,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKS: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    i_b, i_h, i_t = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (Hv // Hk)
    NV: tl.constexpr = (V + BVS - 1) // BVS
    pos = tl.load(p_pos + i_b)
    slot = tl.load(p_slot + i_b)
    s = tl.maximum(slot, 0).to(tl.int64)
    o_kb = (i_t // NV) * BKS + tl.arange(0, BKS)
    o_vb = (i_t % NV) * BVS + tl.arange(0, BVS)
    m_k = o_kb < K
    m_v = o_vb < V
    p_s = p_state + ((s * Hv + i_h) * K + o_kb[:, None]) * V + o_vb[None, :]
    m = m_k[:, None] & m_v[None, :]
    if (slot >= 0) & (pos == 0):  # a sequence's first row: its slot's state becomes S0 = 0
        tl.store(p_s, tl.zeros([BKS, BVS], tl.float32), mask=m)
    if (slot >= 0) & (pos % C == C - 1):
        G_last = tl.load(p_gc + (s * C + C - 1) * Hv + i_h)
        a0 = _leaf8(p_kc, p_vc, p_gc, s, 0, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a1 = _leaf8(p_kc, p_vc, p_gc, s, 8, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a2 = _leaf8(p_kc, p_vc, p_gc, s, 16, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a3 = _leaf8(p_kc, p_vc, p_gc, s, 24, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a4 = _leaf8(p_kc, p_vc, p_gc, s, 32, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a5 = _leaf8(p_kc, p_vc, p_gc, s, 40, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a6 = _leaf8(p_kc, p_vc, p_gc, s, 48, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        a7 = _leaf8(p_kc, p_vc, p_gc, s, 56, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
        upd = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
        b_S = tl.load(p_s, mask=m, other=0.0)
        tl.store(p_s, b_S * _exp(G_last, LIBDEVICE) + upd, mask=m)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def gdn_decode_triton(q, k, v, g, beta, pos, slots, cache, *, bv_row: int = BV_ROW, bks: int = BKS, bvs: int = BVS):
    """``cpu.decode_step`` as two Triton launches.  q, k (B, Hk, K), v (B, Hv, V),
    g, beta (B, Hv) fp32 contiguous; pos, slots (B,) int64; ``cache``:
    ``op.gdn_cache``'s dict (contiguous) -> o (B, Hv, V) fp32 (0 on padding rows).
    ``bv_row``, ``bks``, ``bvs``: launch knobs that cannot change bits."""
    B, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    o = torch.empty(B, Hv, V, dtype=torch.float32, device=q.device)
    if B == 0:
        return o
    lib = not _interpreted() and q.is_cuda
    opts = {"enable_fp_fusion": False, "enable_reflect_ftz": False} if lib else {}
    BK = max(2, next_power_of_2(K))
    BV = max(2, min(bv_row, next_power_of_2(V)))
    _gdn_row_kernel[(B, Hv)](
        q, k, v, g, beta, pos, slots,
        cache["state"], cache["k"], cache["g_cum"], cache["x"], cache["v_new"], cache["n"], o,
        Hk, Hv, K, V, BK, BV, CHUNK, lib, **opts,
    )
    bks, bvs = max(2, min(bks, next_power_of_2(K))), max(2, min(bvs, next_power_of_2(V)))
    _gdn_state_kernel[(B, Hv, cdiv(K, bks) * cdiv(V, bvs))](
        pos, slots, cache["state"], cache["k"], cache["g_cum"], cache["v_new"],
        Hk, Hv, K, V, bks, bvs, CHUNK, lib, **opts,
    )
    return o
