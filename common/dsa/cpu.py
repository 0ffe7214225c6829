"""The indexer's scores and selection, batch-invariant by construction, on any device.

Scores are built from element-wise IEEE operations only (``common/matmul/cpu.py``'s argument: an element-wise
``mul`` / ``add`` rounds each element on its own, whatever the shape), in one order:

    s[i, h, j] = fl32(fl32(Σ_d q[i, h, d] · k[j, d]) · scale)     d left to right, from 0
    r          = max(s, 0) + 0.0                                   ReLU; -0.0 becomes +0.0
    out[i, j]  = Σ_h fl32(w[i, h] · r[i, h, j])                    h left to right, from +0.0

so a row's scores depend only on its own q and w and on each key alone: the same bits in any batch, any row
order, and whether a decode step sees keys 0..p or a prefill sees the whole sequence.

The selection is a stable descending sort of each row's visible scores (keys 0..p): equal scores keep the
smaller position first, and -0.0 already became +0.0, so ties are decided by position alone.  The k kept are
returned ascending.  Exact 0.0 plateaus (every negative q · k) make ties the common case, not a corner.
"""
from __future__ import annotations

import torch

from ..rmsnorm.cpu import row_tree_sum


def index_scores_cpu(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """q (n, H, D), k (L, D) shared by the rows or (n, L, D) a row's own keys (the server's gather from
    its paged pool), any float dtype, w (n, H) fp32 -> (n, L) fp32 (the order above)."""
    n, H, D = q.shape
    L = k.shape[-2]
    q_DNH = q.float().permute(2, 0, 1).contiguous()  # (D, n, H): q_DNH[d] is component d of every head
    if k.dim() == 2:
        k_D = k.float().t().contiguous()[:, None, None, :]  # (D, 1, 1, L)
    else:
        k_D = k.float().permute(2, 0, 1).contiguous()[:, :, None, :]  # (D, n, 1, L)
    s = torch.zeros(n, H, L, dtype=torch.float32, device=q.device)
    tmp = torch.empty_like(s)
    for d in range(D):
        torch.mul(q_DNH[d][:, :, None], k_D[d], out=tmp)
        s.add_(tmp)
    s.mul_(scale).clamp_(min=0.0).add_(0.0)
    out = torch.zeros(n, L, dtype=torch.float32, device=q.device)
    term = torch.empty_like(out)
    wf = w.float()
    for h in range(H):
        torch.mul(wf[:, h, None], s[:, h], out=term)
        out.add_(term)
    return out


def index_topk_cpu(scores: torch.Tensor, positions: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores (n, L) fp32, positions (n,) int (row i sees keys 0..positions[i]) -> (n, top_k) int32 positions,
    ascending, -1 past the row's visible keys."""
    n, L = scores.shape
    j = torch.arange(L, device=scores.device)
    visible = j[None, :] <= positions[:, None]
    s = torch.where(visible, scores + 0.0, torch.full_like(scores, float("-inf")))
    order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :top_k]  # ties: smaller j first
    keep = torch.arange(order.shape[1], device=scores.device)[None, :] <= positions[:, None]
    chosen = torch.where(keep, order, torch.full_like(order, L)).sort(dim=1).values
    out = torch.full((n, top_k), -1, dtype=torch.int32, device=scores.device)
    out[:, : chosen.shape[1]] = torch.where(chosen == L, -1, chosen).to(torch.int32)
    return out


def gather_keys(k_cache: torch.Tensor, block_table: torch.Tensor, seq_idx: torch.Tensor) -> torch.Tensor:
    """Each row's keys from the paged pool, positions 0 .. W·64 - 1 of its sequence:
    k_cache (P, 64, 1, D), block_table (B, W), seq_idx (n,) -> (n, W·64, D).  A page past a sequence's
    end gathers whatever it holds; the selection masks every key past the row's position."""
    P, page, _, D = k_cache.shape
    pages = block_table[seq_idx.long()].long().clamp(min=0)  # (n, W); -1 entries read page 0, masked later
    slots = (pages[:, :, None] * page + torch.arange(page, device=pages.device)).reshape(pages.shape[0], -1)
    return k_cache.view(P * page, D)[slots]


def index_key_norm_cpu(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The indexer key's LayerNorm, (T, D) -> (T, D) in k's dtype, from element-wise fp32 ops and
    ``rmsnorm.cpu.row_tree_sum`` (a row's bits depend on the row alone):
    mean = tree(x) / D;  c = x - mean;  var = tree(c · c) / D;  y = c · rsqrt(var + eps) · w + b, rounded once."""
    x = k.float()
    D = x.shape[-1]
    c = x - (row_tree_sum(x) / D)[:, None]
    r = torch.rsqrt(row_tree_sum(c * c) / D + eps)[:, None]
    return (c * r * weight.float() + bias.float()).to(k.dtype)
