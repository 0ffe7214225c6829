"""CPU path of the fused q/k RMSNorm + RoPE + KV-cache write: the unfused ops, composed.

It calls the very functions the unfused server path and the trainer reach on
the CPU (``rmsnorm_fwd_cpu``, ``rope_rotate_cpu``, ``write_kv_cpu``) on the
same values, so its bits are theirs by construction; each of them is
batch-invariant by construction (their docstrings say why: element-wise ops
and a spelled-out row tree, no torch reduction).  The slices of ``qkv`` are
strided views; reading them through a copy changes no bit.
"""
from __future__ import annotations

import torch

from ..kv_cache.cpu import write_kv_cpu
from ..rmsnorm.cpu import rmsnorm_fwd_cpu
from ..rope.cpu import rope_rotate_cpu


def qk_norm_rope_kv_cpu(
    qkv: torch.Tensor,  # (T, (Hq + 2 Hkv) D)
    q_w: torch.Tensor,  # (D,)
    k_w: torch.Tensor,  # (D,)
    eps: float,
    positions: torch.Tensor,  # (T,)
    cos: torch.Tensor,  # (P, D/2) fp32
    sin: torch.Tensor,  # (P, D/2) fp32
    k_cache: torch.Tensor,  # (pages, PAGE_SIZE, Hkv, D)
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # (T,)
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """-> q (T, Hq, D); k and v written to the cache at ``slot_mapping``."""
    T, D = qkv.shape[0], q_w.shape[0]
    Hq, Hkv = num_heads, num_kv_heads
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = rmsnorm_fwd_cpu(q.reshape(T * Hq, D), q_w, eps)[0].view(T, Hq, D)
    k = rmsnorm_fwd_cpu(k.reshape(T * Hkv, D), k_w, eps)[0].view(T, Hkv, D)
    rot = dict(rot_offset=0, in_interleaved=False, out_interleaved=False, negate_sin=False)  # "half", full width
    q = rope_rotate_cpu(q, positions, cos, sin, **rot)
    k = rope_rotate_cpu(k, positions, cos, sin, **rot)
    write_kv_cpu(k, v.reshape(T, Hkv, D), k_cache, v_cache, slot_mapping)
    return q
