"""CPU routed experts, batch-invariant by construction.

Each (token, slot) pair is computed alone: its expert's rows of the gate/up and
down weights meet its own activation row through ``fixed_order_dot``, whose
K-sum is element-wise left to right (``common/matmul/cpu.py``), so a row's bits
cannot depend on how many other rows its expert got or which tokens share the
batch.  Rows are grouped by expert only to call that dot once per expert.

Rounding points (the contract the Triton path keeps too):

    gu  = fp32 dot(x_t, W_gu[e])             (2I,) kept in fp32, no rounding
    g, u = gu[:I], gu[I:]   (clamped at bf16(limit) when a limit is given)
    a   = bf16(g / (1 + exp(-g)) * u)        SwiGLU in fp32, one rounding
    c_j = fp32 dot(a, W_down[e]) * w_tj      the routing weight inside fp32
    y_t = bf16(((c_0 + c_1) + c_2) + ...)    slots in slot order, one rounding

Shapes: T tokens, H hidden, E experts, I expert width, k slots.
"""
from __future__ import annotations

import torch

from ..matmul.cpu import fixed_order_dot
from ..swiglu.cpu import clamp_gate_up, limit_in, silu
from .router import slot_sum  # (T, k, H) fp32 contributions -> (T, H), added in slot order


def swiglu_f32(gu: torch.Tensor, limit: float | None, dtype: torch.dtype) -> torch.Tensor:
    """(R, 2I) fp32 [gate | up] -> (R, I) in ``dtype``: clamp at ``limit_in(dtype, limit)``
    (DeepSeek-V4), SiLU(g)·u in fp32, one rounding."""
    I = gu.shape[1] // 2
    g, u = clamp_gate_up(gu[:, :I], gu[:, I:], None if limit is None else limit_in(dtype, limit))
    return (silu(g) * u).to(dtype)


def experts_fwd_cpu(x, ids, weights, w_gate_up, w_down, limit=None, keep: bool = False):
    """x: (T, H); ids: (T, k) int; weights: (T, k) (any float dtype: read as
    fp32); w_gate_up: (E, 2I, H); w_down: (E, H, I) -> (T, H) fp32 routed sum
    (unrounded: the caller rounds it, alone or with a shared expert).

    ``keep``: also return (a (T, k, I), c (T, k, H) fp32) for the backward."""
    T, k = ids.shape
    H, I = x.shape[1], w_down.shape[2]
    flat = ids.reshape(-1)
    a = torch.empty(T * k, I, dtype=x.dtype)
    c = torch.empty(T * k, H, dtype=torch.float32)
    w = weights.reshape(-1).float()
    rows = torch.arange(T * k)
    for e in torch.unique(flat).tolist():  # CPU path: host loops are fine here
        sel = rows[flat == e]
        xe = x[sel // k]
        ae = swiglu_f32(fixed_order_dot(xe, w_gate_up[e]), limit, x.dtype)
        a[sel] = ae
        c[sel] = fixed_order_dot(ae, w_down[e]) * w[sel, None]
    y = slot_sum(c.view(T, k, H))
    return (y, a.view(T, k, I), c.view(T, k, H)) if keep else y
