"""Public functions of the DSA indexer: input checks, then the element-wise path (``cpu.py``) on any device.

The indexer takes no gradient (transformers runs it under ``no_grad``): both functions run without autograd.
A Triton kernel with the same order is to come; until then a CUDA tensor runs the same element-wise ops.
"""
from __future__ import annotations

import torch

from .._validate import check_tensor
from .cpu import index_scores_cpu, index_topk_cpu

_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


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
