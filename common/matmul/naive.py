"""Float64 reference for matmul (accuracy and gradient checks)."""
import torch


def matmul_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ in float64 (differentiable)."""
    return x.double() @ w.double().t()
