"""q/k RMSNorm + RoPE + KV-cache write, fused: the launcher and the checked function.

The server calls ``qk_norm_rope_kv_fwd`` in place of ``rmsnorm_fwd`` (q, k),
``rope_fwd`` (q, k) and ``write_kv_fwd``: one launch on CUDA instead of eight,
with the bits of that composition, so of the trainer's
``rope(rmsnorm(q))`` / ``rope(rmsnorm(k))`` too (``kernel.py``: the same
``@triton.jit`` helpers, the same order and rounding points; ``cpu.py``: the
same CPU functions).  Serving only: the cache is written in place and there
is no backward — the trainer keeps its differentiable ``rmsnorm`` and ``rope``.
"""
from __future__ import annotations

import math
import numbers

import torch

from .._validate import FLOAT_DTYPES, check_dim, check_same_device, check_tensor
from ..kv_cache.op import check_cache_write
from ..rmsnorm.cpu import ROW_CHUNK
from ..rope.op import POSITION_DTYPES, _check_positions_range
from ..rope.table import RopeSpec, rope_table
from .cpu import qk_norm_rope_kv_cpu


def _check_spec(spec: RopeSpec, head_dim: int) -> None:
    if spec.pairing != "half" or spec.rotary_dim != head_dim:
        raise NotImplementedError(
            f"qk_norm_rope_kv rotates whole heads with the 'half' pairing (Qwen3); got pairing={spec.pairing!r}, "
            f"rotary_dim={spec.rotary_dim} for head_dim {head_dim}: use rmsnorm_fwd + rope_fwd + write_kv_fwd"
        )


def qk_norm_rope_kv_fwd(
    qkv: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    spec: RopeSpec,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    *,
    heads_per_program: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """q = rope(rmsnorm(q, q_w)); k = rope(rmsnorm(k, k_w)) and v to the cache;
    no validation and no host sync (the server's hot path; CUDA-graph safe).

    qkv:        (T, (Hq + 2 Hkv) D), the qkv projection's rows [q | k | v],
                unit column stride (rows may be strided)
    q_w, k_w:   (D,) the q_norm / k_norm weights
    positions:  (T,) int; out-of-table positions are clamped on CUDA (as ``rope_fwd(check=False)``)
    spec:       the RoPE spec ("half" pairing over the whole head)
    k_cache, v_cache: (pages, PAGE_SIZE, Hkv, D), contiguous, qkv's dtype
    slot_mapping: (T,) int; -1 skips the token's k/v (its q is still computed)
    returns     q (T, Hq, D) contiguous, qkv's dtype.

    Bitwise equal to ``rope_fwd(rmsnorm_fwd(q)[0])``, ``rope_fwd(rmsnorm_fwd(k)[0])``
    and ``write_kv_fwd`` on the same device.  ``heads_per_program`` (a power
    of two) and ``num_warps`` are CUDA launch knobs that never change bits.
    """
    _check_spec(spec, q_w.shape[0])
    cos, sin = rope_table(spec, qkv.device)
    args = (qkv, q_w, k_w, eps, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)
    if qkv.is_cuda:
        from .kernel import qk_norm_rope_kv_triton

        return qk_norm_rope_kv_triton(*args, heads_per_program, num_warps)
    if qkv.shape[0] == 0:
        return qkv.new_empty(0, num_heads, q_w.shape[0])
    return qk_norm_rope_kv_cpu(*args)


def qk_norm_rope_kv(
    qkv: torch.Tensor,
    q_w: torch.Tensor,
    k_w: torch.Tensor,
    eps: float,
    positions: torch.Tensor,
    spec: RopeSpec,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> torch.Tensor:
    """``qk_norm_rope_kv_fwd`` after checking every input (syncs with the host
    on CUDA: positions against the table, slots against the cache)."""
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
    for name, h in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(h, bool) or not isinstance(h, int) or h < 1:
            raise ValueError(f"{name} must be a positive int, got {h!r}")
    check_tensor("qkv", qkv, dtypes=FLOAT_DTYPES, ndim=2, contiguous=False)
    if qkv.stride(1) != 1:
        raise ValueError(f"qkv must have unit column stride (got strides {qkv.stride()}); call .contiguous() first")
    check_tensor("q_w", q_w, dtypes=(qkv.dtype,), ndim=1)
    D = q_w.shape[0]
    if D % 2 or D > ROW_CHUNK:
        raise ValueError(f"q_w: head_dim {D} must be even and at most {ROW_CHUNK} (one row-sum chunk)")
    check_tensor("k_w", k_w, dtypes=(qkv.dtype,), ndim=1)
    check_dim("k_w", k_w.shape[0], D, "length (head_dim)")
    check_dim("qkv", qkv.shape[1], (num_heads + 2 * num_kv_heads) * D, "width ((Hq + 2 Hkv) * head_dim)")
    check_tensor("positions", positions, dtypes=POSITION_DTYPES, ndim=1)
    check_dim("positions", positions.shape[0], qkv.shape[0], "length (tokens)")
    check_same_device(qkv=qkv, q_w=q_w, k_w=k_w, positions=positions)
    check_cache_write(k_cache, v_cache, slot_mapping, qkv.shape[0], (num_kv_heads, D), qkv.dtype, qkv.dtype, "qkv",
                      qkv=qkv)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite real number >= 0, got {eps!r}")
    _check_spec(spec, D)
    _check_positions_range(positions, spec)
    return qk_norm_rope_kv_fwd(qkv, q_w, k_w, eps, positions, spec, k_cache, v_cache, slot_mapping, num_heads,
                               num_kv_heads)
