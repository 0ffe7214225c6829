"""Float64 reference of the fused q/k RMSNorm + RoPE (the exact math, no
intermediate rounding): the composition of ``rmsnorm_ref`` and ``rope_ref``."""
from __future__ import annotations

import torch

from ..rmsnorm.naive import rmsnorm_ref
from ..rope.naive import rope_ref
from ..rope.table import RopeSpec


def qk_norm_rope_ref(qkv: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, eps: float, positions: torch.Tensor,
                     spec: RopeSpec, num_heads: int, num_kv_heads: int):
    """qkv (T, (Hq + 2 Hkv) D) -> float64 (q (T, Hq, D), k (T, Hkv, D), v (T, Hkv, D))."""
    T, D = qkv.shape[0], q_w.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = rope_ref(rmsnorm_ref(q.reshape(T, num_heads, D), q_w, eps), positions, spec)
    k = rope_ref(rmsnorm_ref(k.reshape(T, num_kv_heads, D), k_w, eps), positions, spec)
    return q, k, v.reshape(T, num_kv_heads, D).double()
