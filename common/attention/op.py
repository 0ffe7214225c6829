"""Exact causal GQA attention: launchers, autograd, public functions.

The trainer calls ``attention`` (packed sequences, differentiable); the server
calls ``paged_attention_fwd`` (prefill, chunked prefill and decode against the
paged KV cache) after ``kv_cache.write_kv_fwd``.  Both reach the same per-row
recurrence (see ``cpu.py`` / ``kernel.py`` docstrings), so a row has the same
bits on every path.  ``*_fwd``/``*_bwd`` launchers do no checks (CUDA-graph
safe); the public functions validate first.

The order, in one line: a row's visible KV positions are cut into fixed
segments of ``SEGMENT = 1024`` absolute positions; each segment is an online
softmax over its 64-position blocks in increasing order from the fresh state;
the segments' states are merged in increasing order by one element-wise merge;
out = acc / l.  A row shorter than 1024 positions is one segment: the order it
had before segments existed.  The packed and multi-query paged paths merge
inside one program; decode (``max_seqlen_q == 1`` on CUDA) runs one program per
segment and merges in a second kernel, with the same arithmetic.

Launch knobs that never change bits: ``row_chunk`` (CPU), ``num_stages`` and
``mask_all`` (CUDA).  ``block_m``/``num_warps`` (CUDA) are fixed per head_dim by
``kernel.fwd_config`` (prefill) and ``kernel.decode_config`` (decode): keep
them giving the same bits on every path that must agree.
"""
from __future__ import annotations

import math

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..kv_cache.op import PAGE_SIZE

MAX_HEAD_DIM = 256
SEGMENT = 1024  # KV positions per merge segment: part of the reduction order, the same on every path
_INT_DTYPES = (torch.int32, torch.int64)


