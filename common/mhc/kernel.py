"""Triton kernel for the mHC mixer weights (norm, fn dot, sigmoid / softmax, Sinkhorn), in ``cpu.py``'s order.

One program per token (its hc streams, K = hc·D values):

    pass 1  ss   = tree_sum_k(x·x): P = next_pow2(K) lanes (masked lanes +0.0); P <= 256: one pairwise tree
                   (``rmsnorm.kernel._row_tree_sum``: reshape + split + element-wise +, so the order is fixed by the
                   tensor semantics, not the layout); else NC = P / 256 chunks added lane-wise in order from 0,
                   then the 8-level tree.  rstd = div_rn(1, sqrt_rn(div_rn(ss, K) + norm_eps)) (``_rstd``).
    pass 2  mix[j] = the same order over fl(fl(x[k]·rstd) · fn[j, k]) for the pre, post and comb rows of fn
                   (three (rows, 256) accumulators), then the activations lane by lane:
            pre  = sig(mix·s0 + b) + hc_eps,  post = 2·sig(mix·s1 + b),   sig(z) = div_rn(1, 1 + exp(-z))
            comb = div_rn(e, rowtree(e)) + hc_eps, e = exp(z - max_j z); then a column step and
                   (iters - 1) × (row, column) steps c = div_rn(c, tree(c) + hc_eps), trees over hc lanes.

Compiled with ``enable_fp_fusion=False`` (no FMA) and every division rounded to nearest, so each op rounds where
``cpu.py`` rounds: under the interpreter (torch's exp patched in) the kernel gives the CPU path's bits.  On CUDA
exp is libdevice's (torch's CUDA exp), which may differ from the CPU's MKL exp in the last bit: rstd and mix keep
the CPU bits, pre / post / comb are close, not promised equal.  hc must be a power of two (4 in DeepSeek-V4).
No tl.dot: its order is the hardware's.

The collapse and the mix (``_hc_collapse_kernel``, ``_hc_mix_kernel``: one program per token and BLOCK_D columns)
are ``cpu.py``'s element-wise formulas lane by lane: the streams left to right, the first term without a 0 +, fp32
products and sums, the casts to the stream dtype where ``cpu.py`` casts (round to nearest even).  No exp and no
division, so they are expected to give the CPU bits on CUDA too.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._launch import FP_FUSION
from ..gdn.kernel import _exp, _launch_opts
from ..rmsnorm.cpu import ROW_CHUNK, tree_width
from ..rmsnorm.kernel import _col_tree_sum, _row_tree_sum, _rstd


@triton.jit
def _products(p_x, p_fn, b_rstd, o_k, rows, K):
    """fp32 (rows, CHUNK) tile fl(fl(x[k]·rstd) · fn[row, k]) of one chunk of the token's row; masked lanes +0.0."""
    m_k = o_k < K
    b_n = tl.load(p_x + o_k[None, :], mask=m_k[None, :], other=0.0).to(tl.float32) * b_rstd[:, None]
    b_fn = tl.load(p_fn + rows[:, None] * K + o_k[None, :], mask=m_k[None, :], other=0.0)
    return b_n * b_fn


@triton.jit
def _sigmoid(z, HC: tl.constexpr, LIB: tl.constexpr):
    return tl.math.div_rn(tl.full((HC,), 1.0, tl.float32), 1.0 + _exp(-z, LIB))


