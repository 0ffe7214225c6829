"""Triton kernels for exact causal GQA attention: one forward tile kernel for
packed varlen (training, server prefill) and paged KV (chunked prefill), a
split decode kernel and its merge, and a deterministic backward for the packed
case.

Reduction order and rounding points (forward)
---------------------------------------------
A row is one query token x one query head.  Every row keeps FP32 ``(m, l,
acc)`` (m, l in base 2: scores are pre-multiplied by ``scale * log2(e)``).
Its visible KV positions (``lo .. pos``; ``lo = max(0, pos - W + 1)`` with a
window W, else 0) lie in KV blocks j of ``BLOCK_N = 64`` positions (block j =
sequence positions ``64j .. 64j+63`` = cache page ``block_table[j]``), and the
blocks in fixed segments of ``SEG_BLOCKS = 16`` blocks (segment k = positions
``1024k .. 1024k+1023``, ``op.SEGMENT``; never a function of the batch, the
path or the query count).  Each segment k = lo // 1024 .. pos // 1024 runs the
online softmax from the fresh state ``(-inf, 0, 0)`` over its blocks that hold
a visible position, in increasing order (``_segment_state`` / ``_fwd_block``):

    s     = tl.dot(q, k^T)  (bf16 x bf16 -> fp32, K = head_dim)  * qk_scale
    s     = -inf where the position is not visible
    m_new = max(m, tl.max(s, 1))
    alpha = exp2(m - m_new) if m_new > m else 1
    p     = exp2(s - m_new)                          (fp32)
    l     = l * alpha + tl.sum(p, 1)
    acc   = tl.dot(p.to(v.dtype), v, acc * alpha)    (p rounded to bf16 once)

and the segments' states are folded, in increasing k, into the total
``(m_t, l_t, acc_t)``, which starts at ``(-inf, 0, 0)``, by one element-wise
merge (``_merge``; no reduction, so no thread layout enters it):

    m_n   = max(m_t, m_s)
    a_t   = exp2(m_t - m_n);   a_s = exp2(m_s - m_n)
    l_t   = l_t * a_t + l_s * a_s                    (mul, mul, add: three roundings)
    acc_t = acc_t * a_t + acc_s * a_s                (likewise, per element)
    with two ``tl.where``s taking precedence: m_s == -inf (the row saw nothing
    in the segment) keeps the total as it is; m_t == -inf (nothing merged yet)
    makes the total an exact copy of the segment (never exp2(-inf) == 0).
    out   = acc_t / l_t, rounded once to the output dtype;  lse = (m_t + log2 l_t) * ln 2

A row of up to 1024 positions has one segment, so its bits are those of the
plain recurrence (what this kernel computed before segments existed).

Two schedules compute that arithmetic:
- ``_attn_fwd_kernel`` (packed, and paged with ``max_seqlen_q > 1``): a program
  owns a tile of ``BLOCK_M`` query rows of ONE sequence and ONE kv head:
  ``TPT`` consecutive query tokens x ``HPT`` query heads of the kv head's GQA
  group (row r = token ``r // HPT``, head ``r % HPT``).  It walks the segments
  its rows touch in increasing order, each over the tile's block range cut to
  the segment, and folds each into a second running total at the segment's
  end (``acc_t`` is touched once per 16 blocks; ptxas may keep it in local
  memory).
- ``_attn_decode_split_kernel`` + ``_attn_decode_merge_kernel`` (paged with
  ``max_seqlen_q == 1``, i.e. decode): a program owns ONE decode query x its
  kv head's query heads (padding to ``BLOCK_M``) and some of the row's
  segments (every ``n_prog``-th, from its own index); it computes each
  segment's state with the same ``_segment_state`` from the fresh state and
  writes it in FP32 to a scratch ``(segments, tokens, Hq[, D])``; the merge
  kernel folds segments ``lo // 1024 .. pos // 1024`` (exactly those the
  split kernel wrote: the others hold no visible block, and merging an empty
  segment is the identity) in increasing order with the same ``_merge``, then
  ``_finalize``.  A row whose visible blocks lie in one segment is finalized
  by the split kernel itself (merging one segment into the empty total is a
  copy) and skipped by the merge; when the table holds one segment, no
  scratch is allocated and the merge is not launched.  The grid is
  ``(n_prog, B, Hkv * head chunks)`` with ``n_prog = decode_seg_programs``
  (one per segment of the table, ``ceil(block_table.shape[1] / 16)``, until
  the launch would pass ``DECODE_PROGRAMS`` programs): sized from the table's
  width and the batch, never from ``seq_lens``, so a CUDA graph captured once
  replays while sequences grow.

Why a row gets the same bits on every path (train / prefill / decode / chunks)
- Segments and blocks are aligned to absolute positions (multiples of 1024 and
  64 from position 0), so every path cuts a row's positions the same way; the
  packed path (rows of one sequence from ``cu_seqlens``) and the paged path
  (page ``block_table[j]``) load the same 64 keys for block j.
- The tile shape is the same on every path that must agree: ``(BLOCK_M,
  BLOCK_N, BLOCK_D, num_warps)`` come from ``fwd_config(head_dim, dtype)``
  (multi-query) and ``decode_config`` (decode), never from the number of
  queries.  Decode pads its 1 x G rows up to ``BLOCK_M`` >= 64, so both
  ``tl.dot``s lower to wgmma on Hopper (a tile of fewer than 64 rows could
  lower to mma.sync) with the same K order (head_dim for q.k^T, the block's 64
  positions for p.v), and a row's MMA and row-reduction results depend on its
  own operands only (BM = 64 and 128 give identical bits for the same BK and
  K order).  ``decode_config`` takes 64 rows / 4 warps at head_dim <= 128
  because those give the bits of 128 / 8 (``tests/test_attention.py::
  test_gpu_tile_shape_probe``); the constant ``DECODE_SMALL_TILE = False``
  puts decode back on ``fwd_config``'s shape.
- A tile visits the union of its rows' block ranges.  For a row, a block that
  holds none of its visible positions must change nothing: the masked stage
  keeps the row's old ``(m, l, acc)`` with ``tl.where`` (no reliance on
  ``exp2(0) == 1`` or on an MMA adding exact zeros); a segment in which a row
  sees nothing stays ``(-inf, 0, 0)`` and its merge keeps the total.
- Interior blocks (every row of the tile sees all 64 positions) skip the masks;
  with all-true masks the masked stage computes the same values, so a block
  gets the same bits whichever stage a path puts it in.  ``MASK_ALL=True``
  forces the masked stage everywhere (a debugging knob; same bits).
- FMA contraction is off (``enable_fp_fusion=False``) in every kernel:
  otherwise ``dot * qk_scale - m`` could fuse into one FMA in one stage and not
  in the other, or the merge's ``l_t * a_t + l_s * a_s`` in one kernel and not
  the other.  The merge and ``_finalize`` are element-wise, so the tile kernel
  and the merge kernel run the same instructions on a row's values (sm_90
  PTX: mul.rn / add.rn / ex2.approx.ftz / div.full; the only fma is libdevice's
  log2f, the same in both).
- K/V rows at positions >= the sequence's length are loaded as 0 (never read
  from memory), so garbage or NaN in a page's unused tail cannot leak; decode
  reads no page past its row's last segment.

Launch knobs: ``block_m`` and ``num_warps`` shape the MMA and the row
reductions' thread layout — fixed per (head_dim, dtype) by ``fwd_config`` /
``decode_config``; every path that has to agree must use shapes that give the
same bits.  ``num_stages`` only pipelines loads, ``mask_all`` only skips a
shortcut: both free.  Compiled for sm_90 (triton 3.9, ptxas 13.4): every dot
is a wgmma, no mma.sync, no fma.f32 outside log2f.

head_dim: up to 256 (``BLOCK_D`` = next power of two, zero-padded; zeros add
exactly).  512 would need the output's head_dim split across programs (each
recomputes the same s/p, so bits are unchanged) or a smaller ``BLOCK_M``: a
64x512 fp32 accumulator is 128 KiB of registers, and K and V blocks 64 KiB
each of shared memory per stage.

Backward (packed only), deterministic run to run, no atomics:
- ``_bwd_preprocess_kernel``: delta = sum_d(o * do) in fp32 (``tl.sum``).
- ``_attn_bwd_dq_kernel``: tiles of query rows as the forward's (own
  ``block_m``); p = exp2(s - lse2) recomputed from the saved (merged) lse;
  dq = sum over KV blocks of ``block_n`` positions in increasing order of
  tl.dot(ds.to(bf16), k).
- ``_attn_bwd_dkdv_kernel``: one program per (KV block of ``block_n``,
  sequence, kv head); dk, dv accumulate over the query tiles that see the
  block, head chunks outer, tiles in increasing order; the GQA group's heads
  are summed inside each tile's ``tl.dot`` (rows = tokens x heads).
Both skip the visibility mask where a whole block (tile) is visible to every
row, so only the diagonal pays for it (no window: a window masks all).
The tile shapes (``bwd_config``) are free: nothing else has to match them.
fp32 inputs use ``input_precision="ieee"`` for every dot (not tf32).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior
from ..kv_cache.op import PAGE_SIZE
from .op import SEGMENT

BLOCK_N = PAGE_SIZE
SEG_BLOCKS = SEGMENT // BLOCK_N  # KV blocks per merge segment (16)
_LOG2E = 1.4426950408889634


def fwd_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile shape of the multi-query forward (packed, prefill, chunked
    prefill), fixed per head_dim.  fp32 (parity checks only; ``ieee`` dots are
    FMA loops, not MMA) gets one stage: three needed ~225 KiB of shared memory
    at D = 128."""
    if dtype == torch.float32:
        return {**fwd_config(head_dim), "num_stages": 1}
    if head_dim <= 128:
        return {"block_m": 128, "num_warps": 8, "num_stages": 3}
    # 4 warps spilled ~1.3 KB/thread at D=256 (sm_90 compile); 8 warps split the 64 rows' columns
    # over two warpgroups — a different reduction layout, but the same one on every path
    return {"block_m": 64, "num_warps": 8, "num_stages": 2}


