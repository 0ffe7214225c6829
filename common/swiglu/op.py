"""SwiGLU: launchers, autograd Functions and the public functions.

The server calls ``swiglu_fwd`` directly; the trainer calls ``swiglu`` /
``swiglu_gate_up``, which run the same launcher.  Rounding points: ``cpu.py``
and ``kernel.py`` docstrings (FP32 SiLU(gate) * up, one rounding).
"""
from __future__ import annotations

import math
import numbers

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from .cpu import limit_in, swiglu_bwd_cpu, swiglu_fwd_cpu


def _rows(t: torch.Tensor) -> torch.Tensor:
    """(*, I) with unit last stride -> (M, I) view (rows may be strided)."""
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


def swiglu_fwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None = None,
    *,
    block_rows: int | None = None,
    block_cols: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """y = dtype(SiLU(g) * u) in fp32, no validation (the server's hot path).

    gate, up: (*, I), unit stride along I (they may be the two halves of a
    packed (*, 2I) tensor) -> y: (*, I) contiguous.  ``limit``: DeepSeek-V4's
    swiglu_limit (gate <= L, -L <= up <= L).  ``block_rows``, ``block_cols``,
    ``num_warps`` are launch knobs that never change bits (CPU: row chunk only).
    """
    shape = gate.shape
    g2, u2 = _rows(gate), _rows(up)
    if gate.is_cuda:
        from .kernel import swiglu_fwd_triton

        lim = None if limit is None else limit_in(gate.dtype, limit)
        y = swiglu_fwd_triton(g2, u2, lim, block_rows, block_cols, num_warps)
    else:
        y = swiglu_fwd_cpu(g2, u2, limit, block_rows)
    return y.view(shape)


def swiglu_bwd(
    dy: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate, dup), each (*, I).  ``out``: preallocated (dgate, dup) with unit
    stride along I (e.g. the halves of a packed (*, 2I) gradient)."""
    dy = dy.contiguous()
    if out is None:
        out = (torch.empty(gate.shape, dtype=gate.dtype, device=gate.device), torch.empty(up.shape, dtype=up.dtype, device=up.device))
    dgate, dup = out
    if gate.is_cuda:
        from .kernel import swiglu_bwd_triton

        lim = None if limit is None else limit_in(gate.dtype, limit)
        swiglu_bwd_triton(_rows(dy), _rows(gate), _rows(up), lim, _rows(dgate), _rows(dup))
    else:
        dg, du = swiglu_bwd_cpu(_rows(dy), _rows(gate), _rows(up), limit)
        _rows(dgate).copy_(dg)
        _rows(dup).copy_(du)
    return dgate, dup


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, limit):
        ctx.save_for_backward(gate, up)
        ctx.limit = limit
        return swiglu_fwd(gate, up, limit)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dgate, dup = swiglu_bwd(dy, gate, up, ctx.limit)
        return dgate, dup, None


class _SwiGLUGateUpFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, limit):
        ctx.save_for_backward(gate_up)
        ctx.limit = limit
        gate, up = gate_up.chunk(2, dim=-1)
        return swiglu_fwd(gate, up, limit)

    @staticmethod
    def backward(ctx, dy):
        (gate_up,) = ctx.saved_tensors
        d_gate_up = torch.empty_like(gate_up)
        swiglu_bwd(dy, *gate_up.chunk(2, dim=-1), ctx.limit, out=d_gate_up.chunk(2, dim=-1))
        return d_gate_up, None


def _check_limit(limit) -> None:
    if limit is None:
        return
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real) or not math.isfinite(limit) or limit <= 0:
        raise ValueError(f"limit must be None or a finite real number > 0, got {limit!r}")


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU: y = dtype(SiLU(fp32 gate) * fp32 up), one rounding.

    gate, up: (*, I) bf16 or fp32, same shape and dtype, contiguous -> y: (*, I).
    ``limit`` (DeepSeek-V4 ``swiglu_limit``): gate clamped to <= limit and up to
    [-limit, limit] before the product, the bound taken in the input dtype.
    """
    check_tensor("gate", gate, dtypes=FLOAT_DTYPES)
    check_tensor("up", up, dtypes=(gate.dtype,))
    if gate.dim() < 1 or gate.shape[-1] < 1:
        raise ValueError(f"gate must have shape (*, I) with I >= 1, got shape {tuple(gate.shape)}")
    if up.shape != gate.shape:
        raise ValueError(f"up must have the shape of gate {tuple(gate.shape)}, got {tuple(up.shape)}")
    check_same_device(gate=gate, up=up)
    _check_limit(limit)
    return _SwiGLUFn.apply(gate, up, None if limit is None else float(limit))


def swiglu_gate_up(gate_up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """SwiGLU on a packed projection: gate_up (*, 2I) = [gate | up] along the
    last dim (transformers' ``gate_up.chunk(2, dim=-1)``) -> (*, I).  Same bits
    as ``swiglu(gate, up, limit)``; no copy of the halves."""
    check_tensor("gate_up", gate_up, dtypes=FLOAT_DTYPES)
    if gate_up.dim() < 1 or gate_up.shape[-1] < 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must have shape (*, 2I) with an even last dim, got shape {tuple(gate_up.shape)}")
    _check_limit(limit)
    return _SwiGLUGateUpFn.apply(gate_up, None if limit is None else float(limit))
