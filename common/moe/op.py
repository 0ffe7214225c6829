"""Routed experts: the launcher both sides call, its autograd, and the combine.

``experts_fwd`` is the server's launcher and the trainer's forward (the same
bits): the Triton grouped kernels on CUDA (``kernel.py``), the element-wise
CPU path elsewhere (``cpu.py``); both keep the rounding points in ``cpu.py``'s
docstring, and neither lets a token's arithmetic depend on how many tokens its
experts got.  ``moe_experts`` is its differentiable form for the trainer: the
backward is the gradient of that forward (through the one bf16 rounding of the
SwiGLU output as the identity), w.r.t. the activations, the routing weights and
both expert weight stacks.  ``moe_combine`` adds the routed sum and the shared
expert(s) by the FP64 tree in logical order and rounds once.

Shapes: T tokens, H hidden, E experts, I expert width, k slots.
"""
from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..swiglu.cpu import clamp_gate_up, limit_in
from ..tree import tree_reduce
from .cpu import experts_fwd_cpu, swiglu_f32


def experts_fwd(x, ids, weights, w_gate_up, w_down, limit=None) -> torch.Tensor:
    """(T, H) fp32 routed sum (unrounded); no checks (``moe_experts`` checks)."""
    if x.is_cuda:
        from .kernel import experts_fwd_triton

        return experts_fwd_triton(x, ids, weights, w_gate_up, w_down, limit)
    return experts_fwd_cpu(x, ids, weights, w_gate_up, w_down, limit)


def _swiglu_bwd(gu: torch.Tensor, da: torch.Tensor, limit: float | None, dtype: torch.dtype) -> torch.Tensor:
    """d[gate | up] (R, 2I) fp32 of a = SiLU(g)·u at fp32 ``gu``, clamped where the
    forward clamps (``swiglu_f32``: at ``limit_in(dtype, limit)``, not at the raw limit)."""
    I = gu.shape[1] // 2
    g, u = gu[:, :I], gu[:, I:]
    pass_g = pass_u = None
    if limit is not None:
        lim = limit_in(dtype, limit)
        pass_g, pass_u = g <= lim, (u >= -lim) & (u <= lim)
        g, u = clamp_gate_up(g, u, lim)
    s = torch.sigmoid(g)
    dg = da * u * (s * (1 + g * (1 - s)))
    du = da * g * s
    if limit is not None:
        dg, du = dg * pass_g, du * pass_u
    return torch.cat([dg, du], dim=1)


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, limit):
        ctx.save_for_backward(x, ids, weights, w_gate_up, w_down)
        ctx.limit = limit
        return experts_fwd(x, ids, weights, w_gate_up, w_down, limit)

    @staticmethod
    def backward(ctx, dy):
        x, ids, weights, w_gate_up, w_down = ctx.saved_tensors
        T, k = ids.shape
        dy = dy.float()
        dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        dw = torch.zeros(T * k, dtype=torch.float32, device=x.device)
        dgu_w = torch.zeros(w_gate_up.shape, dtype=torch.float32, device=x.device)
        dd_w = torch.zeros(w_down.shape, dtype=torch.float32, device=x.device)
        flat, wflat = ids.reshape(-1), weights.reshape(-1).float()
        rows = torch.arange(T * k, device=x.device)
        for e in torch.unique(flat).tolist():  # the trainer's backward runs eager: a host read is fine
            sel = rows[flat == e]
            tok = sel // k
            xe = x[tok].float()
            wgu, wd = w_gate_up[e].float(), w_down[e].float()
            gu = xe @ wgu.T
            a = swiglu_f32(gu, ctx.limit, x.dtype).float()  # the forward's bf16 SwiGLU rows
            down = a @ wd.T  # (R, H)
            g = dy[tok]
            dw[sel] = (g * down).sum(1)
            d_down = g * wflat[sel, None]
            dd_w[e] += d_down.T @ a
            dgu = _swiglu_bwd(gu, d_down @ wd, ctx.limit, x.dtype)
            dgu_w[e] += dgu.T @ xe
            dx.index_add_(0, tok, dgu @ wgu)
        return (dx.to(x.dtype), None, dw.view(T, k).to(weights.dtype), dgu_w.to(w_gate_up.dtype),
                dd_w.to(w_down.dtype), None)


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, limit: float | None = None) -> torch.Tensor:
    """The routed experts' sum for each token, in fp32 (round it with the
    shared expert in ``moe_combine``).

    x: (T, H) bf16/fp32; ids: (T, k) int32/int64 in [0, E), the slots in the
    router's order; weights: (T, k) (the router's dtype, read as fp32);
    w_gate_up: (E, 2I, H) [gate | up] rows; w_down: (E, H, I); ``limit``:
    DeepSeek-V4's SwiGLU clamp -> (T, H) fp32.  Differentiable w.r.t. x,
    weights, w_gate_up and w_down."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64), ndim=2)
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3)
    check_tensor("w_down", w_down, dtypes=(x.dtype,), ndim=3)
    check_same_device(x=x, ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down)
    T, H = x.shape
    E, I2, H2 = w_gate_up.shape
    if H2 != H or I2 % 2 or tuple(w_down.shape) != (E, H, I2 // 2):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} "
                         f"(want (E, 2I, {H})), w_down {tuple(w_down.shape)} (want (E, {H}, I))")
    if ids.shape[0] != T or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be (T={T}, k)")
    if ids.numel() and bool(((ids < 0) | (ids >= E)).any()):
        raise ValueError(f"expert ids must be in [0, {E}); got min {int(ids.min())}, max {int(ids.max())}")
    return _Experts.apply(x, ids, weights, w_gate_up, w_down, limit)


def moe_combine(parts, dtype: torch.dtype) -> torch.Tensor:
    """Sum the contributions (routed sum, shared expert, ...), each (T, H), in
    the given logical order by the FP64 pairwise tree, rounded once to dtype."""
    return tree_reduce(list(parts), dtype)
