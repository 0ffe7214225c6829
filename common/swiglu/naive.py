"""Float64 SwiGLU reference (differentiable): SiLU(gate) * up with DeepSeek-V4's
optional clamp (gate <= limit, -limit <= up <= limit), no intermediate rounding."""
from __future__ import annotations

import torch


def swiglu_ref(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """gate, up (*, I) -> float64 (*, I)."""
    g, u = gate.double(), up.double()
    if limit is not None:
        g = g.clamp(max=limit)
        u = u.clamp(min=-limit, max=limit)
    return g * torch.sigmoid(g) * u
