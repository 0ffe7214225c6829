"""Ladder rungs 1-2 and accuracy for the routed experts (``alignzoo check moe``):
the same tokens alone, in batches of other sizes, shuffled, padded, under
skewed routing (every token to one expert) and with experts that get none."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, rung1_repeat, rung2_rows
from .naive import experts_fp8_ref, experts_ref
from .op import (
    dequantize_experts_mxfp4,
    experts_fp8_fwd,
    experts_fwd,
    experts_mxfp4_fwd,
    quantize_experts_fp8,
    quantize_experts_mxfp4,
)
from .router import hash_route_fwd, sigmoid_topk_fwd, softmax_topk_fwd, sqrtsoftplus_topk_fwd
from .router_naive import sigmoid_topk_ref, softmax_topk_ref, sqrtsoftplus_topk_ref

LIMIT = 10.0  # DeepSeek-V4's swiglu_limit


def make_experts(T: int, H: int, I: int, E: int, k: int, *, device, dtype=torch.bfloat16, seed: int = 0,
                 skew: bool = False):
    """Random (x, ids, weights, w_gate_up, w_down); ``skew``: slot 0 of every
    token is expert 0 and experts E-1, E-2 get no token."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(device, dtype)
    scores = torch.rand(T, E, generator=g)
    if E > 3:
        scores[:, E - 2:] = -1.0  # never chosen
    if skew:
        scores[:, 0] = 2.0
    ids = scores.topk(k, dim=-1).indices.to(device)
    weights = torch.softmax(torch.randn(T, k, generator=g), -1).to(device, dtype)
    w_gu = (torch.randn(E, 2 * I, H, generator=g) * H ** -0.5).to(device, dtype)
    w_d = (torch.randn(E, H, I, generator=g) * I ** -0.5).to(device, dtype)
    return x, ids, weights, w_gu, w_d


def _router_rows(device: torch.device) -> list[RungResult]:
    """Each router (Qwen3.5's softmax, GLM-5's grouped sigmoid, DeepSeek-V4's
    sqrt-softplus and hash routing) at its real expert count: rungs 1-2 on
    weights and ids, and weights against float64."""
    g = torch.Generator().manual_seed(1)
    T, E = (300, 256)
    logits = (2 * torch.randn(T, E, generator=g)).to(device)
    bias = (0.1 * torch.randn(E, generator=g)).to(device)
    tokens = torch.randint(0, 1000, (T,), generator=g).to(device)
    tid2eid = torch.stack([torch.randperm(E, generator=g)[:6] for _ in range(1000)]).to(device)
    cases = {
        "softmax top-8": (lambda lg: softmax_topk_fwd(lg, 8), (logits,), {}),
        "grouped sigmoid top-8": (lambda lg, bias: sigmoid_topk_fwd(lg, bias, 8, 8, 4, 2.5), (logits,), {"bias": bias}),
        "sqrt-softplus top-6": (lambda lg, bias: sqrtsoftplus_topk_fwd(lg, bias, 6, 1.5), (logits,), {"bias": bias}),
        "hash top-6": (lambda lg, tok, tid2eid: hash_route_fwd(lg, tok, tid2eid, 1.5), (logits, tokens),
                       {"tid2eid": tid2eid}),
    }
    out = []
    for name, (fn, rows, shared) in cases.items():
        for r in (rung1_repeat("moe", fn, *rows, **shared), rung2_rows("moe", fn, rows, shared=shared)):
            r.check = f"router {name}: {r.check}"
            out.append(r)
    lg = logits.double()
    refs = {"softmax top-8": softmax_topk_ref(lg, 8)[0],
            "grouped sigmoid top-8": sigmoid_topk_ref(lg, bias.double(), 8, n_group=8, topk_group=4,
                                                      routed_scaling_factor=2.5)[0],
            "sqrt-softplus top-6": sqrtsoftplus_topk_ref(lg, bias.double(), 6, routed_scaling_factor=1.5)[0]}
    for name, ref in refs.items():
        fn, rows, shared = cases[name]
        out.append(accuracy("moe", fn(*rows, **shared)[0], ref, 1e-6, f"router {name} weights vs float64"))
    return out


def ladder(device: torch.device) -> list[RungResult]:
    T, H, I, E, k = (70, 72, 40, 7, 3) if device.type == "cpu" else (600, 2048, 512, 64, 8)
    out = _router_rows(device)
    for skew in (False, True):
        x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, skew=skew)
        name = "skewed routing" if skew else "routing"
        fn = lambda x, ids, w, w_gu, w_d, limit=None: experts_fwd(x, ids, w, w_gu, w_d, limit)  # noqa: E731
        r1 = rung1_repeat("moe", fn, x, ids, w, w_gu, w_d)
        r2 = rung2_rows("moe", fn, (x, ids, w), shared={"w_gu": w_gu, "w_d": w_d}, batch_sizes=(1, 2, 3, 7, 64))
        r2l = rung2_rows("moe", fn, (x, ids, w), shared={"w_gu": w_gu, "w_d": w_d, "limit": LIMIT})
        for r, what in ((r1, "experts"), (r2, "experts"), (r2l, "experts, SwiGLU clamp")):
            r.check = f"{what}, {name}: {r.check}"
            out.append(r)
        out.append(accuracy("moe", fn(x, ids, w, w_gu, w_d), experts_ref(x, ids, w, w_gu, w_d), 8e-3,
                            f"experts bf16, {name}, vs float64"))
        out += _fp8_rows(x, ids, w, w_gu, w_d, name)
        # MXFP4 groups K by 32: the CPU shapes' H = 72 and I = 40 do not divide
        mx = (x, ids, w, w_gu, w_d) if device.type != "cpu" else make_experts(70, 96, 64, E, k, device=device, skew=skew)
        out += _mxfp4_rows(*mx, name)
    return out + _lora_rows(device)


