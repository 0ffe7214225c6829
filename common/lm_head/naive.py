"""Float64 references for the LM-head primitive (differentiable through autograd).

Used only by tests and the accuracy rows of ``checks.py``: the inputs are
upcast to float64, so the reference carries none of the FP32 rounding the
kernels do, and its gradients come from torch autograd.
"""
from __future__ import annotations

import torch


def lm_head_logits_ref(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, K), (V, K) -> float64 logits (T, V)."""
    return h.double() @ weight.double().t()


def lm_head_lse_ref(h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(T, K), (V, K) -> float64 log-sum-exp of the logits, (T,)."""
    return torch.logsumexp(lm_head_logits_ref(h, weight), dim=-1)


def lm_head_logprobs_ref(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(T, K), (V, K), (T,) int64 -> float64 log_softmax(h @ Wᵀ)[t, targets[t]], (T,)."""
    logp = torch.log_softmax(lm_head_logits_ref(h, weight), dim=-1)
    return logp.gather(1, targets.unsqueeze(1)).squeeze(1)
