"""Triton kernel: q/k RMSNorm + RoPE + paged KV-cache write in one launch.

It reads the qkv projection's output (T, (Hq + 2 Hkv) D) row-strided, with no
copies, and does what the unfused server path did in five launches at T = 1
and eight above (two ``rmsnorm_fwd``, two ``rope_fwd``, one ``write_kv_fwd``,
three ``.contiguous()`` copies of the qkv slices, no-ops for one token).  The
bits are those of that path and of the trainer's ``rope(rmsnorm(...))``:
every arithmetic op is the same op, called from the same ``@triton.jit``
helpers of ``rmsnorm/kernel.py`` and ``rope/kernel.py``, and the kernel
launches with ``enable_fp_fusion=False`` as they do:

* reduction order: one per head, the sum of squares over its D channels,
  padded with zeros to CHUNK = next_pow2(D) <= 256 lanes (one chunk), summed
  by ``_row_tree_sum`` (the pairwise tree over adjacent lanes written as
  reshape/split adds: fixed by the code, not by the layout Triton picks) —
  ``rmsnorm``'s order for a row of D.  Nothing else is reduced.
* rounding points, per element (as rmsnorm then rope then the cache copy):
    rstd = div_rn(1, sqrt_rn(div_rn(tree_sum(x*x), D) + eps))  fp32 (``_rstd``)
    y    = dtype(dtype(x * rstd) * w)                           (``_normalize``)
    out  = dtype(fl32(fl32(ya c) - fl32(yb s))), dtype(fl32(fl32(yb c) + fl32(ya s)))
                                                                 (``_rotate``)
  with (ya, yb) = channels (i, i + D/2) of y ("half" pairing, the whole head
  rotated) and (c, s) the fp32 table row at the token's position (clamped to
  the table, as ``rope_kernel`` does).  k goes to the cache as that ``out``,
  v as its raw bytes; q to a new (T, Hq, D) tensor.

A head is read twice (the second time from L1/L2): whole, for the sum, then
as its two halves, normalised element-wise and rotated pairwise — channel i's
partner i + D/2 is no register neighbour, and D need not be a power of two
(the tiny preset's 24).

Grid (T, NQB + NKB): program (t, b) takes BH heads of token t: q heads
[b BH, (b + 1) BH) for b < NQB, else k heads (and the same v heads) from
(b - NQB) BH.  A token with a negative slot writes nothing to the cache (its q
is still written, as the unfused path does).  BH and ``num_warps`` are free
launch knobs: the tree's order does not depend on the tile's rows or layout.
No integer argument follows the batch (the token count is the grid's).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior
from ..rmsnorm.cpu import tree_width
from ..rmsnorm.kernel import _normalize, _row_tree_sum, _rstd
from ..rope.kernel import _rotate


@triton.jit
def _norm_rope_heads(p_x, p_w, o_h, m_h, b_cos, b_sin, eps, dtype, D: tl.constexpr, CHUNK: tl.constexpr,
                     LOG2_CHUNK: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr, BH: tl.constexpr):
    """Heads ``o_h`` (rows of D channels at ``p_x + h * D``) normalised with w
    and rotated -> fp32 (BH, HALF_PAD) halves (channels i and i + D/2), not yet cast."""
    o_c = tl.arange(0, CHUNK)
    m_x = m_h[:, None] & (o_c < D)[None, :]
    b_x = tl.load(p_x + o_h[:, None] * D + o_c[None, :], mask=m_x, other=0.0).to(tl.float32)  # (BH, CHUNK)
    b_rstd = _rstd(_row_tree_sum(b_x * b_x, BH, LOG2_CHUNK), D, eps, BH)  # (BH,)
    o_i = tl.arange(0, HALF_PAD)
    m_i = o_i < HALF
    m = m_h[:, None] & m_i[None, :]
    o_a = o_h[:, None] * D + o_i[None, :]  # (BH, HALF_PAD); the pair partner is o_a + HALF
    b_ya = _normalize(tl.load(p_x + o_a, mask=m, other=0.0).to(tl.float32), b_rstd,
                      tl.load(p_w + o_i, mask=m_i, other=0.0).to(tl.float32), dtype)
    b_yb = _normalize(tl.load(p_x + o_a + HALF, mask=m, other=0.0).to(tl.float32), b_rstd,
                      tl.load(p_w + HALF + o_i, mask=m_i, other=0.0).to(tl.float32), dtype)
    return _rotate(b_ya.to(tl.float32), b_yb.to(tl.float32), b_cos, b_sin)


@triton.jit
def _qk_norm_rope_kv_kernel(
    p_qkv,
    p_qw,
    p_kw,
    p_pos,
    p_cos,
    p_sin,
    p_slot,
    p_q,
    p_kc,
    p_vc,
    stride_t,
    eps,
    P,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    NQB: tl.constexpr,
    D: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BH: tl.constexpr, PDL: tl.constexpr = False,
):
    """q (T, Hq, D) and the k/v cache rows of token t (module docstring)."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_t = tl.program_id(0).to(tl.int64)
    i_b = tl.program_id(1)
    p_row = p_qkv + i_t * stride_t
    b_pos = tl.load(p_pos + i_t).to(tl.int64)
    b_pos = tl.minimum(tl.maximum(b_pos, 0), P - 1)  # never read outside the table (as rope_kernel)
    o_i = tl.arange(0, HALF_PAD)
    m_i = o_i < HALF
    b_cos = tl.load(p_cos + b_pos * HALF + o_i, mask=m_i, other=0.0)[None, :]  # (1, HALF_PAD)
    b_sin = tl.load(p_sin + b_pos * HALF + o_i, mask=m_i, other=0.0)[None, :]
    o_r = tl.arange(0, BH)
    dtype = p_qkv.dtype.element_ty  # every rounding of the unfused path; q's and the cache's dtype too
    if i_b < NQB:
        o_h = i_b * BH + o_r
        m_h = o_h < HQ
        b_ya, b_yb = _norm_rope_heads(p_row, p_qw, o_h, m_h, b_cos, b_sin, eps, dtype,
                                      D, CHUNK, LOG2_CHUNK, HALF, HALF_PAD, BH)
        o_y = (i_t * HQ + o_h)[:, None] * D + o_i[None, :]
        m = m_h[:, None] & m_i[None, :]
        tl.store(p_q + o_y, b_ya.to(dtype), mask=m)
        tl.store(p_q + o_y + HALF, b_yb.to(dtype), mask=m)
    else:
        i_slot = tl.load(p_slot + i_t).to(tl.int64)
        o_h = (i_b - NQB) * BH + o_r
        m_h = o_h < tl.where(i_slot >= 0, HKV, 0)  # a negative slot (graph padding): no heads, no writes
        b_ya, b_yb = _norm_rope_heads(p_row + HQ * D, p_kw, o_h, m_h, b_cos, b_sin, eps, dtype,
                                      D, CHUNK, LOG2_CHUNK, HALF, HALF_PAD, BH)
        o_row = (i_slot * HKV + o_h)[:, None] * D  # slot s is row s of the cache seen as (pages * PAGE_SIZE, Hkv, D)
        m = m_h[:, None] & m_i[None, :]
        tl.store(p_kc + o_row + o_i[None, :], b_ya.to(dtype), mask=m)
        tl.store(p_kc + o_row + HALF + o_i[None, :], b_yb.to(dtype), mask=m)
        o_c = tl.arange(0, CHUNK)
        m_v = m_h[:, None] & (o_c < D)[None, :]
        b_v = tl.load(p_row + (HQ + HKV) * D + o_h[:, None] * D + o_c[None, :], mask=m_v)
        tl.store(p_vc + o_row + o_c[None, :], b_v, mask=m_v)


