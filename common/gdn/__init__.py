"""Gated DeltaNet (Qwen3.5): the chunk-64 gated delta rule with an FP32 [K, V]
state whose outputs and states have the same bits for the trainer (packed
varlen), the server's chunked prefill split anywhere and its token-by-token
decode; the causal conv1d + SiLU with its 3-row tail; the L2 norm."""
from .naive import conv1d_ref, gdn_ref, l2norm_ref
from .op import (conv1d, conv1d_fwd, conv1d_state_fields, gdn, gdn_cache, gdn_fwd, gdn_state_fields,
                 l2norm_fwd)

__all__ = ["gdn", "gdn_fwd", "gdn_cache", "gdn_state_fields", "conv1d", "conv1d_fwd", "conv1d_state_fields",
           "l2norm_fwd", "gdn_ref", "conv1d_ref", "l2norm_ref"]
