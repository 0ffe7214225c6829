"""matmul: launchers (server), autograd Function and the public op (trainer).

Both sides reach the same ``matmul_fwd``: the server calls it directly, the
trainer through ``matmul`` (which adds the backward).  Same launcher, same bits.
"""
from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from .cpu import matmul_fwd_cpu


def matmul_fwd(x: torch.Tensor, w: torch.Tensor, **launch) -> torch.Tensor:
    """y = x · wᵀ, fp32 accumulation in the fixed order of the device's path,
    rounded once to x.dtype.  x: (M, K), w: (N, K) -> (M, N).

    ``launch`` holds free launch knobs (CPU: ``row_chunk``; CUDA: ``block_m``,
    ``schedule``, ``num_warps``) that the rung-2 checks vary; none changes bits.
    """
    if x.is_cuda:
        from .kernel import matmul_fwd_triton

        return matmul_fwd_triton(x, w, **launch)
    return matmul_fwd_cpu(x, w, **launch)


def backward_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a · b for a backward pass, which needs determinism run to run, not batch
    invariance: on CUDA cuBLAS (one algorithm per shape, no atomics: the same
    bits every run, at tensor-core speed; our fixed-order kernel on these
    transposed operands runs at half its forward rate), on the CPU ``matmul_fwd`` (fixed order)."""
    if a.is_cuda:
        return torch.mm(a, b)
    return matmul_fwd(a, b.t())


def matmul_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, *, need_dx: bool = True,
               need_dw: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """dX = dY · W (reduction over N), dW = dYᵀ · X (reduction over the M tokens),
    each deterministic run to run (``backward_mm``).  A gradient not needed
    (a frozen base weight under LoRA) is not formed: dW costs as much as the
    forward."""
    dx = backward_mm(dy, w) if need_dx else None  # (M, N) · (N, K)
    dw = backward_mm(dy.t(), x).to(w.dtype) if need_dw else None  # (N, M) · (M, K)
    return dx, dw


class _Matmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return matmul_fwd(x, w)

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        return matmul_bwd(x, w, dy.contiguous(), need_dx=ctx.needs_input_grad[0], need_dw=ctx.needs_input_grad[1])


def matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Batch-invariant ``x · wᵀ`` (a bias-free linear layer) with autograd.

    x: (..., K) bf16 or fp32, contiguous; w: (N, K) same dtype -> (..., N).
    Row i of the output depends only on row i of x and on w: its bits are the
    same whatever else is in the batch.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=range(1, 8))
    check_tensor("w", w, dtypes=(x.dtype,), ndim=2)
    check_same_device(x=x, w=w)
    if x.shape[-1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[-1]} but w has shape {tuple(w.shape)} (expected (N, {x.shape[-1]}))")
    lead = x.shape[:-1]
    y = _Matmul.apply(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[0])
