"""Float64 references for the routed experts: the math without any rounding."""
from __future__ import annotations

import torch


def experts_ref(x, ids, weights, w_gate_up, w_down, limit=None) -> torch.Tensor:
    """x: (T, H); ids, weights: (T, k); w_gate_up: (E, 2I, H); w_down: (E, H, I)
    -> (T, H) float64: Σ_j w_tj · W_down[e] (SiLU(g)·u), gu = W_gu[e] x_t.
    Differentiable (float64 autograd) for the gradient checks."""
    T, k = ids.shape
    I = w_down.shape[2]
    xd, w = x.double(), weights.double()
    out = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():  # one expert at a time: no (T, k, 2I, H) gather
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = xd[t] @ w_gate_up[e].double().T
        g, u = gu[:, :I], gu[:, I:]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = g * torch.sigmoid(g) * u
        out = out.index_add(0, t, (a @ w_down[e].double().T) * w[t, j, None])
    return out
