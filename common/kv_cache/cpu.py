"""CPU writer for the paged KV cache.

An indexed copy: no arithmetic, so the cache holds exactly the bytes of k/v
whatever the batch around a token (the copy is invariant by construction).
"""
from __future__ import annotations

import torch


def write_kv_cpu(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    keep = slot_mapping >= 0  # (N,)
    slots = slot_mapping[keep].long()
    h, d = k_cache.shape[2:]
    k_cache.view(-1, h, d)[slots] = k[keep]
    v_cache.view(-1, h, d)[slots] = v[keep]
