"""CPU attention: packed varlen, paged decode and chunked prefill, batch-invariant
by construction because all three call one row routine, ``attend_rows``.

Why the bits cannot depend on the path or the batch
---------------------------------------------------
No torch ``mm``/``bmm``/SDPA (their blocking and threading follow the whole
problem's shape: docs/DESIGN.md, "Why the CPU paths are invariant by
construction").  Every reduction here is an explicit, fixed sequence of
element-wise ops (``add``, ``mul``, ``maximum``, ``exp``, ``log``,
``div``, ``where``), each of which rounds every element on its own whatever the
tensor's shape, stride or vector width; so an output element depends only on
its own operands and on the order of those ops, which is fixed per row:

For one query row (query head h, position ``pos``; window W: it sees KV
positions ``lo = max(0, pos - W + 1) .. pos``, ``lo = 0`` without a window),
over the KV blocks j of ``BLOCK_N = 64`` positions (block j = positions
``64j .. 64j+63`` = page ``block_table[j]``) that hold a visible position,
``j = lo // 64 .. pos // 64``, in increasing order, cut into segments of
``SEG_BLOCKS = 16`` blocks (segment k = absolute positions
``1024k .. 1024k+1023``; ``op.SEGMENT``).  Each segment k = lo // 1024 ..
pos // 1024 runs the online softmax from the fresh state over its blocks::

    m = -inf, l = 0, acc = 0                                  (fp32, per segment)
    s_n   = tree_D(q_d * k_nd) * scale     # pairwise tree over head_dim, fixed
    s_n   = -inf where n is not visible (n > pos or n < lo)
    m_new = max(m, tree_64(max)(s))        # max is exact
    alpha = exp(m - m_new) if m_new > m else 1
    p_n   = exp(s_n - m_new)
    l     = l * alpha + tree_64(p)                             (two roundings)
    acc   = acc * alpha + tree_64(p_n * v_nd)                  (two roundings)

and the segments' states are merged into the total (m_t, l_t, acc_t), starting
empty (-inf, 0, 0), in increasing k by ``merge_states``::

    m_n   = max(m_t, m_s)
    a_t   = exp(m_t - m_n);  a_s = exp(m_s - m_n)
    l_t   = l_t * a_t + l_s * a_s                              (three roundings)
    acc_t = acc_t * a_t + acc_s * a_s                          (three roundings)
    except: m_s == -inf (the segment saw nothing) -> the total is kept as it is;
            m_t == -inf (nothing merged yet)      -> the total is the segment, copied
    out   = acc_t / l_t, rounded once to the output dtype;  lse = m_t + log(l_t)

The two exceptions are ``where``s, not ``exp(-inf) == 0``, so a row of up to
1024 positions (one segment) gets exactly the bits of the unsegmented
recurrence.  The CUDA kernels compute the same order in base 2.

``tree_n`` is a pairwise tree over a dim of fixed length n (D, or the block's
64 positions): halves added element-wise, an odd element carried up.  Exact
zeros from masked positions (p = 0) are added in the same places on every path.
For q.k^T the tree replaces ``matmul.cpu.fixed_order_dot``'s left-to-right
loop: just as fixed, but log2(D) torch calls instead of 2D, and decode makes
one call per token.

Blocks are evaluated in chunks of rows and blocks (never across a segment
boundary) to bound memory; a block that holds no visible position for a row
leaves that row's (m, l, acc) untouched (``where``), and so does a segment
(its state stays empty and the merge keeps the total), so which extra blocks
and segments a chunk visits, how rows are grouped into streams, padding rows,
other sequences and page placement cannot change a bit.
Packed training, server prefill, decode and chunked prefill only differ in
where k/v come from (the packed tensor or the pages) and in each row's
``pos``; they all call ``attend_rows``.

Measured on the CI CPU (AVX2): ``torch.exp`` and ``torch.log`` give the same
bits for an element whether it sits in a vectorised body, a scalar tail or a
strided view (``torch.exp2`` does *not*: it is not used);
``tests/test_attention.py::test_cpu_exp_log_are_elementwise`` re-checks this.

The one path-dependent bit left: a sum that is exactly zero can come out -0.0
on one path and +0.0 on another (masked p = 0 times a V that is real on one
path and zeroed padding on the other).  ``torch.equal`` calls them equal.

Backward (packed only): recompute p from the saved LSE; dQ sums over KV
positions block by block in increasing order (tree over each block's 64);
dK/dV sum over query rows in fixed chunks of ``BWD_ROWS`` rows (tree inside a
chunk, chunks in order).  Deterministic run to run; no atomics.
"""
from __future__ import annotations

