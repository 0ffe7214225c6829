"""Float64 reference for sparse MLA attention in the absorbed form (differentiable with torch autograd; used for
accuracy and gradient tests)."""
from __future__ import annotations

import torch


def sparse_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, v_dim: int,
    return_lse: bool = False,
):
    """q (T, H, Dqk), kv (T, Dqk), sel (T, top_k) (positions relative to the row's sequence start, -1 = pad) ->
    o (T, H, v_dim) float64 [, lse (T, H)]: softmax(scale * q . kv[sel]) @ kv[sel, :v_dim] over the selected
    positions; a row with none gives o = 0, lse = -inf."""
    cu = cu_seqlens.long()
    starts = torch.repeat_interleave(cu[:-1], torch.diff(cu))
    ok = sel >= 0
    rows = kv.double()[torch.where(ok, starts[:, None] + sel.long(), 0)]  # (T, K, Dqk)
    s = torch.einsum("thd,tkd->thk", q.double(), rows) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)  # (T, H)
    p = torch.where(ok[:, None, :], torch.exp(s - lse[..., None]), 0.0)
    o = torch.einsum("thk,tkd->thd", p, rows[..., :v_dim])
    return (o, lse) if return_lse else o
