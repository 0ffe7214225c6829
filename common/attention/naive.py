"""Float64 reference for causal GQA attention over packed sequences
(differentiable with torch autograd; used for accuracy and gradient tests)."""
from __future__ import annotations

import math

import torch


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    window: int = 0,
    scale: float | None = None,
    return_lse: bool = False,
):
    """q (T, Hq, D), k/v (T, Hkv, D) -> o (T, Hq, D) float64 [, lse (T, Hq)].

    Row at position p of its sequence attends to positions max(0, p-W+1)..p
    (W = window; 0 = no window)."""
    T, hq, d = q.shape
    g = hq // k.shape[1]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    cu = cu_seqlens.tolist()
    for s0, s1 in zip(cu[:-1], cu[1:]):
        L = s1 - s0
        qs = q[s0:s1].double().transpose(0, 1)  # (Hq, L, D)
        ks = k[s0:s1].double().transpose(0, 1).repeat_interleave(g, 0)
        vs = v[s0:s1].double().transpose(0, 1).repeat_interleave(g, 0)
        s = qs @ ks.transpose(1, 2) * scale  # (Hq, L, L)
        i = torch.arange(L, device=q.device)
        vis = i[None, :] <= i[:, None]
        if window > 0:
            vis = vis & (i[None, :] > i[:, None] - window)
        s = s.masked_fill(~vis, float("-inf"))
        lse = torch.logsumexp(s, -1)  # (Hq, L)
        outs.append((torch.exp(s - lse[..., None]) @ vs).transpose(0, 1))
        lses.append(lse.t())
    o = torch.cat(outs) if outs else q.new_zeros(0, hq, d, dtype=torch.float64)
    if return_lse:
        return o, (torch.cat(lses) if lses else q.new_zeros(0, hq, dtype=torch.float64))
    return o
