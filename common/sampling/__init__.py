"""Sampling transforms (temperature -> top-k -> top-p -> min-p), the seeded
draw, and the trainer's bitwise replay of the drawn token's log-probability.
The per-row program and its rules are in ``op.py``'s docstring."""
from .naive import sampling_logprobs_ref, transformed_logprobs_ref
from .op import (
    check_sampling_tensors,
    head_width,
    sample,
    sample_fwd,
    sampling_logprobs,
    sampling_logprobs_bwd,
    sampling_logprobs_fwd,
    transformed_logprobs_fwd,
)
from .params import SamplingParams, params_to_tensors
from .rules import uniform01

__all__ = [
    "SamplingParams",
    "check_sampling_tensors",
    "head_width",
    "sampling_logprobs_ref",
    "transformed_logprobs_ref",
    "params_to_tensors",
    "sample",
    "sample_fwd",
    "sampling_logprobs",
    "sampling_logprobs_bwd",
    "sampling_logprobs_fwd",
    "transformed_logprobs_fwd",
    "uniform01",
]