# Decode's tile holds one token's G heads, so 128 rows are mostly padding.  64 rows / 4 warps
# give the bits of 128 / 8 at D = 128 (tests/test_attention.py::test_gpu_tile_shape_probe), so
# decode takes the smaller tile at D <= 128.  If a GPU contract test fails (decode != train),
# set this to False: decode then runs fwd_config's shape; bench_attention.py --decode-tile
# prefill times the other shape.
DECODE_SMALL_TILE = True


def decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Tile shape of the split decode kernel: ``fwd_config``'s, or 64 rows /
    4 warps at head_dim <= 128 (bf16) while ``DECODE_SMALL_TILE``.
    ``num_stages`` only pipelines the loads (free)."""
    cfg = dict(fwd_config(head_dim, dtype))
    if DECODE_SMALL_TILE and dtype != torch.float32 and head_dim <= 128:
        cfg.update(block_m=64, num_warps=4, num_stages=3)
    return cfg


def bwd_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """{"dq": ..., "dkdv": ...}: each kernel's (block_m query rows, block_n KV positions, num_warps,
    num_stages).  Backward bits need only be deterministic run to run, so these are free to tune."""
    if dtype == torch.float32:
        return {name: {**cfg, "num_stages": 1} for name, cfg in bwd_config(head_dim).items()}
    if head_dim <= 128:  # fastest at D = 128 on both trainer shapes (2026-12-02-h200-trainer-attention-backward.md)
        return {"dq": {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
                "dkdv": {"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 3}}
    # 8 warps: D = 256 still spills ~400 B/thread in dK/dV (sm_90 compile)
    base = {"block_m": 64, "block_n": BLOCK_N, "num_warps": 8, "num_stages": 2}
    return {"dq": dict(base), "dkdv": dict(base)}


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
def _first_visible(r_pos, WINDOW: tl.constexpr, BLOCK_M: tl.constexpr):
    """Each row's first visible KV position (0 without a window)."""
    if WINDOW > 0:
        return tl.maximum(r_pos - WINDOW + 1, 0)
    else:
        return tl.zeros([BLOCK_M], dtype=tl.int32)