def default_heads_per_program(num_kv_heads: int, T: int) -> int:
    """Heads per program; any power of two gives the same bits.  Not swept on
    the GPU yet: 4 heads (a (4, 128) tile) while a launch is one short wave,
    8 for prefill-sized launches; never more than the kv heads (padded)."""
    return min(4 if T <= 64 else 8, next_power_of_2(num_kv_heads))


def qk_norm_rope_kv_triton(qkv, q_w, k_w, eps, positions, cos, sin, k_cache, v_cache, slot_mapping,
                         num_heads, num_kv_heads, heads_per_program=None, num_warps=None):
    """qkv (T, (Hq + 2 Hkv) D), unit column stride -> q (T, Hq, D); k/v to the cache."""
    T, D = qkv.shape[0], q_w.shape[0]
    Hq, Hkv = num_heads, num_kv_heads
    q = torch.empty(T, Hq, D, dtype=qkv.dtype, device=qkv.device)
    if T == 0:
        return q
    assert qkv.stride(1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert k_cache.dtype == v_cache.dtype == qkv.dtype  # the cache write copies, it never casts
    bh = heads_per_program or default_heads_per_program(Hkv, T)
    if bh & (bh - 1):
        raise ValueError(f"heads_per_program must be a power of two, got {bh}")
    chunk = tree_width(D)
    nqb = cdiv(Hq, bh)
    _qk_norm_rope_kv_kernel[(T, nqb + cdiv(Hkv, bh))](
        qkv, q_w, k_w, positions, cos, sin, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), float(eps), cos.shape[0],
        HQ=Hq,
        HKV=Hkv,
        NQB=nqb,
        D=D,
        CHUNK=chunk,
        LOG2_CHUNK=chunk.bit_length() - 1,
        HALF=D // 2,
        HALF_PAD=next_power_of_2(D // 2),
        BH=bh,
        num_warps=num_warps or (1 if bh * chunk <= 512 else 2 if bh * chunk <= 1024 else 4),
        enable_fp_fusion=FP_FUSION, **pdl_options(qkv.device, T),
    )
    return q
