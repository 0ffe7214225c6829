"""The paged KV cache's storage and its one writer.

Layout: ``k_cache``/``v_cache`` are ``(num_pages, PAGE_SIZE, Hkv, D)``; token
position ``p`` of a sequence lives at page ``block_table[p // PAGE_SIZE]``,
offset ``p % PAGE_SIZE`` — its *slot* is ``page * PAGE_SIZE + offset``.

Prefill and decode both write through ``write_kv_fwd``: it copies the rows of
k/v to their slots and does no arithmetic, so the bytes that land in the cache
are the bytes of the k/v the model computed, whichever path wrote them.
"""
from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor

PAGE_SIZE = 64


def allocate_kv_cache(
    num_pages: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed ``(k_cache, v_cache)``, each ``(num_pages, PAGE_SIZE, Hkv, D)``."""
    if num_pages < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"num_pages, num_kv_heads, head_dim must be >= 1, got {num_pages}, {num_kv_heads}, {head_dim}")
    shape = (num_pages, PAGE_SIZE, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device)


def write_kv_fwd(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Copy ``k[i], v[i]`` (each ``(Hkv, D)``) to slot ``slot_mapping[i]``; a
    negative slot skips the row (padding tokens of a CUDA-graph batch).
    No checks: the server calls this directly; ``write_kv`` validates."""
    if k.shape[0] == 0:
        return
    if k.is_cuda:
        from .kernel import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        from .cpu import write_kv_cpu

        write_kv_cpu(k, v, k_cache, v_cache, slot_mapping)


def write_row_fwd(parts, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Copy a row made of several parts into one paged pool, in place: token i's row is
    ``cat([p[i] for p in parts], -1)`` (an MLA row: [latent (Rkv) | rope key (Dr)]), written to slot
    ``slot_mapping[i]`` of ``cache`` (P, PAGE_SIZE, *row); -1 skips the token.  A copy, no arithmetic:
    the pool holds the bytes the parts were, whichever path wrote them.  No checks (``write_row``)."""
    n = parts[0].shape[0]
    if n == 0:
        return
    row = cache.shape[2:]
    rows = torch.cat([p.reshape(n, *row[:-1], -1) for p in parts], dim=-1)
    if cache.is_cuda:  # the K/V writer's kernel, the row as both its k and v: no host read, graph-safe
        from .kernel import write_kv_triton

        write_kv_triton(rows, rows, cache, cache, slot_mapping)
        return
    keep = slot_mapping >= 0
    cache.view(-1, *row)[slot_mapping[keep].long()] = rows[keep]


def write_row(parts, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """``write_row_fwd`` after the checks: every part (N, ...) in the cache's dtype, their widths adding
    up to the cache's row, the slots inside the cache and distinct."""
    if not parts:
        raise ValueError("write_row needs at least one part")
    for i, p in enumerate(parts):
        check_tensor(f"parts[{i}]", p, dtypes=FLOAT_DTYPES)
    n = parts[0].shape[0]
    if any(p.shape[0] != n for p in parts):
        raise ValueError(f"the parts have {[p.shape[0] for p in parts]} rows; they must agree")
    width = sum(p[0].numel() if n else p.shape[1:].numel() for p in parts)
    row = tuple(cache.shape[2:])
    if width != torch.Size(row).numel():
        raise ValueError(f"the parts add up to {width} values a row; the cache holds rows of {row}")
    check_cache_write(cache, cache, slot_mapping, n, row, parts[0].dtype, parts[0].dtype, name="row", **{
        f"part{i}": p for i, p in enumerate(parts)})
    if any(p.dtype != cache.dtype for p in parts):
        raise TypeError(f"part dtypes {[p.dtype for p in parts]}; the cache is {cache.dtype}: the writer never casts")
    write_row_fwd(parts, cache, slot_mapping)


def check_cache_write(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, n_tokens: int, rows: tuple,
    k_dtype: torch.dtype, v_dtype: torch.dtype, name: str = "k/v", **inputs: torch.Tensor,
) -> None:
    """The checks of a cache write of ``n_tokens`` k and v rows of shape
    ``rows`` = (Hkv, D) (named ``name`` in errors) at ``slot_mapping``; the
    writer's other ``inputs`` (already checked) must share the cache's device.
    Syncs with the host on CUDA."""
    for cname, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        check_tensor(cname, t, dtypes=FLOAT_DTYPES, ndim=4)
    check_tensor("slot_mapping", slot_mapping, dtypes=(torch.int32, torch.int64), ndim=1)
    check_same_device(**inputs, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache has shape {tuple(v_cache.shape)}, k_cache has {tuple(k_cache.shape)}; they must match")
    if k_cache.shape[1] != PAGE_SIZE:
        raise ValueError(f"k_cache pages hold {k_cache.shape[1]} tokens; expected PAGE_SIZE = {PAGE_SIZE}")
    if tuple(rows) != tuple(k_cache.shape[2:]):
        raise ValueError(f"{name} rows are (Hkv, D) = {tuple(rows)} but the cache holds {tuple(k_cache.shape[2:])}")
    if k_dtype != k_cache.dtype or v_dtype != v_cache.dtype:
        raise TypeError(f"{name} dtype {k_dtype} does not match the cache dtype {k_cache.dtype}: the writer copies bytes, it never casts")
    if slot_mapping.shape[0] != n_tokens:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} entries for {n_tokens} tokens")
    n_slots = k_cache.shape[0] * PAGE_SIZE
    used = slot_mapping[slot_mapping >= 0]
    if used.numel():
        hi = int(used.max())
        if hi >= n_slots:
            raise ValueError(f"slot_mapping has slot {hi}, past the cache ({k_cache.shape[0]} pages = {n_slots} slots)")
        if torch.unique(used).numel() != used.numel():
            raise ValueError("slot_mapping names the same slot twice")
    if bool((slot_mapping < -1).any()):
        raise ValueError("slot_mapping entries must be >= 0, or -1 to skip a token")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write new tokens' keys and values into the paged cache, in place.

    k, v:               (N, Hkv, D)        same dtype as the cache
    k_cache, v_cache:   (P, PAGE_SIZE, Hkv, D)
    slot_mapping:       (N,) int32/int64   page * PAGE_SIZE + offset, or -1 to skip
    """
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, dtypes=FLOAT_DTYPES, ndim=3)
    if v.shape != k.shape:
        raise ValueError(f"v has shape {tuple(v.shape)}, k has {tuple(k.shape)}; they must match")
    check_cache_write(k_cache, v_cache, slot_mapping, k.shape[0], k.shape[1:], k.dtype, v.dtype, k=k, v=v)
    write_kv_fwd(k, v, k_cache, v_cache, slot_mapping)
