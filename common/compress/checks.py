"""Ladder rows for the KV compressors: rung 1, rung 2 (a sequence alone, and the server's decode one
token at a time, against the trainer's packed batch) and accuracy vs float64, for C4 and C128."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rows_differing, rung1_repeat
from .naive import compress_ref
from .op import compress, compress_state_fields, compress_step

CASES = {"c4": (4, True, 512), "c128": (128, False, 512)}  # (rate, overlap, D): DeepSeek-V4's sizes


def _decoded(kv, gate, pb, lens, rate, overlap) -> torch.Tensor:
    """Every sequence fed one token a step, all in one batch, in reversed slots -> the rows in the
    trainer's order."""
    dev, N, C = kv.device, len(lens), kv.shape[1]
    state = {n: torch.zeros(N, *s, dtype=d, device=dev)
             for n, (s, d) in compress_state_fields(rate, C, overlap=overlap, dtype=kv.dtype).items()}
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()[:-1]
    slots = torch.arange(N - 1, -1, -1, device=dev)
    got = [[] for _ in lens]
    for p in range(max(lens)):
        live = [i for i in range(N) if p < lens[i]]
        idx = torch.tensor([starts[i] + p for i in live], device=dev)
        cu = torch.arange(len(live) + 1, device=dev)
        out = compress_step(kv[idx], gate[idx], pb, cu, torch.full((len(live),), p, device=dev), slots[live], state,
                            rate=rate, overlap=overlap)
        if (p + 1) % rate == 0:
            for b, i in enumerate(live):
                got[i].append(out[b])
    return torch.stack([r for rows in got for r in rows])


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    out: list[RungResult] = []
    for name, (rate, overlap, D) in CASES.items():
        C = 2 * D if overlap else D
        lens = [2 * rate + 1, rate - 1, rate + 2]
        T = sum(lens)
        kv = torch.randn(T, C, generator=g).to(device=device, dtype=torch.bfloat16)
        gate = torch.randn(T, C, generator=g).to(device=device, dtype=torch.bfloat16)
        pb = torch.randn(rate, C, generator=g).to(device)
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
        run = lambda kv, gate: compress(kv, gate, pb, cu, rate=rate, overlap=overlap)[0]  # noqa: E731
        rows = run(kv, gate)
        alone = torch.cat([compress(kv[a:b], gate[a:b], pb, torch.tensor([0, b - a], device=device), rate=rate,
                                    overlap=overlap)[0] for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
        decoded = _decoded(kv, gate, pb, lens, rate, overlap)
        res = [rung1_repeat("compress", run, kv, gate)]
        for check, other in (("each sequence alone", alone), ("server decode, token by token", decoded)):
            bad = int(rows_differing(rows, other).sum())
            res.append(RungResult("compress", 2, check, bad == 0, rows.shape[0], bad))
        ref = compress_ref(kv, gate, pb, cu, rate=rate, overlap=overlap)[0]
        res.append(accuracy("compress", rows, ref, bound=1e-2, what="bf16 vs float64"))
        for r in res:
            r.check = f"{name}: {r.check}"
        out.extend(res)
    return out
