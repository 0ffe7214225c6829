"""Sparse MLA attention in the absorbed form, batch-invariant by construction: every path gathers a query
row's selected KV rows and hands them to one per-row routine, ``attention.cpu.attend_rows``.

What is computed
----------------
Query row i (token i, head h) holds ``q_abs[i, h] = [q_nope[i, h] @ W_UK[h] | q_rope[i, h]]`` (Dqk wide;
GLM-5: 512 + 64 = 576; the model computes it).  Position j of a sequence caches one row shared by every head
(MQA), ``kv[j] = [kv_a_layernorm(latent)[j] | k_rope[j]]`` (Dqk wide); its first Dv columns (the latent,
Dv = kv_lora_rank) are the value.  The indexer's selection ``sel[i]`` (top_k positions relative to the
sequence's start, ascending, -1 = pad) says which positions row i sees; causality is already in it::

    s[i, h, e] = scale * q_abs[i, h] . kv[sel[i, e]]
    out[i, h]  = sum_e softmax_e(s[i, h]) * kv[sel[i, e], :Dv]       lse[i, h] = log sum_e exp(s[i, h, e])

The order (the contract)
------------------------
A row's *entries* are its selected positions in list order with the -1 pads taken out (a stable
compaction: valid entries first, in the order given; the public functions require them strictly
ascending, so the entries are the selected set in increasing position, and the bits depend on that set
alone).  Entry e = 0 .. n_valid-1 plays the role that KV position e plays in the dense recurrence of
``attention/cpu.py``, for a row at "position" n_valid - 1 with no window:

- blocks of ``BLOCK_N = 64`` entries (block b = entries ``64b .. 64b+63``), in increasing b;
- segments of ``SEG_BLOCKS = 16`` blocks (1024 entries, ``attention.op.SEGMENT``: the dense op's, so one code
  path serves both, and a split decode kernel can give each segment of GLM-5's 2048 entries its own
  program), each an online softmax from the fresh state ``(m, l, acc) = (-inf, 0, 0)``::

      s_e   = tree_D(q_d * k_ed) * scale        # pairwise tree over Dqk, fixed
      s_e   = -inf at entries >= n_valid (pads)
      m_new = max(m, tree_64(max)(s))
      alpha = exp(m - m_new) if m_new > m else 1
      p_e   = exp(s_e - m_new)
      l     = l * alpha + tree_64(p)                                   (two roundings)
      acc   = acc * alpha + tree_64(p_e * v_ed)   v_e = k_e[:Dv]       (two roundings)

- the segments merged in increasing order by ``attention.cpu.merge_states``; ``out = acc / l`` rounded once to
  the output dtype, ``lse = m + log(l)`` in fp32.  A row of no entries gives out = 0, lse = -inf.

It is ``attend_rows`` itself (one stream per query token, its H heads the stream's rows, KV = the gathered
entries, "position" n_valid - 1, lo = 0), so the arithmetic is written once for dense and sparse attention.
Every op in it is element-wise (docs/DESIGN.md, "Why the CPU paths are invariant by construction"): a row's
bits depend on its q, its entries' KV rows and the order above, never on the other rows of the call, on how
rows are chunked, or on where the rows came from.  Trainer (contiguous packed kv + ``cu_seqlens``) and server
(a ``(pages, 64, 1, Dqk)`` pool + block table) differ only in the gather that fetches kv[sel[i, e]]; a decode
row and the same token's row in a prefill gather the same rows.  A pad gathers row 0 (slot 0 of the pool)
and is replaced by zeros, so no pad's bytes enter a sum.  Blocks of 64 entries are not pages: a block's
entries lie anywhere in the cache.

Backward (contiguous only), deterministic and per sequence::

    p_e    = exp(s_e - lse)   (s recomputed as above; 0 at pads)
    delta  = tree_Dv(out * dout)              (out as returned, in its dtype)
    dp_e   = tree_Dv(dout * v_e);   ds_e = p_e * (dp_e - delta)
    dq     = scale * (sum over blocks in increasing order of tree_64(ds_e * k_e))
    ck_e   = tree_H(ds_e[h] * q[h]);   cv_e = tree_H(p_e[h] * dout[h])     (one row's part for entry e)
    dk[j]  = ((0 + ck_{i1}) + ck_{i2}) + ...   over the query rows i1 < i2 < ... that selected j
    dv[j]  likewise with cv;   dkv = dk * scale, then dkv[:, :Dv] += dv

A row's entries are distinct positions, so scattering one row's parts is one add per element; rows are
scattered one after another in increasing packed index.  A kv row only receives parts from its own
sequence's rows, so a sequence's gradients do not depend on what else is packed with it.
"""
from __future__ import annotations

