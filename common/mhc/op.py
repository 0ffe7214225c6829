"""DeepSeek-V4's hyper-connections: launchers, autograd Functions and the public functions.

The server calls the launchers (``hc_weights_fwd``, ``hc_collapse_fwd``, ``hc_mix_fwd``, ``hc_head_fwd``); the
trainer calls ``hyper_connection``, ``hc_mix`` and ``hyper_head``, which run the same launchers, so both sides get
the same bits.  Order and rounding points: ``cpu.py`` (CPU) and ``kernel.py`` (the CUDA kernels: weights, collapse,
mix).

Gradients: as in transformers, pre, post and comb are differentiable functions of the streams, fn, base and
scale, so the backward reaches the streams four ways (the norm and fn, the collapse, the mix's comb term, and the
block's input) and fn, base, scale through pre, post and comb.  The softmax's max is held constant (its gradient
is zero).  Every backward is ``cpu.py``'s element-wise path on either device: deterministic run to run.
"""
from __future__ import annotations

import math
import numbers

import torch

from .._validate import FLOAT_DTYPES, check_int, check_same_device, check_tensor
from .cpu import (hc_collapse_bwd_cpu, hc_collapse_cpu, hc_mix_bwd_cpu, hc_mix_cpu, hc_weights_bwd_cpu,
                  hc_weights_cpu)


