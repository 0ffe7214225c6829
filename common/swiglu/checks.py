"""Ladder rungs 1-2 and accuracy for SwiGLU (``alignzoo check swiglu``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rung1_repeat, rung2_rows
from .naive import swiglu_ref
from .op import swiglu_bwd, swiglu_fwd

LIMIT = 10.0  # DeepSeek-V4's swiglu_limit


def _configs(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [{}, {"block_rows": 1, "block_cols": 128, "num_warps": 2}, {"block_rows": 8, "block_cols": 512, "num_warps": 8}]
    return [{}, {"block_rows": 5}]


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    M, I = (64, 1000) if device.type == "cpu" else (300, 12288)
    bf = torch.bfloat16
    gate_up = (6 * torch.randn(M, 2 * I, generator=g)).to(device, bf)  # |x| > 10 in ~10%: the clamp acts
    gate, up = gate_up.chunk(2, dim=-1)
    dy = torch.randn(M, I, generator=g).to(device, bf)

    def packed(gu, limit=None, **kw):
        return swiglu_fwd(*gu.chunk(2, dim=-1), limit, **kw)

    def bwd(dy, gu, limit=None):
        return swiglu_bwd(dy, *gu.chunk(2, dim=-1), limit)

    cfg = _configs(device)
    rows = [
        ("plain", rung1_repeat("swiglu", packed, gate_up)),
        ("limit", rung1_repeat("swiglu", packed, gate_up, LIMIT)),
        ("bwd limit", rung1_repeat("swiglu", bwd, dy, gate_up, LIMIT)),
        ("plain", rung2_rows("swiglu", packed, (gate_up,), configs=cfg)),
        ("limit", rung2_rows("swiglu", packed, (gate_up,), shared={"limit": LIMIT}, configs=cfg)),
        ("bwd limit", rung2_rows("swiglu", bwd, (dy, gate_up), shared={"limit": LIMIT})),
    ]
    out = []
    for name, r in rows:
        r.check = f"{name}: {r.check}"
        out.append(r)
    g32, u32 = gate.float(), up.float()
    out += [
        accuracy("swiglu", packed(gate_up), swiglu_ref(gate, up), 4e-3, "bf16 vs float64"),
        accuracy("swiglu", packed(gate_up, LIMIT), swiglu_ref(gate, up, LIMIT), 4e-3, "bf16 limit vs float64"),
        accuracy("swiglu", swiglu_fwd(g32, u32), swiglu_ref(g32, u32), 1e-6, "fp32 vs float64"),
    ]
    return out
