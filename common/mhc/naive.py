"""float64 references for DeepSeek-V4's manifold-constrained hyper-connections (tests and accuracy checks).

transformers' ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead`` / the decoder layer's mix, every value in
float64 and no rounding to the stream dtype anywhere.
"""
from __future__ import annotations

import torch


def _mixes(x: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """x (..., hc, D) -> fn · rmsnorm(flatten(x)) (..., rows of fn), float64."""
    flat = x.double().flatten(-2)
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
    return flat @ fn.double().t()


def hc_weights_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
                   hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (..., hc, D); fn ((2 + hc)·hc, hc·D), base ((2 + hc)·hc,), scale (3,)
    -> pre (..., hc), post (..., hc), comb (..., hc, hc) float64 (comb[i, j]: input stream i to output stream j)."""
    hc = x.shape[-2]
    m = _mixes(x, fn, norm_eps)
    b, s = base.double(), scale.double()
    pre = torch.sigmoid(m[..., :hc] * s[0] + b[:hc]) + hc_eps
    post = 2 * torch.sigmoid(m[..., hc:2 * hc] * s[1] + b[hc:2 * hc])
    z = (m[..., 2 * hc:] * s[2] + b[2 * hc:]).unflatten(-1, (hc, hc))
    comb = torch.softmax(z, dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    return pre, post, comb


def hc_collapse_ref(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x (..., hc, D), pre (..., hc) -> Σ_i pre_i · x_i (..., D) float64."""
    return (pre.double().unsqueeze(-1) * x.double()).sum(-2)


def hc_mix_ref(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """block_out (..., D), streams (..., hc, D), post (..., hc), comb (..., hc, hc)
    -> post_k · block_out + Σ_j comb[j, k] · streams_j (..., hc, D) float64."""
    mixed = comb.double().transpose(-1, -2) @ streams.double()
    return post.double().unsqueeze(-1) * block_out.double().unsqueeze(-2) + mixed


def hc_head_ref(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                norm_eps: float) -> torch.Tensor:
    """x (..., hc, D); fn (hc, hc·D), base (hc,), scale (1,) -> the final collapse (..., D) float64."""
    pre = torch.sigmoid(_mixes(x, fn, norm_eps) * scale.double()[0] + base.double()) + hc_eps
    return hc_collapse_ref(x, pre)