@triton.jit
def _block_ranges(pos_first, pos_last, WINDOW: tl.constexpr, MASK_ALL: tl.constexpr, BLOCK_N: tl.constexpr):
    """KV blocks [j_lo, j_hi] seen by query positions pos_first..pos_last, and
    the interior [mid_lo, mid_hi) every one of them sees whole (empty: both
    j_hi + 1)."""
    j_hi = pos_last // BLOCK_N
    if WINDOW > 0:
        j_lo = tl.maximum(pos_first - WINDOW + 1, 0) // BLOCK_N
        mid_lo = (tl.maximum(pos_last - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N
    else:
        j_lo = pos_first * 0
        mid_lo = pos_first * 0
    mid_hi = (pos_first + 1) // BLOCK_N
    if MASK_ALL:
        mid_lo = j_hi + 1
        mid_hi = j_hi + 1
    has_mid = mid_lo < mid_hi
    mid_lo = tl.where(has_mid, mid_lo, j_hi + 1)
    mid_hi = tl.where(has_mid, mid_hi, j_hi + 1)
    return j_lo, j_hi, mid_lo, mid_hi


@triton.jit
def _segment_state(
    b_q, k, v, block_table, i_b, i_kvh, bos, kv_len, i_s, j_lo, j_hi, mid_lo, mid_hi,
    r_pos, r_lo, o_d, m_d,
    stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt,
    qk_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr,
    PAGED: tl.constexpr, EVEN_D: tl.constexpr, PRECISION: tl.constexpr,
):
    """(m, l, acc) of segment ``i_s``'s blocks among the visible [j_lo, j_hi]
    (blocks [j0, j1)), from the fresh state, in increasing order: masked head,
    interior, masked tail."""
    j0 = tl.maximum(j_lo, i_s * SEG_BLOCKS)
    j1 = tl.minimum(j_hi + 1, i_s * SEG_BLOCKS + SEG_BLOCKS)
    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(j0, tl.minimum(mid_lo, j1)):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=True, EVEN_D=EVEN_D, PRECISION=PRECISION,
        )
    for j in range(tl.maximum(mid_lo, j0), tl.minimum(mid_hi, j1)):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=False, EVEN_D=EVEN_D, PRECISION=PRECISION,
        )
    for j in range(tl.maximum(mid_hi, j0), j1):
        b_m, b_l, b_acc = _fwd_block(
            b_q, b_m, b_l, b_acc, k, v, block_table, i_b, i_kvh, bos, kv_len, j, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_N=BLOCK_N, PAGED=PAGED, MASKED=True, EVEN_D=EVEN_D, PRECISION=PRECISION,
        )
    return b_m, b_l, b_acc


@triton.jit
def _merge(b_mt, b_lt, b_acct, b_ms, b_ls, b_accs):
    """Fold a segment's state (b_ms, b_ls, b_accs) into the running total;
    rows are dim 0.  Element-wise only (no reduction, so no layout enters the
    bits); the two ``where``s make an empty segment a no-op and the first
    non-empty one an exact copy, never relying on exp2(-inf) == 0."""
    b_mn = tl.maximum(b_mt, b_ms)
    b_at = tl.exp2(b_mt - b_mn)  # NaN where both are -inf: never selected
    b_as = tl.exp2(b_ms - b_mn)
    b_ln = b_lt * b_at + b_ls * b_as
    b_accn = b_acct * b_at[:, None] + b_accs * b_as[:, None]
    s_empty = b_ms == float("-inf")
    t_empty = b_mt == float("-inf")
    b_l = tl.where(s_empty, b_lt, tl.where(t_empty, b_ls, b_ln))
    b_acc = tl.where(s_empty[:, None], b_acct, tl.where(t_empty[:, None], b_accs, b_accn))
    return b_mn, b_l, b_acc