@triton.jit
def _hc_weights_kernel(p_x, p_fn, p_base, p_scale, p_pre, p_post, p_comb, p_rstd, p_mix, norm_eps, hc_eps, iters,
                       K: tl.constexpr, M: tl.constexpr, HC: tl.constexpr, LOG2_HC: tl.constexpr, CHUNK: tl.constexpr,
                       LOG2_CHUNK: tl.constexpr, NC: tl.constexpr, HEAD: tl.constexpr, LIB: tl.constexpr):
    i_t = tl.program_id(0).to(tl.int64)
    p_x += i_t * K
    o_c = tl.arange(0, CHUNK)
    o_h = tl.arange(0, HC)
    o_hh = tl.arange(0, HC * HC)
    if NC == 1:
        b_x = tl.load(p_x + o_c, mask=o_c < K, other=0.0).to(tl.float32)
        b_ss = _row_tree_sum(tl.reshape(b_x * b_x, (1, CHUNK)), 1, LOG2_CHUNK)
    else:
        b_acc = tl.zeros((CHUNK,), dtype=tl.float32)
        for i_c in range(NC):
            b_x = tl.load(p_x + i_c * CHUNK + o_c, mask=i_c * CHUNK + o_c < K, other=0.0).to(tl.float32)
            b_acc = b_acc + b_x * b_x
        b_ss = _row_tree_sum(tl.reshape(b_acc, (1, CHUNK)), 1, LOG2_CHUNK)
    b_rstd = _rstd(b_ss, K, norm_eps, 1)  # (1,)
    tl.store(p_rstd + i_t + tl.arange(0, 1), b_rstd)

    if NC == 1:
        b_pre = _products(p_x, p_fn, b_rstd, o_c, o_h, K)
        if not HEAD:
            b_post = _products(p_x, p_fn, b_rstd, o_c, HC + o_h, K)
            b_comb = _products(p_x, p_fn, b_rstd, o_c, 2 * HC + o_hh, K)
    else:
        b_pre = tl.zeros((HC, CHUNK), dtype=tl.float32)
        b_post = tl.zeros((HC, CHUNK), dtype=tl.float32)
        b_comb = tl.zeros((HC * HC, CHUNK), dtype=tl.float32)
        for i_c in range(NC):
            o_k = i_c * CHUNK + o_c
            b_pre = b_pre + _products(p_x, p_fn, b_rstd, o_k, o_h, K)
            if not HEAD:
                b_post = b_post + _products(p_x, p_fn, b_rstd, o_k, HC + o_h, K)
                b_comb = b_comb + _products(p_x, p_fn, b_rstd, o_k, 2 * HC + o_hh, K)
    p_mix += i_t * M
    b_m = _row_tree_sum(b_pre, HC, LOG2_CHUNK)
    tl.store(p_mix + o_h, b_m)
    b_pre = _sigmoid(b_m * tl.load(p_scale) + tl.load(p_base + o_h), HC, LIB) + hc_eps
    tl.store(p_pre + i_t * HC + o_h, b_pre)
    if not HEAD:
        b_m = _row_tree_sum(b_post, HC, LOG2_CHUNK)
        tl.store(p_mix + HC + o_h, b_m)
        b_post = 2.0 * _sigmoid(b_m * tl.load(p_scale + 1) + tl.load(p_base + HC + o_h), HC, LIB)
        tl.store(p_post + i_t * HC + o_h, b_post)

        b_m = _row_tree_sum(b_comb, HC * HC, LOG2_CHUNK)
        tl.store(p_mix + 2 * HC + o_hh, b_m)
        b_z = tl.reshape(b_m * tl.load(p_scale + 2) + tl.load(p_base + 2 * HC + o_hh), (HC, HC))
        b_e = _exp(b_z - tl.max(b_z, axis=1)[:, None], LIB)
        b_s = tl.broadcast_to(_row_tree_sum(b_e, HC, LOG2_HC)[:, None], (HC, HC))
        b_c = tl.math.div_rn(b_e, b_s) + hc_eps
        b_s = tl.broadcast_to(_col_tree_sum(b_c, HC, HC, LOG2_HC)[None, :] + hc_eps, (HC, HC))
        b_c = tl.math.div_rn(b_c, b_s)
        for _ in range(iters - 1):
            b_s = tl.broadcast_to(_row_tree_sum(b_c, HC, LOG2_HC)[:, None] + hc_eps, (HC, HC))
            b_c = tl.math.div_rn(b_c, b_s)
            b_s = tl.broadcast_to(_col_tree_sum(b_c, HC, HC, LOG2_HC)[None, :] + hc_eps, (HC, HC))
            b_c = tl.math.div_rn(b_c, b_s)
        tl.store(p_comb + i_t * HC * HC + tl.reshape(o_hh, (HC, HC)), b_c)


