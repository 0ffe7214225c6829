"""Sparse MLA attention (absorbed form) over the DSA indexer's selection: launchers, autograd, public functions.

The trainer calls ``sparse_attention`` (packed kv rows + ``cu_seqlens``, differentiable in q and kv); the server
calls ``paged_sparse_attention_fwd`` (the cached rows in a ``(pages, 64, 1, Dqk)`` pool) for prefill, chunked
prefill and decode alike.  Both gather each query row's selected rows and run one per-row routine
(``cpu.py``; its docstring is the order), so a row has the same bits on every path.  ``*_fwd`` / ``*_bwd``
launchers do no checks; the public functions validate first.

On CUDA both forward launchers run one Triton kernel in that order (``kernel.py``: a program per query row and
head, the same bits as the routine run on those tensors, no host read, so a CUDA graph captures it); a head dim
whose odd part passes ``kernel.MAX_ODD`` runs the routine itself (its static mode, the same bits).  The backward
stays the element-wise routine on every device; its per-row scatter syncs with the host.

``scale`` has no default: MLA's is YaRN's mscale of ``qk_head_dim ** -0.5`` (GLM-5: qk_head_dim = 192 + 64),
not ``Dqk ** -0.5`` of the absorbed row.  ``v_dim`` (= kv_lora_rank) says how many leading columns of a KV
row are the value.
"""
from __future__ import annotations

import math

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..attention.op import _check_cu
from ..kv_cache.op import PAGE_SIZE
from .cpu import (
    compact,
    paged_sparse_attention_fwd_cpu,
    sparse_attention_bwd_cpu,
    sparse_attention_fwd_cpu,
)

_INT_DTYPES = (torch.int32, torch.int64)


# ---------------------------------------------------------------- launchers
def _on_kernel(q: torch.Tensor, v_dim: int) -> bool:
    if not q.is_cuda:
        return False
    from .kernel import supported

    return supported(q.shape[2], v_dim)


