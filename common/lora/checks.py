"""Ladder rungs 1-2 and accuracy for LoRA (``alignzoo check lora``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rung1_repeat, rung2_rows
from ..matmul import matmul_fwd
from .adapter import stack_adapters
from .naive import lora_linear_ref
from .op import lora_linear_multi_fwd, lora_linear_separate_fwd, lora_merge_fwd


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    M, K, N, r = (48, 100, 60, 8) if device.type == "cpu" else (300, 4096, 1000, 16)
    bf = torch.bfloat16
    x = torch.randn(M, K, generator=g).to(device, bf)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, bf)
    ads = [((torch.randn(rj, K, generator=g) / K**0.5).to(device, bf), (torch.randn(N, rj, generator=g) / rj**0.5).to(device, bf))
           for rj in (r, 3)]
    (a, b), scale = ads[0], 2.0
    a_n, b_n = stack_adapters(ads)
    idx = (torch.arange(M) % 3 - 1).to(device)  # -1, 0, 1, -1, ...
    w_m = lora_merge_fwd(w, a, b, scale)

    def multi(x, idx):
        return lora_linear_multi_fwd(x, w, idx, a_n, b_n, [scale, 1.5])

    rows = [
        ("merge", rung1_repeat("lora", lora_merge_fwd, w, a, b, scale)),
        ("merged", rung2_rows("lora", matmul_fwd, (x,), shared={"w": w_m})),
        ("separate", rung1_repeat("lora", lora_linear_separate_fwd, x, w, a, b, scale)),
        ("separate", rung2_rows("lora", lora_linear_separate_fwd, (x,), shared={"w": w, "a": a, "b": b, "scale": scale})),
        ("multi", rung2_rows("lora", multi, (x, idx))),
    ]
    out = []
    for name, res in rows:
        res.check = f"{name}: {res.check}"
        out.append(res)
    ref = lora_linear_ref(x, w, a, b, scale)
    out += [
        accuracy("lora", lora_linear_separate_fwd(x, w, a, b, scale), ref, 1e-2, "separate bf16 vs float64"),
        accuracy("lora", matmul_fwd(x, w_m), ref, 1e-2, "merged bf16 vs float64"),
    ]
    return out
