"""Triton gated delta rule for the trainer / prefill, chunk-parallel: the
bits of ``kernel.gdn_scan_triton`` in either of its forms (the trees: and so
of ``cpu.chunked``; MMA, compiled CUDA's default: the state's products as
tensor-core dots), with the work that does not read the state spread over
every 64-row chunk at once.

The arithmetic is ``cpu.py``'s row functions, written with ``kernel.py``'s
jit helpers: every sum the fixed pairwise tree (``_tree_first``, or
unrolled over leaves: pairs of adjacent elements, level by level, -0.0 for a K
lane past K or a row j not present), G a left-to-right running sum, every
product rounded on its own (``enable_fp_fusion=False``), exp from libdevice
on CUDA.  A chunk piece is 64 aligned rows of one sequence (the last one may
be shorter); the launches, in order:

* the head: a sequence that starts mid-chunk (start % 64 != 0) first runs
  its rows up to the next 64 boundary through ``gdn_scan_triton`` (those
  rows mix the slot's cached rows with new ones), which leaves the slot's
  state at that boundary.
* ``_chunk_rows_kernel``, grid (pieces, Hv): G_i = G_{i-1} + g_i over the
  piece's rows in order, the piece's k^T and q^T to scratch, a barrier, then
  BI rows i at a time: kk_i, qk_i = tree_K (``kernel._row``'s tree over the K
  lanes, unrolled over its leaves in ``_kq_tree``: a leaf the outer product
  of row k of k^T (the rows j) and of k^T / q^T (the tile's rows i), so a
  level adds two (BI, 64) tiles in registers), E_i, L_i = (beta_i kk_i) E_i,
  A_i = qk_i E_i, written to scratch.
* ``_chunk_solve_kernel``, grid (pieces x (V + K) / BW, Hv): the 64
  substitution steps x_i = b_i - tree_j(where(j < i, L_ij x_j, -0.0)) on
  (BS, BW) tiles of x = [u | w] (a column of x needs only its own column), a
  block of BS rows at a time: the tree's subtrees left of the block are
  finished rows, summed as whole tiles over their leaves, and only the
  block's own subtree goes row by row: x and w^T to scratch.
* ``_chunk_state_kernel``, grid (sequences x V / BV, Hv): the chunks of a
  sequence in order, on a (K, BV) column tile of the slot's state:
  v_new_i = u_i - tree_K(w_i S0), BR rows at a time,
  then at a complete chunk S0 exp(G_63) + tree_j(k'_j v_new_j^T)
  (``kernel._state_tile``'s sum, k'_j from the rows kernel) in place, a
  barrier.  Each tree is unrolled over its leaves (the recursive ``_ks_tree``,
  ``_av_tree``, ``_kv_tree``): a leaf is the outer product of a loaded row and column, so a
  level adds two tiles element by element in registers, never across lanes.
  V columns never need each other.
  o_i = tree_K((q_i exp(G_i)) S0) + tree_j(where(j <= i, A_ij v_new_j,
  -0.0)) is formed there too (its K tree beside v_new's) when the launch has
  programs enough to fill the GPU (``FUSE_PROGRAMS``); else
* ``_chunk_out_kernel``, grid (pieces x (V / BVO) x (64 / BRO), Hv): the same
  o from each piece's S0 (the state kernel writes it to scratch) and v_new,
  every piece at once: no later piece reads o, and at 1 x 4096 tokens the
  order-bound state kernel has only Hv x V / BV programs.
* ``kernel._k_rows_kernel``: the open chunk's k rows.

In the MMA form ``_chunk_state_mma_kernel`` and ``_chunk_out_mma_kernel`` take the
state and output kernels' places: a program holds its (K, BV) state tile in
registers across the sequence's pieces and forms each piece's 64 rows at once,
v_new = u - _mma(w, S0), o = _mma(q exp(G), S0) + _mma(A, v_new) (A_ij = 0 past
the diagonal) and the update S0 exp(G_63) + _mma(k'^T, v_new): the dots a decode
row forms padded into a 16-row tile (``kernel._ws_mma``, ``_av_mma``,
``_state_tile``).  Rows, lanes and columns past the piece, K or V load as 0.

Cache: as the scan leaves it.  The slot's state is the state after the last
complete chunk (zeros at position 0 before one); a sequence's last piece
writes its rows' g_cum, x, v_new (all 64 rows of a chunk that closes at the
call's end, as the scan does); n = (start + len) % 64.  Rows past the last
piece's end are stale (``op.py``: never read) and not written (the scan
leaves an earlier chunk's rows of the call there, ``cpu.chunked`` zeros).  A
padding row (slot -1) gets o = 0 and writes nothing.

The launcher lays out the pieces on the host, from cu_seqlens, starts and
slots as host lists (the engine's ``ForwardBatch.host``) or read back in one
copy, and sends the layout in one copy that does not block: prefill and the
trainer are not captured in CUDA graphs (decode, ``kernel.gdn_decode_triton``,
reads nothing).  Scratch per call:
(T rounded up to 64 per sequence) x Hv x (2 x 64 + 2 V + 6 K + K V / 64 + 1) fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .cpu import CHUNK, host_lists
from .kernel import (_exp, _k_rows_kernel, _launch_opts, _min_side, _mma, _regs, _tree_first, _use_mma,
                     gdn_scan_triton)
from .trees import _av_tree, _in_bounds, _ks_tree, _kv_tree, _neg0

BW = 16  # x columns per substitution program (a launch knob: columns are independent)
BS = 8  # rows a block of the substitution (a launch knob, a power of two >= 2: the tree is the same)
# state columns per state program, rows per step of its v_new, K rows per state-update
# tile, and its warps (launch knobs; rows and columns are element-wise;
# benchmarks/bench_gdn_prefill.py sweeps them)
BV = 16
BR = 8
BKS = 16
STATE_WARPS = 2  # two (BR, BV) elements a thread
# the state kernel's registers a thread (a launch knob): ptxas schedules faster with 128 than at
# its own 112 (8 x 512 tokens: a chunk call 4.03 ms against 4.63 uncapped)
STATE_MAXNREG = 128
# the output kernel's tile (BRO rows x BVO columns) and warps (launch knobs; 8 x 512 tokens:
# about 1.0 ms at 32 columns, 1.5 at 16)
BVO, BRO, OUT_WARPS = 32, 8, 2
# state programs from which o stays in the state kernel (its inter tree shares S0's loads with
# v_new's) rather than the output kernel: fused is 10% faster at 512 programs, 10% slower at 256
FUSE_PROGRAMS = 512
# the MMA form's state kernel: columns a program and warps (launch knobs; four warps make a 64-row
# tile one wgmma)
MMA_BV, MMA_STATE_WARPS = 32, 4
# rows i per tile of the rows kernel's trees (a launch knob; 8 x 512 tokens: the rows kernel
# about 0.9 ms at 2 rows on 2 warps, 8.2 ms at 4; at 8 ptxas spills, sm_90a, K 128)
BI = 2
ROWS_WARPS = 2  # warps of the rows kernel (a launch knob)
# the solve kernel's (a launch knob): on one, a step's 8-row tree stays in a warp, no barrier
# (8 x 512 tokens: 3.83 ms a chunk call against 4.03 on two)
SOLVE_WARPS = 1


@triton.jit
def _kq_tree(p_kj, p_ki, p_qi, k0, N: tl.constexpr, K: tl.constexpr, C: tl.constexpr):
    """Leaves k0..k0+N-1 (N a power of two) of the K trees of kk and qk, (k_ik k_jk, q_ik k_jk) as
    (BI, C) tiles and -0.0 past K, by the pairwise tree: tile-wise adds, in registers.  A leaf reads
    row k of the piece's k^T (all rows j) and of k^T, q^T (the tile's rows i), each contiguous; k0 a
    runtime value, as in ``_ks_tree``."""
    if N == 1:
        k = tl.minimum(k0, K - 1)  # a lane past K reads row K - 1 and keeps -0.0
        b_kj = tl.load(p_kj + k * C)  # (C,)
        b_ki = tl.load(p_ki + k * C)  # (BI,)
        b_qi = tl.load(p_qi + k * C)
        a = tl.where(k0 < K, b_ki[:, None] * b_kj[None, :], _neg0())
        c = tl.where(k0 < K, b_qi[:, None] * b_kj[None, :], _neg0())
    else:
        a0, c0 = _kq_tree(p_kj, p_ki, p_qi, k0, N // 2, K, C)
        a1, c1 = _kq_tree(p_kj, p_ki, p_qi, k0 + N // 2, N // 2, K, C)
        a = a0 + a1
        c = c0 + c1
    return a, c


@triton.jit
def _chunk_rows_kernel(
    p_q, p_k, p_g, p_beta, p_tok, p_rows, p_wslot,
    p_G, p_L, p_AT, p_QT, p_KD, p_KQ, p_gc,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, BK: tl.constexpr, BI: tl.constexpr, C: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Grid (pieces, Hv): G (left to right); k'_j = k_j exp(G_last - G_j) for the
    state update (read only at a complete piece, where G_last = G_63), q_i exp(G_i)
    transposed (the state kernel's leaves read BR rows i of one column), and k^T,
    q^T to scratch; a barrier; then BI rows i at a time kk_i, qk_i (tree_K,
    ``_kq_tree``), E_i = exp(where(j <= i, G_i - G_j, -inf)), L_i = (beta_i kk_i)
    E_i and A_i = qk_i E_i, as ``kernel._row`` forms them, A stored transposed.
    Rows past the piece's end: 0 in k^T, q^T (they reach only L_ij, A_ij at
    j > i, which nothing reads) and not stored elsewhere."""
    KB: tl.constexpr = 32 if BK > 32 else BK  # k lanes a prologue tile: (64, 128) at once spills (sm_90a, 2 warps)
    i_p, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    t0 = tl.load(p_tok + i_p)
    nr = tl.load(p_rows + i_p)
    ws = tl.load(p_wslot + i_p)
    o_j = tl.arange(0, C)
    m_j = o_j < nr
    G_i = tl.load(p_g + t0 * Hv + i_h)  # G_0 = -0.0 + g_0 == g_0 for every g_0
    b_G = tl.where(o_j == 0, G_i, 0.0)  # (C,)
    for i in range(1, nr):
        G_i = G_i + tl.load(p_g + (t0 + i) * Hv + i_h)
        b_G = tl.where(o_j == i, G_i, b_G)
    tl.store(p_G + (i_p * C + o_j) * Hv + i_h, b_G)
    s = tl.maximum(ws, 0)
    tl.store(p_gc + (s * C + o_j) * Hv + i_h, b_G, mask=o_j < tl.where(ws >= 0, nr, 0))
    e_d = _exp(G_i - b_G, LIBDEVICE)  # (C,) k'_j's factor
    e_G = _exp(b_G, LIBDEVICE)
    p_kt = p_KQ + (i_p * Hv + i_h) * 2 * K * C  # k^T, then q^T: (K, C) each
    for k0 in range(0, K, KB):
        o_kb = k0 + tl.arange(0, KB)
        m_kb = o_kb < K
        p_in = ((t0 + o_j) * Hk + i_hk)[:, None] * K + o_kb[None, :]  # (C, KB) the piece's rows of q, k
        m_in = m_j[:, None] & m_kb[None, :]
        p_t = o_kb[None, :] * C + o_j[:, None]
        b_x = tl.load(p_k + p_in, mask=m_in, other=0.0)
        tl.store(p_KD + ((i_p * C + o_j[:, None]) * Hv + i_h) * K + o_kb[None, :], b_x * e_d[:, None], mask=m_in)
        tl.store(p_kt + p_t, b_x, mask=m_kb[None, :])
        b_x = tl.load(p_q + p_in, mask=m_in, other=0.0)
        tl.store(p_QT + (i_p * Hv + i_h) * K * C + p_t, b_x * e_G[:, None], mask=m_in)
        tl.store(p_kt + K * C + p_t, b_x, mask=m_kb[None, :])
    tl.debug_barrier()  # G and k^T, q^T are read back below
    zero = tl.full([], 0, tl.int32)  # the trees' first leaf as a value, not a constexpr: see _ks_tree
    for i0 in range(0, nr, BI):
        o_i = i0 + tl.arange(0, BI)
        m_i = o_i < nr
        b_kk, b_qk = _kq_tree(p_kt + o_j, p_kt + o_i, p_kt + K * C + o_i, zero, BK, K, C)  # (BI, C)
        b_beta = tl.load(p_beta + (t0 + o_i) * Hv + i_h, mask=m_i, other=0.0)
        b_Gi = tl.load(p_G + (i_p * C + o_i) * Hv + i_h, mask=m_i, other=0.0)
        b_E = _exp(tl.where(o_j[None, :] <= o_i[:, None], b_Gi[:, None] - b_G[None, :], float("-inf")), LIBDEVICE)
        p_hd = (i_p * Hv + i_h) * C
        tl.store(p_L + (p_hd + o_i[:, None]) * C + o_j[None, :], (b_beta[:, None] * b_kk) * b_E, mask=m_i[:, None])
        tl.store(p_AT + (p_hd + o_j[None, :]) * C + o_i[:, None], b_qk * b_E, mask=m_i[:, None])


