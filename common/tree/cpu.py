"""Fixed-order reduction tree on the CPU.

Order: level by level, neighbours (0,1), (2,3), ... are added in float64; an
odd last one is carried up unchanged; repeat until one is left; round once.
Every step is an element-wise float64 add of two slices, which rounds each
element on its own, so an element's result depends only on that element's
N contributions and their logical order — never on the tensor's size.
"""
from __future__ import annotations

import torch


def tree_reduce_cpu(parts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """parts: (N, ...) in logical order -> (...) in out_dtype."""
    level = [p.double() for p in parts.unbind(0)]
    while len(level) > 1:
        nxt = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0].to(out_dtype)
