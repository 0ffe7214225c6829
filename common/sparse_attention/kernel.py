"""Triton kernel for the sparse MLA forward, in ``cpu.py``'s element order (its docstring is the contract).

One program owns one query row and one head; its bits never depend on the batch.  It walks the row's compacted
entries (``cpu.compact``, done on the device by the launcher) in 1024-entry segments of 64-entry blocks, as
``attention.cpu.attend_rows`` does for a row at position n_valid - 1 with no window:

    s_e   = tree_D(q_d * k_ed) * scale       the pairwise tree of ``_tree_sum0``: halves added, an odd one carried
    s_e   = -inf at entries >= n_valid
    m_new = max(m, max_e s_e)                max is exact in any order
    alpha = exp(m - m_new) if m_new > m else 1
    p_e   = exp(s_e - m_new)
    l     = l * alpha + tree_64(p)
    acc   = acc * alpha + tree_64(p_e * v_ed)          v_e = k_e[:Dv]

then each segment merged into the total by ``merge_states``' arithmetic and its two ``where``s,
``out = div_rn(acc, l)`` rounded once to q's dtype, ``lse = m + log(l)``; a row of no entries gives 0 and -inf.

How the trees are laid out (no ``tl.dot``: a dot's order is the hardware's)
- tree_D over D = J * c (J a power of two, c odd): while the length is even the tree adds element d to d + D/2,
  so leaf d = i + c * j (i < c, j < J) meets only leaves of its own i: a (J, C) tile (C = c padded to a power of
  two) halves over j by ``tl.sum`` of an axis of 2 (one add), log2(J) times; then c columns follow the odd
  rule: column i takes i + h (h = n // 2, read by a one-hot sum whose other terms are -0.0, which adds exactly
  nothing), column h takes the carried 2h when n is odd; n -> ceil(n / 2) until one is left.
- tree_64 over a block's entries e = 0..63: its first three levels add e to e + 32, e + 16, e + 8, so the
  eight entries k, k + 8, .., k + 56 ("class" k) are summed by a halving tree of their own, and the classes
  then as ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7)) (visited in bit-reversed order, a binary counter):
  a (8, Dv) tile a class, never (64, Dv).
Every product and sum rounds on its own (``enable_fp_fusion=False``); exp and log are libdevice's expf / logf
(torch's CUDA ops) with subnormals kept, division is ``div_rn`` (torch's ``/``).  So on CUDA tensors the kernel
gives the bits of ``cpu.py`` run on those tensors; under Triton's interpreter, with torch's exp and log patched
in, the bits of ``cpu.py`` on the CPU (``tests/test_sparse_attention.py``).

Sinks (DeepSeek-V4, packed): ``cpu.with_sinks``' element-wise fp32 arithmetic on (out, lse) before the rounding.

Addressing: an entry's KV row is ``kv[start + ent]`` (packed, the trainer; start = ``cu_seqlens_kv[seq]``) or slot
``block_table[seq, ent // 64] * 64 + ent % 64`` of the pool (paged, the server); a pad is never loaded.  The
launch reads nothing on the host (the compaction is device ops, the loops run to each row's n_valid), so a CUDA
graph captures it.  Supported: D with odd part c <= ``MAX_ODD`` (GLM-5's 576 = 64 * 9), Dv <= D.

A correct path before a fast one: every head re-reads its row's KV rows (from L2), and nothing is shared
between the heads of a row.  Compiled for sm_90 (triton 3.9) at GLM-5's shape: no local memory, no fma.f32
outside libdevice's expf / logf, one div.rn.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._host import next_power_of_2
from .._launch import FP_FUSION
from ..gdn.kernel import _exp, _launch_opts
from ..attention.cpu import SEG_BLOCKS
from .cpu import BLOCK_N, compact

MAX_ODD = 31  # largest odd part of D the one-hot odd tree takes ((8, 32, 32) tile a level)


@triton.jit
def _log(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.log(x)
    else:
        return tl.log(x)


@triton.jit
def _slot(p_e, p_b, row, e, ok, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """(8,) int64 kv rows of entries ``e`` (p_e: the row's entries, p_b: its sequence's block-table row; 0 at
    pads, never loaded)."""
    ent = tl.load(p_e + e, mask=ok, other=0).to(tl.int64)
    if PAGED:
        page = tl.load(p_b + ent // PAGE, mask=ok, other=0).to(tl.int64)
        return page * PAGE + ent % PAGE
    else:
        return row + ent


@triton.jit
def _class_scores(b_q, p_kv, p_e, p_b, row, e, nv, stride_kv, scale, ODD: tl.constexpr, J: tl.constexpr,
                  C: tl.constexpr, LOG_J: tl.constexpr, LOG_C: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr):
    """Entries ``e`` (8,) of the row -> their fp32 scores tree_D(q_d * k_d) * scale, -inf at pads; b_q (J, C)
    holds q_d at [j, i], d = i + c * j."""
    ok = e < nv
    slot = _slot(p_e, p_b, row, e, ok, PAGED, PAGE)
    o_j = tl.arange(0, J)
    o_c = tl.arange(0, C)
    o_d = o_c[None, :] + ODD * o_j[:, None]  # (J, C): leaf d = i + c * j
    m_d = (o_c < ODD)[None, :] & (o_j >= 0)[:, None]
    b_k = tl.load(p_kv + slot[:, None, None] * stride_kv + o_d[None, :, :], mask=ok[:, None, None] & m_d[None, :, :],
                  other=0.0).to(tl.float32)
    x = b_q[None, :, :] * b_k  # (8, J, C)
    for lv in tl.static_range(LOG_J):
        x = tl.sum(tl.reshape(x, (8, 2, J >> (lv + 1), C)), axis=1)  # leaf j + J/2^(lv+1) onto j
    x = tl.reshape(x, (8, C))
    for lv in tl.static_range(LOG_C):
        h = ((ODD + (1 << lv) - 1) >> lv) // 2  # half of this level's n = ceil(c / 2^lv)
        g = tl.sum(tl.where(o_c[None, None, :] == (o_c + h)[None, :, None], x[:, None, :], -0.0), axis=2)  # x[:, i+h]
        x = tl.where(o_c[None, :] < h, x + g, tl.where(o_c[None, :] == h, g, -0.0))
    return tl.where(ok, tl.sum(tl.where(o_c[None, :] == 0, x, -0.0), axis=1) * scale, float("-inf"))


@triton.jit
def _halve8(x):
    """(8,) -> scalar by the halving tree (e + 4, e + 2, e + 1)."""
    x = tl.sum(tl.reshape(x, (2, 4)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 2)), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def _halve8_rows(x, DV: tl.constexpr):
    """(8, DV) -> (DV,) by the halving tree over the rows."""
    x = tl.sum(tl.reshape(x, (2, 4, DV)), axis=0)
    x = tl.sum(tl.reshape(x, (2, 2, DV)), axis=0)
    return tl.sum(x, axis=0)


@triton.jit
def _class_pv(p_kv, p_e, p_b, row, e, nv, stride_kv, s, m_safe, o_v, m_v, PAGED: tl.constexpr, PAGE: tl.constexpr,
              LIB: tl.constexpr, DV: tl.constexpr):
    """A class's (tree(p), tree(p * v) (DV,)) with p = exp(s - m_safe), entries ``e``."""
    ok = e < nv
    slot = _slot(p_e, p_b, row, e, ok, PAGED, PAGE)
    p = _exp(s - m_safe, LIB)
    b_v = tl.load(p_kv + slot[:, None] * stride_kv + o_v[None, :], mask=ok[:, None] & m_v[None, :],
                  other=0.0).to(tl.float32)
    return _halve8(p), _halve8_rows(p[:, None] * b_v, DV)