@triton.jit
def _hc_collapse_kernel(p_x, p_pre, p_y, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[d] = dtype(((pre_0 · x_0[d] + pre_1 · x_1[d]) + ...)."""
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_acc = tl.load(p_pre + i_t * HC) * tl.load(p_x + i_t * HC * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    for i in tl.static_range(1, HC):
        b_x = tl.load(p_x + (i_t * HC + i) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_acc = b_acc + tl.load(p_pre + i_t * HC + i) * b_x
    tl.store(p_y + i_t * D + o_d, b_acc.to(p_y.dtype.element_ty), mask=m_d)


@triton.jit
def _comb_term(p_comb, p_h, i_t, j, o_k, o_d, m_d, D, HC: tl.constexpr, dtype):
    """(HC, BLOCK_D) fp32 tile dtype(comb[j, k]) · h_j[d] (exact for bf16: 8 + 8 significand bits)."""
    b_c = tl.load(p_comb + (i_t * HC + j) * HC + o_k).to(dtype).to(tl.float32)
    b_h = tl.load(p_h + (i_t * HC + j) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    return b_c[:, None] * b_h[None, :]


@triton.jit
def _hc_mix_kernel(p_out, p_h, p_post, p_comb, p_y, D, HC: tl.constexpr, BLOCK_D: tl.constexpr):
    """y[k, d] = dtype(dtype(dtype(post_k) · out[d]) + dtype(Σ_j dtype(comb[j, k]) · h_j[d]))."""
    i_t = tl.program_id(0).to(tl.int64)
    o_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    o_k = tl.arange(0, HC)
    m_d = o_d < D
    dtype = p_y.dtype.element_ty
    b_out = tl.load(p_out + i_t * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_post = tl.load(p_post + i_t * HC + o_k).to(dtype).to(tl.float32)
    b_expand = (b_post[:, None] * b_out[None, :]).to(dtype).to(tl.float32)  # (HC, BLOCK_D)
    b_res = _comb_term(p_comb, p_h, i_t, 0, o_k, o_d, m_d, D, HC, dtype)
    for j in tl.static_range(1, HC):
        b_res = b_res + _comb_term(p_comb, p_h, i_t, j, o_k, o_d, m_d, D, HC, dtype)
    b_y = (b_expand + b_res.to(dtype).to(tl.float32)).to(dtype)
    tl.store(p_y + (i_t * HC + o_k[:, None]) * D + o_d[None, :], b_y, mask=m_d[None, :])


BLOCK_D = 1024  # columns a program (a launch knob: columns never mix)


def hc_collapse_triton(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x (T, hc, D), pre (T, hc) fp32 -> (T, D) in x's dtype: ``cpu.hc_collapse_cpu``'s bits."""
    T, hc, D = x.shape
    y = torch.empty(T, D, dtype=x.dtype, device=x.device)
    if T:
        block = min(BLOCK_D, tree_width(D))
        _hc_collapse_kernel[(T, triton.cdiv(D, block))](x.contiguous(), pre.contiguous(), y, D, HC=hc,
                                                        BLOCK_D=block, enable_fp_fusion=FP_FUSION, num_warps=4)
    return y


def hc_mix_triton(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out (T, D), h (T, hc, D); post (T, hc), comb (T, hc, hc) fp32 -> (T, hc, D): ``cpu.hc_mix_cpu``'s bits."""
    T, hc, D = h.shape
    if hc & (hc - 1):
        raise ValueError(f"the Triton mHC kernels need hc a power of two, got hc = {hc}")
    y = torch.empty_like(h)
    if T:
        block = min(BLOCK_D, tree_width(D))
        _hc_mix_kernel[(T, triton.cdiv(D, block))](out.contiguous(), h.contiguous(), post.contiguous(),
                                                   comb.contiguous(), y, D, HC=hc, BLOCK_D=block,
                                                   enable_fp_fusion=FP_FUSION, num_warps=4)
    return y


def hc_weights_triton(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
                      hc_eps: float, norm_eps: float):
    """x (T, hc, D); fn (M, hc·D) fp32 with M = (2 + hc)·hc, or hc for the head -> pre (T, hc), post (T, hc) | None,
    comb (T, hc, hc) | None, rstd (T,), mix (T, M): ``cpu.hc_weights_cpu``'s outputs and order."""
    T, hc, D = x.shape
    if hc & (hc - 1):
        raise ValueError(f"the Triton mHC kernels need hc a power of two, got hc = {hc}")
    K, M = hc * D, fn.shape[0]
    head = M == hc
    P = tree_width(K)
    chunk = min(P, ROW_CHUNK)
    f32 = dict(dtype=torch.float32, device=x.device)
    pre, rstd, mix = torch.empty(T, hc, **f32), torch.empty(T, **f32), torch.empty(T, M, **f32)
    post = None if head else torch.empty(T, hc, **f32)
    comb = None if head else torch.empty(T, hc, hc, **f32)
    if T == 0:
        return pre, post, comb, rstd, mix
    lib, opts = _launch_opts(x)
    _hc_weights_kernel[(T,)](
        x.contiguous(), fn.contiguous(), base.contiguous(), scale.contiguous(), pre, pre if head else post,
        pre if head else comb, rstd, mix, float(norm_eps), float(hc_eps), int(sinkhorn_iters),
        K=K, M=M, HC=hc, LOG2_HC=hc.bit_length() - 1, CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, NC=P // chunk,
        HEAD=head, LIB=lib, **opts, enable_fp_fusion=FP_FUSION, num_warps=4,
    )
    return pre, post, comb, rstd, mix
