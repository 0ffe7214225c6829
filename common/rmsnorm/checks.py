"""Ladder rungs 1-2 and accuracy for RMSNorm (``alignzoo check rmsnorm``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rows_differing, rung1_repeat, rung2_rows
from .naive import rmsnorm_gated_ref, rmsnorm_ref, rmsnorm_residual_ref
from .op import rmsnorm_bwd, rmsnorm_fwd

EPS = 1e-6


def _configs(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [{}, {"block_rows": 1, "num_warps": 2}, {"block_rows": 2, "num_warps": 8}]
    return [{}, {"block_rows": 5}]


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    M, H = (64, 1000) if device.type == "cpu" else (300, 4096)
    Hg = 128  # GDN head dim: the gated norm's row width
    bf = torch.bfloat16
    x = torch.randn(M, H, generator=g).to(device, bf)
    res = (4 * torch.randn(M, H, generator=g)).to(device, bf)
    w = (1 + 0.1 * torch.randn(H, generator=g)).to(device, bf)
    xg = torch.randn(M, Hg, generator=g).to(device, bf)
    zg = (2 * torch.randn(M, Hg, generator=g)).to(device, bf)
    wg = (1 + 0.1 * torch.randn(Hg, generator=g)).to(device, bf)
    dy = torch.randn(M, H, generator=g).to(device, bf)

    plain = lambda x, w, **kw: rmsnorm_fwd(x, w, EPS, **kw)[0]  # noqa: E731
    fused = lambda x, r, w, **kw: rmsnorm_fwd(x, w, EPS, residual=r, **kw)[:2]  # noqa: E731
    gated = lambda x, z, w, **kw: rmsnorm_fwd(x, w, EPS, z=z, **kw)[0]  # noqa: E731

    def bwd(dy, x, w):
        return rmsnorm_bwd(dy, x, w, rmsnorm_fwd(x, w, EPS)[2])[::2]  # (dx, dw)

    def bwd_dx(dy, x, w):
        return bwd(dy, x, w)[0]

    cfg = _configs(device)
    rows = [
        ("plain", rung1_repeat("rmsnorm", plain, x, w)),
        ("fused", rung1_repeat("rmsnorm", fused, x, res, w)),
        ("gated", rung1_repeat("rmsnorm", gated, xg, zg, wg)),
        ("bwd dx, dw", rung1_repeat("rmsnorm", bwd, dy, x, w)),
        ("plain", rung2_rows("rmsnorm", plain, (x,), shared={"w": w}, configs=cfg)),
        ("fused", rung2_rows("rmsnorm", fused, (x, res), shared={"w": w}, configs=cfg)),
        ("gated", rung2_rows("rmsnorm", gated, (xg, zg), shared={"w": wg}, configs=cfg)),
        ("bwd dx", rung2_rows("rmsnorm", bwd_dx, (dy, x), shared={"w": w})),
    ]
    out = []
    for name, r in rows:
        r.check = f"{name}: {r.check}"
        out.append(r)

    normed, new_res = fused(x, res, w)
    bad = rows_differing(normed, plain(new_res, w))
    out.append(RungResult("rmsnorm", 2, "fused normed == plain(new residual)", not bad.any(), bad.numel(), int(bad.sum())))

    x32, w32 = x.float(), w.float()
    out += [
        accuracy("rmsnorm", plain(x, w), rmsnorm_ref(x, w, EPS), 5e-3, "plain bf16 vs float64"),
        accuracy("rmsnorm", plain(x32, w32), rmsnorm_ref(x32, w32, EPS), 1e-6, "plain fp32 vs float64"),
        accuracy("rmsnorm", normed, rmsnorm_residual_ref(x, res, w, EPS)[0], 5e-3, "fused bf16 vs float64"),
        accuracy("rmsnorm", gated(xg, zg, wg), rmsnorm_gated_ref(xg, zg, wg, EPS), 5e-3, "gated bf16 vs float64"),
    ]
    return out
