"""LM-head log-probabilities: fixed-K FP32 projection fused with a streaming
log-sum-exp over fixed 256-logit vocabulary groups merged by one explicit tree."""
from .cpu import VOCAB_GROUP
from .naive import lm_head_logits_ref, lm_head_logprobs_ref, lm_head_lse_ref
from .op import lm_head_bwd, lm_head_fwd, lm_head_logits, lm_head_logits_fwd, lm_head_logprobs

__all__ = [
    "VOCAB_GROUP",
    "lm_head_bwd",
    "lm_head_fwd",
    "lm_head_logits",
    "lm_head_logits_fwd",
    "lm_head_logits_ref",
    "lm_head_logprobs",
    "lm_head_logprobs_ref",
    "lm_head_lse_ref",
]