@triton.jit
def _block(b_q, p_kv, p_e, p_b, row, e0, nv, m, stride_kv, scale, o_v, m_v, ODD: tl.constexpr, J: tl.constexpr,
           C: tl.constexpr, LOG_J: tl.constexpr, LOG_C: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr,
           DV: tl.constexpr, LIB: tl.constexpr):
    """One 64-entry block (class k: entries e0 + k, e0 = block start + 0, 8, .., 56) against the running max m
    -> (m_new, alpha, tree_64(p), tree_64(p * v) (DV,))."""
    o_k = tl.arange(0, 8)
    b_s = tl.full((8, 8), float("-inf"), tl.float32)  # (class, member)
    for k in range(8):
        s_k = _class_scores(b_q, p_kv, p_e, p_b, row, e0 + k, nv, stride_kv, scale, ODD, J, C, LOG_J, LOG_C,
                            PAGED, PAGE)
        b_s = tl.where(o_k[:, None] == k, s_k[None, :], b_s)
    m_new = tl.maximum(m, tl.max(tl.max(b_s, 1), 0))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
    alpha = tl.where(m_new > m, _exp(m - m_safe, LIB), 1.0)
    # the classes in bit-reversed order 0, 4, 2, 6, 1, 5, 3, 7, summed as a binary counter:
    # ((P0 + P4) + (P2 + P6)) + ((P1 + P5) + (P3 + P7))
    rs = tl.full((), 0.0, tl.float32)
    pv = tl.zeros((DV,), dtype=tl.float32)
    r1, r2, r4, v1, v2, v4 = rs, rs, rs, pv, pv, pv
    for t in range(8):
        k = ((t & 1) << 2) | (t & 2) | (t >> 2)
        s_k = tl.sum(tl.where(o_k[:, None] == k, b_s, -0.0), 0)  # row k of b_s, exactly
        r, v = _class_pv(p_kv, p_e, p_b, row, e0 + k, nv, stride_kv, s_k, m_safe, o_v, m_v, PAGED, PAGE, LIB, DV)
        if t % 2 == 0:
            r1, v1 = r, v
        else:
            r, v = r1 + r, v1 + v
            if t % 4 == 1:
                r2, v2 = r, v
            else:
                r, v = r2 + r, v2 + v
                if t == 3:
                    r4, v4 = r, v
                else:
                    rs, pv = r4 + r, v4 + v
    return m_new, alpha, rs, pv