import torch

from ..kv_cache.op import PAGE_SIZE
from .op import SEGMENT

BLOCK_N = PAGE_SIZE  # KV block = one cache page
SEG_BLOCKS = SEGMENT // BLOCK_N  # KV blocks per merge segment (16)
BWD_ROWS = 128  # fixed: the dK/dV row-sum order depends on it
_BUDGET = 1 << 22  # fp32 elements per large temporary (16 MiB); never changes bits
_NEG_INF = float("-inf")


def _tree_sum0(x: torch.Tensor) -> torch.Tensor:
    """Sum over dim 0 by a fixed pairwise tree of element-wise adds."""
    while x.shape[0] > 1:
        n, h = x.shape[0], x.shape[0] // 2
        y = x[:h] + x[h : 2 * h]
        x = torch.cat([y, x[2 * h :]]) if n % 2 else y
    return x[0]


def _tree_max0(x: torch.Tensor) -> torch.Tensor:
    while x.shape[0] > 1:
        n, h = x.shape[0], x.shape[0] // 2
        y = torch.maximum(x[:h], x[h : 2 * h])
        x = torch.cat([y, x[2 * h :]]) if n % 2 else y
    return x[0]


def merge_states(m_t, l_t, acc_t, m_s, l_s, acc_s):
    """Merge a segment's state (m_s (..), l_s (..), acc_s (.., D)) into the
    running total (module docstring; natural-log m).  Element-wise only."""
    m_n = torch.maximum(m_t, m_s)
    a_t, a_s = torch.exp(m_t - m_n), torch.exp(m_s - m_n)  # NaN where both are -inf: never selected
    l_n = l_t * a_t + l_s * a_s
    acc_n = acc_t * a_t[..., None] + acc_s * a_s[..., None]
    s_empty, t_empty = m_s == _NEG_INF, m_t == _NEG_INF
    l = torch.where(s_empty, l_t, torch.where(t_empty, l_s, l_n))
    acc = torch.where(s_empty[..., None], acc_t, torch.where(t_empty[..., None], acc_s, acc_n))
    return m_n, l, acc


def _window_lo(pos: torch.Tensor, window: int) -> torch.Tensor:
    return (pos - window + 1).clamp(min=0) if window > 0 else torch.zeros_like(pos)


