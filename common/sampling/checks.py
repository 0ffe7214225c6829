"""Ladder rows for the sampling transforms (``alignzoo check sampling``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, bitwise_equal, rung1_repeat, rung2_rows
from .naive import transformed_logprobs_ref
from .op import sample_fwd, sampling_logprobs_fwd, transformed_logprobs_fwd

PARAM_NAMES = ("temperature", "top_k", "top_p", "min_p")


def random_case(B: int, V: int, device, seed: int = 0, spread: float = 2.0) -> dict[str, torch.Tensor]:
    """Logits (B, V) with mixed per-row parameters: greedy rows, each transform
    on and off, top_k past V, top_p tiny, min_p near 1, and exact ties."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * (torch.rand(B, 1, generator=g) * spread + 0.5)
    logits[::5, : V // 3] = logits[::5, : V // 3].round()  # exact ties in some rows
    t = torch.rand(B, generator=g) * 1.4 + 0.3
    t[::7] = 0.0
    k = torch.randint(1, V + 8, (B,), generator=g)
    k[::2] = 0
    p = torch.rand(B, generator=g) * 0.98 + 0.02
    p[::3] = 1.0
    p[4::11] = 1e-6
    m = torch.rand(B, generator=g) * 0.2
    m[1::2] = 0.0
    m[6::13] = 0.999
    case = {"logits": logits, "temperature": t, "top_k": k, "top_p": p, "min_p": m,
            "seed": torch.randint(-(2**62), 2**62, (B,), generator=g), "step": torch.randint(0, 5000, (B,), generator=g)}
    return {n: x.to(device) for n, x in case.items()}


def _launch_configs(device) -> list[dict]:
    return [{}, {"row_chunk": 4}, {"row_chunk": 1}]


def ladder(device: torch.device) -> list[RungResult]:
    out = []
    c = random_case(13, 1000, device)
    params = [c[n] for n in PARAM_NAMES]
    rows = (c["logits"], *params, c["seed"], c["step"])
    out.append(rung1_repeat("sampling", sample_fwd, *rows))
    out.append(rung2_rows("sampling", sample_fwd, rows, configs=_launch_configs(device), batch_sizes=(1, 2, 5)))

    wide = random_case(2, 151936, device, seed=1)
    wrows = (wide["logits"], *[wide[n] for n in PARAM_NAMES], wide["seed"], wide["step"])
    r = rung2_rows("sampling", sample_fwd, wrows, configs=[{}, {"row_chunk": 1}], batch_sizes=(1,))
    r.check += " (V=151936)"
    out.append(r)

    tokens, lps = sample_fwd(*rows)
    out.append(rung2_rows("sampling", sampling_logprobs_fwd, (c["logits"], tokens, *params),
                          configs=_launch_configs(device), batch_sizes=(1, 2, 5)))
    out[-1].check += " (replay)"
    replay = sampling_logprobs_fwd(c["logits"], tokens, *params)[0]
    same = bitwise_equal(replay, lps)
    out.append(RungResult("sampling", 3, "replay == sampler", same, lps.numel(), int((replay != lps).sum())))

    # every token's log-prob vs float64 over the common support; the supports
    # themselves may differ only by an edge token whose cut lies within fp32
    # error of its threshold (none on the CPU for this case)
    got = transformed_logprobs_fwd(c["logits"], *params).cpu()
    ref = transformed_logprobs_ref(c["logits"].cpu(), *[x.cpu() for x in params])
    both = torch.isfinite(ref) & torch.isfinite(got)
    r = accuracy("sampling", got[both], ref[both], 2e-6, "support log-probs vs float64")
    edge = (torch.isfinite(ref) != torch.isfinite(got)).sum(1)
    r.differing = int(edge.sum())
    r.passed = r.passed and bool((edge <= 1).all())
    r.detail += f"; support differs in {r.differing} tokens"
    out.append(r)
    return out