@triton.jit
def _sparse_attn_fwd_kernel(
    p_q, p_kv, p_ent, p_nv, p_row, p_bt, p_sink, p_o, p_lse,
    H, K_ENT, stride_qm, stride_qh, stride_kv, stride_bt, stride_om, stride_oh, scale,
    V_DIM: tl.constexpr, ODD: tl.constexpr, J: tl.constexpr, C: tl.constexpr, LOG_J: tl.constexpr,
    LOG_C: tl.constexpr, DV: tl.constexpr, PAGED: tl.constexpr, PAGE: tl.constexpr, SEG: tl.constexpr,
    SINKS: tl.constexpr, LIB: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    nv = tl.load(p_nv + i).to(tl.int32)
    row = tl.load(p_row + i).to(tl.int64)  # paged: the row's sequence; packed: its sequence's first kv row
    o_c = tl.arange(0, C)
    o_d = o_c[None, :] + ODD * tl.arange(0, J)[:, None]  # (J, C): leaf d = i + c * j of the tree over D
    b_q = tl.load(p_q + i * stride_qm + h * stride_qh + o_d, mask=(o_c < ODD)[None, :] & (o_d >= 0), other=0.0)
    b_q = b_q.to(tl.float32)
    p_e = p_ent + i * K_ENT
    p_b = p_bt + row * stride_bt  # paged only
    o_e = tl.arange(0, 8) * 8  # a class's entries within a block: k, k + 8, .., k + 56
    o_v = tl.arange(0, DV)
    m_v = o_v < V_DIM
    m_t = tl.full((), float("-inf"), tl.float32)
    l_t = tl.full((), 0.0, tl.float32)
    acc_t = tl.zeros((DV,), dtype=tl.float32)
    n_blk = tl.cdiv(nv, 64)
    for g in range(0, tl.cdiv(n_blk, SEG)):
        m = tl.full((), float("-inf"), tl.float32)
        l = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((DV,), dtype=tl.float32)
        for b in range(g * SEG, tl.minimum(n_blk, g * SEG + SEG)):
            m_new, alpha, rs, pv = _block(b_q, p_kv, p_e, p_b, row, b * 64 + o_e, nv, m, stride_kv, scale, o_v, m_v,
                                          ODD, J, C, LOG_J, LOG_C, PAGED, PAGE, DV, LIB)
            l = l * alpha + rs
            acc = acc * alpha + pv
            m = m_new
        # merge_states: a segment that saw nothing keeps the total; the first one is copied
        m_n = tl.maximum(m_t, m)
        a_t = _exp(m_t - m_n, LIB)
        a_s = _exp(m - m_n, LIB)
        l_n = l_t * a_t + l * a_s
        acc_n = acc_t * a_t + acc * a_s
        s_empty = m == -float("inf")
        t_empty = m_t == -float("inf")
        l_t = tl.where(s_empty, l_t, tl.where(t_empty, l, l_n))
        acc_t = tl.where(s_empty, acc_t, tl.where(t_empty, acc, acc_n))
        m_t = m_n
    has = nv > 0
    l_safe = tl.where(has, l_t, 1.0)
    out = tl.where(has, tl.div_rn(acc_t, tl.full((DV,), 1.0, tl.float32) * l_safe), 0.0)  # div_rn: one shape
    lse = tl.where(has, m_t + _log(l_safe, LIB), -float("inf"))
    if SINKS:  # cpu.with_sinks: o * (1 / (1 + exp(sink - lse))), lse = m + log(exp(lse - m) + exp(sink - m))
        sk = tl.load(p_sink + h)
        out = out * tl.div_rn(tl.full((), 1.0, tl.float32), 1.0 + _exp(sk - lse, LIB))
        mx = tl.maximum(lse, sk)
        lse = mx + _log(_exp(lse - mx, LIB) + _exp(sk - mx, LIB), LIB)
    tl.store(p_o + i * stride_om + h * stride_oh + o_v, out.to(p_o.dtype.element_ty), mask=m_v)
    tl.store(p_lse + i * H + h, lse)


def _tree_shape(D: int) -> tuple[int, int, int, int, int]:
    """D = J * odd -> (odd, J, C, log2 J, levels of the odd tree), C = odd padded to a power of two."""
    log_j = (D & -D).bit_length() - 1
    odd = D >> log_j
    return odd, 1 << log_j, next_power_of_2(odd), log_j, (odd - 1).bit_length()


def supported(D: int, v_dim: int) -> bool:
    """Whether the kernel takes rows D wide (its odd part within ``MAX_ODD``), the value v_dim wide."""
    return D >= 1 and _tree_shape(D)[0] <= MAX_ODD and 1 <= v_dim <= D


def _launch(q, table, ent, n_valid, row, block_table, scale, v_dim, paged, sinks=None):
    n, H, D = q.shape
    out = torch.empty(n, H, v_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(n, H, dtype=torch.float32, device=q.device)
    if n == 0 or H == 0:
        return out, lse
    odd, J, C, log_j, log_c = _tree_shape(D)
    lib, opts = _launch_opts(q)
    q = q if q.stride(2) == 1 else q.contiguous()
    bt = block_table.contiguous()
    _sparse_attn_fwd_kernel[(n, H)](
        q, table, ent.contiguous(), n_valid.contiguous(), row.contiguous(), bt,
        lse if sinks is None else sinks.contiguous(), out, lse,
        H, ent.shape[1], q.stride(0), q.stride(1), table.stride(0), bt.stride(0), out.stride(0), out.stride(1),
        float(scale), V_DIM=v_dim, ODD=odd, J=J, C=C, LOG_J=log_j, LOG_C=log_c, DV=next_power_of_2(v_dim),
        PAGED=paged, PAGE=BLOCK_N, SEG=SEG_BLOCKS, SINKS=sinks is not None, LIB=lib,
        enable_fp_fusion=FP_FUSION, num_warps=8 if D > 256 else 4, **opts,
    )
    return out, lse


def paged_sparse_attention_fwd_triton(q, kv_cache, sel, seq_idx, block_table, scale, v_dim):
    """``cpu.paged_sparse_attention_fwd_cpu``'s contract and bits: q (n, H, Dqk), kv_cache (P, 64, 1, Dqk), sel
    (n, top_k), seq_idx (n,), block_table (B, W) -> (o (n, H, v_dim) in q.dtype, lse (n, H) fp32)."""
    ent, n_valid = compact(sel)
    table = kv_cache.view(-1, kv_cache.shape[-1])
    return _launch(q, table, ent, n_valid, seq_idx, block_table, scale, v_dim, True)


def sparse_attention_fwd_triton(q, kv, sel, cu_seqlens, scale, v_dim, cu_seqlens_kv=None, sinks=None):
    """``cpu.sparse_attention_fwd_cpu``'s contract and bits: q (T, H, Dqk), kv (T, Dqk) (or ``cu_seqlens_kv``'s
    rows), sel (T, top_k), cu_seqlens (B + 1,), sinks (H,) fp32 or None -> (o (T, H, v_dim) in q.dtype, lse
    (T, H) fp32)."""
    ent, n_valid = compact(sel)
    cu = cu_seqlens.to(q.device).long()
    cu_kv = cu if cu_seqlens_kv is None else cu_seqlens_kv.to(q.device).long()
    seq = torch.searchsorted(cu, torch.arange(q.shape[0], device=q.device), right=True) - 1
    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    return _launch(q, kv, ent, n_valid, cu_kv[seq], cu, scale, v_dim, False, sinks)
