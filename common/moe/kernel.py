"""Triton routed experts: two grouped GEMMs over (token, slot) rows sorted by
expert, with no host read of per-expert counts (the launch grid is a bound
from T, k and E alone, so decode captures into a CUDA graph).

Tiles.  The T·k rows are sorted by (expert, token, slot) on the device; tile t
of the grid covers rows [r0, r1) of one expert (at most BLOCK_M of them), from
a map built on the device; tiles past the last expert's exit at once.  A
token's rows meet their expert's weights in whichever tile they land, and
every output element is the same chain over K whatever else the tile holds:

    acc = 0;  for k0 in 0, BLOCK_K, 2·BLOCK_K, ...:  acc = tl.dot(x[:, k0:k0+BK], W[k0:k0+BK, n], acc)

one fp32 accumulator from zero, the same k16 wgmma steps for every row (rows
of other tokens and masked padding rows cannot enter a row's sum).  BLOCK_M
is 64 or more so Hopper always runs wgmma.

Rounding points (as ``cpu.py``): gate and up stay fp32; a = bf16(g / (1 +
exp(-g)) · u) (clamped first with a limit); c = fp32 dot(a, W_down) · w; the
slots are then added in slot order in fp32 (``cpu.slot_sum``) and rounded by
the caller.  Launched with ``enable_fp_fusion=False``: no mul + add becomes an
FMA, so each op rounds where the source says.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._launch import FP_FUSION
from ..fp8.quant import BLOCK as FP8_BLOCK
from ..fp8.quant import quantize_act
from ..swiglu.cpu import limit_in

BLOCK_M = 64  # wgmma's smallest M: a tile never lowers to mma.sync
BLOCK_K = 64  # the K chain's step: fixed, so every launch sums K the same way


@triton.jit
def _tile_ids(N, COLS: tl.constexpr):
    """(tile, column block) of this program on the 1-D grid: a tile's column blocks are consecutive
    programs, so they run side by side and share its rows in L2, and the expert's next tile meets
    its weights there."""
    nn = (N + COLS - 1) // COLS
    pid = tl.program_id(0)
    return pid // nn, pid % nn


@triton.jit
def _tile_rows(p_r0, p_r1, i_t, BLOCK_M: tl.constexpr):
    """Tile i_t's sorted rows [r0, r1) as (offsets, mask) over BLOCK_M."""
    r0, r1 = tl.load(p_r0 + i_t), tl.load(p_r1 + i_t)
    o_r = r0 + tl.arange(0, BLOCK_M)
    return o_r, o_r < r1


@triton.jit
def _swiglu_store(b_g, b_u, p_a, o_r, m_r, o_n, m_n, I, LIMIT, HAS_LIMIT: tl.constexpr):
    """a = SiLU(g)·u in fp32 (clamped first with a limit), rounded once into the sorted rows of a."""
    if HAS_LIMIT:
        b_g = tl.minimum(b_g, LIMIT)
        b_u = tl.minimum(tl.maximum(b_u, -LIMIT), LIMIT)
    b_a = b_g / (1.0 + tl.exp(-b_g)) * b_u
    tl.store(p_a + o_r[:, None].to(tl.int64) * I + o_n[None, :], b_a.to(p_a.dtype.element_ty),
             mask=m_r[:, None] & m_n[None, :])


@triton.jit
def _weighted_scatter(b_c, p_wt, p_dst, p_c, o_r, m_r, o_n, m_n, H):
    """c[(token, slot)] = fp32 down product · routing weight, scattered back from the sorted rows."""
    b_wt = tl.load(p_wt + o_r, mask=m_r, other=0.0)
    dst = tl.load(p_dst + o_r, mask=m_r, other=0).to(tl.int64)
    tl.store(p_c + dst[:, None] * H + o_n[None, :], b_c * b_wt[:, None], mask=m_r[:, None] & m_n[None, :])


# One code byte (two E2M1 nibbles) and its group's scale, 2^(s - 127) as bf16 in both halves of a
# word, to two bf16 weights, the low nibble first.  b * 4097 puts the high nibble at bits 16-19 and
# keeps the low one at 0-3; shifted by 6 and 12 and masked, each nibble's 3 magnitude bits sit
# under bf16's exponent and first mantissa bit and its sign on the sign bit: v 2^-126 (code 1:
# the subnormal 2^-127).  Times 2^126, then the scale, in bf16x2: each product is exact (a 2-bit
# significand at 2^-128 or more), so the weights are the fp32 decode's, in 7 operations a pair.
_E2M1X2_BF16 = tl.constexpr("""{
.reg .b32 x, m, s, c;
mad.lo.u32 x, $2, 4097, 0;
shl.b32 m, x, 6;
shl.b32 s, x, 12;
and.b32 m, m, 0x01C001C0;
and.b32 s, s, 0x80008000;
or.b32 m, m, s;
mov.b32 c, 0x7E807E80;
mul.rn.bf16x2 m, m, c;
mul.rn.bf16x2 m, m, $3;
mov.b32 {$0, $1}, m;
}""")


