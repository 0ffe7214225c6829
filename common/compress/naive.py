"""Float64 reference of the KV compressors (differentiable), written as transformers lays it out:
per sequence, its complete groups as (n, rate, C) windows, the overlap's previous half shifted
in, softmax over the window, weighted sum.  No intermediate rounding."""
from __future__ import annotations

import torch


def compress_ref(kv, gate, position_bias, cu_seqlens, *, rate: int, overlap: bool):
    """kv, gate (T, C), position_bias (rate, C), cu_seqlens (N + 1,) ->
    (rows (G, D) float64, positions (G,) int64): each sequence's complete groups in order, a
    group's position being its first token's (w * rate)."""
    kv, gate, pb = kv.double(), gate.double(), position_bias.double()
    D = kv.shape[1] // (2 if overlap else 1)
    rows, positions = [], []
    cu = [int(c) for c in cu_seqlens]
    for s, e in zip(cu[:-1], cu[1:]):
        n = (e - s) // rate
        if n == 0:
            continue
        k = kv[s : s + n * rate].view(n, rate, -1)
        g = gate[s : s + n * rate].view(n, rate, -1) + pb
        if overlap:
            prev_k = torch.cat((k.new_zeros(1, rate, D), k[:-1, :, :D]))
            prev_g = torch.cat((g.new_full((1, rate, D), float("-inf")), g[:-1, :, :D]))
            k = torch.cat((prev_k, k[..., D:]), dim=1)
            g = torch.cat((prev_g, g[..., D:]), dim=1)
        rows.append((k * g.softmax(dim=1)).sum(dim=1))
        positions.append(torch.arange(n) * rate)
    if not rows:
        return kv.new_zeros(0, D), torch.zeros(0, dtype=torch.long)
    return torch.cat(rows), torch.cat(positions)
