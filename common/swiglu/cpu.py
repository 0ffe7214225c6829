"""CPU SwiGLU, batch-invariant by construction.

Purely element-wise: each output element is computed from its own gate and up
values by fp32 clamp (exact min/max), add, mul, div (IEEE, correctly rounded
element by element) and ``exp``.  fp32 ``torch.exp`` runs ATen's vml path (MKL
VML in the CPU wheel) and gives an element the same bits whatever the tensor's
length, alignment or thread split (measured: 3.3M values, lengths 1..65537,
offsets 0..16, 1 and 2 threads; ``tests/test_swiglu.py`` keeps checking it).
``F.silu`` and ``torch.sigmoid`` do not: their last few elements take a scalar
fallback (190 of 5000 values differed between a 1-element and a 200k-element
call, torch 2.13 AVX2), so SiLU is written out as ``g / (1 + exp(-g))``.
There is no reduction, hence nothing a batch size, row order, padding or
``block_rows`` could regroup.

Rounding points (forward):

    g = fp32(gate), u = fp32(up)
    limit given:  g = min(g, L);  u = min(max(u, -L), L)   with L = dtype(limit)
    y = dtype(fl(g / fl(1 + exp(-g))) * u)                 one rounding

L is the limit rounded to the input dtype, as DeepSeek-V4's
``gate.clamp(max=limit)`` / ``up.clamp(min=-limit, max=limit)`` do on bf16
tensors; the clamp is exact, so clamping in fp32 gives the same values.
transformers then rounds SiLU(gate) to bf16 before the product; we do not
(one rounding, at the end).
"""
from __future__ import annotations

import torch


def limit_in(dtype: torch.dtype, limit: float) -> float:
    """The clamp bound as the input dtype holds it (what a bf16 ``clamp`` uses)."""
    return torch.tensor(limit, dtype=dtype).item()


def clamp_gate_up(g: torch.Tensor, u: torch.Tensor, lim: float | None):
    """DeepSeek-V4's clamp at the bound ``lim`` (``limit_in``'s value; None: no clamp):
    g = min(g, lim), u = min(max(u, -lim), lim), exact."""
    if lim is None:
        return g, u
    return torch.clamp(g, max=lim), torch.clamp(u, min=-lim, max=lim)


def silu(z: torch.Tensor) -> torch.Tensor:
    """fp32 SiLU as fl(z / fl(1 + exp(-z))) from element-wise ops (see module docstring)."""
    return z / (1.0 + torch.exp(-z))


def _fwd_rows(gate, up, limit):
    lim = None if limit is None else limit_in(gate.dtype, limit)
    g, u = clamp_gate_up(gate.float(), up.float(), lim)
    return (silu(g) * u).to(gate.dtype)


def swiglu_fwd_cpu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None, block_rows: int | None = None):
    """gate, up: (M, I) (rows may be strided) -> y (M, I) contiguous.

    ``block_rows`` processes the rows in independent chunks (a launch-shape
    knob for the rung-2 checks; it cannot change bits).
    """
    M = gate.shape[0]
    if block_rows is None or block_rows >= M:
        return _fwd_rows(gate, up, limit)
    return torch.cat([_fwd_rows(gate[i : i + block_rows], up[i : i + block_rows], limit) for i in range(0, M, block_rows)])


def swiglu_bwd_cpu(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, limit: float | None = None):
    """-> (dgate, dup), each rounded once to the input dtype.

        s = 1 / (1 + exp(-g));  silu = g / (1 + exp(-g))
        dup   = dy * silu                      (0 where up was clamped)
        dgate = dy * u * (s * (1 + g * (1 - s)))   (0 where gate was clamped)

    with g, u the clamped fp32 values; a value equal to the bound passes its
    gradient (torch's clamp rule).
    """
    lim = None if limit is None else limit_in(gate.dtype, limit)
    g0, u0 = gate.float(), up.float()
    g, u = clamp_gate_up(g0, u0, lim)
    dyf = dy.float()
    e = torch.exp(-g)
    s = 1.0 / (1.0 + e)
    dup = dyf * (g / (1.0 + e))
    dgate = dyf * u * (s * (1.0 + g * (1.0 - s)))
    if lim is not None:
        zero = torch.zeros((), dtype=torch.float32)
        dgate = torch.where(g0 <= lim, dgate, zero)
        dup = torch.where((u0 >= -lim) & (u0 <= lim), dup, zero)
    return dgate.to(gate.dtype), dup.to(up.dtype)