def _scale(scale: float | None, d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0


def _i32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.int32 else t.to(torch.int32)


# ---------------------------------------------------------------- launchers
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int | None = None,
    window: int = 0,
    scale: float | None = None,
    row_chunk: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    mask_all: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed varlen forward -> (o (T, Hq, D) in q.dtype, lse (T, Hq) fp32)."""
    scale = _scale(scale, q.shape[-1])
    if q.is_cuda:
        from .kernel import attention_fwd_triton

        max_seqlen = _max_len(cu_seqlens) if max_seqlen is None else max_seqlen
        return attention_fwd_triton(q, k, v, _i32(cu_seqlens), max_seqlen, window, scale,
                                  block_m=block_m, num_warps=num_warps, num_stages=num_stages, mask_all=mask_all)
    from .cpu import attention_fwd_cpu

    return attention_fwd_cpu(q, k, v, cu_seqlens, window, scale, row_chunk=row_chunk)


def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the packed forward; deterministic run to run."""
    scale = _scale(scale, q.shape[-1])
    do = do.to(o.dtype).contiguous()
    if q.is_cuda:
        from .kernel import attention_bwd_triton

        max_seqlen = _max_len(cu_seqlens) if max_seqlen is None else max_seqlen
        return attention_bwd_triton(q, k, v, o, lse, do, _i32(cu_seqlens), max_seqlen, window, scale)
    from .cpu import attention_bwd_cpu

    return attention_bwd_cpu(q, k, v, o, lse, do, cu_seqlens, window, scale)


def paged_attention_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    window: int = 0,
    scale: float | None = None,
    row_chunk: int | None = None,
    block_m: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    mask_all: bool = False,
    seg_programs: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged forward -> (o (T, Hq, D), lse (T, Hq) fp32).  Pass
    ``max_seqlen_q`` (1 for decode) to avoid a device sync.

    On CUDA, ``max_seqlen_q == 1`` runs the split decode (``seg_programs``
    programs per sequence and chunk of a kv head's query heads, each walking
    every ``seg_programs``-th of the row's 1024-position segments, then an
    in-order merge of the rows that have more than one); its grid is sized
    from ``block_table.shape[1]`` and the batch, never from ``seq_lens``, so a
    captured CUDA graph replays correctly while sequences grow (keep the
    table's width fixed across replays, as the engine's static batch does).
    ``seg_programs`` (default: ``kernel.decode_seg_programs``) moves work
    between programs, never bits.  Longer queries run the tile kernel, which
    merges the same segments in-register."""
    if seg_programs is not None and (type(seg_programs) is not int or seg_programs < 1):
        raise ValueError(f"seg_programs must be an int >= 1 (or None: the default), got {seg_programs!r}")
    scale = _scale(scale, q.shape[-1])
    if q.is_cuda:
        from .kernel import paged_attention_fwd_triton

        max_seqlen_q = _max_len(cu_seqlens_q) if max_seqlen_q is None else max_seqlen_q
        return paged_attention_fwd_triton(
            q, k_cache, v_cache, _i32(cu_seqlens_q), _i32(seq_lens), _i32(block_table), max_seqlen_q, window, scale,
            block_m=block_m, num_warps=num_warps, num_stages=num_stages, mask_all=mask_all, seg_programs=seg_programs,
        )
    from .cpu import paged_attention_fwd_cpu

    return paged_attention_fwd_cpu(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, window, scale, row_chunk=row_chunk)


class AttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, window, scale):
        o, lse = attention_fwd(q, k, v, cu_seqlens, max_seqlen=max_seqlen, window=window, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
        ctx.max_seqlen, ctx.window, ctx.scale = max_seqlen, window, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
        dq, dk, dv = attention_bwd(q, k, v, o, lse, do, cu_seqlens,
                                   max_seqlen=ctx.max_seqlen, window=ctx.window, scale=ctx.scale)
        return dq, dk, dv, None, None, None, None


# ---------------------------------------------------------------- checks
def _check_options(window: int, scale: float | None) -> None:
    if not isinstance(window, int) or isinstance(window, bool) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = no sliding window), got {window!r}")
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a finite positive float, got {scale!r}")


def _check_heads(q: torch.Tensor, hkv: int, d_kv: int, kv_name: str) -> None:
    hq, d = q.shape[1], q.shape[2]
    if d != d_kv:
        raise ValueError(f"q has head_dim {d} but {kv_name} has {d_kv}")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim {d} is not supported (1..{MAX_HEAD_DIM})")
    if hkv < 1 or hq % hkv:
        raise ValueError(f"num query heads {hq} is not a multiple of num kv heads {hkv} (GQA needs Hq % Hkv == 0)")


def _check_cu(name: str, cu: torch.Tensor, total: int, total_name: str) -> list[int]:
    check_tensor(name, cu, dtypes=_INT_DTYPES, ndim=1)
    if cu.shape[0] < 2:
        raise ValueError(f"{name} needs at least 2 entries (B + 1), got {cu.shape[0]}")
    c = cu.tolist()
    if c[0] != 0:
        raise ValueError(f"{name} must start at 0, got {c[0]}")
    bad = [i for i in range(len(c) - 1) if c[i + 1] < c[i]]
    if bad:
        i = bad[0]
        raise ValueError(f"{name} must be non-decreasing: {name}[{i + 1}] = {c[i + 1]} < {name}[{i}] = {c[i]}")
    if c[-1] != total:
        raise ValueError(f"{name} ends at {c[-1]} but {total_name} has {total} tokens")
    return c


def _check_max(name: str, given: int | None, cu: list[int]) -> None:
    true = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if given is not None and given < true:
        raise ValueError(f"{name} = {given} is smaller than the longest sequence ({true})")


# ---------------------------------------------------------------- public
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    max_seqlen: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention over packed sequences (training / server prefill).

    q:          (T, Hq, D)   bf16 or fp32, D <= 256
    k, v:       (T, Hkv, D)  same dtype, Hq % Hkv == 0
    cu_seqlens: (B + 1,)     int32/int64, 0 = cu[0] <= cu[1] <= ... <= cu[B] = T
    window:     0, or W: a query at position p sees positions p-W+1 .. p
    scale:      softmax scale, default 1/sqrt(D)
    returns     (T, Hq, D) in q.dtype; differentiable in q, k, v
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=3)
    check_same_device(q=q, k=k, v=v, cu_seqlens=cu_seqlens)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, k has {tuple(k.shape)}; they must match")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k has {k.shape[0]} tokens but q has {q.shape[0]}")
    _check_heads(q, k.shape[1], k.shape[2], "k")
    _check_options(window, scale)
    cu = _check_cu("cu_seqlens", cu_seqlens, q.shape[0], "q")
    _check_max("max_seqlen", max_seqlen, cu)
    return AttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, window, scale)


def check_paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> None:
    """The checks of ``paged_attention`` (a server may run them once per
    schedule and then call ``paged_attention_fwd``)."""
    check_tensor("q", q, dtypes=FLOAT_DTYPES, ndim=3)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("seq_lens", seq_lens, dtypes=_INT_DTYPES, ndim=1)
    check_tensor("block_table", block_table, dtypes=_INT_DTYPES, ndim=2)
    check_same_device(q=q, k_cache=k_cache, v_cache=v_cache, cu_seqlens_q=cu_seqlens_q, seq_lens=seq_lens,
                      block_table=block_table)
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"the cache dtype ({k_cache.dtype}, {v_cache.dtype}) must match q ({q.dtype})")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache has {tuple(k_cache.shape)}; they must match")
    if k_cache.shape[1] != PAGE_SIZE:
        raise ValueError(f"k_cache pages hold {k_cache.shape[1]} tokens; expected PAGE_SIZE = {PAGE_SIZE}")
    _check_heads(q, k_cache.shape[2], k_cache.shape[3], "k_cache")
    _check_options(window, scale)
    cu = _check_cu("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q")
    _check_max("max_seqlen_q", max_seqlen_q, cu)
    B = len(cu) - 1
    if seq_lens.shape[0] != B or block_table.shape[0] != B:
        raise ValueError(f"cu_seqlens_q describes {B} sequences but seq_lens has {seq_lens.shape[0]} "
                         f"and block_table {block_table.shape[0]} rows")
    lens, table = seq_lens.tolist(), block_table.tolist()
    n_pages, width = k_cache.shape[0], block_table.shape[1]
    for b in range(B):
        q_len, n = cu[b + 1] - cu[b], lens[b]
        if n < q_len:
            raise ValueError(f"seq_lens[{b}] = {n} is shorter than its {q_len} new queries "
                             "(seq_lens counts cached + new tokens, written to the cache first)")
        if n > width * PAGE_SIZE:
            raise ValueError(f"sequence {b}: position {n - 1} is past the cache: its block table has {width} "
                             f"pages = {width * PAGE_SIZE} positions")
        if q_len == 0:
            continue
        first = n - q_len
        j0 = max(first - window + 1, 0) // PAGE_SIZE if window > 0 else 0
        for j in range(j0, -(-n // PAGE_SIZE)):
            if not 0 <= table[b][j] < n_pages:
                raise ValueError(f"block_table[{b}, {j}] = {table[b][j]} points past the cache "
                                 f"({n_pages} pages; valid pages are 0..{n_pages - 1})")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    max_seqlen_q: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal GQA attention of new queries against the paged KV cache
    (server prefill, chunked prefill, decode).  Write the new tokens' k/v with
    ``kv_cache.write_kv`` first.

    q:            (T, Hq, D)               new queries of B sequences, packed
    k/v_cache:    (P, 64, Hkv, D)          same dtype as q
    cu_seqlens_q: (B + 1,) int             query offsets (decode: arange(B + 1))
    seq_lens:     (B,) int                 cached + new tokens per sequence;
                                           query i of b is at position seq_lens[b] - q_len_b + i
    block_table:  (B, W) int               page of each 64-position block
    returns       (T, Hq, D) in q.dtype (no autograd)
    """
    check_paged_inputs(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                       max_seqlen_q=max_seqlen_q, window=window, scale=scale)
    return paged_attention_fwd(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                               max_seqlen_q=max_seqlen_q, window=window, scale=scale)[0]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """One query per sequence: q (B, Hq, D) at position seq_lens[b] - 1."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention(q, k_cache, v_cache, cu, seq_lens, block_table, max_seqlen_q=1, window=window, scale=scale)