def _lora_rows(device: torch.device) -> list[RungResult]:
    """An adapter inside the bf16, FP8 and MXFP4 experts (``lora.py``): rungs 1-2 on each format, and
    the bf16 experts with it against float64."""
    from .lora import ExpertLoRA

    T, H, I, E, k, r = (70, 96, 64, 7, 3, 4) if device.type == "cpu" else (600, 2048, 512, 64, 8, 16)
    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, skew=True, seed=5)
    g = torch.Generator().manual_seed(6)
    lora = ExpertLoRA(*((torch.randn(*shape, generator=g) * std).to(device, x.dtype) for shape, std in (
        ((E, r, H), H ** -0.5), ((E, 2 * I, r), 0.3), ((E, r, I), I ** -0.5), ((E, H, r), 0.3))), 2.0)
    out = []
    for label, fwd, q in (("bf16", experts_fwd, (w_gu, w_d)),
                          ("fp8", experts_fp8_fwd, quantize_experts_fp8(w_gu, w_d)),
                          ("mxfp4", experts_mxfp4_fwd, quantize_experts_mxfp4(w_gu, w_d))):
        names = [f"q{i}" for i in range(len(q))]
        fn = lambda x, ids, w, fwd=fwd, names=names, **kw: fwd(x, ids, w, *(kw[n] for n in names), None, lora)  # noqa: E731
        shared = dict(zip(names, q))
        for r_ in (rung1_repeat("moe", fn, x, ids, w, **shared),
                   rung2_rows("moe", fn, (x, ids, w), shared=shared, batch_sizes=(1, 2, 3, 7, 64))):
            r_.check = f"experts {label} + LoRA r{r}, skewed routing: {r_.check}"
            out.append(r_)
    out.append(accuracy("moe", experts_fwd(x, ids, w, w_gu, w_d, None, lora), experts_ref(x, ids, w, w_gu, w_d, None, lora),
                        8e-3, f"experts bf16 + LoRA r{r} vs float64"))
    return out


def _format_rungs(label: str, fwd, x, ids, w, q, name: str) -> list[RungResult]:
    """Rungs 1-2 (plain and clamped) of a quantized experts forward ``fwd(x, ids, w, *q, limit)``."""
    fn = lambda x, ids, w, gc, gs, dc, ds, limit=None: fwd(x, ids, w, gc, gs, dc, ds, limit)  # noqa: E731
    shared = dict(zip(("gc", "gs", "dc", "ds"), q))
    out = [rung1_repeat("moe", fn, x, ids, w, *q),
           rung2_rows("moe", fn, (x, ids, w), shared=shared, batch_sizes=(1, 2, 3, 7, 64)),
           rung2_rows("moe", fn, (x, ids, w), shared={**shared, "limit": LIMIT})]
    for r, what in zip(out, (label, label, f"{label}, SwiGLU clamp")):
        r.check = f"{what}, {name}: {r.check}"
    return out


def _fp8_rows(x, ids, w, w_gu, w_d, name: str) -> list[RungResult]:
    """FP8 experts (GLM-5's format) on the same tokens: rungs 1-2, and float64 at their own
    quantization points."""
    q = quantize_experts_fp8(w_gu, w_d)
    # on the GPU the fp8 wgmma's ~13-bit block accumulation flips some SwiGLU outputs' bf16 (measured 4.5e-3)
    bound = 2e-3 if x.device.type == "cpu" else 1e-2
    return _format_rungs("experts fp8", experts_fp8_fwd, x, ids, w, q, name) + [
        accuracy("moe", experts_fp8_fwd(x, ids, w, *q), experts_fp8_ref(x, ids, w, *q), bound,
                 f"experts fp8, {name}, vs float64 at the fp8 quantization points")]


def _mxfp4_rows(x, ids, w, w_gu, w_d, name: str) -> list[RungResult]:
    """MXFP4 experts (DeepSeek-V4's format): rungs 1-2, the bits of the bf16 experts at the decoded
    weights, and float64 at those weights."""
    q = quantize_experts_mxfp4(w_gu, w_d)
    got = experts_mxfp4_fwd(x, ids, w, *q)
    gu, d = dequantize_experts_mxfp4(*q, dtype=x.dtype)
    return _format_rungs("experts mxfp4", experts_mxfp4_fwd, x, ids, w, q, name) + [
        accuracy("moe", got, experts_fwd(x, ids, w, gu, d), 0.0,
                 f"experts mxfp4, {name}: the bf16 experts' bits at the decoded weights"),
        accuracy("moe", got, experts_ref(x, ids, w, gu, d), 8e-3,
                 f"experts mxfp4, {name}, vs float64 at the decoded weights")]
