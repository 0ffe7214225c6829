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

With LoRA inside the experts (``lora.py``) gu and c_j's dot gain the adapter's term
before the SwiGLU and the routing weight.

Shapes: T tokens, H hidden, E experts, I expert width, k slots.
"""
from __future__ import annotations

import torch

from ..fp8.cpu import fp8_gemm_cpu
from ..fp8.quant import BLOCK, cdiv, quantize_act
from ..matmul.cpu import fixed_order_dot
from ..swiglu.cpu import clamp_gate_up, limit_in, silu
from .router import slot_sum  # (T, k, H) fp32 contributions -> (T, H), added in slot order


def swiglu_f32(gu: torch.Tensor, limit: float | None, dtype: torch.dtype) -> torch.Tensor:
    """(R, 2I) fp32 [gate | up] -> (R, I) in ``dtype``: clamp at ``limit_in(dtype, limit)``
    (DeepSeek-V4), SiLU(g)·u in fp32, one rounding."""
    I = gu.shape[1] // 2
    g, u = clamp_gate_up(gu[:, :I], gu[:, I:], None if limit is None else limit_in(dtype, limit))
    return (silu(g) * u).to(dtype)


def lora_delta_cpu(inp: torch.Tensor, a: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """fl32(s * fp32 dot(dtype(fp32 dot(inp, a)), b)): one expert's adapter term (``lora.py``)."""
    return fixed_order_dot(fixed_order_dot(inp, a).to(inp.dtype), b) * s


def _with_lora(base: torch.Tensor, lora, which: int, e: int, inp: torch.Tensor) -> torch.Tensor:
    """base + the adapter's term for expert e (which 0: gate/up on x, 1: down on a); base alone without LoRA."""
    if lora is None:
        return base
    a, b = lora.tensors()[2 * which:2 * which + 2]
    return base + lora_delta_cpu(inp, a[e], b[e], lora.s)


def experts_fwd_cpu(x, ids, weights, w_gate_up, w_down, limit=None, keep: bool = False, lora=None):
    """x: (T, H); ids: (T, k) int; weights: (T, k) (any float dtype: read as
    fp32); w_gate_up: (E, 2I, H); w_down: (E, H, I) -> (T, H) fp32 routed sum
    (unrounded: the caller rounds it, alone or with a shared expert).

    ``keep``: also return (a (T, k, I), c (T, k, H) fp32) for the backward."""
    return _experts_rows(x, ids, weights, w_gate_up.__getitem__, w_down.__getitem__, w_down.shape[2], limit, keep,
                         lora)


def experts_fwd_mxfp4_cpu(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit=None, lora=None):
    """MXFP4 experts (``mxfp4.py``'s layout) -> (T, H) fp32: the bf16 path's arithmetic at the
    exactly decoded weights (in x.dtype), each expert decoded when a token uses it."""
    from .mxfp4 import dequantize_mxfp4

    return _experts_rows(x, ids, weights, lambda e: dequantize_mxfp4(gu_codes[e], gu_scales[e], x.dtype),
                         lambda e: dequantize_mxfp4(d_codes[e], d_scales[e], x.dtype), d_codes.shape[2] * 2, limit,
                         lora=lora)


def _experts_rows(x, ids, weights, gu_of, d_of, I: int, limit, keep: bool = False, lora=None):
    """The rounding points above, expert e's weights from ``gu_of(e)`` (2I, H) and ``d_of(e)`` (H, I)."""
    T, k = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1)
    a = torch.empty(T * k, I, dtype=x.dtype)
    c = torch.empty(T * k, H, dtype=torch.float32)
    w = weights.reshape(-1).float()
    rows = torch.arange(T * k)
    for e in torch.unique(flat).tolist():  # CPU path: host loops are fine here
        sel = rows[flat == e]
        xe = x[sel // k]
        ae = swiglu_f32(_with_lora(fixed_order_dot(xe, gu_of(e)), lora, 0, e, xe), limit, x.dtype)
        a[sel] = ae
        c[sel] = _with_lora(fixed_order_dot(ae, d_of(e)), lora, 1, e, ae) * w[sel, None]
    y = slot_sum(c.view(T, k, H))
    return (y, a.view(T, k, I), c.view(T, k, H)) if keep else y


def experts_fwd_fp8_cpu(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit=None, lora=None):
    """FP8 experts (``op.quantize_experts_fp8``'s layout) -> (T, H) fp32 routed sum (unrounded).

    The rounding points above with each dot an FP8 block-scaled GEMM (``fp8/cpu.py``: exact
    128-wide block dots, fl32(acc + fl32(p * fl32(sx * sw))) in block order, no rounding at
    the end): x is quantized per token in 1x128 groups (``quantize_act``), gate and up run
    as their own weights (their own 128-row blocks, as the checkpoint stores them), and a =
    bf16(SwiGLU) is quantized per row the same way before the down projection.  Every step
    is row-local, so a row's bits cannot depend on the batch."""
    T, k = ids.shape
    H, I = x.shape[1], d_codes.shape[2]
    nbi = cdiv(I, BLOCK)
    flat = ids.reshape(-1)
    rows = torch.arange(T * k)
    xq, xs = quantize_act(x)
    a = torch.empty(T * k, I, dtype=x.dtype)
    experts = torch.unique(flat).tolist()
    for e in experts:  # CPU path: host loops are fine here
        sel = rows[flat == e]
        tq, ts = xq[sel // k], xs[sel // k]
        g = fp8_gemm_cpu(tq, ts, gu_codes[e, :I], gu_scale[e, :nbi], torch.float32)
        u = fp8_gemm_cpu(tq, ts, gu_codes[e, I:], gu_scale[e, nbi:], torch.float32)
        a[sel] = swiglu_f32(_with_lora(torch.cat([g, u], 1), lora, 0, e, x[sel // k]), limit, x.dtype)
    aq, as_ = quantize_act(a)
    c = torch.empty(T * k, H, dtype=torch.float32)
    w = weights.reshape(-1).float()
    for e in experts:
        sel = rows[flat == e]
        c[sel] = _with_lora(fp8_gemm_cpu(aq[sel], as_[sel], d_codes[e], d_scale[e], torch.float32), lora, 1, e,
                            a[sel]) * w[sel, None]
    return slot_sum(c.view(T, k, H))
