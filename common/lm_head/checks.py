"""Ladder rows for the LM head (``alignzoo check lm_head``): rungs 1-2 of the
forward (logprobs + LSE), of the sampler's logits + LSE and of dh, and
accuracy against float64, at odd sizes (vocabulary not a multiple of 256)."""
from __future__ import annotations

import torch

from alignzoo.common.ladder import RungResult, accuracy, rung1_repeat, rung2_rows

from .naive import lm_head_logprobs_ref, lm_head_lse_ref
from .op import lm_head_bwd, lm_head_fwd, lm_head_logits

NAME = "lm_head"
# Launch knobs that must not change bits; the first is the reference.
CONFIGS = {
    "cpu": ({}, {"block_m": 5, "vocab_chunk": 1}, {"block_m": 16, "vocab_chunk": 3}),
    "cuda": ({"block_m": 64}, {"block_m": 128, "vocab_chunk": 1}),
}
SIZES = {"cpu": (37, 100, 1000), "cuda": (300, 1000, 32001)}  # (T, K, V)
LP_BOUND = 1e-5  # FP32 projection and LSE vs float64 on the same bf16 inputs
DH_BOUND = 1e-2  # dz and dh each rounded once to bf16 (2^-9 relative)


def _fwd(h, targets, *, weight, **knobs):
    return lm_head_fwd(h, weight, targets, **knobs)


def _logits(h, *, weight, **knobs):
    return lm_head_logits(h, weight, return_lse=True, **knobs)


def _dh(h, targets, *, weight, **knobs):
    _, lse = lm_head_fwd(h, weight, targets, **knobs)
    grad = torch.ones(h.shape[0], device=h.device)
    return lm_head_bwd(h, weight, targets, lse, grad, **knobs)[0]


def _named(r: RungResult, what: str) -> RungResult:
    r.check = f"{what}: {r.check}"
    return r


def _inputs(T, K, V, device, centered):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(T, K, generator=g)
    w = torch.randn(V, K, generator=g) / K**0.5
    if centered:
        # Feature 0 as a bias that puts the LSE near 0, where its FP32 ulp is
        # finest: a regrouped sum then shows in the bits instead of rounding away.
        h[:, 0], w[:, 0] = 1.0, 0.0
        w[:, 0] = -lm_head_lse_ref(h[:16], w).mean().float()
    else:
        w *= 3.0  # logits with std ~3, a realistic spread for the accuracy rows
    y = torch.randint(0, V, (T,), generator=g)
    return h.to(torch.bfloat16).to(device), w.to(torch.bfloat16).to(device), y.to(device)


def ladder(device: torch.device) -> list[RungResult]:
    kind = "cuda" if device.type == "cuda" else "cpu"
    T, K, V = SIZES[kind]
    configs = CONFIGS[kind]
    h, w, y = _inputs(T, K, V, device, centered=True)
    shared = {"weight": w}

    def _bwd_twice():
        _, lse = lm_head_fwd(h, w, y)
        return lm_head_bwd(h, w, y, lse, torch.linspace(-1, 1, T, device=device))

    rows = [
        _named(rung1_repeat(NAME, _fwd, h, y, weight=w), "logprobs+lse"),
        _named(rung1_repeat(NAME, _bwd_twice), "dh+dW"),
        _named(rung2_rows(NAME, _fwd, [h, y], shared=shared, configs=configs), "logprobs+lse"),
        _named(rung2_rows(NAME, _logits, [h], shared=shared, configs=configs), "logits+lse"),
        _named(rung2_rows(NAME, _dh, [h, y], shared=shared, configs=configs[:2], batch_sizes=(1, 7)), "dh"),
    ]
    h, w, y = _inputs(T, K, V, device, centered=False)
    lp, _ = lm_head_fwd(h, w, y)
    h64 = h.double().requires_grad_()
    ref = lm_head_logprobs_ref(h64, w, y)
    ref.sum().backward()
    return rows + [
        accuracy(NAME, lp, ref.detach(), LP_BOUND, f"logprobs vs float64 (T={T} K={K} V={V})"),
        accuracy(NAME, _dh(h, y, weight=w), h64.grad, DH_BOUND, "dh vs float64 autograd"),
    ]
