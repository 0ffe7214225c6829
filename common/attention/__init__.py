"""Exact causal GQA attention: one per-row reduction order for packed
training/prefill, paged decode and chunked prefill (64-position KV blocks in
fixed 1024-position segments, merged in increasing order on every path), a
float64 reference, and a deterministic backward for the packed case."""
from .naive import attention_ref
from .op import (
    AttentionFunction,
    attention,
    attention_bwd,
    attention_fwd,
    check_paged_inputs,
    decode_attention,
    paged_attention,
    paged_attention_fwd,
)

__all__ = [
    "AttentionFunction",
    "attention",
    "attention_bwd",
    "attention_fwd",
    "attention_ref",
    "check_paged_inputs",
    "decode_attention",
    "paged_attention",
    "paged_attention_fwd",
]
