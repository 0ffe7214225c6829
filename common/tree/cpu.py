"""Fixed-order reduction trees on the CPU.

``tree_reduce_cpu`` (N partial tensors): level by level, neighbours (0,1),
(2,3), ... are added in float64; an odd last one is carried up unchanged;
repeat until one is left; round once.  Every step is an element-wise float64
add of two slices, which rounds each element on its own, so an element's
result depends only on that element's N contributions and their logical
order — never on the tensor's size.

``pairwise_tree`` (one dim of one tensor, in its own dtype): the dim padded to
``tree_width`` lanes, then x[2m] op x[2m+1] level by level.  The CPU paths'
row trees (RMSNorm, LM head, MoE routers, gated DeltaNet) all call it; each
picks its op and its padding value (the op's identity: -0.0 or +0.0 for a
sum, -inf for a max), which is part of its contract.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def tree_width(n: int) -> int:
    """Lanes of a pairwise tree over n values: n padded up to a power of two (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pad_to(x: torch.Tensor, dim: int, p: int, value: float) -> torch.Tensor:
    """x with ``dim`` extended to length p by ``value`` (x itself when it already has p)."""
    n = x.shape[dim]
    if n == p:
        return x
    shape = list(x.shape)
    shape[dim] = p - n
    return torch.cat([x, x.new_full(shape, value)], dim)


def pairwise_tree(
    x: torch.Tensor,
    op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.add,
    dim: int = -1,
    pad: float | None = None,
) -> torch.Tensor:
    """Reduce ``dim`` by the fixed pairwise tree: x[2m] op x[2m + 1], level by
    level, until one lane is left; the dim is dropped.  With ``pad`` the dim
    is first padded with that value to ``tree_width`` lanes; without it, its
    length must already be a power of two.  Element-wise ops on slices only,
    so a lane's result never depends on the other dims' sizes."""
    dim = dim % x.dim()
    if pad is not None:
        x = pad_to(x, dim, tree_width(x.shape[dim]), pad)
    while x.shape[dim] > 1:
        x = x.unflatten(dim, (x.shape[dim] // 2, 2))
        x = op(x.select(dim + 1, 0), x.select(dim + 1, 1))
    return x.select(dim, 0)


def left_to_right(x: torch.Tensor) -> torch.Tensor:
    """(N, k, ...) -> (N, ...): ((x0 + x1) + x2) + ... over dim 1, element-wise in x's dtype."""
    acc = x[:, 0]
    for j in range(1, x.shape[1]):
        acc = acc + x[:, j]
    return acc


def tree_reduce_cpu(parts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """parts: (N, ...) in logical order -> (...) in out_dtype."""
    level = [p.double() for p in parts.unbind(0)]
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].to(out_dtype)