@triton.jit
def _mx_rows(p_w, p_s, rows, m_rows, k0, K, dtype: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             MX: tl.constexpr):
    """(BLOCK_N, BLOCK_K) weights of rows ``rows`` (int64) of an (N, K) MXFP4 stack, columns k0..,
    decoded from the codes and E8M0 scales in registers (``mxfp4.py``: exact in ``dtype``).  MX 2
    (bf16 on CUDA): two weights a byte in bf16x2 arithmetic (``_E2M1X2_BF16``), the same values."""
    o_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(p_w + rows[:, None] * (K // 2) + o_b[None, :], mask=m_rows[:, None] & (o_b < K // 2)[None, :],
                other=0).to(tl.int32)  # (BN, BK/2) bytes
    o_g = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(p_s + rows[:, None] * (K // 32) + o_g[None, :], mask=m_rows[:, None] & (o_g < K // 32)[None, :],
                other=0).to(tl.int32)  # (BN, BK/32) scale bytes
    if MX == 2:
        # the scale byte under both halves' bf16 exponent fields; 0 is 2^-127, 255 NaN (mxfp4.e8m0_to_float)
        s2 = tl.where(s == 0, 0x00400040, tl.where(s == 255, 0x7FC07FC0, s * 0x00800080))
        s2 = tl.reshape(tl.broadcast_to(s2[:, :, None], (BLOCK_N, BLOCK_K // 32, 16)), (BLOCK_N, BLOCK_K // 2))
        lo, hi = tl.inline_asm_elementwise(_E2M1X2_BF16, "=h,=h,r,r", [b, s2], dtype=(tl.bfloat16, tl.bfloat16),
                                           is_pure=True, pack=1)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    c = tl.reshape(tl.join(b & 15, b >> 4), (BLOCK_N, BLOCK_K))  # element 2j: the low nibble
    # the nibble's 3 bits under fp32's exponent field read v 2^-126 (code 1: the subnormal
    # 2^-127), times 2^126: v exactly in ~6 operations an element, as the decode bounds the
    # experts at decode sizes
    v = (((c & 7) << 22) | ((c & 8) << 28)).to(tl.float32, bitcast=True) * 8.507059173023462e37
    # 2^(s - 127) from the exponent bits; 0 is 2^-127, 255 NaN (mxfp4.e8m0_to_float)
    sv = tl.where(s == 0, 0x00400000, tl.where(s == 255, 0x7FC00000, s << 23)).to(tl.float32, bitcast=True)
    sv = tl.reshape(tl.broadcast_to(sv[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)), (BLOCK_N, BLOCK_K))
    return (v * sv).to(dtype)


@triton.jit
def _w_tile(p_w, p_s, rows, m_rows, k0, K, dtype: tl.constexpr, MX: tl.constexpr, BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr):
    """(BLOCK_K, BLOCK_N) tile of Wᵀ for weight rows ``rows`` (int64) of an (N, K) stack, columns k0..:
    as stored (bf16 / fp32), or with MX decoded from MXFP4 (``_mx_rows``), so the dot is the bf16
    path's at the decoded weights."""
    if MX:
        return tl.trans(_mx_rows(p_w, p_s, rows, m_rows, k0, K, dtype, BLOCK_N, BLOCK_K, MX))
    else:
        o_k = k0 + tl.arange(0, BLOCK_K)
        return tl.load(p_w + rows[None, :] * K + o_k[:, None], mask=(o_k < K)[:, None] & m_rows[None, :], other=0.0)


@triton.jit
def _mx_dot_t(acc, p_w, p_s, rows, m_rows, p_in, in_rows, m_in, k0, K, PRECISION: tl.constexpr,
              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MX: tl.constexpr):
    """accᵀ chain step with the roles swapped: acc (BLOCK_N, BLOCK_M) + dot(decoded W rows (BN, BK),
    inᵀ (BK, BM)): the decoded weights are the dot's first operand, which Hopper reads from registers."""
    o_k = k0 + tl.arange(0, BLOCK_K)
    b_xt = tl.load(p_in + in_rows[None, :] * K + o_k[:, None], mask=(o_k < K)[:, None] & m_in[None, :], other=0.0)
    b_w = _mx_rows(p_w, p_s, rows, m_rows, k0, K, p_in.dtype.element_ty, BLOCK_N, BLOCK_K, MX)
    return tl.dot(b_w, b_xt, acc, input_precision=PRECISION)


@triton.jit
def _add_delta(b_acc, p_delta, o_r, m_r, o_n, m_n, N, HAS_DELTA: tl.constexpr):
    """acc + the LoRA term of these sorted rows (an fp32 (rows, N) tensor), one add (``lora.py``)."""
    if HAS_DELTA:
        b_acc = b_acc + tl.load(p_delta + o_r[:, None].to(tl.int64) * N + o_n[None, :],
                                mask=m_r[:, None] & m_n[None, :], other=0.0)
    return b_acc


@triton.jit
def _add_delta_gu(b_g, b_u, p_delta, o_r, m_r, o_n, m_n, I, HAS_DELTA: tl.constexpr):
    """gate and up + their LoRA terms: columns o_n and I + o_n of the (rows, 2I) delta."""
    if HAS_DELTA:
        o_d = p_delta + o_r[:, None].to(tl.int64) * (2 * I) + o_n[None, :]
        m = m_r[:, None] & m_n[None, :]
        b_g = b_g + tl.load(o_d, mask=m, other=0.0)
        b_u = b_u + tl.load(o_d + I, mask=m, other=0.0)
    return b_g, b_u


@triton.jit
def _grouped_linear_kernel(p_in, p_src, p_w, p_te, p_r0, p_r1, p_out, N, K, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[sorted row] = fp32 dot(in[src[row]], W[e]) rounded to out's dtype: the adapters' products,
    the same K chain as the base kernels'."""
    i_t, i_n = _tile_ids(N, BLOCK_N)
    e = tl.load(p_te + i_t)
    if e < 0:
        return
    o_r, m_r = _tile_rows(p_r0, p_r1, i_t, BLOCK_M)
    src = tl.load(p_src + o_r, mask=m_r, other=0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < N
    rows = e.to(tl.int64) * N + o_n
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        b_x = tl.load(p_in + src[:, None] * K + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0.0)
        b_w = _w_tile(p_w, p_w, rows, m_n, k0, K, p_in.dtype.element_ty, False, BLOCK_N, BLOCK_K)
        b_acc = tl.dot(b_x, b_w, b_acc, input_precision=PRECISION)
    tl.store(p_out + o_r[:, None].to(tl.int64) * N + o_n[None, :], b_acc.to(p_out.dtype.element_ty),
             mask=m_r[:, None] & m_n[None, :])


@triton.jit
def _gate_up_kernel(p_x, p_w, p_s, p_tok, p_te, p_r0, p_r1, p_a, p_delta, H, I, LIMIT, HAS_LIMIT: tl.constexpr,
                    MX: tl.constexpr, SWAP: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    i_t, i_n = _tile_ids(I, BLOCK_N // 2 if MX and SWAP else BLOCK_N)
    e = tl.load(p_te + i_t)
    if e < 0:
        return
    o_r, m_r = _tile_rows(p_r0, p_r1, i_t, BLOCK_M)
    tok = tl.load(p_tok + o_r, mask=m_r, other=0).to(tl.int64)
    if MX and SWAP:  # the swapped chain decodes MXFP4 tiles only
        # one (BLOCK_N, BLOCK_M) accumulator: BLOCK_N / 2 gate rows, then their up rows, so each
        # decoded tile meets BLOCK_M rows with half the registers of two accumulators
        NH: tl.constexpr = BLOCK_N // 2
        o_j = tl.arange(0, BLOCK_N)
        o_h = i_n * NH + o_j % NH
        rows = e.to(tl.int64) * (2 * I) + o_h + (o_j // NH) * I
        b_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            b_t = _mx_dot_t(b_t, p_w, p_s, rows, o_h < I, p_x, tok, m_r, k0, H, PRECISION, BLOCK_N, BLOCK_K, MX)
        b_gt, b_ut = tl.split(tl.permute(tl.reshape(b_t, (2, NH, BLOCK_M)), (1, 2, 0)))
        b_g, b_u = tl.trans(b_gt), tl.trans(b_ut)
        o_n = i_n * NH + tl.arange(0, NH)
        m_n = o_n < I
    else:
        o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_n = o_n < I
        row_g = e.to(tl.int64) * (2 * I) + o_n  # gate's weight rows; up's are I further
        b_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < H
            b_x = tl.load(p_x + tok[:, None] * H + o_k[None, :], mask=m_r[:, None] & m_k[None, :], other=0.0)
            b_wg = _w_tile(p_w, p_s, row_g, m_n, k0, H, p_x.dtype.element_ty, MX, BLOCK_N, BLOCK_K)
            b_wu = _w_tile(p_w, p_s, row_g + I, m_n, k0, H, p_x.dtype.element_ty, MX, BLOCK_N, BLOCK_K)
            b_g = tl.dot(b_x, b_wg, b_g, input_precision=PRECISION)
            b_u = tl.dot(b_x, b_wu, b_u, input_precision=PRECISION)
    b_g, b_u = _add_delta_gu(b_g, b_u, p_delta, o_r, m_r, o_n, m_n, I, HAS_DELTA)
    _swiglu_store(b_g, b_u, p_a, o_r, m_r, o_n, m_n, I, LIMIT, HAS_LIMIT)


@triton.jit
def _down_kernel(p_a, p_w, p_s, p_wt, p_dst, p_te, p_r0, p_r1, p_c, p_delta, H, I, MX: tl.constexpr,
                 SWAP: tl.constexpr, HAS_DELTA: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    i_t, i_n = _tile_ids(H, BLOCK_N)
    e = tl.load(p_te + i_t)
    if e < 0:
        return
    o_r, m_r = _tile_rows(p_r0, p_r1, i_t, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    rows = e.to(tl.int64) * H + o_n
    if MX and SWAP:  # the swapped chain decodes MXFP4 tiles only
        b_ct = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            b_ct = _mx_dot_t(b_ct, p_w, p_s, rows, m_n, p_a, o_r.to(tl.int64), m_r, k0, I, PRECISION, BLOCK_N,
                             BLOCK_K, MX)
        b_c = tl.trans(b_ct)
    else:
        b_c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            o_k = k0 + tl.arange(0, BLOCK_K)
            m_k = o_k < I
            b_a = tl.load(p_a + o_r[:, None].to(tl.int64) * I + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                          other=0.0)
            b_w = _w_tile(p_w, p_s, rows, m_n, k0, I, p_a.dtype.element_ty, MX, BLOCK_N, BLOCK_K)
            b_c = tl.dot(b_a, b_w, b_c, input_precision=PRECISION)
    b_c = _add_delta(b_c, p_delta, o_r, m_r, o_n, m_n, H, HAS_DELTA)
    _weighted_scatter(b_c, p_wt, p_dst, p_c, o_r, m_r, o_n, m_n, H)


@triton.jit
def _fp8_block(acc, p_rows, p_cols, o_kk, m_rows, m_cols, K, sx, p_sw):
    """acc + fl32(dot(x codes, W codes of one 128-wide K block) * fl32(sx * sw)), as fp8/kernel.py."""
    m_k = o_kk < K
    b_x = tl.load(p_rows + o_kk[None, :], mask=m_rows[:, None] & m_k[None, :], other=0.0)  # (BM, BK) e4m3
    b_w = tl.load(p_cols + o_kk[:, None], mask=m_k[:, None] & m_cols[None, :], other=0.0)  # (BK, BN), K-major
    b_p = tl.dot(b_x, b_w, out_dtype=tl.float32)  # fresh accumulator each block
    b_sw = tl.load(p_sw, mask=m_cols, other=0.0)
    return acc + b_p * (sx[:, None] * b_sw[None, :])


@triton.jit
def _gate_up_fp8_kernel(p_xq, p_xs, p_w, p_ws, p_tok, p_te, p_r0, p_r1, p_a, p_delta, H, I, KB, NBI, LIMIT,
                        HAS_LIMIT: tl.constexpr, HAS_DELTA: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    i_t, i_n = _tile_ids(I, BLOCK_N)
    e = tl.load(p_te + i_t)
    if e < 0:
        return
    o_r, m_r = _tile_rows(p_r0, p_r1, i_t, BLOCK_M)
    tok = tl.load(p_tok + o_r, mask=m_r, other=0).to(tl.int64)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    p_rows = p_xq + tok[:, None] * H
    p_g = p_w + e.to(tl.int64) * (2 * I) * H + o_n[None, :].to(tl.int64) * H
    p_u = p_g + I.to(tl.int64) * H
    p_sg = p_ws + e.to(tl.int64) * (2 * NBI) * KB + (o_n // BLOCK_K) * KB  # gate's block rows, then up's
    p_su = p_sg + NBI * KB
    b_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    b_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i_kb in range(KB):
        o_kk = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b_sx = tl.load(p_xs + tok * KB + i_kb, mask=m_r, other=0.0)
        b_g = _fp8_block(b_g, p_rows, p_g, o_kk, m_r, m_n, H, b_sx, p_sg + i_kb)
        b_u = _fp8_block(b_u, p_rows, p_u, o_kk, m_r, m_n, H, b_sx, p_su + i_kb)
    b_g, b_u = _add_delta_gu(b_g, b_u, p_delta, o_r, m_r, o_n, m_n, I, HAS_DELTA)
    _swiglu_store(b_g, b_u, p_a, o_r, m_r, o_n, m_n, I, LIMIT, HAS_LIMIT)


@triton.jit
def _down_fp8_kernel(p_aq, p_as, p_w, p_ws, p_wt, p_dst, p_te, p_r0, p_r1, p_c, p_delta, H, I, KB, NBH,
                     HAS_DELTA: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i_t, i_n = _tile_ids(H, BLOCK_N)
    e = tl.load(p_te + i_t)
    if e < 0:
        return
    o_r, m_r = _tile_rows(p_r0, p_r1, i_t, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    p_rows = p_aq + o_r[:, None].to(tl.int64) * I
    p_cols = p_w + e.to(tl.int64) * H * I + o_n[None, :].to(tl.int64) * I
    p_sw = p_ws + e.to(tl.int64) * NBH * KB + (o_n // BLOCK_K) * KB
    b_c = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i_kb in range(KB):
        o_kk = i_kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b_sx = tl.load(p_as + o_r * KB + i_kb, mask=m_r, other=0.0)
        b_c = _fp8_block(b_c, p_rows, p_cols, o_kk, m_r, m_n, I, b_sx, p_sw + i_kb)
    b_c = _add_delta(b_c, p_delta, o_r, m_r, o_n, m_n, H, HAS_DELTA)
    _weighted_scatter(b_c, p_wt, p_dst, p_c, o_r, m_r, o_n, m_n, H)


def tile_map(ids: torch.Tensor, E: int, block_m: int = BLOCK_M):
    """The sorted rows and their tiles, on the device, with no host read: the torch statement of
    what ``sorted_map_triton`` builds in one launch (the launcher's path; the tests compare them).

    ids: (T, k) -> (order (T·k,): flat (token, slot) index of each sorted row,
    tile_expert, tile_r0, tile_r1 (n_tiles,) int32: each tile's expert (-1
    past the last) and row range).  n_tiles = ceil(T·k / block_m) + E bounds
    Σ_e ceil(n_e / block_m) for any routing."""
    flat = ids.reshape(-1).long()
    n, dev = flat.numel(), ids.device
    order = torch.argsort(flat * n + torch.arange(n, device=dev))  # keys are distinct: one order on any device
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    tiles = (counts + block_m - 1) // block_m
    tile_end = torch.cumsum(tiles, 0)
    n_tiles = cdiv(n, block_m) + E
    t = torch.arange(n_tiles, device=dev)
    e_of = torch.searchsorted(tile_end, t, right=True)
    e_c = e_of.clamp(max=E - 1)
    row_start = torch.cumsum(counts, 0) - counts
    r0 = row_start[e_c] + (t - (tile_end[e_c] - tiles[e_c])) * block_m
    r1 = row_start[e_c] + counts[e_c]
    tile_expert = torch.where(e_of < E, e_c, -1)
    return order, tile_expert.to(torch.int32), r0.to(torch.int32), r1.to(torch.int32)


@triton.jit
def _sorted_map_kernel(p_ids, p_order, p_w, n, E, K_SLOTS, p_tok, p_dst, p_wt, p_te, p_r0, p_r1, p_scr, n_tiles,
                       BM: tl.constexpr, EP: tl.constexpr, BN: tl.constexpr, BT: tl.constexpr):
    """``tile_map``'s tiles (program 0) and the sorted rows' token, destination and routing weight
    (programs 1..), integer arithmetic throughout; p_scr: 4 x EP int32 scratch."""
    pid = tl.program_id(0)
    if pid > 0:
        o = (pid - 1) * BN + tl.arange(0, BN)
        m = o < n
        r = tl.load(p_order + o, mask=m, other=0)
        tl.store(p_tok + o, (r // K_SLOTS).to(tl.int32), mask=m)
        tl.store(p_dst + o, r.to(tl.int32), mask=m)
        tl.store(p_wt + o, tl.load(p_w + r, mask=m, other=0.0).to(tl.float32), mask=m)
    else:
        counts = tl.zeros((EP,), dtype=tl.int32)
        for i0 in range(0, n, BN):
            o = i0 + tl.arange(0, BN)
            e = tl.load(p_ids + o, mask=o < n, other=0).to(tl.int32)
            counts += tl.histogram(e, EP)
        bins = tl.arange(0, EP)
        counts -= tl.where(bins == 0, (BN - n % BN) % BN, 0)  # the last block's masked rows, counted as expert 0
        tiles = (counts + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        row_start = tl.cumsum(counts, 0) - counts
        tl.store(p_scr + bins, counts)
        tl.store(p_scr + EP + bins, tiles)
        tl.store(p_scr + 2 * EP + bins, tile_end)
        tl.store(p_scr + 3 * EP + bins, row_start)
        tl.debug_barrier()  # the gathers below read other threads' stores
        for t0 in range(0, n_tiles, BT):
            t = t0 + tl.arange(0, BT)
            m = t < n_tiles
            e_of = tl.sum(((tile_end[None, :] <= t[:, None]) & (bins < E)[None, :]).to(tl.int32), 1)
            e_c = tl.minimum(e_of, E - 1)
            cnt = tl.load(p_scr + e_c)
            til = tl.load(p_scr + EP + e_c)
            end = tl.load(p_scr + 2 * EP + e_c)
            rs = tl.load(p_scr + 3 * EP + e_c)
            tl.store(p_r0 + t, rs + (t - (end - til)) * BM, mask=m)
            tl.store(p_r1 + t, rs + cnt, mask=m)
            tl.store(p_te + t, tl.where(e_of < E, e_c, -1), mask=m)


def sorted_map_triton(ids: torch.Tensor, weights: torch.Tensor, E: int, block_m: int = BLOCK_M):
    """``tile_map`` and the rows the kernels take from it, in one launch after a stable sort (which
    gives the permutation of ``tile_map``'s distinct keys): -> (order, tok, dst, wt, tile_expert,
    tile_r0, tile_r1); tok = order // k, dst = order (int32), wt = the routing weight of each sorted
    row (fp32).  In torch these are ~40 small ops a layer, and a small prefill is launch-bound."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    n = flat.numel()
    order = torch.sort(flat, stable=True).indices
    n_tiles = cdiv(n, block_m) + E
    i32 = dict(dtype=torch.int32, device=ids.device)
    tok, dst, te, r0, r1 = (torch.empty(n, **i32), torch.empty(n, **i32), torch.empty(n_tiles, **i32),
                            torch.empty(n_tiles, **i32), torch.empty(n_tiles, **i32))
    wt = torch.empty(n, dtype=torch.float32, device=ids.device)
    EP = max(16, triton.next_power_of_2(E))
    scratch = torch.empty(4 * EP, **i32)
    BN = 1024
    _sorted_map_kernel[(1 + cdiv(n, BN),)](flat.contiguous(), order, weights.reshape(-1).contiguous(), n, E, k,
                                           tok, dst, wt, te, r0, r1, scratch, n_tiles, block_m, EP, BN, 64,
                                           num_warps=8, enable_fp_fusion=FP_FUSION)
    return order, tok, dst, wt, te, r0, r1


@triton.jit
def _slot_sum_kernel(p_c, p_y, N, H, K_SLOTS: tl.constexpr, BLOCK: tl.constexpr):
    """y[t, h] = ((c[t, 0, h] + c[t, 1, h]) + c[t, 2, h]) + ... (``cpu.slot_sum``), N = T·H."""
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < N
    t, h = o // H, o % H
    base = t.to(tl.int64) * K_SLOTS * H + h
    acc = tl.load(p_c + base, mask=m)
    for j in tl.static_range(1, K_SLOTS):
        acc = acc + tl.load(p_c + base + j * H, mask=m)
    tl.store(p_y + o, acc, mask=m)


def row_tile_map(ids: torch.Tensor):
    """One tile per (token, slot) row, in row order, for a batch with fewer
    rows than experts (decode): no sort and a grid of T·k tiles instead of
    ceil(T·k / block_m) + E.  Each row's arithmetic is the same as in the
    sorted map (a tile's other rows never enter it)."""
    flat = ids.reshape(-1).long()
    n = flat.numel()
    r0 = torch.arange(n, dtype=torch.int32, device=ids.device)
    return torch.arange(n, device=ids.device), flat.to(torch.int32), r0, r0 + 1


def experts_fwd_triton(x, ids, weights, w_gate_up, w_down, limit=None, *, lora=None, block_m: int = BLOCK_M,
                       block_n: int = 64, num_warps: int = 4, num_stages: int = 3):
    """``cpu.experts_fwd_cpu``'s contract on CUDA: -> (T, H) fp32 routed sum.
    block_m (>= 64), block_n, num_warps and num_stages are launch knobs: each
    output element is the same K chain whatever the tile around it.  ``lora``:
    an ``ExpertLoRA`` whose terms enter before the SwiGLU and the routing weight."""
    return _launch("bf16", x, ids, weights, (w_gate_up, w_gate_up), (w_down, w_down), limit, lora,
                   block_m, block_n, num_warps, num_stages)


def experts_fwd_mxfp4_triton(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit=None, *, lora=None,
                             block_m: int | None = None, block_n: int = 64, num_warps: int = 4,
                             num_stages: int = 3, swap: bool | None = None, bf16x2: bool | None = None):
    """MXFP4 experts computed packed: each K step decodes its (64 x BLOCK_N) weight tile from the
    codes and scales in registers (nothing unpacked in memory) and runs the bf16 path's dot on it,
    so the bits are ``experts_fwd_triton``'s at the exactly decoded weights (``cpu.experts_fwd_mxfp4_cpu``
    on the CPU).  Same knobs, and ``swap``: the dots as Wᵀ-side first operand (accᵀ = W · inᵀ), so
    the decoded tile feeds the tensor cores from registers; the same bits, on by default on CUDA (the
    faster up to 4096 tokens); its gate-up tile is BLOCK_N / 2 gate rows and their up
    rows.  ``block_m`` by default (``mx_block_m``): larger as the experts get more rows, so each
    decoded tile meets more of them.  ``bf16x2``: decode two weights at once in bf16x2 inline PTX
    (``_E2M1X2_BF16``; bf16 on CUDA only, the default there), the same weights as the fp32 decode."""
    swap = x.is_cuda if swap is None else swap
    packed = x.is_cuda and x.dtype == torch.bfloat16
    if bf16x2 and not packed:
        raise ValueError("bf16x2 decodes bf16 experts on CUDA only")
    mx = 2 if (packed if bf16x2 is None else bf16x2) else 1
    block_m = mx_block_m(ids.numel() / gu_codes.shape[0]) if block_m is None else block_m
    return _launch("mxfp4", x, ids, weights, (gu_codes, gu_scales), (d_codes, d_scales), limit, lora,
                   block_m, block_n, num_warps, num_stages, swap, mx)


def mx_block_m(rows_per_expert: float) -> int:
    """The MXFP4 kernels' default rows a tile for an average of ``rows_per_expert`` (T·k / E).  In bf16,
    64 columns on 4 warps: 256 from 256 rows (GLM-5, 16384 tokens: 33.0 ms against 34.7 at
    128), 128 from 64 (DeepSeek-V4, 4096: 5.9 against 9.1 at 256), else 64."""
    return 256 if rows_per_expert >= 256 else 128 if rows_per_expert >= 64 else BLOCK_M


def experts_fwd_fp8_triton(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit=None, *, lora=None,
                           block_m: int = BLOCK_M, block_n: int = 64, num_warps: int = 4, num_stages: int = 3):
    """``cpu.experts_fwd_fp8_cpu``'s rounding points on CUDA (each 128-wide block dot on the fp8
    tensor cores, as ``fp8/kernel.py``: not the CPU's exactly rounded block dot, so the devices'
    bits differ) -> (T, H) fp32 routed sum.  The same tile map and launch knobs as the bf16 path."""
    return _launch("fp8", x, ids, weights, (gu_codes, gu_scale), (d_codes, d_scale), limit, lora,
                   block_m, block_n, num_warps, num_stages)


def _lora_term(inp, src, a, b, s, tiles, sorted_rows, knobs) -> torch.Tensor:
    """fl32(s * fp32 dot(dtype(fp32 dot(inp[src], A[e])), B[e])) for the sorted rows: (rows, N) fp32;
    ``sorted_rows``: 0 .. rows - 1 (the second product reads t in the sorted order it was written)."""
    t_e, t_r0, t_r1 = tiles
    R, r, N, K = src.shape[0], a.shape[1], b.shape[1], inp.shape[1]
    bn = knobs["BLOCK_N"]
    t = torch.empty(R, r, dtype=inp.dtype, device=inp.device)
    _grouped_linear_kernel[(t_e.shape[0] * cdiv(r, bn),)](inp, src, a.contiguous(), t_e, t_r0, t_r1, t, r, K,
        **knobs, enable_fp_fusion=FP_FUSION)
    u = torch.empty(R, N, dtype=torch.float32, device=inp.device)
    _grouped_linear_kernel[(t_e.shape[0] * cdiv(N, bn),)](t, sorted_rows, b.contiguous(), t_e, t_r0, t_r1, u, N, r,
                                                        **knobs, enable_fp_fusion=FP_FUSION)
    return u * s


def _launch(fmt, x, ids, weights, gate_up, down, limit, lora, block_m, block_n, num_warps, num_stages, swap=False,
            mx=1):
    """The grouped launches of every format; ``gate_up`` / ``down``: (weight or codes, scales) (bf16:
    the weight twice).  With LoRA, the adapters' terms go into the base kernels' accumulators."""
    T, k = ids.shape
    E, I2 = gate_up[0].shape[:2]
    I, H = I2 // 2, x.shape[1]
    if T * k == 0:
        return torch.zeros(T, H, dtype=torch.float32, device=x.device)
    x = x.contiguous()
    (w_gu, s_gu), (w_d, s_d) = ((w.contiguous(), sc.contiguous()) for w, sc in (gate_up, down))
    # a static choice (shapes only): a graph captured for one T keeps it
    if T * k < E:
        order, t_e, t_r0, t_r1 = row_tile_map(ids)
        tok, dst, wt = (order // k).to(torch.int32), order.to(torch.int32), weights.reshape(-1).float()[order]
    else:
        order, tok, dst, wt, t_e, t_r0, t_r1 = sorted_map_triton(ids, weights, E, block_m)
    tiles, n_tiles = (t_e, t_r0, t_r1), t_e.shape[0]
    a = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    c = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    lim = 0.0 if limit is None else limit_in(x.dtype, limit)  # the CPU path's bound (cpu.swiglu_f32)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 experts (tests, fp32 trainers): no tf32 rounding
    knobs = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": BLOCK_K, "PRECISION": prec, "num_warps": num_warps,
             "num_stages": num_stages}
    fp8 = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": FP8_BLOCK, "num_warps": num_warps,
           "num_stages": num_stages}
    has = lora is not None
    sorted_rows = torch.arange(T * k, dtype=torch.int32, device=x.device) if has else None
    d_gu = _lora_term(x, tok, lora.a_gate_up, lora.b_gate_up, lora.s, tiles, sorted_rows, knobs) if has else c
    if fmt == "fp8":
        xq, xs = quantize_act(x)
        _gate_up_fp8_kernel[(n_tiles * cdiv(I, block_n),)](
            xq, xs, w_gu, s_gu, tok, t_e, t_r0, t_r1, a, d_gu, H, I, cdiv(H, FP8_BLOCK), cdiv(I, FP8_BLOCK), lim,
            HAS_LIMIT=limit is not None, HAS_DELTA=has, **fp8, enable_fp_fusion=FP_FUSION)
    else:
        cols = block_n // 2 if swap and fmt == "mxfp4" else block_n  # the swapped tile: gate rows, then up rows
        _gate_up_kernel[(n_tiles * cdiv(I, cols),)](
            x, w_gu, s_gu, tok, t_e, t_r0, t_r1, a, d_gu, H, I, lim, HAS_LIMIT=limit is not None,
            MX=mx if fmt == "mxfp4" else 0, SWAP=swap, HAS_DELTA=has, **knobs, enable_fp_fusion=FP_FUSION)
    d_down = _lora_term(a, sorted_rows, lora.a_down, lora.b_down, lora.s, tiles, sorted_rows, knobs) if has else c
    if fmt == "fp8":
        aq, as_ = quantize_act(a)  # rows in sorted order: row-local, so the order is free
        _down_fp8_kernel[(n_tiles * cdiv(H, block_n),)](
            aq, as_, w_d, s_d, wt, dst, t_e, t_r0, t_r1, c, d_down, H, I, cdiv(I, FP8_BLOCK), cdiv(H, FP8_BLOCK),
            HAS_DELTA=has, **fp8, enable_fp_fusion=FP_FUSION)
    else:
        _down_kernel[(n_tiles * cdiv(H, block_n),)](
            a, w_d, s_d, wt, dst, t_e, t_r0, t_r1, c, d_down, H, I, MX=mx if fmt == "mxfp4" else 0, SWAP=swap,
            HAS_DELTA=has, **knobs, enable_fp_fusion=FP_FUSION)
    y = torch.empty(T, H, dtype=torch.float32, device=x.device)
    _slot_sum_kernel[(cdiv(T * H, 1024),)](c, y, T * H, H, k, 1024, enable_fp_fusion=FP_FUSION, num_warps=4)
    return y
