"""Fixed-order reduction tree (pairwise in float64, odd carried up, one rounding)."""
from .naive import tree_reduce_ref
from .op import tree_reduce, tree_reduce_fwd

__all__ = ["tree_reduce", "tree_reduce_fwd", "tree_reduce_ref"]
