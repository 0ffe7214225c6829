"""Triton gated delta rule: the decode step (one new row per sequence from its
slot's open-chunk cache, static shapes, no host reads, graph-capturable) and a
row-by-row scan over each sequence through the same row and state functions:
the reference for ``chunk_kernel.py``'s chunk-parallel trainer / prefill
kernel (which runs it for a sequence's rows before its first 64 boundary when
it starts mid-chunk) and the jit helpers that kernel imports.

Two forms, one per device (``MMA``, ``_use_mma``):

* the trees (the interpreter; CUDA with ``mma=False``): the arithmetic, its
  order and its rounding points are ``cpu.py``'s, written out the same way:
  every sum is the fixed pairwise tree (``tl.reshape`` to pairs of adjacent
  elements and ``tl.sum`` over the pair axis: a sum of two is one IEEE add in
  any implementation), padded with -0.0 (a K lane past K, a row j not yet
  present), so the kernels give the CPU path's bits whenever exp does;
* MMA (compiled CUDA's default): the same, except the four products with the
  state, w_i S0, (q_i exp(G_i)) S0, tree_j(A_ij v_new_j) and the update's
  tree_j(k'_j v_new_j^T), which are ``_mma`` tf32x3 tensor-core dots over the
  whole K (or all 64 rows) from a zero accumulator.  A dot's row depends on
  that row and the other operand alone (not on the other rows, a zero row's
  stale partner, or a 16-row mma.sync against a 64-row wgmma:
  ``benchmarks/experiments/probe_mma_rows.py``), so a decode row padded into
  a 16-row tile gets the chunk's bits; the chunk's own sums (kk, qk, the
  substitution) stay trees.  Not the CPU path's bits (the torch path is the function to ~1e-7).

The jit helpers:

* ``_row``: row r = pos % 64 of one (token, value head): G_i, kk_i, qk_i, E_i,
  the substitution step x_i = [u_i | w_i], v_new_i, o_i; writes o and the
  slot's g_cum, x, v_new rows at r.  V is taken in blocks of BV_ROW columns
  (u, v_new and o of a column need w_i and S0's column only).  The chunk's k
  rows come from the input for positions in the call, else from the slot.
* ``_state_tile``: a (BKS, BVS) tile of the slot's state: zeros at position 0
  (S0 of the first chunk), at row 63 S0 * exp(G_63) + tree_j(k'_j v_new_j^T),
  the 64-leaf tree as eight 8-leaf subtrees (levels 1-3, ``_leaf8``) combined
  by levels 4-6: the same tree, an (8, BKS, BVS) tile at a time (MMA: one dot).

Kernels: decode = ``_gdn_decode_row_kernel`` (grid (B, Hv); every head of a
group writes the same k row) then ``_gdn_decode_state_kernel`` (grid (Hv,
tiles, groups): each program's tile for the sequences of its group, of which
only those at row 63 or position 0 do work).  Prefill / trainer =
``_gdn_scan_kernel`` (grid (B, Hv), a loop over the sequence's rows with a
barrier after each row and state update, since the next row reads what the
program wrote; the slot's k rows are only read
during the scan, heads of a group running at their own pace) then
``_k_rows_kernel`` (the open chunk's k rows).  The scan is sequential in a
sequence's length, a correct GPU path but not a fast one: ``gdn_fwd`` runs
``chunk_kernel.gdn_chunk_triton`` (the 64 substitution steps of every chunk at
once, as ``cpu.chunked`` does), which gives the scan's bits in either form.

Launched with ``enable_fp_fusion=False`` (no mul + add becomes an FMA: the
CPU path rounds each product) and, on CUDA, exp from libdevice (``expf``,
what torch's CUDA exp runs; ``enable_reflect_ftz=False`` keeps subnormals as
torch does), so that on the GPU the trees give the bits of the torch path on
CUDA tensors (``cpu.py`` run there; ``tests/test_gdn.py``'s and
``tests/test_gdn_chunk.py``'s gpu-marked tests check both forms).  Under
Triton's interpreter ``tl.exp`` is numpy's; the interpreted tests put torch's
exp in its place and compare bit for bit with the torch path (the MMA form's
test puts a row-local dot in place of numpy's matmul).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .cpu import CHUNK
from .trees import _neg0

BV_ROW = 32  # V columns per step of the row kernel (a launch knob: columns are independent)
BKS, BVS = 32, 32  # state tile of the state kernel (a launch knob)
# K lanes a subtree of the row's K trees (a launch knob: a power of two, the tree is the same): the
# row keeps (64, 32) tiles live, not (64, 128)
BKQ = 32
STATE_WARPS = 4  # warps of the decode's state kernel (a launch knob)
# sequence groups of the state kernel (a launch knob): Hv x tiles x 8 programs whatever the batch,
# each looping over its group's sequences, as a step's state work is the few that close a chunk
# (B 256, every sequence closing one: 2.83 ms a step against 3.89 with a program a (sequence, head, tile))
STATE_GROUPS = 8
# the decode row kernel's warps and V columns a step, by programs (launch knobs): one warp on
# 8-column steps up to 8 x 32 programs, two on 32 past it (32 heads, B 256: 0.970 ms against 1.438 on 4)
ROW_SMALL, ROW_LARGE = (1, 8), (2, 32)
# and its register cap on two (a launch knob): 8 programs an SM, not 4 (B 256: 0.795 ms against 0.896 uncapped)
ROW_LARGE_MAXNREG = 128
# the same in the MMA form, uncapped (launch knobs; B 256: 1.17 ms a layer on two warps, 2.27 capped at 128)
ROW_SMALL_MMA, ROW_LARGE_MMA = (4, 32), (2, 32)
# On CUDA the products with the state (v_new's w_i S0, o's inter and intra sums, the state update)
# run as ``_mma`` tensor-core dots, the chunk's own sums as trees; the interpreter and the torch path
# keep the trees.  Not a launch knob: it changes bits, so every path on a device takes the same.
MMA = True


def _use_mma(lib: bool, mma: bool | None) -> bool:
    """The kernels' form: ``mma`` if given (tests, benchmarks), else MMA on compiled CUDA."""
    return (lib and MMA) if mma is None else bool(mma)


