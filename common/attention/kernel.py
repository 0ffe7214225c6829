"""Triton kernels for exact causal GQA attention: one forward kernel for packed
varlen (training, server prefill) and paged KV (decode, chunked prefill), and a
deterministic backward for the packed case.

Reduction order and rounding points (forward, ``_attn_fwd_kernel``)
--------------------------------------------------------------------
A program owns a tile of ``BLOCK_M`` query rows of ONE sequence and ONE kv
head: ``TPT`` consecutive query tokens x ``HPT`` query heads of the kv head's
GQA group (row r = token ``r // HPT``, head ``r % HPT``; decode is one token,
its group's heads, the rest padding rows).  Every row keeps FP32 ``(m, l, acc)``
(m, l in base 2: scores are pre-multiplied by ``scale * log2(e)``) and walks the
KV blocks j of ``BLOCK_N = 64`` positions (block j = sequence positions
``64j .. 64j+63`` = cache page ``block_table[j]``) that hold a position it can
see (``lo // 64 .. pos // 64``; ``lo = max(0, pos - W + 1)`` with a window W,
else 0), in increasing order, starting at the first; no split-KV:

    s     = tl.dot(q, k^T)  (bf16 x bf16 -> fp32, K = head_dim)  * qk_scale
    s     = -inf where the position is not visible
    m_new = max(m, tl.max(s, 1))
    alpha = exp2(m - m_new) if m_new > m else 1
    p     = exp2(s - m_new)                          (fp32)
    l     = l * alpha + tl.sum(p, 1)
    acc   = tl.dot(p.to(v.dtype), v, acc * alpha)    (p rounded to bf16 once)
    out   = acc / l, rounded once to the output dtype;  lse = (m + log2 l) * ln 2

Why a row gets the same bits on every path (train / prefill / decode / chunks)
- The tile shape is the same on every path: ``(BLOCK_M, BLOCK_N, BLOCK_D,
  num_warps)`` come from ``fwd_config(head_dim, dtype)`` only, never from the number
  of queries.  Decode pads its 1 x G rows up to ``BLOCK_M``, so both ``tl.dot``s
  lower to the same MMA instruction (wgmma on Hopper: a tile of fewer than 64
  rows could lower to mma.sync) with the same K order (head_dim for q.k^T, the
  block's 64 positions for p.v), and ``tl.max``/``tl.sum`` reduce a row over the
  same thread layout.  A row's position inside the tile does not matter: a
  row's MMA and row-reduction results depend on its own operands only (DESIGN
  §5: BM = 64 and 128 gave identical bits for the same BK and K order).
- Blocks are aligned to absolute positions (multiples of 64 from position 0),
  so the packed path (rows of one sequence from ``cu_seqlens``) and the paged
  path (page ``block_table[j]``) load the same 64 keys for block j.
- A tile visits the union of its rows' block ranges.  For a row, a block that
  holds none of its visible positions must change nothing: the masked stage
  keeps the row's old ``(m, l, acc)`` with ``tl.where`` (no reliance on
  ``exp2(0) == 1`` or on an MMA adding exact zeros).
- Interior blocks (every row of the tile sees all 64 positions) skip the masks;
  with all-true masks the masked stage computes the same values, so a block
  gets the same bits whichever stage a path puts it in.  ``MASK_ALL=True``
  forces the masked stage everywhere (a debugging knob; same bits).
- FMA contraction is off (``enable_fp_fusion=False``): otherwise
  ``dot * qk_scale - m`` could fuse into one FMA in one stage and not in the
  other.
- K/V rows at positions >= the sequence's length are loaded as 0 (never read
  from memory), so garbage or NaN in a page's unused tail cannot leak.

Launch knobs: ``block_m`` and ``num_warps`` shape the MMA and the row
reductions' thread layout — ``fwd_config`` fixes them per (head_dim, dtype) and
every path that has to agree must use the same pair (``tests/test_attention.py
::test_gpu_tile_shape_probe`` asks whether 64/4 and 128/8 happen to agree).
``num_stages`` only pipelines loads, ``mask_all`` only skips a shortcut: both
free.  Compiled here for sm_90 (no GPU): every dot is a wgmma, no mma.sync, no
fma.f32; D <= 128 uses 253-255 registers with at most 16 B/thread of spill.

head_dim: up to 256 (``BLOCK_D`` = next power of two, zero-padded; zeros add
exactly).  512 would need the output's head_dim split across programs (each
recomputes the same s/p, so bits are unchanged) or a smaller ``BLOCK_M``: a
64x512 fp32 accumulator is 128 KiB of registers, and K and V blocks 64 KiB
each of shared memory per stage.

Backward (packed only), deterministic run to run, no atomics:
- ``_bwd_preprocess_kernel``: delta = sum_d(o * do) in fp32 (``tl.sum``).
- ``_attn_bwd_dq_kernel``: tiles as the forward; p = exp2(s - lse2) recomputed;
  dq = sum over KV blocks in increasing order of tl.dot(ds.to(bf16), k).
- ``_attn_bwd_dkdv_kernel``: one program per (KV block, sequence, kv head);
  dk, dv accumulate over the query tiles that see the block, head chunks
  outer, tiles in increasing order; the GQA group's heads are summed inside
  each tile's ``tl.dot`` (rows = tokens x heads).
fp32 inputs use ``input_precision="ieee"`` for every dot (not tf32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kv_cache.op import PAGE_SIZE

BLOCK_N = PAGE_SIZE
_LOG2E = 1.4426950408889634


def fwd_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile shape of the forward, fixed per head_dim (shared by every path).
    fp32 (parity checks only; ``ieee`` dots are FMA loops, not MMA) gets one
    stage: three needed ~225 KiB of shared memory at D = 128."""
    if dtype == torch.float32:
        return {**fwd_config(head_dim), "num_stages": 1}
    if head_dim <= 128:
        return {"block_m": 128, "num_warps": 8, "num_stages": 3}
    # 4 warps spilled ~1.3 KB/thread at D=256 (sm_90 compile); 8 warps split the 64 rows' columns
    # over two warpgroups — a different reduction layout, but the same one on every path
    return {"block_m": 64, "num_warps": 8, "num_stages": 2}


