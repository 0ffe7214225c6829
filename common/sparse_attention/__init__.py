"""Exact sparse MLA attention (absorbed form) over the DSA indexer's selection: one per-row order (the selected
positions ascending, 64-entry blocks, 1024-entry segments, the dense attention's recurrence) for the trainer's
packed rows and the server's paged cache, a float64 reference, and a deterministic backward."""
from .naive import sparse_attention_ref
from .op import (
    SparseAttentionFunction,
    check_paged_sparse_inputs,
    check_sparse_inputs,
    paged_sparse_attention,
    paged_sparse_attention_fwd,
    sparse_attention,
    sparse_attention_bwd,
    sparse_attention_fwd,
)

__all__ = [
    "SparseAttentionFunction",
    "check_paged_sparse_inputs",
    "check_sparse_inputs",
    "paged_sparse_attention",
    "paged_sparse_attention_fwd",
    "sparse_attention",
    "sparse_attention_bwd",
    "sparse_attention_fwd",
    "sparse_attention_ref",
]
