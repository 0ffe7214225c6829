"""The routed experts as a conventional serving stack runs them: the vendor baseline.

Neither batch-invariant nor the trainer's bits (a grouped GEMM's tiling follows the per-expert row
counts): what ``benchmarks/bench_moe.py`` and the vendor servers (``models/*/serve_vendor.py``)
measure the aligned experts against.  Sort the (token, slot) rows by expert, ``torch._grouped_mm``
for gate/up and down (bf16 in, fp32 accumulate inside), SiLU·up in the model dtype, the routing
weight, an ``index_add_`` (transformers' grouped backend does the same).  No host read where
``_grouped_mm`` exists, so it captures into a decode CUDA graph; elsewhere a per-expert loop.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """rows xs (N, H) sorted by expert, w (E, O, H), offs (E,) int32 cumulative counts -> (N, O)."""
    if hasattr(torch, "_grouped_mm") and xs.is_cuda:
        return torch._grouped_mm(xs, w.transpose(1, 2), offs=offs)
    return grouped_loop(xs, w, offs)


def grouped_loop(xs: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``_grouped`` as one matmul an expert (a host read of the counts): where ``_grouped_mm`` is missing."""
    bounds = [0, *offs.tolist()]
    return torch.cat([xs[a:b] @ w[e].T for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def experts_vendor(x, ids, w, w_gu, w_d, limit: float | None = None) -> torch.Tensor:
    """x (T, H); ids (T, k) int; w (T, k) routing weights; w_gu (E, 2I, H) gate rows then up rows;
    w_d (E, H, I); ``limit``: DeepSeek-V4's SwiGLU clamp -> (T, H) in x.dtype."""
    T, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat)
    tok = order // k
    counts = torch.zeros(w_gu.shape[0], dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts, 0).to(torch.int32)
    g, u = _grouped(x[tok], w_gu, offs).chunk(2, dim=-1)
    if limit is not None:
        g, u = g.clamp(max=limit), u.clamp(min=-limit, max=limit)
    d = _grouped(F.silu(g) * u, w_d, offs) * w.reshape(-1)[order, None].to(x.dtype)
    return torch.zeros_like(x).index_add_(0, tok, d)
