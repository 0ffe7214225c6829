"""Ladder rows for RoPE: rung 1, rung 2 (tokens as rows) and accuracy vs float64."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rung1_repeat, rung2_rows
from .naive import rope_ref
from .op import rope_bwd, rope_fwd
from .table import RopeSpec, Yarn

# Qwen3 (full half-split), DeepSeek-V4 compress (YaRN, interleaved, [nope | rope]),
# GLM-5 MLA query (interleaved in, half-split out, [nope | rope]).
SPECS = {
    "qwen3": (RopeSpec(128, 1e6, 4096), 128),
    "dsv4-yarn": (
        RopeSpec(64, 160000.0, 4096, pairing="interleaved", rotary_slice="last", yarn=Yarn(16.0, 65536, attention_factor=1.0)),
        192,
    ),
    "glm5": (RopeSpec(64, 1e6, 4096, pairing="interleaved_to_half", rotary_slice="last"), 256),
}


def _configs(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [{}, {"block_rows": 1}, {"block_rows": 64}]
    return [{}, {"block_rows": 37}, {"block_rows": 100}]


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    T, H = 333, 3  # positions up to 4095: past 593 and 2048
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    out: list[RungResult] = []
    for name, (spec, D) in SPECS.items():
        x = torch.randn(T, H, D, generator=g).to(device=device, dtype=torch.bfloat16)
        fwd = lambda x, p, spec=spec, **kw: rope_fwd(x, p, spec, **kw)  # noqa: E731
        bwd = lambda dy, p, spec=spec, **kw: rope_bwd(dy, p, spec, **kw)  # noqa: E731
        x32 = x.float()
        rows = [
            rung1_repeat("rope", fwd, x, positions),
            rung2_rows("rope", fwd, [x, positions], configs=_configs(device)),
            rung2_rows("rope", bwd, [x, positions], configs=_configs(device)),
            accuracy("rope", fwd(x, positions), rope_ref(x, positions, spec), bound=4e-3, what="bf16 vs float64"),
            accuracy("rope", fwd(x32, positions), rope_ref(x32, positions, spec), bound=1e-6, what="fp32 vs float64"),
        ]
        rows[2].check += " (bwd)"
        for r in rows:
            r.check = f"{name}: {r.check}"
        out.extend(rows)
    return out
