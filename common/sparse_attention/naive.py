"""Float64 reference for sparse MLA attention in the absorbed form (differentiable with torch autograd; used for
accuracy and gradient tests)."""
from __future__ import annotations

import torch


def sparse_attention_ref(
    q: torch.Tensor, kv: torch.Tensor, sel: torch.Tensor, cu_seqlens: torch.Tensor, *, scale: float, v_dim: int,
    return_lse: bool = False, cu_seqlens_kv: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
):
    """q (T, H, Dqk), kv (T, Dqk) (or ``cu_seqlens_kv``'s rows), sel (T, top_k) (rows relative to the row's
    sequence start in kv, -1 = pad) -> o (T, H, v_dim) float64 [, lse (T, H)]: softmax(scale * q . kv[sel]
    [, sink]) @ kv[sel, :v_dim] over the selected rows (and the head's sink logit, which has no value); a row
    with none gives o = 0, lse = -inf (the sink, with one)."""
    cu = cu_seqlens.long()
    kv_cu = cu if cu_seqlens_kv is None else cu_seqlens_kv.long()
    starts = torch.repeat_interleave(kv_cu[:-1], torch.diff(cu))
    ok = sel >= 0
    rows = kv.double()[torch.where(ok, starts[:, None] + sel.long(), 0)]  # (T, K, Dqk)
    s = torch.einsum("thd,tkd->thk", q.double(), rows) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    full = s if sinks is None else torch.cat([s, sinks.double()[None, :, None].expand(s.shape[0], -1, 1)], -1)
    lse = torch.logsumexp(full, -1)  # (T, H)
    p = torch.where(ok[:, None, :], torch.exp(s - lse[..., None]), 0.0)
    o = torch.einsum("thk,tkd->thd", p, rows[..., :v_dim])
    return (o, lse) if return_lse else o
