"""Float64 references for LoRA (accuracy and gradient checks)."""
import torch


def lora_linear_ref(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """x·Wᵀ + s·(x·Aᵀ)·Bᵀ in float64 (differentiable).
    x: (M, K), w: (N, K), a: (r, K), b: (N, r) -> (M, N)."""
    xd = x.double()
    return xd @ w.double().t() + scale * ((xd @ a.double().t()) @ b.double().t())


def lora_merge_ref(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W + s·B·A in float64.  w: (N, K), a: (r, K), b: (N, r) -> (N, K)."""
    return w.double() + scale * (b.double() @ a.double())
