"""Adapter weights: seeded init, a small parameter holder, stacking for multi-LoRA."""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn


def init_lora_weights(out_features: int, in_features: int, r: int, *, seed: int,
                      dtype: torch.dtype = torch.bfloat16, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> A (r, K) uniform in ±1/sqrt(K) (PEFT's kaiming_uniform_(a=sqrt(5)))
    drawn in fp32 on the CPU from ``seed`` and then cast, so every device gets
    the same values; B (N, r) zeros, so the new adapter is a no-op."""
    if r < 1 or in_features < 1 or out_features < 1:
        raise ValueError(f"need r, in_features, out_features >= 1, got {r}, {in_features}, {out_features}")
    g = torch.Generator().manual_seed(seed)
    bound = 1.0 / math.sqrt(in_features)
    a = torch.empty(r, in_features).uniform_(-bound, bound, generator=g)
    b = torch.zeros(out_features, r)
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)


class LoRAAdapter(nn.Module):
    """The trainable half of one adapted linear layer: ``lora_A`` (r, K),
    ``lora_B`` (N, r) and ``scale`` = lora_alpha / r.  The base weight stays
    in the model; pass ``(w, adapter.lora_A, adapter.lora_B, adapter.scale)``
    to ``lora_linear_separate``, ``lora_merge`` or ``MergedLoRACache.weight``."""

    def __init__(self, in_features: int, out_features: int, r: int, lora_alpha: float, *, seed: int = 0,
                 device=None, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        a, b = init_lora_weights(out_features, in_features, r, seed=seed, dtype=dtype, device=device)
        self.lora_A = nn.Parameter(a)
        self.lora_B = nn.Parameter(b)
        self.r, self.lora_alpha = r, lora_alpha
        self.scale = lora_alpha / r

    def extra_repr(self) -> str:
        return f"in={self.lora_A.shape[1]}, out={self.lora_B.shape[0]}, r={self.r}, lora_alpha={self.lora_alpha}"


def collect_adapters(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{module path: (A, B)} for every ``LoRAAdapter`` under ``module`` (for ``save_peft_adapter``)."""
    return {name: (m.lora_A, m.lora_B) for name, m in module.named_modules() if isinstance(m, LoRAAdapter)}


def stack_adapters(adapters: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """[(A_j (r_j, K), B_j (N, r_j))] -> A (n, r, K), B (n, N, r), r = max r_j.

    A smaller rank is padded with zero rows of A and zero columns of B.  The
    padding adds only exact zeros after a row's real terms (CPU: +0 to a sum
    that is never -0; CUDA: the kernel already zero-fills K up to BLOCK_K), so
    a padded adapter gives its unpadded bits.  Keep each adapter's own scale
    (alpha / r_j).
    """
    if not adapters:
        raise ValueError("stack_adapters needs at least one (A, B) pair")
    K, N = adapters[0][0].shape[1], adapters[0][1].shape[0]
    r = max(a.shape[0] for a, _ in adapters)
    a0 = adapters[0][0]
    a_n = torch.zeros(len(adapters), r, K, dtype=a0.dtype, device=a0.device)
    b_n = torch.zeros(len(adapters), N, r, dtype=a0.dtype, device=a0.device)
    for j, (a, b) in enumerate(adapters):
        rj = a.shape[0]
        if a.shape[1] != K or tuple(b.shape) != (N, rj) or a.dtype != a0.dtype or b.dtype != a0.dtype:
            raise ValueError(f"adapter {j}: A {tuple(a.shape)} {a.dtype}, B {tuple(b.shape)} {b.dtype} do not fit "
                             f"A (r, {K}), B ({N}, r) in {a0.dtype}")
        a_n[j, :rj] = a.detach()
        b_n[j, :, :rj] = b.detach()
    return a_n, b_n
