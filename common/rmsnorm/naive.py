"""Float64 references for the three RMSNorm variants (differentiable).

No intermediate rounding: these are the exact math the kernels approximate,
used for accuracy bounds and for the gradients (torch autograd)."""
from __future__ import annotations

import torch


def rmsnorm_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x (*, H), w (H,) -> float64 x * rsqrt(mean(x^2) + eps) * w."""
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()


def rmsnorm_residual_ref(x: torch.Tensor, residual: torch.Tensor, w: torch.Tensor, eps: float):
    """-> (normed, new_residual) in float64, the sum unrounded."""
    s = x.double() + residual.double()
    return rmsnorm_ref(s, w, eps), s


def rmsnorm_gated_ref(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """float64 rmsnorm(x) * w * SiLU(z)."""
    z = z.double()
    return rmsnorm_ref(x, w, eps) * z * torch.sigmoid(z)
