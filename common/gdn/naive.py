"""Float64 references (differentiable): the gated delta rule token by token
(transformers' ``torch_recurrent_gated_delta_rule``), the causal depthwise
conv1d + SiLU and the L2 norm, with no intermediate rounding."""
from __future__ import annotations

import torch


def gdn_ref(q, k, v, g, beta, cu_seqlens, initial_state=None):
    """q, k (T, Hk, K) (q already L2-normalized and scaled), v (T, Hv, V),
    g, beta (T, Hv); cu_seqlens (B + 1,); initial_state (B, Hv, K, V) or None
    -> (o (T, Hv, V), final states (B, Hv, K, V)), float64.

    Per token: S = S * exp(g); delta = (v - S^T k) * beta; S = S + k delta^T;
    o = S^T q.  All sequences step together, each masked past its end."""
    cu = [int(c) for c in cu_seqlens]
    B = len(cu) - 1
    T, Hk, K = k.shape
    Hv, V = v.shape[1:]
    rep = Hv // Hk
    q, k = q.double().repeat_interleave(rep, 1), k.double().repeat_interleave(rep, 1)
    v, g, beta = v.double(), g.double(), beta.double()
    lens = [cu[b + 1] - cu[b] for b in range(B)]
    Lmax = max(lens, default=0)
    idx = torch.full((B, Lmax), T, dtype=torch.long)
    for b in range(B):
        idx[b, : lens[b]] = torch.arange(cu[b], cu[b + 1])

    def pad(x):
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])[idx]  # (B, Lmax, ...)

    qp, kp, vp, gp, bp = (pad(x) for x in (q, k, v, g, beta))
    S = q.new_zeros(B, Hv, K, V) if initial_state is None else initial_state.double()
    live = torch.arange(Lmax)[None, :] < torch.tensor(lens)[:, None]
    outs = []
    for t in range(Lmax):
        kt, qt = kp[:, t], qp[:, t]
        Sd = S * torch.exp(gp[:, t])[..., None, None]
        delta = (vp[:, t] - (Sd * kt[..., None]).sum(-2)) * bp[:, t, :, None]
        Sn = Sd + kt[..., None] * delta[..., None, :]
        outs.append((Sn * qt[..., None]).sum(-2))
        S = torch.where(live[:, t, None, None, None], Sn, S)
    o = torch.stack(outs, 1) if outs else q.new_zeros(B, 0, Hv, V)
    flat = o.reshape(B * Lmax, Hv, V)
    take = [torch.arange(b * Lmax, b * Lmax + lens[b]) for b in range(B)]
    take = torch.cat(take) if take else torch.zeros(0, dtype=torch.long)
    return flat[take], S


def conv1d_ref(x, weight, cu_seqlens, tail=None):
    """x (T, C), weight (C, 4), tail (B, 3, C) or None (zeros) -> float64
    SiLU(sum_d w[:, d] * x[t - 3 + d]) per sequence."""
    cu = [int(c) for c in cu_seqlens]
    x, w = x.double(), weight.double()
    outs = []
    for b in range(len(cu) - 1):
        pre = x.new_zeros(3, x.shape[1]) if tail is None else tail[b].double()
        xs = torch.cat([pre, x[cu[b] : cu[b + 1]]])
        n = cu[b + 1] - cu[b]
        z = sum(w[:, d] * xs[d : d + n] for d in range(4))
        outs.append(z * torch.sigmoid(z))
    return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


def l2norm_ref(x, eps=1e-6):
    x = x.double()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