def _min_side(mma: bool) -> int:
    """A tile's smallest side in the form: 16 for a ``tl.dot`` operand (MMA), else 2."""
    return 16 if mma else 2


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
def _k_rows(p_k, p_kc, s, t0, start, pos, o_j, o_kb, m_k, i_hk, Hk: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """k of rows ``o_j`` of the chunk holding ``pos``, columns ``o_kb``: a row at a
    position in [start, pos] is the input's token t0 + (p - start), an earlier one
    the slot's cache row, a later one 0 (never read unmasked)."""
    p_j = pos - pos % C + o_j
    inp = (p_j >= start) & (p_j <= pos)
    old = p_j < start
    a = tl.load(p_k + ((t0 + p_j - start) * Hk + i_hk)[:, None] * K + o_kb[None, :],
                mask=inp[:, None] & m_k[None, :], other=0.0)
    c = tl.load(p_kc + ((s * C + o_j) * Hk + i_hk)[:, None] * K + o_kb[None, :],
                mask=old[:, None] & m_k[None, :], other=0.0)
    return tl.where(inp[:, None], a, c)


@triton.jit
def _kq_part(p_k, p_kc, p_ki, p_qi, s, t0, start, pos, o_j, k0, i_hk, N: tl.constexpr, QK: tl.constexpr,
             Hk: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """Lanes k0..k0+N-1 of kk's and qk's K trees (k_i, q_i against the chunk's rows j), -0.0 past K:
    halves down to QK lanes, each a (C, QK) tile's tree, so no (C, K) tile is ever live."""
    if N == QK:
        o_kb = k0 + tl.arange(0, QK)
        m_kb = o_kb < K
        b_kc = _k_rows(p_k, p_kc, s, t0, start, pos, o_j, o_kb, m_kb, i_hk, Hk, K, C)  # (C, QK)
        b_ki = tl.load(p_ki + o_kb, mask=m_kb, other=0.0)
        b_qi = tl.load(p_qi + o_kb, mask=m_kb, other=0.0)
        kk = _tree_last(tl.where(m_kb[None, :], b_ki[None, :] * b_kc, _neg0()), C, QK)
        qk = _tree_last(tl.where(m_kb[None, :], b_qi[None, :] * b_kc, _neg0()), C, QK)
    else:
        kk0, qk0 = _kq_part(p_k, p_kc, p_ki, p_qi, s, t0, start, pos, o_j, k0, i_hk, N // 2, QK, Hk, K, C)
        kk1, qk1 = _kq_part(p_k, p_kc, p_ki, p_qi, s, t0, start, pos, o_j, k0 + N // 2, i_hk, N // 2, QK, Hk, K, C)
        kk = kk0 + kk1
        qk = qk0 + qk1
    return kk, qk


@triton.jit
def _ws_part(p_S, p_w, p_q, e_G, fresh, o_v, m_v, k0, N: tl.constexpr, QK: tl.constexpr, K: tl.constexpr,
             V: tl.constexpr, BV: tl.constexpr):
    """Rows k0..k0+N-1 of the K trees of w_k S0_kv and (q_k exp(G_i)) S0_kv, -0.0 past K: halves
    down to QK rows of S0 (zeros when fresh), w read back from the slot's x row."""
    if N == QK:
        o_kb = k0 + tl.arange(0, QK)
        m_kb = o_kb < K
        b_S = tl.load(p_S + o_kb[:, None] * V + o_v[None, :], mask=m_kb[:, None] & m_v[None, :], other=0.0)
        b_S = tl.where(fresh, 0.0, b_S)  # (QK, BV)
        b_w = tl.load(p_w + o_kb, mask=m_kb, other=0.0)
        b_qe = tl.load(p_q + o_kb, mask=m_kb, other=0.0) * e_G
        a = _tree_first(tl.where(m_kb[:, None], b_w[:, None] * b_S, _neg0()), QK, BV)
        b = _tree_first(tl.where(m_kb[:, None], b_qe[:, None] * b_S, _neg0()), QK, BV)
    else:
        a0, b0 = _ws_part(p_S, p_w, p_q, e_G, fresh, o_v, m_v, k0, N // 2, QK, K, V, BV)
        a1, b1 = _ws_part(p_S, p_w, p_q, e_G, fresh, o_v, m_v, k0 + N // 2, N // 2, QK, K, V, BV)
        a = a0 + a1
        b = b0 + b1
    return a, b


@triton.jit
def _mma(a, b):
    """a (M, R) @ b (R, N) fp32 on tensor cores, tf32x3 (three TF32 products: ~fp32 accuracy), one
    tl.dot over the whole R from a zero accumulator.  A row's result is a function of that row of a
    and of b where the row is not zero, whatever M, the other rows, and 16-row mma.sync or 64-row
    wgmma (``benchmarks/experiments/probe_mma_rows.py``); the R split into dots is part of the order (two
    dots of R/2 give other bits), so every caller passes the whole R at once."""
    return tl.dot(a, b, input_precision="tf32x3", out_dtype=tl.float32)


@triton.jit
def _row_of(x, o_m, m):
    """Row m of a (16, N) tile, exactly: the other rows become -0.0, which no sum changes."""
    return tl.sum(tl.where(o_m[:, None] == m, x, _neg0()), axis=0)


@triton.jit
def _ws_mma(p_S, p_w, p_q, e_G, fresh, o_v, m_v, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr):
    """``_ws_part``'s two products as rows 0 and 1 of one 16-row ``_mma``: w_i S0 and (q_i exp(G_i))
    S0 over S0's (BK, BV) column tile, the chunk state kernel's dots for row i."""
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    b_S = tl.load(p_S + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_S = tl.where(fresh, 0.0, b_S)
    b_w = tl.load(p_w + o_k, mask=m_k, other=0.0)
    b_qe = tl.load(p_q + o_k, mask=m_k, other=0.0) * e_G
    o_m = tl.arange(0, 16)
    a = tl.where(o_m[:, None] == 0, b_w[None, :], tl.where(o_m[:, None] == 1, b_qe[None, :], 0.0))
    x = _mma(a, b_S)
    return _row_of(x, o_m, 0), _row_of(x, o_m, 1)


@triton.jit
def _av_mma(b_a, b_vc, C: tl.constexpr):
    """tree_j's MMA form for one row: b_a (C,) the row's A_ij (0 where j > i), b_vc (C, BV) the
    rows j (0 where j > i) -> (BV,), row 0 of a 16-row ``_mma``."""
    o_m = tl.arange(0, 16)
    x = _mma(tl.where(o_m[:, None] == 0, b_a[None, :], 0.0), b_vc)
    return _row_of(x, o_m, 0)


@triton.jit
def _row(p_q, p_k, p_v, p_g, p_beta, p_o, p_state, p_kc, p_gc, p_xc, p_vc,
         t, t0, start, pos, s, valid, i_h, i_hk,
         Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
         BK: tl.constexpr, BV: tl.constexpr, QK: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr,
         MMA: tl.constexpr):
    """Row r = pos % 64 of token t (``cpu.py``'s row functions): writes o[t] and
    the slot's rows g_cum, x, v_new at r (not k: the callers do).  Every K tree is
    formed QK lanes at a time (its subtrees, then their levels), so the live tiles
    are (64, QK) and (QK, BV), not (64, K) and (K, BV).  MMA: the products with the
    state (w_i S0, (q_i exp(G_i)) S0) and o's intra sum as the chunk kernels' ``_mma``
    rows (``_ws_mma``, ``_av_mma``); the chunk's own sums stay trees."""
    W: tl.constexpr = V + K
    r = pos % C
    o_j = tl.arange(0, C)
    here = o_j == r
    causal = o_j <= r
    strict = o_j < r

    p_ki = p_k + (t * Hk + i_hk) * K
    p_qi = p_q + (t * Hk + i_hk) * K
    # rows past r never enter a sum (the trees take -0.0 there): not read, half the cache traffic on average
    b_gc = tl.load(p_gc + (s * C + o_j) * Hv + i_h, mask=strict, other=0.0)  # (C,)
    G_prev = tl.load(p_gc + (s * C + r - 1) * Hv + i_h, mask=r > 0, other=_neg0())
    b_g = tl.load(p_g + t * Hv + i_h)
    b_beta = tl.load(p_beta + t * Hv + i_h)
    G_i = G_prev + b_g
    b_gc = tl.where(here, G_i, b_gc)

    zero = tl.full([], 0, tl.int32)  # the trees' first lane as a value, not a constexpr: one function a level
    b_kk, b_qk = _kq_part(p_k, p_kc, p_ki, p_qi, s, t0, start, pos, o_j, zero, i_hk, BK, QK, Hk, K, C)  # (C,)
    b_E = _exp(tl.where(causal, G_i - b_gc, float("-inf")), LIBDEVICE)
    b_L = (b_beta * b_kk) * b_E  # (C,)
    e_G = _exp(G_i, LIBDEVICE)

    p_xrow = p_xc + ((s * C + o_j[:, None]) * Hv + i_h) * W  # (C, 1) rows of x
    p_xr = p_xc + ((s * C + r) * Hv + i_h) * W  # the slot's x row r
    # masks that carry a scalar flag are written as o < where(flag, n, 0): the interpreter
    # refuses a vector mask & a scalar bool
    n_k = tl.where(valid, K, 0)
    n_v = tl.where(valid, V, 0)
    for k0 in range(0, BK, QK):  # w's columns are independent: QK at a time, to x row r
        o_kb = k0 + tl.arange(0, QK)
        m_kb = o_kb < K
        b_xw = tl.load(p_xrow + V + o_kb[None, :], mask=strict[:, None] & m_kb[None, :], other=0.0)
        b_t = tl.where(strict[:, None], b_L[:, None] * b_xw, _neg0())
        b_kq = tl.load(p_ki + o_kb, mask=m_kb, other=0.0)
        b_w = (b_kq * b_beta) * e_G - _tree_first(b_t, C, QK)  # (QK,)
        tl.store(p_xr + V + o_kb, b_w, mask=o_kb < n_k)
    tl.debug_barrier()  # w is read back below, lanes other than the ones that wrote it
    fresh = pos == 0

    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < V
        b_vv = tl.load(p_v + (t * Hv + i_h) * V + o_v, mask=m_v, other=0.0)
        b_xu = tl.load(p_xrow + o_v[None, :], mask=strict[:, None] & m_v[None, :], other=0.0)
        b_u = b_vv * b_beta - _tree_first(tl.where(strict[:, None], b_L[:, None] * b_xu, _neg0()), C, BV)
        if MMA:
            b_sw, b_inter = _ws_mma(p_state + (s * Hv + i_h) * K * V, p_xr + V, p_qi, e_G, fresh, o_v, m_v, K, V, BK)
        else:
            b_sw, b_inter = _ws_part(p_state + (s * Hv + i_h) * K * V, p_xr + V, p_qi, e_G, fresh, o_v, m_v, zero,
                                     BK, QK, K, V, BV)
        b_vn = b_u - b_sw
        b_vc = tl.load(p_vc + ((s * C + o_j[:, None]) * Hv + i_h) * V + o_v[None, :],
                       mask=strict[:, None] & m_v[None, :], other=0.0)
        b_vc = tl.where(here[:, None], b_vn[None, :], b_vc)
        if MMA:
            b_intra = _av_mma(tl.where(causal, b_qk * b_E, 0.0), b_vc, C)
        else:
            b_intra = _tree_first(tl.where(causal[:, None], (b_qk * b_E)[:, None] * b_vc, _neg0()), C, BV)
        b_o = b_inter + b_intra
        tl.store(p_o + (t * Hv + i_h) * V + o_v, tl.where(valid, b_o, 0.0), mask=m_v)
        tl.store(p_xr + o_v, b_u, mask=o_v < n_v)
        tl.store(p_vc + ((s * C + r) * Hv + i_h) * V + o_v, b_vn, mask=o_v < n_v)
    o_1 = tl.arange(0, 2)  # scalar stores as masked 2-lane stores (the interpreter refuses scalar masks)
    tl.store(p_gc + (s * C + r) * Hv + i_h + o_1, tl.zeros([2], tl.float32) + G_i, mask=o_1 < tl.where(valid, 1, 0))


@triton.jit
def _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, j0, G_last, o_kb, o_vb, m_k, m_v, i_h, i_hk,
           Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
           BKS: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Rows j0..j0+7: the level-3 node tree_8((k_j exp(G_last - G_j)) v_j^T) -> (BKS, BVS)."""
    o_j = j0 + tl.arange(0, 8)
    b_g = tl.load(p_gc + (s * C + o_j) * Hv + i_h)
    b_kc = _k_rows(p_k, p_kc, s, t0, start, pos, o_j, o_kb, m_k, i_hk, Hk, K, C)
    b_kd = b_kc * _exp(G_last - b_g, LIBDEVICE)[:, None]  # (8, BKS)
    b_vc = tl.load(p_vc + ((s * C + o_j[:, None]) * Hv + i_h) * V + o_vb[None, :], mask=m_v[None, :], other=0.0)
    x = b_kd[:, :, None] * b_vc[:, None, :]  # (8, BKS, BVS)
    x = tl.sum(tl.reshape(x, (4, 2, BKS, BVS)), axis=1)
    x = tl.sum(tl.reshape(x, (2, 2, BKS, BVS)), axis=1)
    x = tl.sum(tl.reshape(x, (1, 2, BKS, BVS)), axis=1)
    return tl.reshape(x, (BKS, BVS))


@triton.jit
def _state_tile(p_k, p_kc, p_gc, p_vc, p_state, s, t0, start, pos, i_tile, i_h, i_hk,
                Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BKS: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr,
                MMA: tl.constexpr):
    """One (BKS, BVS) tile of the slot's state after row pos % 64: zeros at
    position 0; S0 * exp(G_63) + tree_j(k'_j v_new_j^T) at row 63 (MMA: the sum as
    ``_mma(k'^T, v_new)``, the chunk state kernel's dot); else unchanged."""
    NV: tl.constexpr = (V + BVS - 1) // BVS
    o_kb = (i_tile // NV) * BKS + tl.arange(0, BKS)
    o_vb = (i_tile % NV) * BVS + tl.arange(0, BVS)
    m_k = o_kb < K
    m_v = o_vb < V
    p_s = p_state + ((s * Hv + i_h) * K + o_kb[:, None]) * V + o_vb[None, :]
    m = m_k[:, None] & m_v[None, :]
    if pos == 0:  # a sequence's first row: its slot's state becomes S0 = 0
        tl.store(p_s, tl.zeros([BKS, BVS], tl.float32), mask=m)
    if pos % C == C - 1:
        G_last = tl.load(p_gc + (s * C + C - 1) * Hv + i_h)
        if MMA:
            o_j = tl.arange(0, C)
            b_g = tl.load(p_gc + (s * C + o_j) * Hv + i_h)
            b_kd = _k_rows(p_k, p_kc, s, t0, start, pos, o_j, o_kb, m_k, i_hk, Hk, K, C) * _exp(G_last - b_g,
                                                                                           LIBDEVICE)[:, None]
            b_vc = tl.load(p_vc + ((s * C + o_j[:, None]) * Hv + i_h) * V + o_vb[None, :], mask=m_v[None, :],
                           other=0.0)
            upd = _mma(tl.trans(b_kd), b_vc)
        else:
            a0 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 0, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a1 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 8, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a2 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 16, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a3 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 24, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a4 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 32, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a5 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 40, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a6 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 48, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            a7 = _leaf8(p_k, p_kc, p_vc, p_gc, s, t0, start, pos, 56, G_last, o_kb, o_vb, m_k, m_v,
                        i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE)
            upd = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
        b_S = tl.load(p_s, mask=m, other=0.0)
        tl.store(p_s, b_S * _exp(G_last, LIBDEVICE) + upd, mask=m)


@triton.jit
def _gdn_decode_row_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_pos, p_slot,
    p_state, p_kc, p_gc, p_xc, p_vc, p_nc, p_o,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, QK: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr,
    MMA: tl.constexpr,
):
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    t = i_b.to(tl.int64)
    pos = tl.load(p_pos + i_b)
    slot = tl.load(p_slot + i_b)
    valid = slot >= 0
    s = tl.maximum(slot, 0).to(tl.int64)
    _row(p_q, p_k, p_v, p_g, p_beta, p_o, p_state, p_kc, p_gc, p_xc, p_vc, t, t, pos, pos, s, valid, i_h, i_hk,
         Hk, Hv, K, V, BK, BV, QK, C, LIBDEVICE, MMA)
    r = pos % C
    o_k = tl.arange(0, BK)
    # every head of a group writes the same k row (no program of this launch reads cache row r)
    b_k = tl.load(p_k + (t * Hk + i_hk) * K + o_k, mask=o_k < K, other=0.0)
    tl.store(p_kc + ((s * C + r) * Hk + i_hk) * K + o_k, b_k, mask=o_k < tl.where(valid, K, 0))
    o_1 = tl.arange(0, 2)
    tl.store(p_nc + s + o_1, tl.zeros([2], tl.int64) + ((r + 1) % C).to(tl.int64),
             mask=o_1 < tl.where(valid & (i_h == 0), 1, 0))


@triton.jit(do_not_specialize=["B", "G"])  # no recompile per batch size (== 1, % 16)
def _gdn_decode_state_kernel(
    p_k, p_pos, p_slot, p_state, p_kc, p_gc, p_vc, B, G,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BKS: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr, MMA: tl.constexpr,
):
    """Grid (Hv, tiles, G): tile i_t of head i_h's state for sequences i_g, i_g + G, ...; a row
    that neither closes a chunk nor starts one leaves its state as it is (``_state_tile``)."""
    i_h, i_t, i_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_hk = i_h // (Hv // Hk)
    for i_b in range(i_g, B, G):
        pos = tl.load(p_pos + i_b)
        slot = tl.load(p_slot + i_b)
        if slot >= 0:  # i_b is a Python int under the interpreter: made an int64 tensor by the add
            _state_tile(p_k, p_kc, p_gc, p_vc, p_state, slot.to(tl.int64), tl.zeros([], tl.int64) + i_b, pos, pos,
                        i_t, i_h, i_hk, Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE, MMA)


@triton.jit
def _gdn_scan_kernel(
    p_q, p_k, p_v, p_g, p_beta, p_cu, p_start, p_slot,
    p_state, p_gc, p_xc, p_vc, p_kc, p_nc, p_o,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, QK: tl.constexpr, BKS: tl.constexpr, BVS: tl.constexpr,
    C: tl.constexpr, LIBDEVICE: tl.constexpr, MMA: tl.constexpr,
):
    """Grid (B, Hv): a sequence's rows in order, each the decode row, the state
    after rows 63 (and at position 0) by tiles; a barrier after each step, as
    the next reads what this program wrote.  The slot's k rows are read, never
    written (heads of a group run at their own pace): ``_k_rows_kernel`` writes
    the open chunk's after the scan."""
    i_b, i_h = tl.program_id(0), tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    t0 = tl.load(p_cu + i_b).to(tl.int64)
    n = tl.load(p_cu + i_b + 1).to(tl.int64) - t0
    start = tl.load(p_start + i_b)
    slot = tl.load(p_slot + i_b)
    valid = slot >= 0
    s = tl.maximum(slot, 0).to(tl.int64)
    NT: tl.constexpr = ((K + BKS - 1) // BKS) * ((V + BVS - 1) // BVS)
    for i in range(n):
        pos = start + i
        _row(p_q, p_k, p_v, p_g, p_beta, p_o, p_state, p_kc, p_gc, p_xc, p_vc, t0 + i, t0, start, pos, s, valid,
             i_h, i_hk, Hk, Hv, K, V, BK, BV, QK, C, LIBDEVICE, MMA)
        tl.debug_barrier()
        if valid & ((pos == 0) | (pos % C == C - 1)):
            for i_t in range(NT):
                _state_tile(p_k, p_kc, p_gc, p_vc, p_state, s, t0, start, pos, i_t, i_h, i_hk,
                            Hk, Hv, K, V, BKS, BVS, C, LIBDEVICE, MMA)
            tl.debug_barrier()
    o_1 = tl.arange(0, 2)
    tl.store(p_nc + s + o_1, tl.zeros([2], tl.int64) + ((start + n) % C).to(tl.int64),
             mask=o_1 < tl.where(valid & (i_h == 0) & (n > 0), 1, 0))


@triton.jit
def _k_rows_kernel(p_k, p_cu, p_start, p_slot, p_kc, Hk: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                   C: tl.constexpr):
    """Grid (B, 64, Hk): row j of the slot's open chunk after the call, from the
    input where its position is in the call (rows before it stay)."""
    i_b, j, i_hk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0 = tl.load(p_cu + i_b).to(tl.int64)
    n = tl.load(p_cu + i_b + 1).to(tl.int64) - t0
    start = tl.load(p_start + i_b)
    slot = tl.load(p_slot + i_b)
    last = start + n - 1
    p_j = last - last % C + j
    ok = (slot >= 0) & (n > 0) & (p_j >= start) & (p_j <= last)
    o_k = tl.arange(0, BK)
    b_k = tl.load(p_k + ((t0 + p_j - start) * Hk + i_hk) * K + o_k, mask=o_k < tl.where(ok, K, 0), other=0.0)
    s = tl.maximum(slot, 0).to(tl.int64)
    tl.store(p_kc + ((s * C + j) * Hk + i_hk) * K + o_k, b_k, mask=o_k < tl.where(ok, K, 0))


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch_opts(x):
    lib = not _interpreted() and x.is_cuda
    return lib, ({"enable_reflect_ftz": False} if lib else {})


def _regs(lib: bool, maxnreg: int | None) -> dict:
    """A launch's register cap a thread (ptxas's .maxnreg), on CUDA only: a knob of occupancy that
    cannot change bits (the interpreter takes no such option)."""
    return {"maxnreg": maxnreg} if lib and maxnreg else {}


def gdn_decode_triton(q, k, v, g, beta, pos, slots, cache, *, bv_row: int | None = None, bks: int = BKS,
                      bvs: int = BVS, row_warps: int | None = None, state_warps: int = STATE_WARPS,
                      row_maxnreg: int | None = None, bkq: int = BKQ, state_groups: int = STATE_GROUPS,
                      mma: bool | None = None):
    """``cpu.decode_step`` as two Triton launches.  q, k (B, Hk, K), v (B, Hv, V),
    g, beta (B, Hv) fp32 contiguous; pos, slots (B,) int64; ``cache``:
    ``op.gdn_cache``'s dict (contiguous) -> o (B, Hv, V) fp32 (0 on padding rows).
    ``bv_row``, ``bks``, ``bvs``, ``bkq`` (the row's K lanes a subtree), ``state_groups``, the two
    kernels' warps and the row kernel's register cap (None: by the batch, 0: none): launch knobs
    that cannot change bits.  ``mma``: the kernels' form (``_use_mma``), which does."""
    B, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    o = torch.empty(B, Hv, V, dtype=torch.float32, device=q.device)
    if B == 0:
        return o
    lib, opts = _launch_opts(q)
    mma = _use_mma(lib, mma)
    lo = _min_side(mma)
    BK = max(lo, next_power_of_2(K))
    small = B * Hv <= 8 * 32
    if mma:
        warps, cols = ROW_SMALL_MMA if small else ROW_LARGE_MMA
    else:
        warps, cols = ROW_SMALL if small else ROW_LARGE
    if row_maxnreg is None:
        row_maxnreg = 0 if small or mma else ROW_LARGE_MAXNREG
    BV = max(lo, min(bv_row or cols, next_power_of_2(V)))
    row_warps = row_warps or warps
    _gdn_decode_row_kernel[(B, Hv)](
        q, k, v, g, beta, pos, slots,
        cache["state"], cache["k"], cache["g_cum"], cache["x"], cache["v_new"], cache["n"], o,
        Hk, Hv, K, V, BK, BV, min(BK, max(2, next_power_of_2(bkq))), CHUNK, lib, mma, num_warps=row_warps, **opts,
        **_regs(lib, row_maxnreg), enable_fp_fusion=FP_FUSION,
    )
    bks, bvs = max(lo, min(bks, next_power_of_2(K))), max(lo, min(bvs, next_power_of_2(V)))
    G = max(1, min(B, state_groups))
    _gdn_decode_state_kernel[(Hv, cdiv(K, bks) * cdiv(V, bvs), G)](
        k, pos, slots, cache["state"], cache["k"], cache["g_cum"], cache["v_new"], B, G,
        Hk, Hv, K, V, bks, bvs, CHUNK, lib, mma, num_warps=state_warps, **opts, enable_fp_fusion=FP_FUSION,
    )
    return o


def gdn_scan_triton(q, k, v, g, beta, cu_seqlens, starts, slots, cache, *, bv_row: int = BV_ROW, bks: int = BKS,
                    bvs: int = BVS, bkq: int = BKQ, mma: bool | None = None):
    """The trainer / prefill path as a row-by-row scan: one program per
    (sequence, value head) runs its rows in order through the decode step's
    row and state functions (the same jit helpers), so every row has the
    decode's bits and therefore the CPU path's.  q, k (T, Hk, K), v (T, Hv, V),
    g, beta (T, Hv) fp32 contiguous; cu_seqlens (B + 1,), starts, slots (B,)
    int64 device tensors (no host reads); ``cache`` as for decode (the trainer
    passes a fresh one, slots 0..B-1) -> o (T, Hv, V) fp32.  Sequential in a
    sequence's length: the reference for ``chunk_kernel.gdn_chunk_triton``
    (``gdn_fwd``'s prefill / trainer forward), not a fast one."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    B = cu_seqlens.shape[0] - 1
    o = torch.empty(T, Hv, V, dtype=torch.float32, device=q.device)
    if B == 0 or T == 0:
        return o.zero_()
    lib, opts = _launch_opts(q)
    mma = _use_mma(lib, mma)
    lo = _min_side(mma)
    BK = max(lo, next_power_of_2(K))
    BV = max(lo, min(bv_row, next_power_of_2(V)))
    bks, bvs = max(lo, min(bks, next_power_of_2(K))), max(lo, min(bvs, next_power_of_2(V)))
    _gdn_scan_kernel[(B, Hv)](
        q, k, v, g, beta, cu_seqlens, starts, slots,
        cache["state"], cache["g_cum"], cache["x"], cache["v_new"], cache["k"], cache["n"], o,
        Hk, Hv, K, V, BK, BV, min(BK, max(2, next_power_of_2(bkq))), bks, bvs, CHUNK, lib, mma, **opts,
        enable_fp_fusion=FP_FUSION, num_warps=4,
    )
    _k_rows_kernel[(B, CHUNK, Hk)](k, cu_seqlens, starts, slots, cache["k"], Hk, K, BK, CHUNK, **opts,
        enable_fp_fusion=FP_FUSION, num_warps=4)
    return o