def sparse_attention_fwd(
    q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, v_dim: int,
    row_chunk: int | None = None, cu_seqlens_kv: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed forward -> (o (T, H, v_dim) in q.dtype, lse (T, H) fp32, the sinks' included).  ``row_chunk`` bounds
    the CPU path's memory only."""
    if _on_kernel(q, v_dim):
        from .kernel import sparse_attention_fwd_triton

        return sparse_attention_fwd_triton(q, kv, sel, cu_seqlens, float(scale), v_dim, cu_seqlens_kv, sinks)
    return sparse_attention_fwd_cpu(q, kv, sel, cu_seqlens, float(scale), v_dim, row_chunk=row_chunk,
                                    cu_seqlens_kv=cu_seqlens_kv, sinks=sinks)


def paged_sparse_attention_fwd(
    q: torch.Tensor, kv_cache: torch.Tensor, sel: torch.Tensor, seq_idx: torch.Tensor, block_table: torch.Tensor,
    *, scale: float, v_dim: int, row_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged forward -> (o (n, H, v_dim) in q.dtype, lse (n, H) fp32); the same bits as the packed forward for
    the same rows."""
    if _on_kernel(q, v_dim):
        from .kernel import paged_sparse_attention_fwd_triton

        return paged_sparse_attention_fwd_triton(q, kv_cache, sel, seq_idx, block_table, float(scale), v_dim)
    return paged_sparse_attention_fwd_cpu(q, kv_cache, sel, seq_idx, block_table, float(scale), v_dim,
                                          row_chunk=row_chunk)


def sparse_attention_bwd(
    q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, cu_seqlens: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor, do: torch.Tensor, *, scale: float, v_dim: int, cu_seqlens_kv: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq (T, H, Dqk), dkv (R, Dqk), dsinks (H,) fp32 or None) of the packed forward; deterministic, and the
    kv rows' per sequence."""
    return sparse_attention_bwd_cpu(q, kv, sel, cu_seqlens, o, lse, do.to(o.dtype), float(scale), v_dim,
                                    cu_seqlens_kv=cu_seqlens_kv, sinks=sinks)


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, kv, sel, cu_seqlens, scale, v_dim, cu_seqlens_kv=None, sinks=None):
        o, lse = sparse_attention_fwd(q, kv, sel, cu_seqlens, scale=scale, v_dim=v_dim, cu_seqlens_kv=cu_seqlens_kv,
                                      sinks=sinks)
        ctx.save_for_backward(q, kv, sel, cu_seqlens, o, lse, cu_seqlens_kv, sinks)
        ctx.scale, ctx.v_dim = scale, v_dim
        return o

    @staticmethod
    def backward(ctx, do):
        q, kv, sel, cu_seqlens, o, lse, cu_kv, sinks = ctx.saved_tensors
        dq, dkv, dsinks = sparse_attention_bwd(q, kv, sel, cu_seqlens, o, lse, do, scale=ctx.scale, v_dim=ctx.v_dim,
                                               cu_seqlens_kv=cu_kv, sinks=sinks)
        return dq, dkv, None, None, None, None, None, dsinks


# ---------------------------------------------------------------- checks
def _check_common(q: torch.Tensor, d_kv: int, kv_dtype: torch.dtype, sel: torch.Tensor, scale, v_dim) -> None:
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("sel", sel, dtypes=_INT_DTYPES, ndim=2)
    if kv_dtype != q.dtype:
        raise TypeError(f"q and the kv rows must share a dtype, got {q.dtype} and {kv_dtype}")
    if d_kv != q.shape[2]:
        raise ValueError(f"kv rows are {d_kv} wide but q's head dim (Dqk) is {q.shape[2]}")
    if isinstance(v_dim, bool) or not isinstance(v_dim, int) or not 1 <= v_dim <= d_kv:
        raise ValueError(f"v_dim must be an int in 1..{d_kv} (the value is a prefix of the kv row), got {v_dim!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")
    if sel.shape[0] != q.shape[0]:
        raise ValueError(f"sel has {sel.shape[0]} rows but q has {q.shape[0]}")
    if sel.shape[1] < 1:
        raise ValueError("sel needs at least one column (top_k >= 1)")


def _check_selection(sel: torch.Tensor, positions: torch.Tensor) -> None:
    """Entries are -1 (pad) or positions 0..positions[i] of the row's sequence, strictly ascending."""
    bad = sel < -1
    if bool(bad.any()):
        i, e = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"sel[{i}, {e}] = {int(sel[i, e])} is below -1 (the pad)")
    past = sel > positions[:, None]
    if bool(past.any()):
        i, e = (int(x) for x in past.nonzero()[0])
        raise ValueError(f"sel[{i}, {e}] = {int(sel[i, e])} is past the row's position {int(positions[i])} "
                         "(a row sees positions 0..its own, relative to its sequence's start)")
    ent, n_valid = compact(sel)
    both = (torch.arange(1, ent.shape[1], device=sel.device)[None, :] < n_valid[:, None])
    down = both & (ent[:, 1:] <= ent[:, :-1])
    if bool(down.any()):
        i = int(down.nonzero()[0, 0])
        raise ValueError(f"sel[{i}] is not strictly ascending (pads aside): {sel[i].tolist()}; the indexer returns "
                         "each row's positions ascending and distinct")


def check_sparse_inputs(q, kv, sel, cu_seqlens, *, scale, v_dim, cu_seqlens_kv=None, sinks=None) -> None:
    """The checks of ``sparse_attention``."""
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    check_same_device(q=q, kv=kv, sel=sel, cu_seqlens=cu_seqlens)
    _check_common(q, kv.shape[1], kv.dtype, sel, scale, v_dim)
    check_tensor("cu_seqlens", cu_seqlens, dtypes=_INT_DTYPES, ndim=1)
    _check_cu("cu_seqlens", cu_seqlens, q.shape[0], "q")
    if sinks is not None:
        check_tensor("sinks", sinks, dtypes=(torch.float32,), ndim=1)
        check_same_device(q=q, sinks=sinks)
        if sinks.shape[0] != q.shape[1]:
            raise ValueError(f"sinks has {sinks.shape[0]} entries for q's {q.shape[1]} heads")
    if cu_seqlens_kv is None:
        if kv.shape[0] != q.shape[0]:
            raise ValueError(f"kv has {kv.shape[0]} rows but q has {q.shape[0]} tokens (packed: one row per token; "
                             f"pass cu_seqlens_kv for another layout)")
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), torch.diff(cu_seqlens).long())
        _check_selection(sel, torch.arange(q.shape[0], device=q.device) - starts)
        return
    check_tensor("cu_seqlens_kv", cu_seqlens_kv, dtypes=_INT_DTYPES, ndim=1)
    check_same_device(q=q, cu_seqlens_kv=cu_seqlens_kv)
    if cu_seqlens_kv.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_kv has {cu_seqlens_kv.shape[0] - 1} sequences, cu_seqlens "
                         f"{cu_seqlens.shape[0] - 1}")
    _check_cu("cu_seqlens_kv", cu_seqlens_kv, kv.shape[0], "kv")
    # a row's entries index its sequence's kv rows; which of them it may see is the caller's layout
    last = torch.repeat_interleave(torch.diff(cu_seqlens_kv).long(), torch.diff(cu_seqlens).long()) - 1
    _check_selection(sel, last)


