"""Float64 RoPE reference, differentiable with torch autograd.

Angles p * inv_freq[i] from the spec's fp32 inverse frequencies (the definition,
shared with transformers), then cos, sin, the rotation and the YaRN multiplier
all in float64, written out with plain indexing so the pairing is easy to read.
"""
from __future__ import annotations

import torch

from .table import RopeSpec, inv_freq_and_attention_factor


def rope_ref(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, conjugate: bool = False) -> torch.Tensor:
    """x: (T, H, D) any float dtype, positions: (T,) -> (T, H, D) float64."""
    inv_freq, scale = inv_freq_and_attention_factor(spec.rotary_dim, spec.base, spec.yarn)
    angle = positions.double().cpu()[:, None] * inv_freq.double()[None, :]  # (T, R/2)
    cos = (torch.cos(angle) * scale).to(x.device)[:, None, :]  # (T, 1, R/2)
    sin = (torch.sin(angle) * scale).to(x.device)[:, None, :]
    if conjugate:
        sin = -sin
    x = x.double()
    D, R = x.shape[-1], spec.rotary_dim
    off = spec.rotary_offset(D)
    xr = x[..., off : off + R]
    if spec.pairing == "half":
        a, b = xr[..., : R // 2], xr[..., R // 2 :]
    else:
        a, b = xr[..., 0::2], xr[..., 1::2]
    ya, yb = a * cos - b * sin, b * cos + a * sin
    if spec.pairing == "interleaved":
        yr = torch.stack((ya, yb), dim=-1).flatten(-2)
    else:
        yr = torch.cat((ya, yb), dim=-1)
    return torch.cat((x[..., :off], yr, x[..., off + R :]), dim=-1)
