"""Float64 references for the routed experts: the math without any rounding."""
from __future__ import annotations

import torch


def experts_ref(x, ids, weights, w_gate_up, w_down, limit=None) -> torch.Tensor:
    """x: (T, H); ids, weights: (T, k); w_gate_up: (E, 2I, H); w_down: (E, H, I)
    -> (T, H) float64: Σ_j w_tj · W_down[e] (SiLU(g)·u), gu = W_gu[e] x_t.
    Differentiable (float64 autograd) for the gradient checks."""
    T, k = ids.shape
    I = w_down.shape[2]
    xd, wgu, wd, w = x.double(), w_gate_up.double(), w_down.double(), weights.double()
    gu = torch.einsum("tjnh,th->tjn", wgu[ids], xd)  # (T, k, 2I)
    g, u = gu[..., :I], gu[..., I:]
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    a = g * torch.sigmoid(g) * u  # (T, k, I)
    down = torch.einsum("tjhi,tji->tjh", wd[ids], a)
    return (down * w[..., None]).sum(1)
