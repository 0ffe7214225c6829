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


def experts_fwd_cpu(x, ids, weights, w_gate_up, w_down, limit=None, lora=None):
    """x: (T, H); ids: (T, k) int; weights: (T, k) (any float dtype: read as
    fp32); w_gate_up: (E, 2I, H); w_down: (E, H, I) -> (T, H) fp32 routed sum
    (unrounded: the caller rounds it, alone or with a shared expert)."""
    return _experts_rows(x, ids, weights, lambda e, xe: fixed_order_dot(xe, w_gate_up[e]),
                         lambda e, ae: fixed_order_dot(ae, w_down[e]), w_down.shape[2], limit, lora)


def experts_fwd_mxfp4_cpu(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit=None, lora=None):
    """MXFP4 experts (``mxfp4.py``'s layout) -> (T, H) fp32: the bf16 path's arithmetic at the
    exactly decoded weights (in x.dtype), each expert decoded when a token uses it."""
    from .mxfp4 import dequantize_mxfp4

    return _experts_rows(x, ids, weights,
                         lambda e, xe: fixed_order_dot(xe, dequantize_mxfp4(gu_codes[e], gu_scales[e], x.dtype)),
                         lambda e, ae: fixed_order_dot(ae, dequantize_mxfp4(d_codes[e], d_scales[e], x.dtype)),
                         d_codes.shape[2] * 2, limit, lora)


def experts_fwd_fp8_cpu(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit=None, lora=None):
    """FP8 experts (``op.quantize_experts_fp8``'s layout) -> (T, H) fp32 routed sum (unrounded).

    The rounding points above with each dot an FP8 block-scaled GEMM (``fp8/cpu.py``: exact
    128-wide block dots, fl32(acc + fl32(p * fl32(sx * sw))) in block order, no rounding at
    the end): x is quantized per token in 1x128 groups (``quantize_act``), gate and up run
    as their own weights (their own 128-row blocks, as the checkpoint stores them), and a =
    bf16(SwiGLU) is quantized per row the same way before the down projection.  Every step
    is row-local, so a row's bits cannot depend on the batch (nor on which rows are quantized
    together: each expert's rows are quantized where they meet it)."""
    I = d_codes.shape[2]
    nbi = cdiv(I, BLOCK)

    def gate_up(e, xe):
        xq, xs = quantize_act(xe)
        return torch.cat([fp8_gemm_cpu(xq, xs, gu_codes[e, :I], gu_scale[e, :nbi], torch.float32),
                          fp8_gemm_cpu(xq, xs, gu_codes[e, I:], gu_scale[e, nbi:], torch.float32)], 1)

    def down(e, ae):
        return fp8_gemm_cpu(*quantize_act(ae), d_codes[e], d_scale[e], torch.float32)

    return _experts_rows(x, ids, weights, gate_up, down, I, limit, lora)


def _experts_rows(x, ids, weights, gate_up, down, I: int, limit, lora=None):
    """The rounding points above for every format: ``gate_up(e, x rows)`` -> (R, 2I) fp32 and
    ``down(e, a rows)`` -> (R, H) fp32 are expert e's base dots, the adapter's terms added to each."""
    T, k = ids.shape
    H = x.shape[1]
    flat = ids.reshape(-1)
    c = torch.empty(T * k, H, dtype=torch.float32)
    w = weights.reshape(-1).float()
    rows = torch.arange(T * k)
    for e in torch.unique(flat).tolist():  # CPU path: host loops are fine here
        sel = rows[flat == e]
        xe = x[sel // k]
        ae = swiglu_f32(_with_lora(gate_up(e, xe), lora, 0, e, xe), limit, x.dtype)
        c[sel] = _with_lora(down(e, ae), lora, 1, e, ae) * w[sel, None]
    return slot_sum(c.view(T, k, H))
