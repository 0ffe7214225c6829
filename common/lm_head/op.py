"""LM-head log-probabilities: launchers, autograd Function, public function.

The server calls ``lm_head_fwd`` (teacher-forced scoring: logprobs and LSE) and
``lm_head_logits`` (decode rows: FP32 logits for the sampling transforms, with
the LSE if asked); the trainer calls ``lm_head_logprobs``.  All three run the
same projection and the same LSE code, so for one row ``logits[t, y] - lse[t]``
equals ``logprobs[t]`` bit for bit, whatever the batch.  The contract (group
size 256, trees, rounding points) is in ``cpu.py`` and ``kernel.py``.
"""
from __future__ import annotations

import torch

from alignzoo.common._validate import FLOAT_DTYPES, check_dim, check_same_device, check_tensor

from .cpu import lm_head_bwd_cpu, lm_head_fwd_cpu, lm_head_logits_cpu

# Rows per program on CUDA: both use the same m64 wgmma tiling (kernel.py).
CUDA_BLOCK_MS = (64, 128)


def _check_inputs(h, weight, targets=None, check_range=True) -> None:
    check_tensor("h", h, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES, ndim=2)
    if weight.dtype != h.dtype:
        raise TypeError(f"weight has dtype {str(weight.dtype)[6:]} but h has {str(h.dtype)[6:]}; they must match")
    check_dim("weight", weight.shape[1], h.shape[1], "hidden size (dim 1, must equal h.shape[1])")
    if weight.shape[0] == 0:
        raise ValueError("weight: vocabulary size (dim 0) is 0")
    if targets is None:
        check_same_device(h=h, weight=weight)
        return
    check_tensor("targets", targets, dtypes=(torch.int64,), ndim=1)
    check_dim("targets", targets.shape[0], h.shape[0], "length (must equal h.shape[0], the number of rows)")
    check_same_device(h=h, weight=weight, targets=targets)
    if check_range and targets.numel():
        lo, hi = (int(x) for x in torch.aminmax(targets))
        if lo < 0 or hi >= weight.shape[0]:
            raise ValueError(f"targets must lie in [0, {weight.shape[0]}) (the vocabulary size); got min {lo}, max {hi}")


def _check_knobs(device: torch.device, block_m, vocab_chunk) -> None:
    if device.type == "cuda":
        if block_m is not None and block_m not in CUDA_BLOCK_MS:
            raise ValueError(f"block_m on CUDA must be one of {CUDA_BLOCK_MS}, got {block_m}")
    elif block_m is not None and block_m < 1:
        raise ValueError(f"block_m must be >= 1, got {block_m}")
    if vocab_chunk is not None and vocab_chunk < 1:
        raise ValueError(f"vocab_chunk (vocabulary groups per chunk) must be >= 1, got {vocab_chunk}")


def lm_head_fwd(h, weight, targets, *, block_m=None, vocab_chunk=None, check_range=True):
    """FP32 log-probabilities of ``targets`` and the per-row LSE.

    h: (T, K) bf16/fp32, weight: (V, K) same dtype, targets: (T,) int64 in [0, V)
    -> (logprobs (T,) fp32, lse (T,) fp32).  ``block_m``/``vocab_chunk`` are
    launch knobs that cannot change bits.  ``check_range=False`` skips the
    targets range check (a device sync); an out-of-range target then yields NaN.
    """
    _check_inputs(h, weight, targets, check_range)
    _check_knobs(h.device, block_m, vocab_chunk)
    if h.is_cuda:
        from .kernel import lm_head_fwd_triton

        return lm_head_fwd_triton(h, weight, targets, block_m=block_m)
    return lm_head_fwd_cpu(h, weight, targets, block_m=block_m, vocab_chunk=vocab_chunk)


def lm_head_logits_fwd(h, weight, *, return_lse=False, block_m=None, vocab_chunk=None):
    """The server's launcher of ``lm_head_logits`` (no checks, no autograd)."""
    if h.is_cuda:
        from .kernel import lm_head_logits_triton

        return lm_head_logits_triton(h, weight, return_lse=return_lse, block_m=block_m)
    return lm_head_logits_cpu(h, weight, return_lse=return_lse, block_m=block_m, vocab_chunk=vocab_chunk)


