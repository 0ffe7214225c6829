"""Float64 references for the routed experts: the math without any rounding."""
from __future__ import annotations

import torch


def experts_ref(x, ids, weights, w_gate_up, w_down, limit=None, lora=None) -> torch.Tensor:
    """x: (T, H); ids, weights: (T, k); w_gate_up: (E, 2I, H); w_down: (E, H, I)
    -> (T, H) float64: Σ_j w_tj · W_down[e] (SiLU(g)·u), gu = W_gu[e] x_t; with ``lora``
    (an ``ExpertLoRA``) gu += s·B_gu A_gu x_t and the down product += s·B_d A_d a.
    Differentiable (float64 autograd) for the gradient checks."""
    T, k = ids.shape
    I = w_down.shape[2]
    xd, w = x.double(), weights.double()
    out = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():  # one expert at a time: no (T, k, 2I, H) gather
        t, j = (ids == e).nonzero(as_tuple=True)
        gu = xd[t] @ w_gate_up[e].double().T
        if lora is not None:
            a1, b1, a2, b2 = (m[e].double() for m in lora.tensors())
            gu = gu + lora.s * (xd[t] @ a1.T @ b1.T)
        g, u = gu[:, :I], gu[:, I:]
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = g * torch.sigmoid(g) * u
        down = a @ w_down[e].double().T
        if lora is not None:
            down = down + lora.s * (a @ a2.T @ b2.T)
        out = out.index_add(0, t, down * w[t, j, None])
    return out


def experts_fp8_ref(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit=None) -> torch.Tensor:
    """The FP8 experts' math in float64 at the FP8 path's own quantization points: x and the
    bf16-rounded SwiGLU output quantized per token in 1x128 groups (``quantize_act``, exact
    codes), the weights dequantized exactly; no other rounding.  -> (T, H) float64."""
    from ..fp8.quant import BLOCK, cdiv, quantize_act

    T = ids.shape[0]
    I = d_codes.shape[2]
    nbi = cdiv(I, BLOCK)

    def deq(codes, scale):  # (N, K) codes, (NB, KB) scales -> float64, exact
        return codes.double() * scale.double().repeat_interleave(BLOCK, 0)[:codes.shape[0]].repeat_interleave(
            BLOCK, 1)[:, :codes.shape[1]]

    def act(v):  # quantize per row, dequantize exactly
        q, s = quantize_act(v)
        return q.double() * s.double().repeat_interleave(BLOCK, 1)[:, :v.shape[1]]

    xd, w = act(x), weights.double()
    out = torch.zeros(T, x.shape[1], dtype=torch.float64, device=x.device)
    for e in torch.unique(ids).tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        g = xd[t] @ deq(gu_codes[e, :I], gu_scale[e, :nbi]).T
        u = xd[t] @ deq(gu_codes[e, I:], gu_scale[e, nbi:]).T
        if limit is not None:
            g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
        a = act((g * torch.sigmoid(g) * u).to(x.dtype))
        out = out.index_add(0, t, (a @ deq(d_codes[e], d_scale[e]).T) * w[t, j, None])
    return out