def _weights(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
    if x.is_cuda and x.shape[0] > 0:
        from .kernel import hc_weights_triton

        return hc_weights_triton(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return hc_weights_cpu(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)


def _collapse(x, pre):
    if x.is_cuda:
        from .kernel import hc_collapse_triton

        return hc_collapse_triton(x, pre)
    return hc_collapse_cpu(x, pre)


def hc_weights_fwd(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
                   hc_eps: float, norm_eps: float):
    """No validation (the server's hot path).  x (*, hc, D); fn ((2 + hc)·hc, hc·D), base ((2 + hc)·hc,), scale (3,)
    fp32 -> pre (*, hc), post (*, hc), comb (*, hc, hc), rstd (*,), mix (*, (2 + hc)·hc), all fp32."""
    lead, (hc, D) = x.shape[:-2], x.shape[-2:]
    pre, post, comb, rstd, mix = _weights(x.reshape(-1, hc, D), fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
    return (pre.view(*lead, hc), post.view(*lead, hc), comb.view(*lead, hc, hc), rstd.view(lead),
            mix.view(*lead, fn.shape[0]))


def hc_collapse_fwd(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x (*, hc, D), pre (*, hc) fp32 -> dtype(Σ_i pre_i · x_i) (*, D)."""
    hc, D = x.shape[-2:]
    return _collapse(x.reshape(-1, hc, D), pre.reshape(-1, hc)).view(*x.shape[:-2], D)


def hc_mix_fwd(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """block_out (*, D), streams (*, hc, D), post (*, hc), comb (*, hc, hc) fp32 -> the next streams (*, hc, D)."""
    hc, D = streams.shape[-2:]
    args = (block_out.reshape(-1, D), streams.reshape(-1, hc, D), post.reshape(-1, hc), comb.reshape(-1, hc, hc))
    if streams.is_cuda:
        from .kernel import hc_mix_triton

        return hc_mix_triton(*args).view(streams.shape)
    return hc_mix_cpu(*args).view(streams.shape)


def hc_head_fwd(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                norm_eps: float):
    """x (*, hc, D); fn (hc, hc·D), base (hc,), scale (1,) fp32 -> collapsed (*, D), pre (*, hc), rstd (*,),
    mix (*, hc)."""
    lead, (hc, D) = x.shape[:-2], x.shape[-2:]
    x2 = x.reshape(-1, hc, D)
    pre, _, _, rstd, mix = _weights(x2, fn, base, scale, 1, hc_eps, norm_eps)
    return _collapse(x2, pre).view(*lead, D), pre.view(*lead, hc), rstd.view(lead), mix.view(*lead, hc)


def hc_weights_bwd(x, fn, base, scale, rstd, mix, sinkhorn_iters, hc_eps, dpre, dpost=None, dcomb=None):
    """x (*, hc, D); rstd (*,), mix (*, M) from the forward; dpre, dpost (*, hc), dcomb (*, hc, hc) fp32 or None
    -> dx (*, hc, D) fp32 (through the norm), dfn (M, hc·D), dbase (M,), dscale (3,) or (1,)."""
    hc, D = x.shape[-2:]
    flat = (lambda t, *s: None if t is None else t.reshape(-1, *s))
    dx, dfn, dbase, dscale = hc_weights_bwd_cpu(
        x.reshape(-1, hc, D), fn, base, scale, rstd.reshape(-1), mix.reshape(-1, fn.shape[0]), sinkhorn_iters,
        hc_eps, flat(dpre, hc), flat(dpost, hc), flat(dcomb, hc, hc))
    return dx.view(x.shape), dfn, dbase, dscale


def hc_collapse_bwd(g: torch.Tensor, x: torch.Tensor, pre: torch.Tensor):
    """g (*, D) -> dx (*, hc, D) fp32, dpre (*, hc) fp32."""
    hc, D = x.shape[-2:]
    dx, dpre = hc_collapse_bwd_cpu(g.reshape(-1, D), x.reshape(-1, hc, D), pre.reshape(-1, hc))
    return dx.view(x.shape), dpre.view(pre.shape)


def hc_mix_bwd(dy, block_out, streams, post, comb):
    """dy (*, hc, D) -> dblock_out (*, D), dstreams (*, hc, D) in the streams' dtype; dpost, dcomb fp32."""
    hc, D = streams.shape[-2:]
    dout, dh, dpost, dcomb = hc_mix_bwd_cpu(dy.reshape(-1, hc, D), block_out.reshape(-1, D),
                                            streams.reshape(-1, hc, D), post.reshape(-1, hc), comb.reshape(-1, hc, hc))
    return dout.view(block_out.shape), dh.view(streams.shape), dpost.view(post.shape), dcomb.view(comb.shape)


class _HyperConnectionFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps):
        pre, post, comb, rstd, mix = hc_weights_fwd(x, fn, base, scale, sinkhorn_iters, hc_eps, norm_eps)
        collapsed = hc_collapse_fwd(x, pre)
        ctx.save_for_backward(x, fn, base, scale, pre, rstd, mix)
        ctx.args = (sinkhorn_iters, hc_eps)
        return post, comb, collapsed

    @staticmethod
    def backward(ctx, dpost, dcomb, dcollapsed):
        x, fn, base, scale, pre, rstd, mix = ctx.saved_tensors
        dx_c, dpre = hc_collapse_bwd(dcollapsed, x, pre)
        dx, dfn, dbase, dscale = hc_weights_bwd(x, fn, base, scale, rstd, mix, *ctx.args, dpre, dpost, dcomb)
        return (dx + dx_c).to(x.dtype), dfn, dbase, dscale, None, None, None


class _MixFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, block_out, streams, post, comb):
        ctx.save_for_backward(block_out, streams, post, comb)
        return hc_mix_fwd(block_out, streams, post, comb)

    @staticmethod
    def backward(ctx, dy):
        return hc_mix_bwd(dy, *ctx.saved_tensors)


class _HyperHeadFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, base, scale, hc_eps, norm_eps):
        collapsed, pre, rstd, mix = hc_head_fwd(x, fn, base, scale, hc_eps, norm_eps)
        ctx.save_for_backward(x, fn, base, scale, pre, rstd, mix)
        ctx.hc_eps = hc_eps
        return collapsed

    @staticmethod
    def backward(ctx, dcollapsed):
        x, fn, base, scale, pre, rstd, mix = ctx.saved_tensors
        dx_c, dpre = hc_collapse_bwd(dcollapsed, x, pre)
        dx, dfn, dbase, dscale = hc_weights_bwd(x, fn, base, scale, rstd, mix, 1, ctx.hc_eps, dpre)
        return (dx + dx_c).to(x.dtype), dfn, dbase, dscale, None, None


def _check_eps(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite real number >= 0, got {v!r}")
    return float(v)


def _check_weights(x, fn, base, scale, rows_per_hc: int, n_scales: int) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 3 or x.shape[-2] < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape (*, hc, D) with * non-empty, got shape {tuple(x.shape)}")
    hc, D = x.shape[-2:]
    M = (rows_per_hc + hc) * hc if rows_per_hc else hc
    for name, t, shape in (("fn", fn, (M, hc * D)), ("base", base, (M,)), ("scale", scale, (n_scales,))):
        check_tensor(name, t, dtypes=(torch.float32,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} for x's hc = {hc}, D = {D}, got {tuple(t.shape)}")
    check_same_device(x=x, fn=fn, base=base, scale=scale)


def hyper_connection(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                     sinkhorn_iters: int = 20, hc_eps: float = 1e-6, norm_eps: float = 1e-6):
    """transformers' ``DeepseekV4HyperConnection.forward``: the mixer weights and the collapsed block input.

    x (*, hc, D) bf16 or fp32 streams; fn ((2 + hc)·hc, hc·D), base ((2 + hc)·hc,), scale (3,) fp32
    -> post (*, hc) fp32, comb (*, hc, hc) fp32, collapsed (*, D) in x's dtype.
    Each token's outputs depend only on its own streams (batch-invariant).
    """
    _check_weights(x, fn, base, scale, 2, 3)
    check_int("sinkhorn_iters", sinkhorn_iters)
    return _HyperConnectionFn.apply(x, fn, base, scale, sinkhorn_iters, _check_eps("hc_eps", hc_eps),
                                    _check_eps("norm_eps", norm_eps))


def hc_mix(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """The decoder layer's mix: dtype(post_k) · block_out + Σ_j dtype(comb[j, k]) · streams_j, in the streams' dtype.

    block_out (*, D), streams (*, hc, D) of one dtype; post (*, hc), comb (*, hc, hc) fp32 -> (*, hc, D).
    """
    check_tensor("streams", streams, dtypes=FLOAT_DTYPES)
    if streams.dim() < 3:
        raise ValueError(f"streams must have shape (*, hc, D), got shape {tuple(streams.shape)}")
    lead, (hc, D) = tuple(streams.shape[:-2]), streams.shape[-2:]
    for name, t, shape, dtype in (("block_out", block_out, lead + (D,), streams.dtype),
                                  ("post", post, lead + (hc,), torch.float32),
                                  ("comb", comb, lead + (hc, hc), torch.float32)):
        check_tensor(name, t, dtypes=(dtype,))
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must have shape {shape} to match streams {tuple(streams.shape)}, "
                             f"got {tuple(t.shape)}")
    check_same_device(block_out=block_out, streams=streams, post=post, comb=comb)
    return _MixFn.apply(block_out, streams, post, comb)


def hyper_head(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float = 1e-6,
               norm_eps: float = 1e-6) -> torch.Tensor:
    """transformers' ``DeepseekV4HyperHead.forward``: the final collapse of the streams.

    x (*, hc, D) bf16 or fp32; fn (hc, hc·D), base (hc,), scale (1,) fp32 -> (*, D) in x's dtype.
    """
    _check_weights(x, fn, base, scale, 0, 1)
    return _HyperHeadFn.apply(x, fn, base, scale, _check_eps("hc_eps", hc_eps), _check_eps("norm_eps", norm_eps))