class _LMHeadLogits(torch.autograd.Function):
    """Differentiable logits for a trainer that scores under sampling
    transforms (``sampling_logprobs`` needs the full row).  The backward only
    has to be deterministic run to run (``_logits_bwd_mm``)."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(h, weight)
        return lm_head_logits_fwd(h, weight)

    @staticmethod
    def backward(ctx, g):
        h, weight = ctx.saved_tensors
        parts = _split_parts(g.float(), h.dtype == weight.dtype == torch.bfloat16)
        dh = _logits_bwd_mm(parts, weight).to(h.dtype) if ctx.needs_input_grad[0] else None
        dw = _logits_bwd_mm([p.t() for p in parts], h).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return dh, dw


def _split_parts(g: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
    """fp32 g as the parts ``_logits_bwd_mm`` multiplies: [g] itself, or, on CUDA with bf16 operands, bf16
    hi + lo (g - hi is exact in fp32, and lo keeps its top 8 bits more: g to ~2^-17), split in one
    pass (``split_hi_lo_triton``) and shared by dh and dW."""
    if not (g.is_cuda and bf16):
        return [g]
    from .kernel import split_hi_lo_triton

    return list(split_hi_lo_triton(g.contiguous()))


def _logits_bwd_mm(parts: list[torch.Tensor], b: torch.Tensor) -> torch.Tensor:
    """sum of part · b -> fp32, one fixed torch.mm per part (deterministic run to run).  bf16 parts
    run on the tensor cores with fp32 output: fp32 accuracy, where an fp32 mm of the (T, V)
    gradient runs on CUDA cores at ~1/15 the rate (28% of a qwen3-0.6b step)."""
    if len(parts) == 1:
        return torch.mm(parts[0], b.float())
    hi, lo = parts
    return torch.mm(hi, b, out_dtype=torch.float32) + torch.mm(lo, b, out_dtype=torch.float32)


def lm_head_logits(h, weight, *, return_lse=False, block_m=None, vocab_chunk=None):
    """FP32 logits ``h · weightᵀ`` with the very bits the log-probabilities use.

    h: (T, K), weight: (V, K) -> logits (T, V) fp32, or (logits, lse (T,)) with
    ``return_lse``; then ``logits.gather(1, y[:, None])[:, 0] - lse`` equals
    ``lm_head_fwd(h, weight, y)[0]`` bitwise.  Differentiable in h and weight
    when grad is enabled (not with ``return_lse``); the bits do not change.
    """
    _check_inputs(h, weight)
    _check_knobs(h.device, block_m, vocab_chunk)
    if not return_lse and torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LMHeadLogits.apply(h, weight)
    return lm_head_logits_fwd(h, weight, return_lse=return_lse, block_m=block_m, vocab_chunk=vocab_chunk)


def lm_head_bwd(h, weight, targets, lse, grad, *, block_m=None, vocab_chunk=None):
    """Gradients of ``sum_t grad[t] * logprob[t]``.

    h: (T, K), weight: (V, K), targets: (T,) int64, lse: (T,) fp32 from
    ``lm_head_fwd``, grad: (T,) float -> (dh (T, K) h.dtype, dW (V, K) weight.dtype).
    The logits are recomputed chunk by chunk; no (T, V) FP32 tensor is made.
    """
    _check_inputs(h, weight, targets, check_range=False)
    check_tensor("lse", lse, dtypes=(torch.float32,), ndim=1)
    check_tensor("grad", grad, dtypes=FLOAT_DTYPES, ndim=1, contiguous=False)
    check_dim("lse", lse.shape[0], h.shape[0], "length")
    check_dim("grad", grad.shape[0], h.shape[0], "length")
    _check_knobs(h.device, block_m, vocab_chunk)
    if h.is_cuda:
        from .kernel import lm_head_bwd_triton

        return lm_head_bwd_triton(h, weight, targets, lse, grad, block_m=block_m, vocab_chunk=vocab_chunk)
    return lm_head_bwd_cpu(h, weight, targets, lse, grad, block_m=block_m, vocab_chunk=vocab_chunk)


class LMHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, block_m, vocab_chunk):
        lp, lse = lm_head_fwd(h, weight, targets, block_m=block_m, vocab_chunk=vocab_chunk, check_range=False)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.knobs = dict(block_m=block_m, vocab_chunk=vocab_chunk)
        return lp

    @staticmethod
    def backward(ctx, grad):
        h, weight, targets, lse = ctx.saved_tensors
        dh, dw = lm_head_bwd(h, weight, targets, lse, grad.contiguous(), **ctx.knobs)
        return dh, dw, None, None, None


def lm_head_logprobs(h, weight, targets, *, block_m=None, vocab_chunk=None):
    """FP32 log-probability of each target token under softmax(h · weightᵀ).

    h: (T, K) bf16 or fp32 hidden states, weight: (V, K) LM-head weight of the
    same dtype, targets: (T,) int64 token ids in [0, V) -> (T,) fp32.
    Differentiable in h and weight (backward without a (T, V) FP32 tensor).
    Bits for a row do not depend on T, the row's position, the other rows or
    the launch knobs ``block_m`` / ``vocab_chunk``.
    """
    _check_inputs(h, weight, targets)
    _check_knobs(h.device, block_m, vocab_chunk)
    return LMHeadLogprobs.apply(h, weight, targets, block_m, vocab_chunk)
