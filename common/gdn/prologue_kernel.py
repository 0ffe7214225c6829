"""The GDN layer's element-wise prologue on CUDA: the causal conv1d + SiLU with
its tail, and the L2 norm of q and k, each one or two launches in place of the
torch path's ~110 and ~25 small ops (a 512-token prefill is launch-bound, so a
layer's launch count is its prefill time).

Each kernel is ``cpu.py``'s function written element for element: the same
products and sums in the same order (``enable_fp_fusion=False``: no product is
fused into an add), the same roundings to the input dtype, exp and rsqrt from
libdevice (``expf`` / ``rsqrtf``, what torch's CUDA ops run), division rounded
to nearest (``div_rn``, torch's ``/``).  So on a CUDA tensor a kernel gives the
torch path's bits (``tests/test_gdn.py``'s gpu test), and under the interpreter,
with torch's exp and rsqrt patched in, the CPU torch path's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .cpu import CONV_K
from .kernel import _exp, _launch_opts
from .trees import _neg0

CONV_BT, CONV_BC = 16, 256  # tokens x channels a conv program (launch knobs: every element is its own)
NORM_BR = 16  # rows an l2norm program (a launch knob: rows are independent)
TAPS = tl.constexpr(CONV_K)


@triton.jit
def _rsqrt(x, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.rsqrt(x)
    else:
        return tl.rsqrt(x)


@triton.jit
def _conv1d_kernel(p_x, s_x, p_w, p_cu, p_st, p_sl, p_tail, p_y, T, C, B, STEPS: tl.constexpr, HAS_TAIL: tl.constexpr,
                   BT: tl.constexpr, BC: tl.constexpr, LIB: tl.constexpr):
    """y[t, c] = dt(silu(dt(((w0 x[t-3] + w1 x[t-2]) + w2 x[t-1]) + w3 x[t]))) for a (BT, BC) tile,
    a tap before the sequence's first token read from its slot's tail (0 before position 0)."""
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_t, m_c = o_t < T, o_c < C
    # each token's sequence: the last b with cu[b] <= t (cpu.py's searchsorted over cu[1:])
    lo = tl.zeros((BT,), dtype=tl.int32)
    hi = tl.zeros((BT,), dtype=tl.int32) + (B - 1)
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        ok = tl.load(p_cu + mid) <= o_t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    local = o_t - tl.load(p_cu + lo).to(tl.int32)
    m2 = m_t[:, None] & m_c[None, :]
    if HAS_TAIL:
        pos = local + tl.load(p_st + lo).to(tl.int32)
        slot = tl.maximum(tl.load(p_sl + lo), 0).to(tl.int64)  # cpu.py's clamp: a pad row reads slot 0
    for d in tl.static_range(TAPS):  # tap d reads position pos - (3 - d)
        back = TAPS - 1 - d
        own = tl.load(p_x + tl.maximum(o_t - back, 0).to(tl.int64)[:, None] * s_x + o_c[None, :],
                      mask=m2 & (local >= back)[:, None], other=0.0).to(tl.float32)
        xs = own
        if HAS_TAIL:
            row = tl.minimum(tl.maximum(TAPS - 1 + local - back, 0), TAPS - 2)
            past = tl.load(p_tail + (slot * (TAPS - 1) + row)[:, None] * C + o_c[None, :],
                           mask=m2 & ((local < back) & (pos - back >= 0))[:, None], other=0.0).to(tl.float32)
            xs = tl.where((local >= back)[:, None], own, past)
        term = tl.load(p_w + o_c * TAPS + d, mask=m_c, other=0.0).to(tl.float32)[None, :] * xs
        if d == 0:
            acc = term
        else:
            acc = acc + term
    z = acc.to(p_y.dtype.element_ty).to(tl.float32)
    y = tl.div_rn(z, 1.0 + _exp(-z, LIB))
    tl.store(p_y + o_t.to(tl.int64)[:, None] * C + o_c[None, :], y.to(p_y.dtype.element_ty), mask=m2)


@triton.jit
def _conv_tail_kernel(p_x, s_x, p_cu, p_st, p_sl, p_tail, T, C, BC: tl.constexpr):
    """Sequence b's slot gets its last three inputs, older rows of the slot's tail where the
    sequence has fewer than three (0 before position 0); every old row is loaded before a row is
    stored, each column by one thread."""
    b = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(p_sl + b)
    if slot >= 0:
        c0 = tl.load(p_cu + b)
        n = tl.load(p_cu + b + 1) - c0
        st = tl.load(p_st + b)
        base = p_tail + slot * (TAPS - 1) * C + o_c
        loc0, loc1, loc2 = n - 3, n - 2, n - 1
        old0 = tl.load(base + tl.minimum(tl.maximum(TAPS - 1 + loc0, 0), TAPS - 2) * C, mask=m_c)
        old1 = tl.load(base + tl.minimum(tl.maximum(TAPS - 1 + loc1, 0), TAPS - 2) * C, mask=m_c)
        old2 = tl.load(base + tl.minimum(tl.maximum(TAPS - 1 + loc2, 0), TAPS - 2) * C, mask=m_c)
        for m in tl.static_range(TAPS - 1):
            if m == 0:
                loc, old = loc0, old0
            elif m == 1:
                loc, old = loc1, old1
            else:
                loc, old = loc2, old2
            own = tl.load(p_x + tl.minimum(tl.maximum(c0 + loc, 0), T - 1) * s_x + o_c, mask=m_c)
            old = tl.where(st + loc >= 0, old, tl.zeros_like(old))
            tl.store(base + m * C, tl.where(loc >= 0, own, old), mask=m_c)


def conv1d_triton(x, weight, cu_seqlens, tail=None, slots=None, starts=None):
    """``cpu.conv1d_cpu``'s contract and bits in two launches (one without a tail); no host reads
    (graph-capturable).  x (T, C) contiguous, weight (C, 4), cu_seqlens (B + 1,), and with ``tail``
    (S, 3, C) contiguous, ``slots`` and ``starts`` (B,).  x's rows may be strided (a column slice
    of the input projection)."""
    T, C = x.shape
    B = cu_seqlens.shape[0] - 1
    y = torch.empty(T, C, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    lib, opts = _launch_opts(x)
    if x.stride(1) != 1:
        x = x.contiguous()
    weight, cu = weight.contiguous(), cu_seqlens.contiguous()
    has = tail is not None
    st = starts.contiguous() if has else cu
    sl = slots.contiguous() if has else cu
    bc = min(CONV_BC, next_power_of_2(C))
    _conv1d_kernel[(cdiv(T, CONV_BT), cdiv(C, bc))](
        x, x.stride(0), weight, cu, st, sl, tail if has else x, y, T, C, B, max(1, (B - 1).bit_length()), has, CONV_BT, bc, lib,
        **opts, enable_fp_fusion=FP_FUSION, num_warps=4)
    if has and B:
        _conv_tail_kernel[(B, cdiv(C, bc))](x, x.stride(0), cu, st, sl, tail, T, C, bc, **opts,
            enable_fp_fusion=FP_FUSION, num_warps=4)
    return y


@triton.jit
def _l2norm_kernel(p_x, p_y, R, D, eps, DP: tl.constexpr, LEVELS: tl.constexpr, BR: tl.constexpr,
                   LIB: tl.constexpr):
    """Rows of y = x * rsqrt(tree(x * x) + eps), the tree over D lanes padded with -0.0 to DP."""
    o_r = tl.program_id(0) * BR + tl.arange(0, BR)
    o_d = tl.arange(0, DP)
    m = (o_r < R)[:, None] & (o_d < D)[None, :]
    offs = o_r.to(tl.int64)[:, None] * D + o_d[None, :]
    x = tl.load(p_x + offs, mask=m, other=0.0).to(tl.float32)
    s = tl.where((o_d < D)[None, :], x * x, _neg0())
    for lv in tl.static_range(LEVELS):  # level by level: lanes (2m, 2m + 1)
        s = tl.sum(tl.reshape(s, (BR, DP >> (lv + 1), 2)), axis=2)
    r = _rsqrt(tl.reshape(s, (BR,)) + eps, LIB)
    tl.store(p_y + offs, x * r[:, None], mask=m)


def l2norm_triton(x, eps: float = 1e-6):
    """``cpu.l2norm_cpu``'s bits in one launch: x (..., D) -> fp32."""
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    R = x.numel() // max(D, 1)
    if R == 0 or D == 0:
        return y
    lib, opts = _launch_opts(x)
    dp = max(2, next_power_of_2(D))
    _l2norm_kernel[(cdiv(R, NORM_BR),)](x.contiguous(), y, R, D, eps, dp, dp.bit_length() - 1, NORM_BR, lib, **opts,
        enable_fp_fusion=FP_FUSION, num_warps=4)
    return y