@triton.jit
def _left_tile(p_li, p_xr, o_i, r0, S: tl.constexpr, RX: tl.constexpr, C: tl.constexpr,
               BS: tl.constexpr, BW: tl.constexpr):
    """The rows block at r0's left sibling at tree level S (leaves r0 - r0 % 2S .. + S - 1, every
    one a finished row j < r0 <= i) as a (BS, BW) tile of tree_j(L_ij x_j); -0.0 where the block's
    node is a left child (its sibling holds rows j >= i only) or the level is past the root."""
    x = tl.broadcast_to(_neg0(), (BS, BW))
    if S < C:
        if r0 % (2 * S) >= S:
            x = _av_tree(p_li, p_xr, o_i, r0 - r0 % (2 * S), S, r0, 1, RX, BS, BW)
    return x


@triton.jit
def _chunk_solve_kernel(
    p_k, p_v, p_beta, p_tok, p_rows, p_wslot,
    p_G, p_L, p_X, p_WT, p_xc,
    Hk: tl.constexpr, Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BW: tl.constexpr, BS: tl.constexpr, C: tl.constexpr, LIBDEVICE: tl.constexpr, STORE_WT: tl.constexpr,
):
    """Grid (pieces x (V + K) / BW, Hv), a piece's column tiles consecutive programs (they share its
    L in L2): columns c of x = [u | w], x_i = b_i -
    tree_j(where(j < i, L_ij x_j, -0.0)) with b_i = v_i beta_i (c < V) or
    (k_i beta_i) exp(G_i) (c >= V), ``kernel._row``'s terms, in blocks of BS
    aligned rows.  Row i's tree over the 64 leaves is the subtree of its block
    (rows j >= i there -0.0), then at each level up the left sibling added when
    the block's node is a right child (a right sibling holds only -0.0 leaves,
    and x + -0.0 == x): the siblings are finished rows, so whole (BS, BW) tiles
    of leaves (``_left_tile``), and only the block's subtree (BS rows, not 64)
    is summed a row at a time.  x to scratch (row-major, read back by later
    blocks and the state kernel), w^T (with STORE_WT: the trees' state kernel's leaves; the MMA
    form's reads w from x) and the slot's open chunk."""
    W: tl.constexpr = V + K
    NC: tl.constexpr = (W + BW - 1) // BW
    i_p, i_c, i_h = (tl.program_id(0) // NC).to(tl.int64), tl.program_id(0) % NC, tl.program_id(1)
    i_hk = i_h // (Hv // Hk)
    t0 = tl.load(p_tok + i_p)
    nr = tl.load(p_rows + i_p)
    ws = tl.load(p_wslot + i_p)
    n_slot = tl.where(ws >= 0, nr, 0)
    s = tl.maximum(ws, 0)
    o_r = tl.arange(0, BS)
    o_c = i_c * BW + tl.arange(0, BW)
    is_u = o_c < V
    is_w = (o_c >= V) & (o_c < W)
    m_c = o_c < W
    p_l0 = p_L + (i_p * Hv + i_h) * C * C  # L of the piece and head, row-major
    p_xr = p_X + (i_p * C * Hv + i_h) * W + o_c  # (BW,) row 0 of x's column tile
    p_xl = p_X + (i_p * C * Hv + i_h) * W + _in_bounds(o_c, W, BW)  # the same, for the trees' unmasked loads
    for r0 in range(0, nr, BS):
        o_i = r0 + o_r
        m_i = o_i < nr
        t = t0 + o_i
        b_beta = tl.load(p_beta + t * Hv + i_h, mask=m_i, other=0.0)  # (BS,)
        e_G = _exp(tl.load(p_G + (i_p * C + o_i) * Hv + i_h, mask=m_i, other=0.0), LIBDEVICE)
        b_v = tl.load(p_v + (t * Hv + i_h)[:, None] * V + o_c[None, :], mask=m_i[:, None] & is_u[None, :],
                      other=0.0)
        b_k = tl.load(p_k + (t * Hk + i_hk)[:, None] * K + o_c[None, :] - V, mask=m_i[:, None] & is_w[None, :],
                      other=0.0)
        # rows hold b_i until their step, which turns row i into x_i (b_i minus the tree)
        b_X = tl.where(is_u[None, :], b_v * b_beta[:, None], (b_k * b_beta[:, None]) * e_G[:, None])  # (BS, BW)
        p_li = p_l0 + o_i * C  # (BS,) column 0 of L's rows i
        a0 = _left_tile(p_li, p_xl, o_i, r0, BS, Hv * W, C, BS, BW)
        a1 = _left_tile(p_li, p_xl, o_i, r0, BS * 2, Hv * W, C, BS, BW)
        a2 = _left_tile(p_li, p_xl, o_i, r0, BS * 4, Hv * W, C, BS, BW)
        a3 = _left_tile(p_li, p_xl, o_i, r0, BS * 8, Hv * W, C, BS, BW)
        a4 = _left_tile(p_li, p_xl, o_i, r0, BS * 16, Hv * W, C, BS, BW)
        b_l = tl.load(p_l0 + r0 * C + o_i)  # (BS,) L_ij, j in the block, of the step's row i
        for ii in range(tl.minimum(BS, nr - r0)):
            # the next row's L issued before this step's chain, which would otherwise wait on it
            b_ln = tl.load(p_l0 + tl.minimum(r0 + ii + 1, C - 1) * C + o_i)
            b_t = _tree_first(tl.where((o_r < ii)[:, None], b_l[:, None] * b_X, _neg0()), BS, BW)
            b_t = b_t[None, :] + a0  # a row's levels in order, bottom up (a level past the root: -0.0)
            if BS * 2 < C:
                b_t = b_t + a1
            if BS * 4 < C:
                b_t = b_t + a2
            if BS * 8 < C:
                b_t = b_t + a3
            if BS * 16 < C:
                b_t = b_t + a4
            b_X = tl.where((o_r == ii)[:, None], b_X - b_t, b_X)
            b_l = b_ln
        m = m_i[:, None] & m_c[None, :]
        tl.store(p_xr[None, :] + o_i[:, None] * (Hv * W), b_X, mask=m)
        if STORE_WT:
            tl.store(p_WT + ((i_p * Hv + i_h) * K + o_c[None, :] - V) * C + o_i[:, None], b_X,
                     mask=m & is_w[None, :])
        tl.store(p_xc + ((s * C + o_i[:, None]) * Hv + i_h) * W + o_c[None, :], b_X,
                 mask=m & (o_i < n_slot)[:, None])
        tl.debug_barrier()  # the block's rows are the next blocks' leaves


@triton.jit
def _seq_program(p_seq, p_sslot, p_fresh, V: tl.constexpr, BV: tl.constexpr):
    """A state kernel's program on grid (sequences x V / BV, Hv), a sequence's column tiles
    consecutive: (sequence, column tile, head, its first piece and the end of its pieces, slot,
    from position 0, the tile's columns and their mask)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    i_b, i_v, i_h = tl.program_id(0) // NV, tl.program_id(0) % NV, tl.program_id(1)
    o_v = i_v * BV + tl.arange(0, BV)
    return (i_b, i_v, i_h, tl.load(p_seq + i_b), tl.load(p_seq + i_b + 1), tl.load(p_sslot + i_b),
            tl.load(p_fresh + i_b), o_v, o_v < V)


@triton.jit
def _store_n(p_nc, p_nend, s, i_b, i_h, i_v):
    """The slot's n = (start + len) % 64, from one program of the sequence: a scalar store as a masked
    2-lane store (the interpreter refuses scalar masks)."""
    o_1 = tl.arange(0, 2)
    tl.store(p_nc + s + o_1, tl.zeros([2], tl.int64) + tl.load(p_nend + i_b),
             mask=o_1 < tl.where((i_h == 0) & (i_v == 0), 1, 0))


@triton.jit
def _piece_program(p_tok, p_rows, V: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, C: tl.constexpr):
    """An output kernel's program on grid (pieces x (V / BV) x (64 / BR), Hv), a piece's tiles
    consecutive: (piece, tile, head, the piece's first token, its rows, the tile's first row).  Rows in
    32 bits: the trees' compares of row indices are then 1 op, not 2."""
    NR: tl.constexpr = C // BR
    NT: tl.constexpr = (V + BV - 1) // BV * NR
    i_p, i_t = (tl.program_id(0) // NT).to(tl.int64), tl.program_id(0) % NT
    return i_p, i_t, tl.program_id(1), tl.load(p_tok + i_p), tl.load(p_rows + i_p).to(tl.int32), (i_t % NR) * BR


@triton.jit
def _chunk_state_kernel(
    p_o, p_tok, p_rows, p_seq, p_sslot, p_fresh, p_nend,
    p_G, p_AT, p_QT, p_U, p_WT, p_KD, p_VN, p_S0, p_state, p_vc, p_nc,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, BKS: tl.constexpr, C: tl.constexpr,
    FUSED: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """Grid (sequences x V / BV, Hv), a sequence's column tiles consecutive programs (they share its
    pieces' w^T, q^T, A^T and k' in L2): the sequence's pieces in order from S0 (the
    slot's state, zeros at position 0), BR rows x BV columns a step.  Per piece:
    v_new_i = u_i - tree_K(w_i S0) for every row, a barrier; at a complete piece
    the state S0 exp(G_63) + tree_j(k'_j v_new_j^T) in (BKS, BV) tiles, a
    barrier.  o, which no later piece reads: FUSED, here (its inter term's tree
    beside v_new's, sharing S0's rows, into o, then after the barrier o += the
    intra term); else each piece's S0 goes to scratch for the output kernel,
    every piece at once.  Each tree is unrolled over its leaves (``_ks_tree``,
    ``_av_tree``, ``_kv_tree``), a leaf an outer product of two loaded vectors,
    so every level adds whole tiles in registers.  The last piece's v_new rows
    go to the slot."""
    NK: tl.constexpr = (K + BKS - 1) // BKS
    W: tl.constexpr = V + K
    i_b, i_v, i_h, p0, p1, s, fresh, o_v, m_v = _seq_program(p_seq, p_sslot, p_fresh, V, BV)
    o_vl = _in_bounds(o_v, V, BV)  # columns for the trees' unmasked loads
    o_r = tl.arange(0, BR)
    o_ks = tl.arange(0, BKS)
    zero = tl.full([], 0, tl.int32)  # the trees' first leaf as a value, not a constexpr: see _ks_tree
    p_S = p_state + (s * Hv + i_h) * K * V + o_v  # (BV,) row 0 of the slot's S0 tile
    p_Sl = p_state + (s * Hv + i_h) * K * V + o_vl
    p_s0 = p_S0 + i_h * K * V + o_v  # (BV,) row 0 of piece 0's S0 tile in scratch
    for i_kt in range(NK):
        o_kb = i_kt * BKS + o_ks
        m_s = (o_kb < K)[:, None] & m_v[None, :]
        p_s = p_S[None, :] + o_kb[:, None] * V
        if fresh != 0:  # position 0: S0 = 0, and the slot's state with it
            tl.store(p_s, tl.zeros([BKS, BV], dtype=tl.float32), mask=m_s)
        if not FUSED:  # the first piece's S0, for the output kernel
            b_S = tl.where(fresh != 0, 0.0, tl.load(p_s, mask=m_s, other=0.0))
            tl.store(p_s0[None, :] + (p0 * Hv * K + o_kb[:, None]) * V, b_S, mask=m_s)
    tl.debug_barrier()
    for i_p in range(p0, p1):
        t0 = tl.load(p_tok + i_p)
        nr = tl.load(p_rows + i_p).to(tl.int32)  # row indices in 32 bits: the trees' compares are 1 op, not 2
        n_last = tl.where(i_p == p1 - 1, nr, 0)  # rows that go to the slot's open chunk
        p_vn = p_VN + (i_p * C * Hv + i_h) * V + o_v  # (BV,) row 0 of the piece's v_new tile
        p_vnl = p_VN + (i_p * C * Hv + i_h) * V + o_vl
        for r0 in range(0, nr, BR):
            o_i = r0 + o_r
            m_i = o_i < nr
            p_hk = (i_p * Hv + i_h) * K * C + o_i  # (BR,) column 0 of w^T, (q exp(G))^T
            b_t, b_inter = _ks_tree(p_Sl, p_WT + p_hk, p_QT + p_hk, zero, BK, K, V, C, FUSED)
            m_iv = m_i[:, None] & m_v[None, :]
            b_u = tl.load(p_U + ((i_p * C + o_i[:, None]) * Hv + i_h) * W + o_v[None, :], mask=m_iv, other=0.0)
            b_vn = b_u - b_t
            tl.store(p_vn[None, :] + o_i[:, None] * (Hv * V), b_vn, mask=m_iv)
            tl.store(p_vc + ((s * C + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_vn,
                     mask=(o_i < n_last)[:, None] & m_v[None, :])
            if FUSED:
                tl.store(p_o + ((t0 + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_inter, mask=m_iv)
        tl.debug_barrier()
        if FUSED:
            for r0 in range(0, nr, BR):  # rows r0.. see v_new rows j < r0 + BR only
                o_i = r0 + o_r
                m_i = o_i < nr
                m_iv = m_i[:, None] & m_v[None, :]
                p_oi = p_o + ((t0 + o_i[:, None]) * Hv + i_h) * V + o_v[None, :]
                b_intra = _av_tree(p_AT + (i_p * Hv + i_h) * C * C + o_i, p_vnl, o_i, zero, C, r0 + BR,
                                   C, Hv * V, BR, BV)
                tl.store(p_oi, tl.load(p_oi, mask=m_iv, other=0.0) + b_intra, mask=m_iv)
        if nr == C:
            e_last = _exp(tl.load(p_G + (i_p * C + C - 1) * Hv + i_h), LIBDEVICE)
            n_next = tl.where(i_p + 1 < p1, K, 0)  # the next piece's S0, when there is one
            for i_kt in range(NK):
                o_kb = i_kt * BKS + o_ks
                m_k = o_kb < K
                upd = _kv_tree(p_KD + (i_p * C * Hv + i_h) * K + _in_bounds(o_kb, K, BKS), p_vnl, zero, C, Hv * K,
                               Hv * V)
                p_s = p_S[None, :] + o_kb[:, None] * V
                m_s = m_k[:, None] & m_v[None, :]
                b_S = tl.load(p_s, mask=m_s, other=0.0) * e_last + upd
                tl.store(p_s, b_S, mask=m_s)
                if not FUSED:
                    tl.store(p_s0[None, :] + ((i_p + 1) * Hv * K + o_kb[:, None]) * V, b_S,
                             mask=(o_kb < n_next)[:, None] & m_v[None, :])
            tl.debug_barrier()
    _store_n(p_nc, p_nend, s, i_b, i_h, i_v)


@triton.jit
def _chunk_state_mma_kernel(
    p_o, p_tok, p_rows, p_seq, p_sslot, p_fresh, p_nend,
    p_G, p_AT, p_QT, p_X, p_KD, p_VN, p_S0, p_state, p_vc, p_nc,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, FUSED: tl.constexpr, LIBDEVICE: tl.constexpr,
):
    """``_chunk_state_kernel``'s work with the state's products as ``kernel._mma`` dots, the
    state's (BK, BV) column tile held in registers across the sequence's pieces.  Per piece, all
    64 rows at once: v_new = u - _mma(w, S0); FUSED, o = _mma(q exp(G), S0) + _mma(A, v_new) with
    A_ij = 0 where j > i (else S0 to scratch for ``_chunk_out_mma_kernel``); at a complete piece
    S0 exp(G_63) + _mma(k'^T, v_new).  A row's dots are the decode row's (``kernel._ws_mma``,
    ``_av_mma``) and the update is ``kernel._state_tile``'s: rows and columns past the piece or
    past K, V load as 0, so every stale scratch value stays out of a product."""
    W: tl.constexpr = V + K
    i_b, i_v, i_h, p0, p1, s, fresh, o_v, m_v = _seq_program(p_seq, p_sslot, p_fresh, V, BV)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_i = tl.arange(0, C)
    m_s = m_k[:, None] & m_v[None, :]
    p_s = p_state + ((s * Hv + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    b_S = tl.where(fresh != 0, 0.0, tl.load(p_s, mask=m_s, other=0.0))  # (BK, BV)
    for i_p in range(p0, p1):
        t0 = tl.load(p_tok + i_p)
        nr = tl.load(p_rows + i_p).to(tl.int32)
        n_last = tl.where(i_p == p1 - 1, nr, 0)  # rows that go to the slot's open chunk
        m_i = o_i < nr
        if not FUSED:
            tl.store(p_S0 + ((i_p * Hv + i_h) * K + o_k[:, None]) * V + o_v[None, :], b_S, mask=m_s)
        p_x = p_X + ((i_p * C + o_i[:, None]) * Hv + i_h) * W  # (C, 1) rows of x = [u | w]
        b_w = tl.load(p_x + V + o_k[None, :], mask=m_i[:, None] & m_k[None, :], other=0.0)  # (C, BK)
        b_u = tl.load(p_x + o_v[None, :], mask=m_i[:, None] & m_v[None, :], other=0.0)  # (C, BV)
        b_vn = b_u - _mma(b_w, b_S)
        m_iv = m_i[:, None] & m_v[None, :]
        if not FUSED:
            tl.store(p_VN + ((i_p * C + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_vn, mask=m_iv)
        tl.store(p_vc + ((s * C + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_vn,
                 mask=(o_i < n_last)[:, None] & m_v[None, :])
        if FUSED:
            p_hd = (i_p * Hv + i_h) * C
            b_qe = tl.load(p_QT + ((i_p * Hv + i_h) * K + o_k[None, :]) * C + o_i[:, None],
                           mask=m_i[:, None] & m_k[None, :], other=0.0)  # (C, BK) q_i exp(G_i)
            b_a = tl.load(p_AT + (p_hd + o_i[None, :]) * C + o_i[:, None], mask=m_i[:, None], other=0.0)  # (C i, C j)
            b_a = tl.where(o_i[None, :] <= o_i[:, None], b_a, 0.0)
            b_o = _mma(b_qe, b_S) + _mma(b_a, b_vn)
            tl.store(p_o + ((t0 + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_o, mask=m_iv)
        if nr == C:
            e_last = _exp(tl.load(p_G + (i_p * C + C - 1) * Hv + i_h), LIBDEVICE)
            b_kd = tl.load(p_KD + ((i_p * C + o_i[None, :]) * Hv + i_h) * K + o_k[:, None], mask=m_k[:, None],
                           other=0.0)  # (BK, C) k'^T
            b_S = b_S * e_last + _mma(b_kd, b_vn)
    tl.store(p_s, b_S, mask=m_s)
    _store_n(p_nc, p_nend, s, i_b, i_h, i_v)


@triton.jit
def _chunk_out_mma_kernel(
    p_o, p_tok, p_rows, p_AT, p_QT, p_VN, p_S0,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, C: tl.constexpr,
):
    """``_chunk_out_kernel``'s grid and tile, o = _mma(q exp(G), S0) + _mma(A, v_new) as the fused
    state kernel forms it (a row's dots do not see the other rows)."""
    NR: tl.constexpr = C // BR
    i_p, i_t, i_h, t0, nr, r0 = _piece_program(p_tok, p_rows, V, BV, BR, C)
    if r0 < nr:
        o_i = r0 + tl.arange(0, BR)
        o_j = tl.arange(0, C)
        o_v = (i_t // NR) * BV + tl.arange(0, BV)
        o_k = tl.arange(0, BK)
        m_i = o_i < nr
        m_v = o_v < V
        m_k = o_k < K
        p_hd = (i_p * Hv + i_h) * C
        b_qe = tl.load(p_QT + ((i_p * Hv + i_h) * K + o_k[None, :]) * C + o_i[:, None], mask=m_i[:, None] & m_k[None, :],
                       other=0.0)  # (BR, BK)
        b_S = tl.load(p_S0 + ((i_p * Hv + i_h) * K + o_k[:, None]) * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_a = tl.load(p_AT + (p_hd + o_j[None, :]) * C + o_i[:, None], mask=m_i[:, None], other=0.0)  # (BR, C)
        b_a = tl.where(o_j[None, :] <= o_i[:, None], b_a, 0.0)
        b_vn = tl.load(p_VN + ((i_p * C + o_j[:, None]) * Hv + i_h) * V + o_v[None, :],
                       mask=(o_j < nr)[:, None] & m_v[None, :], other=0.0)
        tl.store(p_o + ((t0 + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], _mma(b_qe, b_S) + _mma(b_a, b_vn),
                 mask=m_i[:, None] & m_v[None, :])


@triton.jit
def _chunk_out_kernel(
    p_o, p_tok, p_rows, p_AT, p_QT, p_VN, p_S0,
    Hv: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BR: tl.constexpr, C: tl.constexpr,
):
    """Grid (pieces x (V / BV) x (64 / BR), Hv), a piece's tiles consecutive programs: a (BR, BV) tile of o_i =
    tree_K((q_i exp(G_i)) S0) + tree_j(where(j <= i, A_ij v_new_j, -0.0)), from
    the piece's S0 and v_new that the state kernel wrote: every piece at once."""
    NR: tl.constexpr = C // BR
    i_p, i_t, i_h, t0, nr, r0 = _piece_program(p_tok, p_rows, V, BV, BR, C)
    if r0 < nr:
        o_i = r0 + tl.arange(0, BR)
        o_v = (i_t // NR) * BV + tl.arange(0, BV)
        m_i = o_i < nr
        m_v = o_v < V
        zero = tl.full([], 0, tl.int32)
        p_qt = p_QT + (i_p * Hv + i_h) * K * C + o_i
        o_vl = _in_bounds(o_v, V, BV)  # columns for the trees' unmasked loads
        b_inter, _ = _ks_tree(p_S0 + (i_p * Hv + i_h) * K * V + o_vl, p_qt, p_qt, zero, BK, K, V, C, False)
        b_intra = _av_tree(p_AT + (i_p * Hv + i_h) * C * C + o_i, p_VN + (i_p * C * Hv + i_h) * V + o_vl, o_i,
                           zero, C, r0 + BR, C, Hv * V, BR, BV)
        tl.store(p_o + ((t0 + o_i[:, None]) * Hv + i_h) * V + o_v[None, :], b_inter + b_intra,
                 mask=m_i[:, None] & m_v[None, :])


def _layout(cu, starts, slots):
    """Host lists -> the head rows (a sequence's rows before its first 64 boundary
    when it starts mid-chunk: (sequence, rows)), the pieces (token of row 0, rows,
    slot to write or -1) and the sequences of the chunk-parallel part (first piece,
    slot, from position 0, (start + len) % 64)."""
    heads, pieces, seqs = [], [], []
    for b in range(len(cu) - 1):
        s, n, slot = starts[b], cu[b + 1] - cu[b], slots[b]
        if n <= 0 or slot < 0:
            continue
        h = min(n, -s % CHUNK)
        if h:
            heads.append((b, h))
        if n == h:
            continue
        seqs.append((len(pieces), slot, int(s == 0), (s + n) % CHUNK))
        for r in range(h, n, CHUNK):
            pieces.append([cu[b] + r, min(CHUNK, n - r), -1])
        pieces[-1][2] = slot
    return heads, pieces, seqs


def _device_lists(lists, dev):
    """int64 lists -> device tensors, in one copy: views of one buffer, each starting 16 bytes
    aligned, because Triton compiles a variant per pointer alignment (an odd offset after a list of
    odd length: about 40 s for the state kernel, paid mid-serving).  From pinned memory
    without blocking on CUDA: a pageable copy synchronizes the stream."""
    flat, starts = [], []
    for x in lists:
        starts.append(len(flat))
        flat += x + [0] * (len(x) % 2)
    cuda = torch.device(dev).type == "cuda"
    flat = torch.tensor(flat, dtype=torch.int64, pin_memory=cuda).to(dev, non_blocking=True)
    return [flat[a : a + len(x)] for x, a in zip(lists, starts)]


def gdn_chunk_triton(q, k, v, g, beta, cu_seqlens, starts, slots, cache, *, bw: int = BW, bs: int = BS,
                     bv: int | None = None,
                     br: int = BR, bks: int = BKS, bi: int = BI, bvo: int = BVO, bro: int = BRO,
                     state_warps: int | None = None, out_warps: int = OUT_WARPS, fused: bool | None = None,
                     rows_warps: int = ROWS_WARPS, solve_warps: int = SOLVE_WARPS,
                     state_maxnreg: int | None = -1, rows_maxnreg: int | None = None, host=None,
                     mma: bool | None = None):
    """``gdn_scan_triton``'s contract (shapes, cache writes, bits), chunk-parallel.
    q, k (T, Hk, K), v (T, Hv, V), g, beta (T, Hv) fp32 contiguous; cu_seqlens
    (B + 1,), starts, slots (B,) int64 device tensors, read on the host (not
    graph-capturable) unless ``host`` holds their values as lists
    (``cpu.host_lists``); ``cache``: ``op.gdn_cache``'s dict (the trainer
    passes a fresh one, slots 0..B-1) -> o (T, Hv, V) fp32 (0 on padding rows).
    ``bw``, ``bs``, ``bv``, ``br``, ``bks``, ``bi``, ``bvo``, ``bro``, the four
    kernels' warps and ``fused`` (o in the state kernel, or the output kernel's;
    None: by the state kernel's program count): launch knobs that cannot change
    bits, as are the state and rows kernels' register caps (``kernel._regs``; the
    state kernel's -1: its form's default).  ``mma``: the form (``kernel._use_mma``),
    which does: the MMA state and output kernels, or the trees'.  ``bv`` and
    ``state_warps`` default by the form."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    B = cu_seqlens.shape[0] - 1
    dev = q.device
    o = torch.zeros(T, Hv, V, dtype=torch.float32, device=dev)
    if B == 0 or T == 0:
        return o
    cu, st, sl = host_lists(cu_seqlens, starts, slots) if host is None else host
    heads, pieces, seqs = _layout(cu, st, sl)
    P, NB = len(pieces), len(seqs)
    hcu = [0]
    for _, h in heads:
        hcu.append(hcu[-1] + h)
    tok, rows, wslot, seq, sslot, fresh, nend, idx, hcu, hst, hsl = _device_lists(
        [[p[0] for p in pieces], [p[1] for p in pieces], [p[2] for p in pieces], [x[0] for x in seqs] + [P],
         [x[1] for x in seqs], [x[2] for x in seqs], [x[3] for x in seqs],
         [cu[b] + i for b, h in heads for i in range(h)], hcu, [st[b] for b, _ in heads], [sl[b] for b, _ in heads]],
        dev)
    lib, opts = _launch_opts(q)
    mma = _use_mma(lib, mma)
    if heads:
        o_h = gdn_scan_triton(*(t.index_select(0, idx) for t in (q, k, v, g, beta)), hcu, hst, hsl, cache, mma=mma)
        o.index_copy_(0, idx, o_h)
    if P:
        BK = max(2, next_power_of_2(K))
        G = torch.empty(P, CHUNK, Hv, dtype=torch.float32, device=dev)
        L = torch.empty(P, Hv, CHUNK, CHUNK, dtype=torch.float32, device=dev)
        AT = torch.empty_like(L)
        QT = torch.empty(P, Hv, K, CHUNK, dtype=torch.float32, device=dev)
        WT = QT if mma else torch.empty_like(QT)  # w^T: the trees' state kernel's leaves only
        X = torch.empty(P, CHUNK, Hv, V + K, dtype=torch.float32, device=dev)
        KD = torch.empty(P, CHUNK, Hv, K, dtype=torch.float32, device=dev)
        KQ = torch.empty(P, Hv, 2 * K, CHUNK, dtype=torch.float32, device=dev)
        VN = torch.empty(P, CHUNK, Hv, V, dtype=torch.float32, device=dev)
        bi = min(next_power_of_2(max(1, bi)), CHUNK)
        _chunk_rows_kernel[(P, Hv)](q, k, g, beta, tok, rows, wslot, G, L, AT, QT, KD, KQ, cache["g_cum"],
                                    Hk, Hv, K, BK, bi, CHUNK, lib, num_warps=rows_warps, **opts,
                                    **_regs(lib, rows_maxnreg), enable_fp_fusion=FP_FUSION)
        bw = max(2, min(bw, next_power_of_2(V + K)))
        bs = max(2, min(next_power_of_2(bs), CHUNK))
        _chunk_solve_kernel[(P * cdiv(V + K, bw), Hv)](k, v, beta, tok, rows, wslot, G, L, X, WT, cache["x"],
                                                       Hk, Hv, K, V, bw, bs, CHUNK, lib, not mma,
                                                       num_warps=solve_warps, **opts, enable_fp_fusion=FP_FUSION)
        lo = _min_side(mma)
        bv = max(lo, min(bv or (MMA_BV if mma else BV), next_power_of_2(V)))
        br = min(next_power_of_2(max(1, br)), CHUNK)
        bks = max(2, min(bks, BK))
        state_warps = state_warps or (MMA_STATE_WARPS if mma else STATE_WARPS)
        if state_maxnreg == -1:
            state_maxnreg = None if mma else STATE_MAXNREG
        if fused is None:
            fused = NB * Hv * cdiv(V, bv) >= FUSE_PROGRAMS
        S0 = VN if fused else torch.empty(P, Hv, K, V, dtype=torch.float32, device=dev)  # unread when fused
        if mma:
            _chunk_state_mma_kernel[(NB * cdiv(V, bv), Hv)](
                o, tok, rows, seq, sslot, fresh, nend, G, AT, QT, X, KD, VN, S0,
                cache["state"], cache["v_new"], cache["n"],
                Hv, K, V, max(lo, BK), bv, CHUNK, bool(fused), lib, num_warps=state_warps, **opts,
                **_regs(lib, state_maxnreg), enable_fp_fusion=FP_FUSION,
            )
        else:
            _chunk_state_kernel[(NB * cdiv(V, bv), Hv)](
                o, tok, rows, seq, sslot, fresh, nend, G, AT, QT, X, WT, KD, VN, S0,
                cache["state"], cache["v_new"], cache["n"],
                Hv, K, V, BK, bv, br, bks, CHUNK, bool(fused), lib, num_warps=state_warps, **opts,
                **_regs(lib, state_maxnreg), enable_fp_fusion=FP_FUSION,
            )
        if not fused:
            bvo = max(lo, min(bvo, next_power_of_2(V)))
            bro = min(max(lo, next_power_of_2(max(1, bro))), CHUNK)
            out = _chunk_out_mma_kernel if mma else _chunk_out_kernel
            out[(P * cdiv(V, bvo) * (CHUNK // bro), Hv)](
                o, tok, rows, AT, QT, VN, S0, Hv, K, V, max(lo, BK), bvo, bro, CHUNK, num_warps=out_warps, **opts,
                enable_fp_fusion=FP_FUSION,
            )
    _k_rows_kernel[(B, CHUNK, Hk)](k, cu_seqlens, starts, slots, cache["k"], Hk, K, max(2, next_power_of_2(K)),
                                   CHUNK, **_launch_opts(q)[1], enable_fp_fusion=FP_FUSION, num_warps=4)
    return o
