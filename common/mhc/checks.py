"""Ladder rungs 1-2 and accuracy for DeepSeek-V4's hyper-connections (``alignzoo check mhc``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rung1_repeat, rung2_rows
from .naive import hc_collapse_ref, hc_head_ref, hc_mix_ref, hc_weights_ref
from .op import hc_collapse_fwd, hc_head_fwd, hc_mix_fwd, hc_weights_fwd

ITERS, EPS = 20, 1e-6  # DeepSeek-V4's hc_sinkhorn_iters, hc_eps and rms_norm_eps


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    T, hc, D = (63, 4, 100) if device.type == "cpu" else (300, 4, 4096)
    x = torch.randn(T, hc, D, generator=g)
    out = torch.randn(T, D, generator=g)
    fn = (torch.randn((2 + hc) * hc, hc * D, generator=g) * 0.05).to(device)
    base = (torch.randn((2 + hc) * hc, generator=g) * 0.1).to(device)
    scale = (torch.rand(3, generator=g) + 0.5).to(device)
    hfn, hbase, hscale = fn[hc:2 * hc].contiguous(), base[hc:2 * hc].contiguous(), scale[1:2].contiguous()

    def layer(x, out):
        pre, post, comb, _, _ = hc_weights_fwd(x, fn, base, scale, ITERS, EPS, EPS)
        return post, comb, hc_collapse_fwd(x, pre), hc_mix_fwd(out, x, post, comb)

    def head(x):
        return hc_head_fwd(x, hfn, hbase, hscale, EPS, EPS)[0]

    out_rows = []
    for dtype in (torch.bfloat16, torch.float32):
        xd, od = x.to(device, dtype), out.to(device, dtype)
        name = str(dtype).replace("torch.", "")
        for what, r in (("layer", rung1_repeat("mhc", layer, xd, od)), ("head", rung1_repeat("mhc", head, xd)),
                        ("layer", rung2_rows("mhc", layer, (xd, od))), ("head", rung2_rows("mhc", head, (xd,)))):
            r.check = f"{name} {what}: {r.check}"
            out_rows.append(r)
    x32, o32 = x.to(device), out.to(device)
    post, comb, collapsed, mixed = layer(x32, o32)
    pre_r, post_r, comb_r = hc_weights_ref(x32, fn, base, scale, ITERS, EPS, EPS)
    out_rows += [
        accuracy("mhc", comb, comb_r, 1e-6, "fp32 comb vs float64"),
        accuracy("mhc", post, post_r, 1e-6, "fp32 post vs float64"),
        accuracy("mhc", collapsed, hc_collapse_ref(x32, pre_r), 1e-6, "fp32 collapse vs float64"),
        accuracy("mhc", mixed, hc_mix_ref(o32, x32, post_r, comb_r), 1e-6, "fp32 mix vs float64"),
        accuracy("mhc", head(x32), hc_head_ref(x32, hfn, hbase, hscale, EPS, EPS), 1e-6, "fp32 head vs float64"),
    ]
    return out_rows
