"""float64 references for the indexer's scores and the selection rule (tests and accuracy checks)."""
from __future__ import annotations

import torch


def index_scores_ref(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, D), k (L, D), w (n, H) -> (n, L) float64: Σ_h w[i, h] · max(scale · q[i, h] · k[j], 0)."""
    s = torch.einsum("nhd,ld->nhl", q.double(), k.double()) * scale
    return (w.double()[:, :, None] * s.clamp(min=0)).sum(1)


def index_topk_ref(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """The rule, row by row in Python: among keys 0..positions[i], the top_k highest scores, equal scores to the
    smaller position (-0.0 equals +0.0), returned ascending and padded with -1 -> (n, top_k) int32."""
    out = torch.full((scores.shape[0], top_k), -1, dtype=torch.int32)
    for i, p in enumerate(positions.tolist()):
        row = scores[i, : p + 1].tolist()
        best = sorted(range(p + 1), key=lambda j: (-row[j], j))[:top_k]
        out[i, : len(best)] = torch.tensor(sorted(best), dtype=torch.int32)
    return out