import torch

from ..attention.cpu import _BUDGET, BLOCK_N, _tree_sum0, attend_rows


def compact(sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, top_k) selection -> (entries (n, K) int64, n_valid (n,) int64): valid entries first in list order,
    then -1, K = top_k rounded up to whole 64-entry blocks."""
    n, top_k = sel.shape
    order = torch.argsort((sel < 0).to(torch.uint8), dim=1, stable=True)
    ent = torch.gather(sel.long(), 1, order)
    K = -(-top_k // BLOCK_N) * BLOCK_N
    if K > top_k:
        ent = torch.cat([ent, ent.new_full((n, K - top_k), -1)], 1)
    return ent, (sel >= 0).sum(1)


def contiguous_rows(cu_seqlens: torch.Tensor, ent: torch.Tensor, cu_seqlens_kv: torch.Tensor | None = None) -> torch.Tensor:
    """Row of each entry in the packed kv: the start of the row's sequence in kv (``cu_seqlens_kv``, default
    ``cu_seqlens``: one kv row per token) + the entry; pads -> 0."""
    kv_starts = (cu_seqlens if cu_seqlens_kv is None else cu_seqlens_kv)[:-1].long()
    starts = torch.repeat_interleave(kv_starts, torch.diff(cu_seqlens).long())  # (n,)
    return torch.where(ent >= 0, starts[:, None] + ent, 0)


def with_sinks(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A per-head sink logit joined to a row's softmax (DeepSeek-V4; gpt-oss): o (n, H, Dv), lse (n, H) fp32,
    sinks (H,) fp32 -> (o / (1 + exp(sink - lse)), log(exp(lse) + exp(sink))), element-wise in fp32; a row with
    no entry keeps o = 0 and gets lse = sink."""
    sk = sinks.float()[None, :]
    m = torch.maximum(lse, sk)
    lse_s = m + torch.log(torch.exp(lse - m) + torch.exp(sk - m))
    return o * (1.0 / (1.0 + torch.exp(sk - lse)))[..., None], lse_s