def bwd_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    if dtype == torch.float32:
        return {**bwd_config(head_dim), "num_stages": 1}
    # backward bits need only be deterministic; 8 warps: no spills at D = 128 (sm_90 compile),
    # D = 256 still spills ~400 B/thread in dK/dV (a target for the H200 tuning)
    return {"block_m": 64, "num_warps": 8, "num_stages": 2}


@triton.jit
def _load_kv(p, o_n, kv_len, m_d, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A (BLOCK_N, BLOCK_D) K or V block; positions >= kv_len read as 0."""
    if MASKED:
        return tl.load(p, mask=(o_n < kv_len)[:, None] & m_d[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(p)
    else:
        return tl.load(p, mask=m_d[None, :], other=0.0)


@triton.jit
def _fwd_block(
    b_q, b_m, b_l, b_acc,
    k, v, block_table, i_b, i_kvh, bos, kv_len, j,
    r_pos, r_lo, o_d, m_d,
    stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt,
    qk_scale,
    BLOCK_N: tl.constexpr, PAGED: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
):
    o_i = tl.arange(0, BLOCK_N)
    o_n = j * BLOCK_N + o_i  # absolute KV positions of block j
    if PAGED:
        i_page = tl.load(block_table + i_b * stride_bt + j).to(tl.int64)
        p_k = k + i_page * stride_kp + o_i[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :]
        p_v = v + i_page * stride_vp + o_i[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :]
    else:
        p_k = k + (bos + o_n).to(tl.int64)[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :]
        p_v = v + (bos + o_n).to(tl.int64)[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :]
    b_k = _load_kv(p_k, o_n, kv_len, m_d, MASKED, EVEN_D)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale  # (BM, BN) fp32
    if MASKED:
        m_vis = (o_n[None, :] <= r_pos[:, None]) & (o_n[None, :] >= r_lo[:, None])
        b_s = tl.where(m_vis, b_s, float("-inf"))
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    if MASKED:
        b_ms = tl.where(b_mn == float("-inf"), 0.0, b_mn)  # rows with nothing visible yet
    else:
        b_ms = b_mn
    b_alpha = tl.where(b_mn > b_m, tl.exp2(b_m - b_ms), 1.0)
    b_p = tl.exp2(b_s - b_ms[:, None])
    b_ln = b_l * b_alpha + tl.sum(b_p, 1)
    b_v = _load_kv(p_v, o_n, kv_len, m_d, MASKED, EVEN_D)
    b_accn = tl.dot(b_p.to(b_v.dtype), b_v, b_acc * b_alpha[:, None], input_precision=PRECISION)
    if MASKED:
        # a row with no visible position in block j keeps its state exactly
        r_act = (j >= r_lo // BLOCK_N) & (j <= r_pos // BLOCK_N)
        b_m = tl.where(r_act, b_mn, b_m)
        b_l = tl.where(r_act, b_ln, b_l)
        b_acc = tl.where(r_act[:, None], b_accn, b_acc)
    else:
        b_m = b_mn
        b_l = b_ln
        b_acc = b_accn
    return b_m, b_l, b_acc


@triton.jit
def _attn_fwd_kernel(
    q, k, v, o, lse, cu_q, seq_lens, block_table,
    stride_qt, stride_qh,
    stride_kt, stride_kh, stride_kp,
    stride_vt, stride_vh, stride_vp,
    stride_ot, stride_oh, stride_lt, stride_bt,
    qk_scale, n_m_tiles,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    G: tl.constexpr, HPT: tl.constexpr, N_HC: tl.constexpr, TPT: tl.constexpr,
    WINDOW: tl.constexpr, PAGED: tl.constexpr, MASK_ALL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # late query tiles (the most KV blocks) are launched first
    i_m = n_m_tiles - 1 - tl.program_id(0)
    i_b = tl.program_id(1)
    i_hc = tl.program_id(2)
    i_kvh = i_hc // N_HC
    i_c = i_hc % N_HC
    bos = tl.load(cu_q + i_b)
    q_len = tl.load(cu_q + i_b + 1) - bos
    tok0 = i_m * TPT
    if tok0 >= q_len:
        return
    if PAGED:
        kv_len = tl.load(seq_lens + i_b)
    else:
        kv_len = q_len
    ctx = kv_len - q_len  # position of the first query

    o_r = tl.arange(0, BLOCK_M)
    r_tok = tok0 + o_r // HPT
    r_hh = i_c * HPT + o_r % HPT
    r_ok = (o_r < TPT * HPT) & (r_tok < q_len) & (r_hh < G)
    r_head = i_kvh * G + r_hh
    r_pos = ctx + r_tok
    if WINDOW > 0:
        r_lo = tl.maximum(r_pos - WINDOW + 1, 0)
    else:
        r_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + (bos + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=r_ok[:, None] & m_d[None, :], other=0.0)

    # blocks [j_lo, j_hi]; interior [mid_lo, mid_hi) is fully visible to every row
    pos_first = ctx + tok0
    pos_last = ctx + tl.minimum(tok0 + TPT, q_len) - 1
    j_hi = pos_last // BLOCK_N
    if WINDOW > 0:
        j_lo = tl.maximum(pos_first - WINDOW + 1, 0) // BLOCK_N
        mid_lo = (tl.maximum(pos_last - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N
    else:
        j_lo = 0
        mid_lo = 0
    mid_hi = (pos_first + 1) // BLOCK_N
    if MASK_ALL:
        mid_lo = j_hi + 1
        mid_hi = j_hi + 1
    has_mid = mid_lo < mid_hi
    mid_lo = tl.where(has_mid, mid_lo, j_hi + 1)
    mid_hi = tl.where(has_mid, mid_hi, j_hi + 1)

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(j_lo, mid_lo):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=True, EVEN_D=BLOCK_D == D, PRECISION=PRECISION,
        )
    for j in range(mid_lo, mid_hi):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=False, EVEN_D=BLOCK_D == D, PRECISION=PRECISION,
        )
    for j in range(mid_hi, j_hi + 1):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=True, EVEN_D=BLOCK_D == D, PRECISION=PRECISION,
        )

    b_l = tl.where(r_ok, b_l, 1.0)  # padding rows only: every real row sees itself
    b_o = b_acc / b_l[:, None]
    p_o = o + (bos + r_tok).to(tl.int64)[:, None] * stride_ot + r_head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=r_ok[:, None] & m_d[None, :])
    b_lse = (b_m + tl.log2(b_l)) * 0.6931471805599453
    tl.store(lse + (bos + r_tok).to(tl.int64) * stride_lt + r_head, b_lse, mask=r_ok)


@triton.jit
def _bwd_preprocess_kernel(o, do, delta, n_rows, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr):
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_d = tl.arange(0, BLOCK_D)
    m = (o_r < n_rows)[:, None] & (o_d < D)[None, :]
    p = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    b_o = tl.load(o + p, mask=m, other=0.0).to(tl.float32)
    b_do = tl.load(do + p, mask=m, other=0.0).to(tl.float32)
    tl.store(delta + o_r, tl.sum(b_o * b_do, 1), mask=o_r < n_rows)


@triton.jit
def _attn_bwd_dq_kernel(
    q, k, v, do, lse, delta, dq, cu,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_lt,
    qk_scale, scale, n_m_tiles,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    G: tl.constexpr, HPT: tl.constexpr, N_HC: tl.constexpr, TPT: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # q, do, dq share strides (T, Hq, D) contiguous; lse, delta are (T, Hq)
    i_m = n_m_tiles - 1 - tl.program_id(0)
    i_b = tl.program_id(1)
    i_hc = tl.program_id(2)
    i_kvh = i_hc // N_HC
    i_c = i_hc % N_HC
    bos = tl.load(cu + i_b)
    L = tl.load(cu + i_b + 1) - bos
    tok0 = i_m * TPT
    if tok0 >= L:
        return
    o_r = tl.arange(0, BLOCK_M)
    r_tok = tok0 + o_r // HPT
    r_hh = i_c * HPT + o_r % HPT
    r_ok = (o_r < TPT * HPT) & (r_tok < L) & (r_hh < G)
    r_head = i_kvh * G + r_hh
    r_pos = r_tok
    if WINDOW > 0:
        r_lo = tl.maximum(r_pos - WINDOW + 1, 0)
        j_lo = tl.maximum(tok0 - WINDOW + 1, 0) // BLOCK_N
    else:
        r_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        j_lo = 0
    j_hi = (tl.minimum(tok0 + TPT, L) - 1) // BLOCK_N
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_q = r_ok[:, None] & m_d[None, :]
    o_q = (bos + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(q + o_q, mask=m_q, other=0.0)
    b_do = tl.load(do + o_q, mask=m_q, other=0.0)
    o_l = (bos + r_tok).to(tl.int64) * stride_lt + r_head
    b_lse2 = tl.load(lse + o_l, mask=r_ok, other=0.0) * 1.4426950408889634
    b_delta = tl.load(delta + o_l, mask=r_ok, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(j_lo, j_hi + 1):
        o_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
        m_kv = (o_n < L)[:, None] & m_d[None, :]
        b_k = tl.load(k + (bos + o_n).to(tl.int64)[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :], mask=m_kv, other=0.0)
        b_v = tl.load(v + (bos + o_n).to(tl.int64)[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :], mask=m_kv, other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale
        m_vis = (o_n[None, :] <= r_pos[:, None]) & (o_n[None, :] >= r_lo[:, None]) & r_ok[:, None]
        b_p = tl.where(m_vis, tl.exp2(b_s - b_lse2[:, None]), 0.0)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=PRECISION)
    b_dq = b_dq * scale
    tl.store(dq + o_q, b_dq.to(dq.dtype.element_ty), mask=m_q)


@triton.jit
def _attn_bwd_dkdv_kernel(
    q, k, v, do, lse, delta, dk, dv, cu,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_lt,
    qk_scale, scale,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    G: tl.constexpr, HPT: tl.constexpr, N_HC: tl.constexpr, TPT: tl.constexpr,
    WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # k, dk share strides; v, dv share strides; q and do share strides
    i_j = tl.program_id(0)
    i_b = tl.program_id(1)
    i_kvh = tl.program_id(2)
    bos = tl.load(cu + i_b)
    L = tl.load(cu + i_b + 1) - bos
    if i_j * BLOCK_N >= L:
        return
    o_n = i_j * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < L
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_kv = m_n[:, None] & m_d[None, :]
    o_k = (bos + o_n).to(tl.int64)[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :]
    o_v = (bos + o_n).to(tl.int64)[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :]
    b_k = tl.load(k + o_k, mask=m_kv, other=0.0)
    b_v = tl.load(v + o_v, mask=m_kv, other=0.0)
    b_dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    b_dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    # query tokens that can see this block: [64 j, t_hi]
    t_hi = L - 1
    if WINDOW > 0:
        t_hi = tl.minimum(t_hi, i_j * BLOCK_N + BLOCK_N - 1 + WINDOW - 1)
    m_lo = (i_j * BLOCK_N) // TPT
    m_hi = t_hi // TPT
    o_r = tl.arange(0, BLOCK_M)
    for i_c in range(N_HC):
        for i_m in range(m_lo, m_hi + 1):
            r_tok = i_m * TPT + o_r // HPT
            r_hh = i_c * HPT + o_r % HPT
            r_ok = (o_r < TPT * HPT) & (r_tok < L) & (r_hh < G)
            r_head = i_kvh * G + r_hh
            if WINDOW > 0:
                r_lo = tl.maximum(r_tok - WINDOW + 1, 0)
            else:
                r_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
            m_q = r_ok[:, None] & m_d[None, :]
            o_q = (bos + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
            b_q = tl.load(q + o_q, mask=m_q, other=0.0)
            b_do = tl.load(do + o_q, mask=m_q, other=0.0)
            o_l = (bos + r_tok).to(tl.int64) * stride_lt + r_head
            b_lse2 = tl.load(lse + o_l, mask=r_ok, other=0.0) * 1.4426950408889634
            b_delta = tl.load(delta + o_l, mask=r_ok, other=0.0)
            b_sT = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION) * qk_scale  # (BN, BM)
            m_vis = (o_n[:, None] <= r_tok[None, :]) & (o_n[:, None] >= r_lo[None, :]) & r_ok[None, :] & m_n[:, None]
            b_pT = tl.where(m_vis, tl.exp2(b_sT - b_lse2[None, :]), 0.0)
            b_dv = tl.dot(b_pT.to(b_do.dtype), b_do, b_dv, input_precision=PRECISION)
            b_dpT = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)
            b_dsT = b_pT * (b_dpT - b_delta[None, :])
            b_dk = tl.dot(b_dsT.to(b_q.dtype), b_q, b_dk, input_precision=PRECISION)
    b_dk = b_dk * scale
    tl.store(dk + o_k, b_dk.to(dk.dtype.element_ty), mask=m_kv)
    tl.store(dv + o_v, b_dv.to(dv.dtype.element_ty), mask=m_kv)


# ---------------------------------------------------------------- launchers
def _tiling(G: int, block_m: int) -> tuple[int, int, int]:
    """(heads per tile, head chunks per kv head, tokens per tile)."""
    hpt = min(G, block_m)
    return hpt, triton.cdiv(G, hpt), block_m // hpt


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # None: the default (bf16 operands have one MMA path)


def _fwd_launch(q, k, v, cu_q, seq_lens, block_table, max_q_len, window, scale, paged, cfg, mask_all):
    T, hq, d = q.shape
    hkv = k.shape[-2]
    G = hq // hkv
    B = cu_q.shape[0] - 1
    block_m, num_warps, num_stages = cfg["block_m"], cfg["num_warps"], cfg["num_stages"]
    hpt, n_hc, tpt = _tiling(G, block_m)
    o = torch.empty_like(q)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device)
    if T == 0 or B == 0:
        return o, lse
    n_m = triton.cdiv(max_q_len, tpt)
    if paged:
        skp, svp, sbt = k.stride(0), v.stride(0), block_table.stride(0)
        skt, skh, svt, svh = k.stride(1), k.stride(2), v.stride(1), v.stride(2)
    else:
        skp = svp = sbt = 0
        skt, skh, svt, svh = k.stride(0), k.stride(1), v.stride(0), v.stride(1)
        seq_lens = block_table = cu_q  # unused
    _attn_fwd_kernel[(n_m, B, hkv * n_hc)](
        q, k, v, o, lse, cu_q, seq_lens, block_table,
        q.stride(0), q.stride(1),
        skt, skh, skp, svt, svh, svp,
        o.stride(0), o.stride(1), lse.stride(0), sbt,
        scale * _LOG2E, n_m,
        D=d, BLOCK_D=max(16, triton.next_power_of_2(d)),
        G=G, HPT=hpt, N_HC=n_hc, TPT=tpt,
        WINDOW=window, PAGED=paged, MASK_ALL=mask_all, PRECISION=_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False,
    )
    return o, lse


def _config(head_dim: int, dtype: torch.dtype, default, block_m, num_warps, num_stages) -> dict:
    cfg = dict(default(head_dim, dtype))
    for key, val in (("block_m", block_m), ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    return cfg


def attention_fwd_cuda(q, k, v, cu_seqlens, max_seqlen, window, scale, *,
                       block_m=None, num_warps=None, num_stages=None, mask_all=False):
    cfg = _config(q.shape[-1], q.dtype, fwd_config, block_m, num_warps, num_stages)
    return _fwd_launch(q, k, v, cu_seqlens, None, None, max_seqlen, window, scale, False, cfg, mask_all)


def paged_attention_fwd_cuda(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, window, scale, *,
                             block_m=None, num_warps=None, num_stages=None, mask_all=False):
    cfg = _config(q.shape[-1], q.dtype, fwd_config, block_m, num_warps, num_stages)
    return _fwd_launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, window, scale, True, cfg, mask_all)


def attention_bwd_cuda(q, k, v, o, lse, do, cu_seqlens, max_seqlen, window, scale, *,
                       block_m=None, num_warps=None, num_stages=None):
    T, hq, d = q.shape
    hkv = k.shape[1]
    G = hq // hkv
    B = cu_seqlens.shape[0] - 1
    cfg = _config(d, q.dtype, bwd_config, block_m, num_warps, num_stages)
    block_m, num_warps, num_stages = cfg["block_m"], cfg["num_warps"], cfg["num_stages"]
    hpt, n_hc, tpt = _tiling(G, block_m)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if T == 0 or B == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = max(16, triton.next_power_of_2(d))
    prec = _precision(q.dtype)
    delta = torch.empty(T, hq, dtype=torch.float32, device=q.device)
    _bwd_preprocess_kernel[(triton.cdiv(T * hq, 64),)](o, do, delta, T * hq, D=d, BLOCK_D=block_d, BLOCK_R=64)
    n_m = triton.cdiv(max_seqlen, tpt)
    common = dict(D=d, BLOCK_D=block_d, G=G, HPT=hpt, N_HC=n_hc, TPT=tpt, WINDOW=window, PRECISION=prec,
                  BLOCK_M=block_m, BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=False)
    _attn_bwd_dq_kernel[(n_m, B, hkv * n_hc)](
        q, k, v, do, lse, delta, dq, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), lse.stride(0),
        scale * _LOG2E, scale, n_m, **common,
    )
    _attn_bwd_dkdv_kernel[(triton.cdiv(max_seqlen, BLOCK_N), B, hkv)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), lse.stride(0),
        scale * _LOG2E, scale, **common,
    )
    return dq, dk, dv