def attend_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pos: torch.Tensor,
    lo: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    *,
    block0: int = 0,
    row_chunk: int | None = None,
    seg_blocks: int = SEG_BLOCKS,
    static: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-row recurrence of the module docstring, for S independent streams.

    q: (S, M, D) rows; k: (S, NB*64, D), v: (S, NB*64, Dv) holding absolute KV
    blocks ``block0 .. block0+NB-1`` of the stream (Dv may differ from D: MLA's
    values are a prefix of its KV row); pos, lo: (S, M) int64 — the row's
    position and first visible KV position (``pos < 0``: a padding row);
    kv_len: (S,) — K/V at positions >= kv_len are never data (may be garbage).
    Returns out (S, M, Dv) fp32 = acc / l (not rounded) and lse (S, M) fp32,
    on q's device (the ops are the same element-wise ops on any device).
    ``row_chunk`` only bounds memory: it cannot change bits.  ``seg_blocks``
    is part of the order: anything but ``SEG_BLOCKS`` breaks the contract
    (the tests' counter-example uses it).  ``static``: read nothing on the
    host (a CUDA graph can capture it): every block of every chunk runs, a
    block outside a row's range kept out by ``torch.where``, which adds
    exactly nothing, so the bits are the skipping path's.
    """
    S, M, D = q.shape
    Dv, dev = v.shape[2], q.device
    NB = k.shape[1] // BLOCK_N
    n_abs = block0 * BLOCK_N + torch.arange(NB * BLOCK_N, device=dev)  # (L,)
    kT = k.float().view(S, NB, BLOCK_N, D).permute(3, 2, 0, 1).contiguous()  # (D, 64, S, NB)
    v_ok = (n_abs[None, :] < kv_len[:, None])[..., None]  # (S, L, 1)
    vT = torch.where(v_ok, v.float(), 0.0).view(S, NB, BLOCK_N, Dv).permute(2, 0, 1, 3).contiguous()  # (64, S, NB, Dv)
    qT = q.float().permute(2, 0, 1)  # (D, S, M)
    valid = pos >= 0
    jlo = torch.where(valid, lo // BLOCK_N, 1 << 40)  # padding rows: no block is theirs
    jhi = torch.where(valid, pos // BLOCK_N, -1)

    out = torch.zeros(S, M, Dv, device=dev)
    lse = torch.full((S, M), _NEG_INF, device=dev)
    mc = row_chunk or max(1, min(M, _BUDGET // max(1, D * BLOCK_N * S * NB)))
    for m0 in range(0, M, mc):
        m1 = min(M, m0 + mc)
        ok = valid[:, m0:m1]
        if static:
            j0, j1 = 0, NB
        else:
            if not bool(ok.any()):
                continue
            j0 = int(jlo[:, m0:m1][ok].min()) - block0
            j1 = int(jhi[:, m0:m1][ok].max()) - block0 + 1
        pos_c, lo_c = pos[:, m0:m1], lo[:, m0:m1]
        jlo_c, jhi_c = jlo[:, m0:m1], jhi[:, m0:m1]
        m_t = torch.full((S, m1 - m0), _NEG_INF, device=dev)
        l_t = torch.zeros(S, m1 - m0, device=dev)
        acc_t = torch.zeros(S, m1 - m0, Dv, device=dev)
        bc = max(1, _BUDGET // max(1, D * BLOCK_N * S * (m1 - m0)))
        a0, a1 = block0 + j0, block0 + j1  # absolute block range of the chunk
        for g0 in range(a0 - a0 % seg_blocks, a1, seg_blocks):  # segments, in increasing order
            m = torch.full((S, m1 - m0), _NEG_INF, device=dev)
            l = torch.zeros(S, m1 - m0, device=dev)
            acc = torch.zeros(S, m1 - m0, Dv, device=dev)
            seg_hi = min(a1, g0 + seg_blocks) - block0
            for b0 in range(max(a0, g0) - block0, seg_hi, bc):
                b1 = min(seg_hi, b0 + bc)
                nb = b1 - b0
                s = _tree_sum0(qT[:, None, :, m0:m1, None] * kT[:, :, :, None, b0:b1]) * scale  # (64, S, Mc, nb)
                n = n_abs.view(NB, BLOCK_N)[b0:b1].t()[:, None, None, :]  # (64, 1, 1, nb)
                vis = (n <= pos_c[None, :, :, None]) & (n >= lo_c[None, :, :, None])
                s = torch.where(vis, s, _NEG_INF)
                run = torch.cat([m[..., None], _tree_max0(s)], -1).cummax(-1).values  # (S, Mc, nb+1)
                m_prev, m_new = run[..., :-1], run[..., 1:]
                m_safe = torch.where(m_new == _NEG_INF, 0.0, m_new)
                p = torch.exp(s - m_safe[None])  # (64, S, Mc, nb)
                alpha = torch.where(m_new > m_prev, torch.exp(m_prev - m_safe), 1.0)  # (S, Mc, nb)
                rs = _tree_sum0(p)  # (S, Mc, nb)
                pv = _tree_sum0(p[..., None] * vT[:, :, None, b0:b1, :])  # (S, Mc, nb, Dv)
                jj = block0 + torch.arange(b0, b1, device=dev)
                act = (jj >= jlo_c[..., None]) & (jj <= jhi_c[..., None])  # (S, Mc, nb)
                all_act = [False] * nb if static else act.flatten(0, 1).all(0).tolist()
                any_act = [True] * nb if static else act.flatten(0, 1).any(0).tolist()
                for t in range(nb):
                    if not any_act[t]:
                        continue
                    l_new = l * alpha[..., t] + rs[..., t]
                    acc_new = acc * alpha[..., t, None] + pv[:, :, t]
                    if all_act[t]:
                        l, acc = l_new, acc_new
                    else:
                        a = act[..., t]
                        l = torch.where(a, l_new, l)
                        acc = torch.where(a[..., None], acc_new, acc)
                m = m_new[..., -1]
            m_t, l_t, acc_t = merge_states(m_t, l_t, acc_t, m, l, acc)
        l_safe = torch.where(ok, l_t, 1.0)
        out[:, m0:m1] = torch.where(ok[..., None], acc_t / l_safe[..., None], 0.0)
        lse[:, m0:m1] = torch.where(ok, m_t + torch.log(l_safe), _NEG_INF)
    return out, lse


def _rows_of(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(L, Hq, D) -> (Hkv, L*G, D): a stream per kv head, rows token-major,
    query head of the group minor."""
    L, hq, d = x.shape
    return x.view(L, hkv, hq // hkv, d).permute(1, 0, 2, 3).reshape(hkv, -1, d)


def _unrows(x: torch.Tensor, L: int) -> torch.Tensor:
    """(Hkv, L*G, ...) -> (L, Hq, ...)."""
    hkv = x.shape[0]
    rest = x.shape[2:]
    x = x.reshape(hkv, L, -1, *rest).transpose(0, 1)
    return x.reshape(L, -1, *rest)


def _kv_blocks(t: torch.Tensor, s0: int, s1: int, dtype: torch.dtype) -> torch.Tensor:
    """Tokens s0..s1 of a packed (T, Hkv, D) k or v as (Hkv, NB * BLOCK_N, D),
    zero-padded up to whole KV blocks."""
    L = s1 - s0
    out = torch.zeros(t.shape[1], -(-L // BLOCK_N) * BLOCK_N, t.shape[2], dtype=dtype, device=t.device)
    out[:, :L] = t[s0:s1].to(dtype).transpose(0, 1)
    return out


def attention_fwd_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: int,
    scale: float,
    *,
    row_chunk: int | None = None,
    seg_blocks: int = SEG_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen causal attention.  q (T, Hq, D), k/v (T, Hkv, D) ->
    o (T, Hq, D) in q.dtype, lse (T, Hq) fp32."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    o = torch.zeros_like(q)
    lse = torch.full((T, hq), _NEG_INF)
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        L = s1 - s0
        if L == 0:
            continue
        kb, vb = _kv_blocks(k, s0, s1, k.dtype), _kv_blocks(v, s0, s1, v.dtype)
        pos = torch.arange(L).repeat_interleave(g).expand(hkv, -1)
        out, ls = attend_rows(
            _rows_of(q[s0:s1], hkv), kb, vb, pos, _window_lo(pos, window), torch.full((hkv,), L), scale,
            row_chunk=row_chunk, seg_blocks=seg_blocks,
        )
        o[s0:s1] = _unrows(out, L).to(q.dtype)
        lse[s0:s1] = _unrows(ls, L)
    return o, lse


def paged_attention_fwd_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    window: int,
    scale: float,
    *,
    row_chunk: int | None = None,
    seg_blocks: int = SEG_BLOCKS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (T, Hq, D) packed by cu_seqlens_q against the paged cache; query
    i of sequence b sits at position ``seq_lens[b] - q_len_b + i``.  Decode is
    q_len = 1.  Sequences with few queries are batched into one call of
    ``attend_rows`` (padding rows), longer ones go alone: bits are the same."""
    T, hq, d = q.shape
    hkv = k_cache.shape[2]
    g = hq // hkv
    o = torch.zeros_like(q)
    lse = torch.full((T, hq), _NEG_INF)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens.tolist()
    qlens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    short = [b for b, n in enumerate(qlens) if 0 < n <= 16]
    groups = ([short] if short else []) + [[b] for b, n in enumerate(qlens) if n > 16]
    width = block_table.shape[1]
    for grp in groups:
        first = [lens[b] - qlens[b] for b in grp]
        jfirst = [max(p - window + 1, 0) // BLOCK_N if window > 0 else 0 for p in first]
        jend = [-(-lens[b] // BLOCK_N) for b in grp]
        block0, nb = min(jfirst), max(jend) - min(jfirst)
        j = block0 + torch.arange(nb)
        need = (j[None] >= torch.tensor(jfirst)[:, None]) & (j[None] < torch.tensor(jend)[:, None])
        pages = torch.where(need, block_table[grp][:, j.clamp(max=width - 1)].long(), 0)  # (g, nb)
        kg = k_cache[pages].permute(0, 3, 1, 2, 4).reshape(len(grp) * hkv, nb * BLOCK_N, d)
        vg = v_cache[pages].permute(0, 3, 1, 2, 4).reshape(len(grp) * hkv, nb * BLOCK_N, d)
        ml = max(qlens[b] for b in grp) * g
        qg = q.new_zeros(len(grp), hkv, ml, d)
        pos = torch.full((len(grp), hkv, ml), -1, dtype=torch.long)
        for i, b in enumerate(grp):
            qg[i, :, : qlens[b] * g] = _rows_of(q[cu[b] : cu[b + 1]], hkv)
            pos[i, :, : qlens[b] * g] = first[i] + torch.arange(qlens[b]).repeat_interleave(g)
        kv_len = torch.tensor(lens)[grp].repeat_interleave(hkv)
        pos = pos.view(-1, ml)
        lo = torch.where(pos >= 0, _window_lo(pos, window), 0)
        out, ls = attend_rows(qg.view(-1, ml, d), kg, vg, pos, lo, kv_len, scale, block0=block0, row_chunk=row_chunk,
                              seg_blocks=seg_blocks)
        out, ls = out.view(len(grp), hkv, ml, d), ls.view(len(grp), hkv, ml)
        for i, b in enumerate(grp):
            n = qlens[b]
            o[cu[b] : cu[b + 1]] = _unrows(out[i, :, : n * g], n).to(q.dtype)
            lse[cu[b] : cu[b + 1]] = _unrows(ls[i, :, : n * g], n)
    return o, lse


def attention_bwd_cpu(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens: torch.Tensor,
    window: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv for ``attention_fwd_cpu`` (order: module docstring)."""
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        L = s1 - s0
        if L == 0:
            continue
        nb = -(-L // BLOCK_N)
        kb, vb = _kv_blocks(k, s0, s1, torch.float32), _kv_blocks(v, s0, s1, torch.float32)
        kT = kb.view(hkv, nb, BLOCK_N, d).permute(3, 2, 0, 1).contiguous()  # (D, 64, S, NB)
        vT = vb.view(hkv, nb, BLOCK_N, d).permute(3, 2, 0, 1).contiguous()
        kR = kb.view(hkv, nb, BLOCK_N, d).permute(2, 0, 1, 3).contiguous()  # (64, S, NB, D)
        qr = _rows_of(q[s0:s1], hkv).float()  # (S, M, D)
        dor = _rows_of(do[s0:s1], hkv).float()
        orr = _rows_of(o[s0:s1], hkv).float()
        lser = _rows_of(lse[s0:s1, :, None], hkv)[..., 0]  # (S, M)
        delta = _tree_sum0((orr * dor).permute(2, 0, 1))  # (S, M)
        qT, doT = qr.permute(2, 0, 1), dor.permute(2, 0, 1)  # (D, S, M)
        M = qr.shape[1]
        pos = torch.arange(L).repeat_interleave(g)  # (M,)
        lo = _window_lo(pos, window)
        dq_r = torch.zeros(hkv, M, d)
        dk_b = torch.zeros(hkv, nb, BLOCK_N, d)
        dv_b = torch.zeros(hkv, nb, BLOCK_N, d)
        for m0 in range(0, M, BWD_ROWS):
            m1 = min(M, m0 + BWD_ROWS)
            mc = m1 - m0
            j0, j1 = int(lo[m0]) // BLOCK_N, int(pos[m1 - 1]) // BLOCK_N + 1
            bc = max(1, _BUDGET // max(1, d * BLOCK_N * hkv * mc))
            for b0 in range(j0, j1, bc):
                b1 = min(j1, b0 + bc)
                n = (torch.arange(b0, b1)[None, :] * BLOCK_N + torch.arange(BLOCK_N)[:, None])[:, None, :]  # (64, 1, nb)
                vis = ((n <= pos[m0:m1, None]) & (n >= lo[m0:m1, None]))[:, None]  # (64, 1, Mc, nb)
                s = _tree_sum0(qT[:, None, :, m0:m1, None] * kT[:, :, :, None, b0:b1]) * scale  # (64, S, Mc, nb)
                p = torch.where(vis, torch.exp(s - lser[None, :, m0:m1, None]), 0.0)
                dp = _tree_sum0(doT[:, None, :, m0:m1, None] * vT[:, :, :, None, b0:b1])
                ds = p * (dp - delta[None, :, m0:m1, None])  # (64, S, Mc, nb)
                dq_part = _tree_sum0(ds[..., None] * kR[:, :, None, b0:b1, :])  # (S, Mc, nb, D)
                for t in range(b1 - b0):
                    dq_r[:, m0:m1] += dq_part[:, :, t]
                # rows first, then a tree over the chunk's rows
                dk_b[:, b0:b1] += _tree_sum0(ds.permute(2, 1, 3, 0)[..., None] * qr.permute(1, 0, 2)[m0:m1, :, None, None, :])
                dv_b[:, b0:b1] += _tree_sum0(p.permute(2, 1, 3, 0)[..., None] * dor.permute(1, 0, 2)[m0:m1, :, None, None, :])
        dq[s0:s1] = _unrows(dq_r * scale, L).to(q.dtype)
        dk[s0:s1] = (dk_b.view(hkv, -1, d)[:, :L] * scale).transpose(0, 1).to(k.dtype)
        dv[s0:s1] = dv_b.view(hkv, -1, d)[:, :L].transpose(0, 1).to(v.dtype)
    return dq, dk, dv