def paged_rows(block_table: torch.Tensor, seq_idx: torch.Tensor, ent: torch.Tensor) -> torch.Tensor:
    """Slot (page * 64 + offset) of each entry in a (P * 64, Dqk) view of the pool; pads -> 0."""
    e = ent.clamp(min=0)
    page = block_table.long()[seq_idx.long()[:, None], e // BLOCK_N]
    return torch.where(ent >= 0, page * BLOCK_N + e % BLOCK_N, 0)


def _gather(table: torch.Tensor, rows: torch.Tensor, n_valid: torch.Tensor, w: int) -> torch.Tensor:
    """(Rc, w, Dqk) KV rows of the entries 0..w-1, zeros at pads."""
    ok = torch.arange(w, device=rows.device)[None, :] < n_valid[:, None]
    return torch.where(ok[..., None], table[rows[:, :w]], 0)


def _width(n_valid: torch.Tensor) -> int:
    """Entries to gather for a chunk of rows: its longest row, in whole blocks (0: no row has an entry)."""
    return -(-int(n_valid.max()) // BLOCK_N) * BLOCK_N if n_valid.numel() else 0


def sparse_attend(
    q: torch.Tensor, table: torch.Tensor, rows: torch.Tensor, n_valid: torch.Tensor, scale: float, v_dim: int,
    *, row_chunk: int | None = None, static: bool | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (n, H, Dqk); table (R, Dqk) the KV rows; rows (n, K) the table row of each compacted entry; n_valid (n,)
    -> out (n, H, Dv) in q.dtype, lse (n, H) fp32 (the order of the module docstring).  ``row_chunk`` (query
    rows per ``attend_rows`` call) only bounds memory: it cannot change bits.  ``static`` (default: on CUDA)
    reads nothing on the host, so a CUDA graph captures it: all K entries of every row run, the blocks past a
    row's entries masked, which adds exactly nothing (the same bits as gathering only the longest row's).
    ``sinks`` (H,) fp32: each head's sink logit joins the softmax (``with_sinks``) before the one rounding."""
    n, H, D = q.shape
    out = q.new_zeros(n, H, v_dim)
    lse = torch.full((n, H), float("-inf"), device=q.device)
    rc = row_chunk or max(1, _BUDGET // max(1, D * rows.shape[1] * H))
    static = q.is_cuda if static is None else static
    for r0 in range(0, n, rc):
        r1 = min(n, r0 + rc)
        nv = n_valid[r0:r1]
        w = rows.shape[1] if static else _width(nv)
        if w == 0:
            if sinks is not None:
                lse[r0:r1] = sinks.float()[None, :]
            continue
        kv = _gather(table, rows[r0:r1], nv, w)
        pos = (nv - 1)[:, None].expand(-1, H).contiguous()  # -1: a row with no entry is a padding row
        o, ls = attend_rows(q[r0:r1], kv, kv[..., :v_dim], pos, torch.zeros_like(pos), nv, scale, static=static)
        if sinks is not None:
            o, ls = with_sinks(o, ls, sinks)
        out[r0:r1] = o.to(q.dtype)
        lse[r0:r1] = ls
    return out, lse


def sparse_attention_fwd_cpu(q, kv, sel, cu_seqlens, scale, v_dim, *, row_chunk=None, cu_seqlens_kv=None, sinks=None):
    """Packed: q (T, H, Dqk), kv (T, Dqk) (or ``cu_seqlens_kv``'s rows), sel (T, top_k) relative to each row's
    sequence start in kv."""
    ent, n_valid = compact(sel)
    cu_kv = None if cu_seqlens_kv is None else cu_seqlens_kv.to(q.device)
    return sparse_attend(q, kv, contiguous_rows(cu_seqlens.to(q.device), ent, cu_kv), n_valid, scale, v_dim,
                         row_chunk=row_chunk, sinks=sinks)


def paged_sparse_attention_fwd_cpu(q, kv_cache, sel, seq_idx, block_table, scale, v_dim, *, row_chunk=None):
    """Paged: q (n, H, Dqk), kv_cache (P, 64, 1, Dqk), row i in sequence seq_idx[i] of block_table (B, W)."""
    ent, n_valid = compact(sel)
    table = kv_cache.view(-1, kv_cache.shape[-1])
    return sparse_attend(q, table, paged_rows(block_table, seq_idx, ent), n_valid, scale, v_dim, row_chunk=row_chunk)


def sparse_attention_bwd_cpu(q, kv, sel, cu_seqlens, o, lse, do, scale, v_dim, *, row_chunk=None, cu_seqlens_kv=None,
                             sinks=None):
    """(dq (T, H, Dqk) in q.dtype, dkv (R, Dqk) in kv.dtype, dsinks (H,) fp32 or None) of the packed forward
    (module docstring).  With sinks, ``lse`` is the forward's (sink included) and dsink_h = -Σ_rows
    exp(sink_h - lse) · delta, summed over the rows by the pairwise tree."""
    n, H, D = q.shape
    Dv = v_dim
    ent, n_valid = compact(sel)
    rows = contiguous_rows(cu_seqlens.to(q.device), ent, None if cu_seqlens_kv is None else cu_seqlens_kv.to(q.device))
    dsinks = None
    if sinks is not None:
        delta_all = _tree_sum0((o.float() * do.float()).permute(2, 0, 1))  # (n, H)
        dsinks = torch.zeros(H, device=q.device)
        dsinks = _tree_sum0(-(torch.exp(sinks.float()[None, :] - lse) * delta_all)) if n else dsinks
    dq = torch.zeros(n, H, D, device=q.device)
    dk = torch.zeros(kv.shape[0], D, device=q.device)
    dv = torch.zeros(kv.shape[0], Dv, device=q.device)
    rc = row_chunk or max(1, _BUDGET // max(1, D * BLOCK_N * H))
    for r0 in range(0, n, rc):
        r1 = min(n, r0 + rc)
        R, nv = r1 - r0, n_valid[r0:r1]
        w = _width(nv)
        if w == 0:
            continue
        NB = w // BLOCK_N
        kvr = _gather(kv, rows[r0:r1], nv, w).float().view(R, NB, BLOCK_N, D)
        kT = kvr.permute(3, 2, 0, 1)  # (D, 64, R, NB)
        vT = kT[:Dv]  # (Dv, 64, R, NB): v is a prefix of the row
        kR = kvr.permute(2, 0, 1, 3)  # (64, R, NB, D)
        qf, dof = q[r0:r1].float(), do[r0:r1].float()  # (R, H, D), (R, H, Dv)
        delta = _tree_sum0((o[r0:r1].float() * dof).permute(2, 0, 1))  # (R, H)
        qT, doT = qf.permute(2, 0, 1), dof.permute(2, 0, 1)  # (D, R, H), (Dv, R, H)
        okT = (torch.arange(w, device=q.device)[None, :] < nv[:, None]).view(R, NB, BLOCK_N).permute(2, 0, 1)
        lse_c = lse[r0:r1]
        dq_r = torch.zeros(R, H, D, device=q.device)
        ck = torch.zeros(R, NB, BLOCK_N, D, device=q.device)
        cv = torch.zeros(R, NB, BLOCK_N, Dv, device=q.device)
        bc = max(1, _BUDGET // max(1, D * BLOCK_N * R * H))
        for b0 in range(0, NB, bc):
            b1 = min(NB, b0 + bc)
            s = _tree_sum0(qT[:, None, :, :, None] * kT[:, :, :, None, b0:b1]) * scale  # (64, R, H, nb)
            ok = okT[:, :, None, b0:b1]  # (64, R, 1, nb)
            p = torch.where(ok, torch.exp(s - lse_c[None, :, :, None]), 0.0)
            dp = _tree_sum0(doT[:, None, :, :, None] * vT[:, :, :, None, b0:b1])  # (64, R, H, nb)
            ds = p * (dp - delta[None, :, :, None])
            dq_part = _tree_sum0(ds[..., None] * kR[:, :, None, b0:b1, :])  # (R, H, nb, D)
            for t in range(b1 - b0):
                dq_r += dq_part[:, :, t]
            # heads first (tree over H), per entry: (H, R, nb, 64, 1) * (H, R, 1, 1, D)
            ck[:, b0:b1] = _tree_sum0(ds.permute(2, 1, 3, 0)[..., None] * qf.permute(1, 0, 2)[:, :, None, None, :])
            cv[:, b0:b1] = _tree_sum0(p.permute(2, 1, 3, 0)[..., None] * dof.permute(1, 0, 2)[:, :, None, None, :])
        dq[r0:r1] = dq_r * scale
        ck, cv = ck.view(R, w, D), cv.view(R, w, Dv)
        for r, k in enumerate(nv.tolist()):  # rows in increasing packed index; a row's entries are distinct
            idx = rows[r0 + r, :k]
            dk.index_add_(0, idx, ck[r, :k])
            dv.index_add_(0, idx, cv[r, :k])
    dkv = dk * scale
    dkv[:, :Dv] += dv
    return dq.to(q.dtype), dkv.to(kv.dtype), dsinks
