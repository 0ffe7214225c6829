"""RMSNorm: launchers, autograd Functions and the public functions.

The server calls ``rmsnorm_fwd`` directly; the trainer calls ``rmsnorm`` /
``rmsnorm_residual`` / ``rmsnorm_gated``, which run the same launcher, so both
sides get the same bits.  Reduction order and rounding points: ``kernel.py``
(CUDA) and ``cpu.py`` (CPU) docstrings.
"""
from __future__ import annotations

import math
import numbers

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from .cpu import rmsnorm_bwd_cpu, rmsnorm_fwd_cpu

MAX_H = 32768  # the CUDA forward normalises a whole row (next_pow2(H) fp32 lanes) as one element-wise tile


def rmsnorm_fwd(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
):
    """Forward of the three variants, no validation (the server's hot path).

    x, residual, z: (*, H); w: (H,)
    -> (y (*, H), new_residual (*, H) or None, rstd (*,) fp32).
    ``residual`` given: fused add, y = norm(dtype(x + residual)).  ``z`` given:
    gated, y = norm(x) * SiLU(z).  ``block_rows`` (rows per program / CPU row
    chunk) and ``num_warps`` (CUDA only) are launch knobs that never change bits.
    """
    shape = x.shape
    H = shape[-1]
    x2 = x.reshape(-1, H)  # (M, H)
    r2 = None if residual is None else residual.reshape(-1, H)
    z2 = None if z is None else z.reshape(-1, H)
    if x.is_cuda:
        from .kernel import rmsnorm_fwd_triton

        y, new_res, rstd = rmsnorm_fwd_triton(x2, w, eps, r2, z2, block_rows, num_warps)
    else:
        y, new_res, rstd = rmsnorm_fwd_cpu(x2, w, eps, r2, z2, block_rows)
    return y.view(shape), None if new_res is None else new_res.view(shape), rstd.view(shape[:-1])


def rmsnorm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    dres: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
):
    """Backward of the three variants -> (dx, dz or None, dw).

    dy, x, dres, z: (*, H); rstd: (*,) from ``rmsnorm_fwd``.  For the fused
    variant x is the new residual and ``dres`` the gradient reaching it; dx is
    then the gradient of both x and residual.  dw sums over rows in a fixed
    order (deterministic run to run).
    """
    shape = x.shape
    H = shape[-1]
    unweighted = w is None
    if unweighted:  # d(x * rstd): the weighted backward at w = 1, no dw
        w = torch.ones(H, dtype=torch.float32, device=x.device)
    args = (
        dy.contiguous().reshape(-1, H),
        x.reshape(-1, H),
        w,
        rstd.reshape(-1),
        None if dres is None else dres.contiguous().reshape(-1, H),
        None if z is None else z.reshape(-1, H),
    )
    if x.is_cuda:
        from .kernel import rmsnorm_bwd_triton

        dx, dz, dw = rmsnorm_bwd_triton(*args)
    else:
        dx, dz, dw = rmsnorm_bwd_cpu(*args)
    return dx.view(shape), None if dz is None else dz.view(shape), None if unweighted else dw


class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, eps):
        y, _, rstd = rmsnorm_fwd(x, w, eps)
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, rstd = ctx.saved_tensors
        dx, _, dw = rmsnorm_bwd(dy, x, w, rstd)
        return dx, dw, None


class _RMSNormResidualFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, w, eps):
        y, new_res, rstd = rmsnorm_fwd(x, w, eps, residual=residual)
        ctx.save_for_backward(new_res, w, rstd)
        return y, new_res

    @staticmethod
    def backward(ctx, dy, dres):
        new_res, w, rstd = ctx.saved_tensors
        dsum, _, dw = rmsnorm_bwd(dy, new_res, w, rstd, dres=dres)
        # x and residual enter only through their sum; separate tensors so an
        # in-place update of one .grad cannot touch the other.
        return dsum, dsum.clone(), dw, None


class _RMSNormGatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, w, eps):
        y, _, rstd = rmsnorm_fwd(x, w, eps, z=z)
        ctx.save_for_backward(x, z, w, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, z, w, rstd = ctx.saved_tensors
        dx, dz, dw = rmsnorm_bwd(dy, x, w, rstd, z=z)
        return dx, dz, dw, None


def _check(x: torch.Tensor, w: torch.Tensor, eps: float, **others: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"x must have shape (*, H) with H >= 1, got shape {tuple(x.shape)}")
    H = x.shape[-1]
    if H > MAX_H:
        raise ValueError(f"x: row width H = {H} is above the supported maximum {MAX_H}")
    if w is not None:
        check_tensor("w", w, dtypes=(x.dtype, torch.float32), ndim=1)
        if w.shape[0] != H:
            raise ValueError(f"w must have shape ({H},) to match the last dim of x, got {tuple(w.shape)}")
        check_same_device(x=x, w=w)
    for name, t in others.items():
        check_tensor(name, t, dtypes=(x.dtype,))
        if t.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    check_same_device(x=x, **others)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite real number >= 0, got {eps!r}")


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3 RMSNorm: y = dtype(dtype(x * rsqrt(mean(x^2) + eps)) * w).

    x: (*, H) bf16 or fp32, contiguous; w: (H,) of x's dtype -> y: (*, H).  An fp32 w beside a bf16 x is
    DeepseekV4RMSNorm (its norms keep fp32 weights): y = dtype(w * (x * rsqrt(...))), one rounding; dw fp32.
    Each row's bits depend only on that row and w (batch-invariant).
    """
    _check(x, w, eps)
    return _RMSNormFn.apply(x, w, float(eps))


class _RMSNormUnweightedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, eps):
        y, _, rstd = rmsnorm_fwd(x, None, eps)
        ctx.save_for_backward(x, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, rstd = ctx.saved_tensors
        return rmsnorm_bwd(dy, x, None, rstd)[0], None


def rmsnorm_unweighted(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """DeepseekV4UnweightedRMSNorm (its per-head q norm): y = dtype(x * dtype(rsqrt(mean(x^2) + eps))).

    x: (*, H) bf16 or fp32, contiguous -> y: (*, H); the same row sum and rstd as ``rmsnorm``.
    """
    _check(x, None, eps)
    return _RMSNormUnweightedFn.apply(x, float(eps))


def rmsnorm_residual(
    x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm -> (normed, new_residual).

    x, residual: (*, H); w: (H,).  new_residual = dtype(fp32(x) + fp32(residual))
    (one rounding); normed is bit-identical to ``rmsnorm(new_residual, w, eps)``.
    """
    _check(x, w, eps, residual=residual)
    return _RMSNormResidualFn.apply(x, residual, w, float(eps))


def rmsnorm_gated(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Qwen3.5 GDN output norm (Qwen3_5MoeRMSNormGated): dtype(rmsnorm(x, w) * SiLU(fp32(z))).

    x, z: (*, H); w: (H,).  The norm part is bit-identical to ``rmsnorm(x, w, eps)``;
    the gate multiplies in fp32 and rounds once.
    """
    _check(x, w, eps, z=z)
    return _RMSNormGatedFn.apply(x, z, w, float(eps))
