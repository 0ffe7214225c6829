"""Batch-invariant matmul ``y = x · wᵀ`` (bf16/fp32 in, fp32 accumulate, one rounding)."""
from .cpu import fixed_order_dot
from .launches import graph_launches
from .naive import matmul_ref
from .op import matmul, matmul_bwd, matmul_fwd

__all__ = ["matmul", "matmul_fwd", "matmul_bwd", "matmul_ref", "fixed_order_dot", "graph_launches"]
