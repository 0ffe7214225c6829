"""Triton RoPE.

x (T, H, D) is seen as N = T*H rows of D channels; row r belongs to token
r // H.  One program rotates BLOCK_R consecutive rows: it gathers each row's
table row cos[pos], sin[pos] (fp32, built on the CPU), loads the pairs, and for
each pair computes

    out_a = RN_out( fl32(fl32(a * c) - fl32(b * s)) )
    out_b = RN_out( fl32(fl32(b * c) + fl32(a * s)) )

with ``s`` negated (exactly) for a rotation by -theta.  Reduction order: none —
there is no reduction, so every element's bits depend only on its own row, its
position and the table, whatever BLOCK_R, the grid or the batch.  Rounding
points: the two fp32 products, the fp32 add/sub, one cast to the output dtype
(round to nearest even).  The kernel is launched with ``enable_fp_fusion=False``
so the compiler never contracts a product and the add into an FMA (which would
drop one rounding); with that, the bits equal the CPU path's.  Channels outside
the rotary slice are copied as raw values (no conversion).  ``_rotate`` is
also the server's fused q/k norm + RoPE's (``qk_norm_rope/kernel.py``).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior


@triton.jit
def _rotate(b_a, b_b, b_cos, b_sin):
    """The pair (a, b) rotated in fp32: (a c - b s, b c + a s), each a product
    pair and one add, every op rounded (launch with ``enable_fp_fusion=False``)."""
    return b_a * b_cos - b_b * b_sin, b_b * b_cos + b_a * b_sin


@triton.jit(do_not_specialize=["N"])
def rope_kernel(
    p_x,
    p_y,
    p_pos,
    p_cos,
    p_sin,
    N,
    H,
    P,
    D: tl.constexpr,
    ROT_OFF: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    PASS_OFF: tl.constexpr,
    PASS: tl.constexpr,
    PASS_PAD: tl.constexpr,
    IN_INTERLEAVED: tl.constexpr,
    OUT_INTERLEAVED: tl.constexpr,
    NEGATE_SIN: tl.constexpr,
    BLOCK_R: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_r = tl.program_id(0)
    o_r = i_r * BLOCK_R + tl.arange(0, BLOCK_R)  # rows t*H + h
    m_r = o_r < N
    i_t = o_r // H
    b_pos = tl.load(p_pos + i_t, mask=m_r, other=0).to(tl.int64)
    # never read outside the table; the host checks the range unless told not to
    b_pos = tl.minimum(tl.maximum(b_pos, 0), P - 1)
    o_row = o_r.to(tl.int64) * D  # (BLOCK_R,)

    o_i = tl.arange(0, HALF_PAD)
    m_i = o_i < HALF
    m = m_r[:, None] & m_i[None, :]
    b_cos = tl.load(p_cos + b_pos[:, None] * HALF + o_i[None, :], mask=m, other=0.0)
    b_sin = tl.load(p_sin + b_pos[:, None] * HALF + o_i[None, :], mask=m, other=0.0)
    if NEGATE_SIN:
        b_sin = -b_sin

    if IN_INTERLEAVED:
        o_a = ROT_OFF + 2 * o_i
        o_b = ROT_OFF + 2 * o_i + 1
    else:
        o_a = ROT_OFF + o_i
        o_b = ROT_OFF + HALF + o_i
    b_a = tl.load(p_x + o_row[:, None] + o_a[None, :], mask=m, other=0.0).to(tl.float32)
    b_b = tl.load(p_x + o_row[:, None] + o_b[None, :], mask=m, other=0.0).to(tl.float32)

    b_ya, b_yb = _rotate(b_a, b_b, b_cos, b_sin)

    if OUT_INTERLEAVED:
        o_ya = ROT_OFF + 2 * o_i
        o_yb = ROT_OFF + 2 * o_i + 1
    else:
        o_ya = ROT_OFF + o_i
        o_yb = ROT_OFF + HALF + o_i
    tl.store(p_y + o_row[:, None] + o_ya[None, :], b_ya.to(p_y.dtype.element_ty), mask=m)
    tl.store(p_y + o_row[:, None] + o_yb[None, :], b_yb.to(p_y.dtype.element_ty), mask=m)

    if PASS > 0:
        o_c = tl.arange(0, PASS_PAD)
        m_c = m_r[:, None] & (o_c < PASS)[None, :]
        p_c = o_row[:, None] + PASS_OFF + o_c[None, :]
        tl.store(p_y + p_c, tl.load(p_x + p_c, mask=m_c), mask=m_c)


def default_block_rows(rotary_dim: int, head_dim: int) -> int:
    """About 4K elements per program; any power of two gives the same bits."""
    width = max(next_power_of_2(rotary_dim // 2), next_power_of_2(max(head_dim - rotary_dim, 1)))
    return max(1, min(128, 4096 // width))


def rope_rotate_triton(
    x: torch.Tensor,  # (T, H, D)
    positions: torch.Tensor,  # (T,) int
    cos: torch.Tensor,  # (P, R/2) fp32
    sin: torch.Tensor,  # (P, R/2) fp32
    *,
    rot_offset: int,
    in_interleaved: bool,
    out_interleaved: bool,
    negate_sin: bool,
    block_rows: int | None = None,
) -> torch.Tensor:
    T, H, D = x.shape
    half = cos.shape[1]
    R = 2 * half
    y = torch.empty_like(x)
    N = T * H
    if N == 0:
        return y
    block_r = block_rows or default_block_rows(R, D)
    if block_r & (block_r - 1):
        raise ValueError(f"block_rows must be a power of two on CUDA, got {block_r}")
    n_pass = D - R
    pass_off = R if rot_offset == 0 else 0
    grid = (cdiv(N, block_r),)
    rope_kernel[grid](
        x, y, positions, cos, sin,
        N, H, cos.shape[0],
        D=D,
        ROT_OFF=rot_offset,
        HALF=half,
        HALF_PAD=next_power_of_2(half),
        PASS_OFF=pass_off,
        PASS=n_pass,
        PASS_PAD=next_power_of_2(max(n_pass, 1)),
        IN_INTERLEAVED=in_interleaved,
        OUT_INTERLEAVED=out_interleaved,
        NEGATE_SIN=negate_sin,
        BLOCK_R=block_r,
        num_warps=4,
        enable_fp_fusion=FP_FUSION, **pdl_options(x.device, T),
    )
    return y
