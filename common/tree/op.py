"""Fixed-order reduction tree: combine N partial tensors in a given logical order.

Used for MoE expert-output combines and (later) for collectives: contributors
are exchanged without reducing, put in logical order, then reduced here.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .._validate import check_tensor
from .cpu import tree_reduce_cpu

_MAX_PARTS = 256


def tree_reduce_fwd(parts: torch.Tensor, out_dtype: torch.dtype, **launch) -> torch.Tensor:
    if parts.is_cuda:
        from .kernel import tree_reduce_triton

        return tree_reduce_triton(parts, out_dtype, **launch)
    return tree_reduce_cpu(parts, out_dtype)


class _TreeReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, parts, out_dtype):
        ctx.n, ctx.in_dtype = parts.shape[0], parts.dtype
        return tree_reduce_fwd(parts, out_dtype)

    @staticmethod
    def backward(ctx, dy):
        # d(sum)/d(part) = 1 for every contributor
        return dy.to(ctx.in_dtype).unsqueeze(0).expand(ctx.n, *dy.shape).contiguous(), None


def tree_reduce(parts: torch.Tensor | Sequence[torch.Tensor], out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum N contributions in logical order: pairwise in float64, an odd one
    carried up unchanged, rounded once to ``out_dtype`` (default: input dtype).

    parts: (N, ...) tensor or a sequence of N same-shaped tensors -> (...).
    """
    if not isinstance(parts, torch.Tensor):
        parts = list(parts)
        if not parts:
            raise ValueError("tree_reduce needs at least one contribution")
        shapes = {tuple(p.shape) for p in parts}
        if len(shapes) > 1:
            raise ValueError(f"tree_reduce contributions have different shapes: {sorted(shapes)}")
        parts = torch.stack(parts)
    check_tensor("parts", parts, dtypes=(torch.bfloat16, torch.float16, torch.float32, torch.float64), ndim=range(1, 9))
    if parts.shape[0] == 0:
        raise ValueError("tree_reduce needs at least one contribution")
    if parts.shape[0] > _MAX_PARTS:
        raise ValueError(f"tree_reduce takes at most {_MAX_PARTS} contributions, got {parts.shape[0]}")
    return _TreeReduce.apply(parts, out_dtype or parts.dtype)
