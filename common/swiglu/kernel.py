"""Triton SwiGLU kernels and their CUDA launchers.

Element-wise over (BM, BN) tiles of a (M, I) problem; rows may be strided
(``gate`` and ``up`` may be the two halves of one packed (M, 2I) tensor).
No reduction: each output element depends on its own gate/up values only, so
the tile shape and ``num_warps`` are free launch knobs that never change bits.

Rounding points (same as ``cpu.py``):

    g = fp32(gate), u = fp32(up)
    limit given:  g = min(g, L);  u = min(max(u, -L), L)   (L = limit in the input dtype)
    y = dtype(g / (1 + exp(-g)) * u)                       one rounding

Backward, each output rounded once to the input dtype, with s = 1 / (1 + exp(-g)):
dup = dy * g / (1 + exp(-g)), dgate = dy * u * (s * (1 + g * (1 - s))), zero where
the clamp cut the value (a value equal to the bound keeps its gradient).

Launched with ``enable_fp_fusion=False`` so no mul+add becomes an FMA; ``tl.exp``
and ``/`` are the fast (approximate but deterministic) GPU versions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior


@triton.jit(do_not_specialize=["M"])
def _swiglu_fwd_kernel(
    p_g,
    p_u,
    p_y,
    M,
    I,
    s_g,
    s_u,
    s_y,
    lim,
    HAS_LIMIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)  # (BM,)
    o_n = i_n * BN + tl.arange(0, BN)  # (BN,)
    m = (o_m < M)[:, None] & (o_n < I)[None, :]
    b_g = tl.load(p_g + o_m[:, None] * s_g + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    b_u = tl.load(p_u + o_m[:, None] * s_u + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    if HAS_LIMIT:
        b_g = tl.minimum(b_g, lim)
        b_u = tl.minimum(tl.maximum(b_u, -lim), lim)
    b_y = b_g / (1.0 + tl.exp(-b_g)) * b_u
    tl.store(p_y + o_m[:, None] * s_y + o_n[None, :], b_y.to(p_y.dtype.element_ty), mask=m)


@triton.jit(do_not_specialize=["M"])
def _swiglu_bwd_kernel(
    p_dy,
    p_g,
    p_u,
    p_dg,
    p_du,
    M,
    I,
    s_dy,
    s_g,
    s_u,
    s_dg,
    s_du,
    lim,
    HAS_LIMIT: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = (i_m * BM + tl.arange(0, BM)).to(tl.int64)
    o_n = i_n * BN + tl.arange(0, BN)
    m = (o_m < M)[:, None] & (o_n < I)[None, :]
    b_dy = tl.load(p_dy + o_m[:, None] * s_dy + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    b_g0 = tl.load(p_g + o_m[:, None] * s_g + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    b_u0 = tl.load(p_u + o_m[:, None] * s_u + o_n[None, :], mask=m, other=0.0).to(tl.float32)
    b_g, b_u = b_g0, b_u0
    if HAS_LIMIT:
        b_g = tl.minimum(b_g0, lim)
        b_u = tl.minimum(tl.maximum(b_u0, -lim), lim)
    b_e = tl.exp(-b_g)
    b_s = 1.0 / (1.0 + b_e)
    b_du = b_dy * (b_g / (1.0 + b_e))
    b_dg = b_dy * b_u * (b_s * (1.0 + b_g * (1.0 - b_s)))
    if HAS_LIMIT:
        b_dg = tl.where(b_g0 <= lim, b_dg, 0.0)
        b_du = tl.where((b_u0 >= -lim) & (b_u0 <= lim), b_du, 0.0)
    tl.store(p_dg + o_m[:, None] * s_dg + o_n[None, :], b_dg.to(p_dg.dtype.element_ty), mask=m)
    tl.store(p_du + o_m[:, None] * s_du + o_n[None, :], b_du.to(p_du.dtype.element_ty), mask=m)


def _config(I: int, block_rows, block_cols):
    bn = block_cols or min(1024, next_power_of_2(I))
    bm = block_rows or max(1, 2048 // bn)
    if bm & (bm - 1) or bn & (bn - 1):
        raise ValueError(f"block_rows and block_cols must be powers of two on CUDA, got {bm}, {bn}")
    return bm, bn


def swiglu_fwd_triton(gate, up, lim, block_rows=None, block_cols=None, num_warps=None):
    """gate, up: (M, I) with unit column stride; lim: the bound in the input
    dtype, or None -> y (M, I) contiguous."""
    M, I = gate.shape
    y = torch.empty((M, I), dtype=gate.dtype, device=gate.device)
    if M == 0 or I == 0:
        return y
    bm, bn = _config(I, block_rows, block_cols)
    _swiglu_fwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
        gate, up, y, M, I, gate.stride(0), up.stride(0), y.stride(0),
        0.0 if lim is None else lim,
        HAS_LIMIT=lim is not None, BM=bm, BN=bn,
        num_warps=num_warps or 4, enable_fp_fusion=FP_FUSION, **pdl_options(gate.device, M),
    )
    return y


def swiglu_bwd_triton(dy, gate, up, lim, dgate, dup, block_rows=None, block_cols=None, num_warps=None):
    """Writes dgate, dup (M, I), unit column stride (may be halves of one buffer)."""
    M, I = gate.shape
    if M == 0 or I == 0:
        return dgate, dup
    bm, bn = _config(I, block_rows, block_cols)
    _swiglu_bwd_kernel[(cdiv(M, bm), cdiv(I, bn))](
        dy, gate, up, dgate, dup, M, I,
        dy.stride(0), gate.stride(0), up.stride(0), dgate.stride(0), dup.stride(0),
        0.0 if lim is None else lim,
        HAS_LIMIT=lim is not None, BM=bm, BN=bn,
        num_warps=num_warps or 4, enable_fp_fusion=FP_FUSION,
    )
    return dgate, dup