@triton.jit
def _finalize(b_m, b_l, b_acc, r_ok):
    """out = acc / l (fp32; the caller rounds it once), lse in natural log."""
    b_l = tl.where(r_ok, b_l, 1.0)  # padding rows only: every real row sees itself
    b_o = b_acc / b_l[:, None]
    b_lse = (b_m + tl.log2(b_l)) * 0.6931471805599453
    return b_o, b_lse


@triton.jit(do_not_specialize=["n_m_tiles"])  # no recompile per query count (== 1, % 16)
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, PDL: tl.constexpr = False,
):
    # late query tiles (the most KV blocks) are launched first
    wait_prior(PDL)  # PDL: first, before any global load or store
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
    r_lo = _first_visible(r_pos, WINDOW, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + (bos + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=r_ok[:, None] & m_d[None, :], other=0.0)

    pos_first = ctx + tok0
    pos_last = ctx + tl.minimum(tok0 + TPT, q_len) - 1
    j_lo, j_hi, mid_lo, mid_hi = _block_ranges(pos_first, pos_last, WINDOW, MASK_ALL, BLOCK_N)

    # segments in increasing order, each from the fresh state, folded into the total at its end
    b_mt = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_lt = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acct = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for i_s in range(j_lo // SEG_BLOCKS, j_hi // SEG_BLOCKS + 1):
        b_m, b_l, b_acc = _segment_state(
            b_q, k, v, block_table, i_b, i_kvh, bos, kv_len, i_s, j_lo, j_hi, mid_lo, mid_hi, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, SEG_BLOCKS=SEG_BLOCKS, PAGED=PAGED,
            EVEN_D=BLOCK_D == D, PRECISION=PRECISION,
        )
        b_mt, b_lt, b_acct = _merge(b_mt, b_lt, b_acct, b_m, b_l, b_acc)

    b_o, b_lse = _finalize(b_mt, b_lt, b_acct, r_ok)
    p_o = o + (bos + r_tok).to(tl.int64)[:, None] * stride_ot + r_head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=r_ok[:, None] & m_d[None, :])
    tl.store(lse + (bos + r_tok).to(tl.int64) * stride_lt + r_head, b_lse, mask=r_ok)


@triton.jit
def _store_out(o, lse, row_t, r_head, b_m, b_l, b_acc, r_ok, o_d, m_d, stride_ot, stride_oh, stride_lt):
    """Finalize one token's rows (heads ``r_head``) and store out (rounded
    once to o's dtype) and lse."""
    b_o, b_lse = _finalize(b_m, b_l, b_acc, r_ok)
    p_o = o + row_t.to(tl.int64) * stride_ot + r_head[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=r_ok[:, None] & m_d[None, :])
    tl.store(lse + row_t.to(tl.int64) * stride_lt + r_head, b_lse, mask=r_ok)


@triton.jit(do_not_specialize=["n_tok", "n_prog"])  # no recompile per batch size (== 1, % 16)
def _attn_decode_split_kernel(
    q, k, v, o, lse, ws_m, ws_l, ws_acc, cu_q, seq_lens, block_table,
    stride_qt, stride_qh,
    stride_kt, stride_kh, stride_kp,
    stride_vt, stride_vh, stride_vp,
    stride_ot, stride_oh, stride_lt, stride_bt,
    qk_scale, n_tok, n_heads, n_prog,
    D: tl.constexpr, BLOCK_D: tl.constexpr,
    G: tl.constexpr, HPT: tl.constexpr, N_HC: tl.constexpr,
    WINDOW: tl.constexpr, MASK_ALL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """The segments ``s_lo + i_p, s_lo + i_p + n_prog, ...`` (up to ``s_hi``)
    of one decode query (token ``cu_q[b]`` at position ``seq_lens[b] - 1``,
    whose visible blocks lie in segments ``s_lo .. s_hi``) x one kv head's
    query heads (rows; padding to BLOCK_M).  Each segment's (m, l, acc) goes to
    ws[i_s, token, head]; a row with one segment (``s_lo == s_hi``) writes
    out/lse instead, which is what merging one segment into the empty total
    gives (``_merge`` copies the first non-empty state).  Which program
    computes a segment never changes its bits: ``_segment_state`` from the
    fresh state either way."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_p = tl.program_id(0)
    i_b = tl.program_id(1)
    i_hc = tl.program_id(2)
    i_kvh = i_hc // N_HC
    i_c = i_hc % N_HC
    bos = tl.load(cu_q + i_b)
    if tl.load(cu_q + i_b + 1) == bos:  # no query for this sequence in the step
        return
    kv_len = tl.load(seq_lens + i_b)
    pos = kv_len - 1
    j_lo, j_hi, mid_lo, mid_hi = _block_ranges(pos, pos, WINDOW, MASK_ALL, BLOCK_N)
    s_lo = j_lo // SEG_BLOCKS
    s_hi = j_hi // SEG_BLOCKS
    if s_lo + i_p > s_hi:  # more programs than the row has segments
        return

    o_r = tl.arange(0, BLOCK_M)
    r_hh = i_c * HPT + o_r
    r_ok = (o_r < HPT) & (r_hh < G)
    r_head = i_kvh * G + r_hh
    r_pos = tl.zeros([BLOCK_M], dtype=tl.int32) + pos
    r_lo = _first_visible(r_pos, WINDOW, BLOCK_M)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + bos.to(tl.int64) * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=r_ok[:, None] & m_d[None, :], other=0.0)
    for i_s in range(s_lo + i_p, s_hi + 1, n_prog):
        b_m, b_l, b_acc = _segment_state(
            b_q, k, v, block_table, i_b, i_kvh, bos, kv_len, i_s, j_lo, j_hi, mid_lo, mid_hi, r_pos, r_lo, o_d, m_d,
            stride_kt, stride_kh, stride_kp, stride_vt, stride_vh, stride_vp, stride_bt, qk_scale,
            BLOCK_M=BLOCK_M, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N, SEG_BLOCKS=SEG_BLOCKS, PAGED=True,
            EVEN_D=BLOCK_D == D, PRECISION=PRECISION,
        )
        if s_lo == s_hi:
            _store_out(o, lse, bos, r_head, b_m, b_l, b_acc, r_ok, o_d, m_d, stride_ot, stride_oh, stride_lt)
        else:
            r_w = (i_s * n_tok + bos).to(tl.int64) * n_heads + r_head  # ws row (segment, token, head)
            tl.store(ws_m + r_w, b_m, mask=r_ok)
            tl.store(ws_l + r_w, b_l, mask=r_ok)
            tl.store(ws_acc + r_w[:, None] * D + o_d[None, :], b_acc, mask=r_ok[:, None] & m_d[None, :])


@triton.jit(do_not_specialize=["n_tok"])  # no recompile per batch size (== 1, % 16)
def _attn_decode_merge_kernel(
    o, lse, ws_m, ws_l, ws_acc, cu_q, seq_lens,
    stride_ot, stride_oh, stride_lt,
    n_tok, n_heads,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
    WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, SEG_BLOCKS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Merge decode segments in increasing order into the total (``_merge``,
    the tile kernel's arithmetic), then out/lse (``_finalize``).  One program:
    one decode query x BLOCK_H heads (rows).  A row with one segment was
    written by the split kernel."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_b = tl.program_id(0)
    bos = tl.load(cu_q + i_b)
    if tl.load(cu_q + i_b + 1) == bos:
        return
    pos = tl.load(seq_lens + i_b) - 1
    j_lo, j_hi, _, _ = _block_ranges(pos, pos, WINDOW, False, BLOCK_N)
    if j_lo // SEG_BLOCKS == j_hi // SEG_BLOCKS:
        return
    o_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m_h = o_h < n_heads
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_hd = m_h[:, None] & m_d[None, :]
    b_mt = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    b_lt = tl.zeros([BLOCK_H], dtype=tl.float32)
    b_acct = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # exactly the segments the split kernel wrote: those holding a visible block
    for i_s in range(j_lo // SEG_BLOCKS, j_hi // SEG_BLOCKS + 1):
        r_w = (i_s * n_tok + bos).to(tl.int64) * n_heads + o_h
        b_ms = tl.load(ws_m + r_w, mask=m_h, other=float("-inf"))
        b_ls = tl.load(ws_l + r_w, mask=m_h, other=0.0)
        b_accs = tl.load(ws_acc + r_w[:, None] * D + o_d[None, :], mask=m_hd, other=0.0)
        b_mt, b_lt, b_acct = _merge(b_mt, b_lt, b_acct, b_ms, b_ls, b_accs)
    _store_out(o, lse, bos, o_h, b_mt, b_lt, b_acct, m_h, o_d, m_d, stride_ot, stride_oh, stride_lt)


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
def _bwd_rows(i_kvh, i_c, tok0, L, HPT: tl.constexpr, TPT: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr):
    """A tile's rows: (token, query head, valid); row r = token tok0 + r // HPT, head r % HPT of the chunk."""
    o_r = tl.arange(0, BLOCK_M)
    r_tok = tok0 + o_r // HPT
    r_hh = i_c * HPT + o_r % HPT
    r_ok = (o_r < TPT * HPT) & (r_tok < L) & (r_hh < G)
    return r_tok, i_kvh * G + r_hh, r_ok


@triton.jit
def _bwd_dq_block(b_q, b_do, b_lse2, b_delta, b_dq, k, v, bos, L, j, i_kvh, r_pos, r_lo, r_ok, o_d, m_d,
                  stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                  MASKED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    o_n = j * BLOCK_N + tl.arange(0, BLOCK_N)
    m_kv = (o_n < L)[:, None] & m_d[None, :]
    b_k = tl.load(k + (bos + o_n).to(tl.int64)[:, None] * stride_kt + i_kvh * stride_kh + o_d[None, :], mask=m_kv, other=0.0)
    b_v = tl.load(v + (bos + o_n).to(tl.int64)[:, None] * stride_vt + i_kvh * stride_vh + o_d[None, :], mask=m_kv, other=0.0)
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PRECISION) * qk_scale
    b_p = tl.exp2(b_s - b_lse2[:, None])
    if MASKED:
        m_vis = (o_n[None, :] <= r_pos[:, None]) & (o_n[None, :] >= r_lo[:, None]) & r_ok[:, None]
        b_p = tl.where(m_vis, b_p, 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=PRECISION)
    b_ds = b_p * (b_dp - b_delta[:, None])
    return tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=PRECISION)


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
    r_pos, r_head, r_ok = _bwd_rows(i_kvh, i_c, tok0, L, HPT, TPT, G, BLOCK_M)
    if WINDOW > 0:
        r_lo = tl.maximum(r_pos - WINDOW + 1, 0)
        j_lo = tl.maximum(tok0 - WINDOW + 1, 0) // BLOCK_N
        j_mask = j_lo  # the window's lower edge: every block is masked
    else:
        r_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        j_lo = 0
        j_mask = (tok0 + 1) // BLOCK_N  # blocks below see every row of the tile
    j_hi = (tl.minimum(tok0 + TPT, L) - 1) // BLOCK_N
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_q = r_ok[:, None] & m_d[None, :]
    o_q = (bos + r_pos).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(q + o_q, mask=m_q, other=0.0)
    b_do = tl.load(do + o_q, mask=m_q, other=0.0)
    o_l = (bos + r_pos).to(tl.int64) * stride_lt + r_head
    b_lse2 = tl.load(lse + o_l, mask=r_ok, other=0.0) * 1.4426950408889634
    b_delta = tl.load(delta + o_l, mask=r_ok, other=0.0)
    b_dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # unmasked blocks: a padded row loads q = do = lse = delta = 0, so its ds is 0 without the mask
    for j in range(j_lo, j_mask):
        b_dq = _bwd_dq_block(b_q, b_do, b_lse2, b_delta, b_dq, k, v, bos, L, j, i_kvh, r_pos, r_lo, r_ok, o_d, m_d,
                             stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                             MASKED=False, PRECISION=PRECISION, BLOCK_N=BLOCK_N)
    for j in range(j_mask, j_hi + 1):
        b_dq = _bwd_dq_block(b_q, b_do, b_lse2, b_delta, b_dq, k, v, bos, L, j, i_kvh, r_pos, r_lo, r_ok, o_d, m_d,
                             stride_kt, stride_kh, stride_vt, stride_vh, qk_scale,
                             MASKED=True, PRECISION=PRECISION, BLOCK_N=BLOCK_N)
    b_dq = b_dq * scale
    tl.store(dq + o_q, b_dq.to(dq.dtype.element_ty), mask=m_q)


@triton.jit
def _bwd_dkdv_tile(b_k, b_v, b_dk, b_dv, q, do, lse, delta, bos, L, i_m, i_kvh, i_c, o_n, m_n, o_d, m_d,
                   stride_qt, stride_qh, stride_lt, qk_scale,
                   G: tl.constexpr, HPT: tl.constexpr, TPT: tl.constexpr, WINDOW: tl.constexpr,
                   MASKED: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    r_tok, r_head, r_ok = _bwd_rows(i_kvh, i_c, i_m * TPT, L, HPT, TPT, G, BLOCK_M)
    m_q = r_ok[:, None] & m_d[None, :]
    o_q = (bos + r_tok).to(tl.int64)[:, None] * stride_qt + r_head[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(q + o_q, mask=m_q, other=0.0)
    b_do = tl.load(do + o_q, mask=m_q, other=0.0)
    o_l = (bos + r_tok).to(tl.int64) * stride_lt + r_head
    b_lse2 = tl.load(lse + o_l, mask=r_ok, other=0.0) * 1.4426950408889634
    b_delta = tl.load(delta + o_l, mask=r_ok, other=0.0)
    b_sT = tl.dot(b_k, tl.trans(b_q), input_precision=PRECISION) * qk_scale  # (BN, BM)
    b_pT = tl.exp2(b_sT - b_lse2[None, :])
    if MASKED:
        if WINDOW > 0:
            r_lo = tl.maximum(r_tok - WINDOW + 1, 0)
        else:
            r_lo = tl.zeros([BLOCK_M], dtype=tl.int32)
        m_vis = (o_n[:, None] <= r_tok[None, :]) & (o_n[:, None] >= r_lo[None, :]) & r_ok[None, :] & m_n[:, None]
        b_pT = tl.where(m_vis, b_pT, 0.0)
    b_dv = tl.dot(b_pT.to(b_do.dtype), b_do, b_dv, input_precision=PRECISION)
    b_dpT = tl.dot(b_v, tl.trans(b_do), input_precision=PRECISION)
    b_dsT = b_pT * (b_dpT - b_delta[None, :])
    b_dk = tl.dot(b_dsT.to(b_q.dtype), b_q, b_dk, input_precision=PRECISION)
    return b_dk, b_dv


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
    # query tokens that can see this block: [BLOCK_N * i_j, t_hi]
    t_hi = L - 1
    if WINDOW > 0:
        t_hi = tl.minimum(t_hi, i_j * BLOCK_N + BLOCK_N - 1 + WINDOW - 1)
        m_mask = t_hi // TPT + 1  # the window's upper edge: every tile is masked
    else:
        m_mask = (i_j * BLOCK_N + BLOCK_N - 1 + TPT - 1) // TPT  # tiles from here see every position of the block
    m_lo = (i_j * BLOCK_N) // TPT
    m_hi = t_hi // TPT
    m_mask = tl.minimum(m_mask, m_hi + 1)
    for i_c in range(N_HC):
        for i_m in range(m_lo, m_mask):
            b_dk, b_dv = _bwd_dkdv_tile(b_k, b_v, b_dk, b_dv, q, do, lse, delta, bos, L, i_m, i_kvh, i_c, o_n, m_n,
                                        o_d, m_d, stride_qt, stride_qh, stride_lt, qk_scale, G=G, HPT=HPT, TPT=TPT,
                                        WINDOW=WINDOW, MASKED=True, PRECISION=PRECISION, BLOCK_M=BLOCK_M)
        # a padded row (past L, or a head past G) loads zeros and adds nothing without the mask
        for i_m in range(m_mask, m_hi + 1):
            b_dk, b_dv = _bwd_dkdv_tile(b_k, b_v, b_dk, b_dv, q, do, lse, delta, bos, L, i_m, i_kvh, i_c, o_n, m_n,
                                        o_d, m_d, stride_qt, stride_qh, stride_lt, qk_scale, G=G, HPT=HPT, TPT=TPT,
                                        WINDOW=WINDOW, MASKED=False, PRECISION=PRECISION, BLOCK_M=BLOCK_M)
    b_dk = b_dk * scale
    tl.store(dk + o_k, b_dk.to(dk.dtype.element_ty), mask=m_kv)
    tl.store(dv + o_v, b_dv.to(dv.dtype.element_ty), mask=m_kv)


# ---------------------------------------------------------------- launchers
def _tiling(G: int, block_m: int) -> tuple[int, int, int]:
    """(heads per tile, head chunks per kv head, tokens per tile)."""
    hpt = min(G, block_m)
    return hpt, cdiv(G, hpt), block_m // hpt


def _precision(dtype: torch.dtype) -> str | None:
    return "ieee" if dtype == torch.float32 else None  # None: the default (bf16 operands have one MMA path)


def _launch_setup(q, k, cu_q, block_m):
    """(G, B, tiling) and the empty outputs o (T, Hq, D), lse (T, Hq) fp32."""
    T, hq, _ = q.shape
    G = hq // k.shape[-2]
    o = torch.empty_like(q)
    lse = torch.empty(T, hq, dtype=torch.float32, device=q.device)
    return G, cu_q.shape[0] - 1, _tiling(G, block_m), o, lse


def _fwd_launch(q, k, v, cu_q, seq_lens, block_table, max_q_len, window, scale, paged, cfg, mask_all):
    d, hkv = q.shape[-1], k.shape[-2]
    block_m, num_warps, num_stages = cfg["block_m"], cfg["num_warps"], cfg["num_stages"]
    G, B, (hpt, n_hc, tpt), o, lse = _launch_setup(q, k, cu_q, block_m)
    if q.shape[0] == 0 or B == 0:
        return o, lse
    n_m = cdiv(max_q_len, tpt)
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
        D=d, BLOCK_D=max(16, next_power_of_2(d)),
        G=G, HPT=hpt, N_HC=n_hc, TPT=tpt,
        WINDOW=window, PAGED=paged, MASK_ALL=mask_all, PRECISION=_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, SEG_BLOCKS=SEG_BLOCKS,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=FP_FUSION, **pdl_options(q.device, q.shape[0]),
    )
    return o, lse


# The split decode's programs per (sequence, head chunk) step down as the batch grows, so a
# launch has about this many programs in all; never a function of seq_lens (graphs replay).
# 2048: at 40960 positions one per segment made 20,480 a layer at batch 64, nearly all empty.
DECODE_PROGRAMS = 2048


def decode_seg_programs(n_seg: int, n_rows: int) -> int:
    """Programs per (sequence, kv head, head chunk) for a table of ``n_seg``
    segments and ``n_rows`` such triples: one per segment while the launch
    stays under ``DECODE_PROGRAMS``, else each walks several."""
    return max(1, min(n_seg, cdiv(DECODE_PROGRAMS, max(1, n_rows))))


def _decode_launch(q, k, v, cu_q, seq_lens, block_table, window, scale, cfg, mask_all, seg_blocks, seg_programs):
    """Split decode: (programs per row, sequences, kv heads x head chunks)
    programs, then the merge of the rows with more than one segment.  Nothing
    here reads a device value: the grid follows the block table's width and
    the batch, so a CUDA graph captured once replays as sequences grow."""
    T, hq, d = q.shape
    hkv = k.shape[-2]
    block_m, num_warps, num_stages = cfg["block_m"], cfg["num_warps"], cfg["num_stages"]
    G, B, (hpt, n_hc, _), o, lse = _launch_setup(q, k, cu_q, block_m)
    if T == 0 or B == 0:
        return o, lse
    n_seg = max(1, cdiv(block_table.shape[1], seg_blocks))
    n_prog = min(n_seg, seg_programs or decode_seg_programs(n_seg, B * hkv * n_hc))
    final = n_seg == 1  # every row has one segment: no scratch, no merge
    if final:
        ws_m = ws_l = ws_acc = lse  # unused
    else:
        ws_m = torch.empty(n_seg, T, hq, dtype=torch.float32, device=q.device)
        ws_l = torch.empty_like(ws_m)
        ws_acc = torch.empty(n_seg, T, hq, d, dtype=torch.float32, device=q.device)
    block_d = max(16, next_power_of_2(d))
    _attn_decode_split_kernel[(n_prog, B, hkv * n_hc)](
        q, k, v, o, lse, ws_m, ws_l, ws_acc, cu_q, seq_lens, block_table,
        q.stride(0), q.stride(1),
        k.stride(1), k.stride(2), k.stride(0), v.stride(1), v.stride(2), v.stride(0),
        o.stride(0), o.stride(1), lse.stride(0), block_table.stride(0),
        scale * _LOG2E, T, hq, n_prog,
        D=d, BLOCK_D=block_d, G=G, HPT=hpt, N_HC=n_hc,
        WINDOW=window, MASK_ALL=mask_all, PRECISION=_precision(q.dtype),
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, SEG_BLOCKS=seg_blocks,
        num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=FP_FUSION, **pdl_options(q.device, q.shape[0]),
    )
    if not final:
        block_h = min(16, next_power_of_2(hq))
        _attn_decode_merge_kernel[(B, cdiv(hq, block_h))](
            o, lse, ws_m, ws_l, ws_acc, cu_q, seq_lens,
            o.stride(0), o.stride(1), lse.stride(0), T, hq,
            D=d, BLOCK_D=block_d, BLOCK_H=block_h, WINDOW=window, BLOCK_N=BLOCK_N, SEG_BLOCKS=seg_blocks,
            num_warps=4, enable_fp_fusion=FP_FUSION, **pdl_options(o.device, o.shape[0]),
        )
    return o, lse


def _config(head_dim: int, dtype: torch.dtype, default, block_m, num_warps, num_stages) -> dict:
    cfg = dict(default(head_dim, dtype))
    for key, val in (("block_m", block_m), ("num_warps", num_warps), ("num_stages", num_stages)):
        if val is not None:
            cfg[key] = val
    return cfg


def attention_fwd_triton(q, k, v, cu_seqlens, max_seqlen, window, scale, *,
                       block_m=None, num_warps=None, num_stages=None, mask_all=False):
    cfg = _config(q.shape[-1], q.dtype, fwd_config, block_m, num_warps, num_stages)
    return _fwd_launch(q, k, v, cu_seqlens, None, None, max_seqlen, window, scale, False, cfg, mask_all)


def paged_attention_fwd_triton(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, window, scale, *,
                             block_m=None, num_warps=None, num_stages=None, mask_all=False, seg_blocks=SEG_BLOCKS,
                             seg_programs=None):
    """``max_seqlen_q == 1``: the split decode (``decode_config``); else the
    tile kernel (``fwd_config``).  ``seg_blocks`` other than SEG_BLOCKS breaks
    the contract (decode only; the tests' counter-example); ``seg_programs``
    does not (decode only; None: ``decode_seg_programs``)."""
    if max_seqlen_q == 1:
        cfg = _config(q.shape[-1], q.dtype, decode_config, block_m, num_warps, num_stages)
        return _decode_launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, window, scale, cfg, mask_all,
                              seg_blocks, seg_programs)
    cfg = _config(q.shape[-1], q.dtype, fwd_config, block_m, num_warps, num_stages)
    return _fwd_launch(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, window, scale, True, cfg, mask_all)


def attention_bwd_triton(q, k, v, o, lse, do, cu_seqlens, max_seqlen, window, scale, *, dq_cfg=None, dkdv_cfg=None):
    """(dq, dk, dv); ``dq_cfg`` / ``dkdv_cfg`` override keys of ``bwd_config``'s (tuning runs)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    G = hq // hkv
    B = cu_seqlens.shape[0] - 1
    cfgs = bwd_config(d, q.dtype)
    dq_cfg, dkdv_cfg = {**cfgs["dq"], **(dq_cfg or {})}, {**cfgs["dkdv"], **(dkdv_cfg or {})}
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if T == 0 or B == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    block_d = max(16, next_power_of_2(d))
    delta = torch.empty(T, hq, dtype=torch.float32, device=q.device)
    _bwd_preprocess_kernel[(cdiv(T * hq, 64),)](o, do, delta, T * hq, D=d, BLOCK_D=block_d, BLOCK_R=64,
        enable_fp_fusion=FP_FUSION, num_warps=4)
    strides = (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), lse.stride(0))

    def consts(cfg):
        hpt, n_hc, tpt = _tiling(G, cfg["block_m"])
        return dict(D=d, BLOCK_D=block_d, G=G, HPT=hpt, N_HC=n_hc, TPT=tpt, WINDOW=window,
                    PRECISION=_precision(q.dtype), BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"],
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

    c = consts(dq_cfg)
    n_m = cdiv(max_seqlen, c["TPT"])
    _attn_bwd_dq_kernel[(n_m, B, hkv * c["N_HC"])](
        q, k, v, do, lse, delta, dq, cu_seqlens, *strides, scale * _LOG2E, scale, n_m, **c, enable_fp_fusion=FP_FUSION)
    _attn_bwd_dkdv_kernel[(cdiv(max_seqlen, dkdv_cfg["block_n"]), B, hkv)](
        q, k, v, do, lse, delta, dk, dv, cu_seqlens, *strides, scale * _LOG2E, scale, **consts(dkdv_cfg),
        enable_fp_fusion=FP_FUSION)
    return dq, dk, dv
