"""Float64 references for FP8 (accuracy and gradient checks)."""
from __future__ import annotations

import torch

from .quant import BLOCK, FP8_DTYPE, expand_weight_scale, quantize_act


def e4m3_round_ref(q: torch.Tensor) -> torch.Tensor:
    """Saturating round-to-nearest-even onto the e4m3fn grid, by brute force in
    float64 (independent of torch's cast): q (...) -> (...) float64 values."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).double()
    grid = codes[~codes.isnan()].unique().to(q.device)  # 253 sorted finite values (±0 merge)
    q = q.double().clamp(grid[0], grid[-1])
    hi = torch.searchsorted(grid, q).clamp(1, len(grid) - 1)
    below, above = grid[hi - 1], grid[hi]
    tie = above - q == q - below
    pick_above = (above - q < q - below) | (tie & _mantissa_even(above))
    return torch.where(pick_above, above, below)


def _mantissa_even(v: torch.Tensor) -> torch.Tensor:
    bits = v.float().to(FP8_DTYPE).view(torch.uint8)  # exact: v is on the grid
    return (bits & 1) == 0


def dequantize_weight_ref(codes: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """codes (N, K), scale_inv (ceil(N/128), ceil(K/128)) -> (N, K) float64 exact products."""
    N, K = codes.shape
    return codes.double() * expand_weight_scale(scale_inv, N, K).double()


def dequantize_act_ref(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes (M, K), scales (M, ceil(K/128)) -> (M, K) float64 exact products."""
    return codes.double() * scales.double().repeat_interleave(BLOCK, 1)[:, : codes.shape[1]]


def fp8_matmul_ref(x: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """x (M, K) · W (N, K)ᵀ in float64 on the dequantized operands: x goes
    through the same per-token quantizer, so this isolates the GEMM's roundings."""
    x_codes, x_scales = quantize_act(x.detach())
    return dequantize_act_ref(x_codes, x_scales) @ dequantize_weight_ref(w_codes, w_scale_inv).t()


def fp8_linear_ref(x: torch.Tensor, master_w: torch.Tensor, w_codes: torch.Tensor,
                   w_scale_inv: torch.Tensor) -> torch.Tensor:
    """float64 ``fp8_linear``: the value of ``fp8_matmul_ref`` with the
    straight-through gradients dX = dY · dequant(W) and dW = dYᵀ · x."""
    x64, w64 = x.double(), master_w.double()
    w_q = dequantize_weight_ref(w_codes, w_scale_inv)
    y_lin = x64 @ (w64 + (w_q - w64).detach()).t()  # carries both gradients, adds exactly 0
    return fp8_matmul_ref(x, w_codes, w_scale_inv) + (y_lin - y_lin.detach())