def check_paged_sparse_inputs(q, kv_cache, sel, seq_idx, positions, block_table, *, scale, v_dim) -> None:
    """The checks of ``paged_sparse_attention`` (a server may run them once per schedule, then call
    ``paged_sparse_attention_fwd``)."""
    check_tensor("kv_cache", kv_cache, dtypes=FLOAT_DTYPES)
    if kv_cache.dim() != 4 or kv_cache.shape[1] != PAGE_SIZE or kv_cache.shape[2] != 1:
        raise ValueError(f"kv_cache must be (pages, {PAGE_SIZE}, 1, Dqk) (one MQA row per position), "
                         f"got {tuple(kv_cache.shape)}")
    for name, t, nd in (("seq_idx", seq_idx, 1), ("positions", positions, 1), ("block_table", block_table, 2)):
        check_tensor(name, t, dtypes=_INT_DTYPES, ndim=nd)
    check_same_device(q=q, kv_cache=kv_cache, sel=sel, seq_idx=seq_idx, positions=positions, block_table=block_table)
    _check_common(q, kv_cache.shape[3], kv_cache.dtype, sel, scale, v_dim)
    n, (B, W), P = q.shape[0], block_table.shape, kv_cache.shape[0]
    for name, t in (("seq_idx", seq_idx), ("positions", positions)):
        if t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} entries but q has {n} rows")
    out = (seq_idx < 0) | (seq_idx >= B)
    if bool(out.any()):
        i = int(out.nonzero()[0, 0])
        raise ValueError(f"seq_idx[{i}] = {int(seq_idx[i])} is not a sequence of block_table ({B} rows)")
    out = (positions < 0) | (positions >= W * PAGE_SIZE)
    if bool(out.any()):
        i = int(out.nonzero()[0, 0])
        raise ValueError(f"positions[{i}] = {int(positions[i])} is past sequence {int(seq_idx[i])}'s block table "
                         f"({W} pages = {W * PAGE_SIZE} positions) or negative")
    _check_selection(sel, positions.long())
    ok = sel >= 0
    col = torch.where(ok, sel.long(), 0) // PAGE_SIZE
    page = block_table.long()[seq_idx.long()[:, None], col]
    out = ok & ((page < 0) | (page >= P))
    if bool(out.any()):
        i, e = (int(x) for x in out.nonzero()[0])
        b, j = int(seq_idx[i]), int(col[i, e])
        raise ValueError(f"block_table[{b}, {j}] = {int(block_table[b, j])} points past the cache ({P} pages), "
                         f"read by sel[{i}, {e}] = {int(sel[i, e])}")


# ---------------------------------------------------------------- public
def sparse_attention(
    q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, v_dim: int,
    cu_seqlens_kv: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sparse MLA attention over packed sequences, absorbed form (training / scoring).

    q:          (T, H, Dqk)   bf16 or fp32; q_abs = [q_nope @ W_UK | q_rope], any Dqk (GLM-5: 576)
    kv:         (T, Dqk)      same dtype; row t = [latent | k_rope] of token t, shared by every head
    sel:        (T, top_k)    int32/int64; positions relative to each row's sequence start, ascending, -1 = pad;
                              causal (row at position p selects from 0..p)
    cu_seqlens: (B + 1,)      int, 0 = cu[0] <= ... <= cu[B] = T
    scale:      softmax scale (no default: see the module docstring)
    v_dim:      Dv, the value = kv[:, :v_dim] (GLM-5: kv_lora_rank = 512)
    cu_seqlens_kv: (B + 1,) int or None: sequence b's kv rows are kv[cu_kv[b]:cu_kv[b + 1]], any number, and
                a row's entries index them (DeepSeek-V4: [compressed rows | token rows]); causality is then the
                caller's (entries are only checked to lie in the sequence's rows)
    sinks:      (H,) fp32 or None: a per-head logit that joins each row's softmax with no value (DeepSeek-V4)
    returns     (T, H, v_dim) in q.dtype; differentiable in q, kv and sinks
    """
    check_sparse_inputs(q, kv, sel, cu_seqlens, scale=scale, v_dim=v_dim, cu_seqlens_kv=cu_seqlens_kv, sinks=sinks)
    return SparseAttentionFunction.apply(q, kv, sel, cu_seqlens, float(scale), v_dim, cu_seqlens_kv, sinks)


def paged_sparse_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, sel: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor,
    block_table: torch.Tensor, *, scale: float, v_dim: int,
) -> torch.Tensor:
    """Sparse MLA attention of query rows against the paged cache (server prefill, chunked prefill, decode).

    q:           (n, H, Dqk)          the rows, any mix of sequences and positions
    kv_cache:    (P, 64, 1, Dqk)      the cached [latent | k_rope] rows, same dtype as q
    sel:         (n, top_k) int       as for ``sparse_attention``
    seq_idx:     (n,) int             the row's sequence: its row of block_table
    positions:   (n,) int             the row's position (checked: sel[i] <= positions[i])
    block_table: (B, W) int           page of each 64-position block of a sequence
    returns      (n, H, v_dim) in q.dtype (no autograd)
    """
    check_paged_sparse_inputs(q, kv_cache, sel, seq_idx, positions, block_table, scale=scale, v_dim=v_dim)
    return paged_sparse_attention_fwd(q, kv_cache, sel, seq_idx, block_table, scale=scale, v_dim=v_dim)[0]
