"""Public functions of the DSA indexer: input checks, then the element-wise path (``cpu.py``) on any device.

The indexer takes no gradient (transformers runs it under ``no_grad``): both functions run without autograd.
On CUDA the server's paged scores run one Triton kernel in that order (``kernel.py``); the trainer's packed
scores and the selection run the same element-wise ops on any device.
"""
from __future__ import annotations

import torch

from .._validate import check_tensor
from .cpu import gather_keys, index_key_norm_cpu, index_scores_cpu, index_topk_cpu

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)
ROW_CHUNK = 256  # query rows scored at once: bounds the (rows, H, L) fp32 buffer, never changes a bit


@torch.no_grad()
def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """Indexer scores Σ_h w[i, h] · ReLU(scale · q[i, h] · k[j]) in one fixed order (``cpu.py``).

    q: (n, H, D) the queries' heads after RoPE; k: (L, D) the keys of positions 0..L-1; w: (n, H) fp32 head
    weights (the model's ``weights_proj`` output times H**-0.5) -> (n, L) fp32, every key (mask with
    ``index_topk``'s positions)."""
    check_tensor("q", q, dtypes=_FLOATS, ndim=3)
    check_tensor("k", k, dtypes=_FLOATS, ndim=2)
    check_tensor("w", w, dtypes=(torch.float32,), ndim=2)
    n, H, D = q.shape
    if k.shape[1] != D:
        raise ValueError(f"k has head dim {k.shape[1]}, q has {D}")
    if tuple(w.shape) != (n, H):
        raise ValueError(f"w has shape {tuple(w.shape)}; expected (n, H) = {(n, H)}")
    return index_scores_cpu(q, k, w, float(scale))


@torch.no_grad()
def index_topk(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """Each row's ``top_k`` highest scores among keys 0..positions[i]: ties to the smaller position, returned
    ascending, -1 where a row sees fewer keys.  scores (n, L) fp32, positions (n,) int -> (n, top_k) int32."""
    check_tensor("scores", scores, dtypes=(torch.float32,), ndim=2)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k must be a positive int, got {top_k!r}")
    if positions.shape != (scores.shape[0],) or positions.dtype.is_floating_point:
        raise ValueError(f"positions must be ({scores.shape[0]},) ints, got {positions.dtype} {tuple(positions.shape)}")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= scores.shape[1]):
        raise ValueError(f"positions must lie in [0, {scores.shape[1]}) (the scored keys), got "
                         f"{int(positions.min())}..{int(positions.max())}")
    if torch.isnan(scores).any():
        raise ValueError("scores hold NaN: the indexer's inputs were not finite")
    return index_topk_cpu(scores, positions.to(scores.device).long(), top_k)


# ---------------------------------------------------------------- the model's calls
@torch.no_grad()
def index_key_norm(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The indexer key's LayerNorm with bias (transformers' ``k_norm``, eps 1e-6), one order (``cpu.py``):
    k (T, D) -> (T, D) in k's dtype.  Trainer and server both call it; no checks (a model's own call)."""
    return index_key_norm_cpu(k, weight, bias, float(eps))


@torch.no_grad()
def index_select(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, cu_seqlens: torch.Tensor,
                 positions: torch.Tensor, *, scale: float, top_k: int) -> torch.Tensor:
    """The trainer's selection over packed sequences: row t of sequence b scores the keys of b
    (``index_scores``) and keeps its ``top_k`` among positions 0..positions[t] (``index_topk``).
    q (T, H, D), k (T, D), w (T, H) fp32, cu_seqlens (B + 1,), positions (T,) from 0 in each sequence
    -> (T, top_k) int32 positions relative to the sequence start, ascending, -1 pads."""
    out = torch.empty(q.shape[0], top_k, dtype=torch.int32, device=q.device)
    cu = cu_seqlens.tolist()
    for s, e in zip(cu[:-1], cu[1:]):
        for a in range(s, e, ROW_CHUNK):
            b = min(a + ROW_CHUNK, e)
            scores = index_scores_cpu(q[a:b], k[s:e], w[a:b], float(scale))
            out[a:b] = index_topk_cpu(scores, positions[a:b].long(), top_k)
    return out


@torch.no_grad()
def paged_index_select_fwd(q: torch.Tensor, k_cache: torch.Tensor, w: torch.Tensor, seq_idx: torch.Tensor,
                           block_table: torch.Tensor, positions: torch.Tensor, *, scale: float,
                           top_k: int) -> torch.Tensor:
    """The server's selection: each row scores its sequence's keys in the paged pool (``gather_keys``:
    k_cache (P, 64, 1, D), block_table (B, W), seq_idx (n,)) and keeps its ``top_k`` among
    0..positions[i] -> (n, top_k) int32, the bits ``index_select`` gives the same row (a key's score
    depends on that key alone; the masked keys past the row never enter the selection).  No checks and
    no host reads: decode steps run it inside a CUDA graph."""
    n = q.shape[0]
    out = torch.empty(n, top_k, dtype=torch.int32, device=q.device)
    for a in range(0, n, ROW_CHUNK):
        b = min(a + ROW_CHUNK, n)
        if q.is_cuda:  # the same element order in one kernel (kernel.py), no (rows, H, L) buffer
            from .kernel import paged_index_scores_triton

            scores = paged_index_scores_triton(q[a:b], k_cache, w[a:b], seq_idx[a:b], block_table, scale)
        else:
            scores = index_scores_cpu(q[a:b], gather_keys(k_cache, block_table, seq_idx[a:b]), w[a:b], float(scale))
        out[a:b] = index_topk_cpu(scores, positions[a:b].long(), top_k)
    return out
