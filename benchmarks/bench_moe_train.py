"""Routed experts as a trainer runs them: forward + backward of one MoE layer's experts, ours
(``moe_experts``: the grouped Triton forward, the backward batched over experts in fp32) against a
conventional trainer's (``common/moe/vendor.py``'s grouped bf16 experts under autograd:
``torch._grouped_mm``'s own backward where the device's torch has it, else a per-expert loop), at
the real expert shapes, side by side in one run.

    python benchmarks/bench_moe_train.py --out DIR [--tokens 4096,16384] [--shapes ...] [--frozen]
        [--formats bf16,fp8,mxfp4]

Each side: the same bf16 x, routing (softmax top-k over random logits) and bf16 expert weights with
``requires_grad`` (``--frozen``: the experts frozen, gradients to x and the routing weights only, as
LoRA on attention trains), loss = sum(out * dy).  ``fp8`` / ``mxfp4``: ours runs the quantized experts
(``moe_experts_fp8`` / ``_mxfp4`` on the codes, the bf16 weights as the straight-through masters; its
backward decodes a group of experts at a time), the vendor the same grouped bf16 experts at the decoded
weights.  Times: CUDA events around forward + backward,
median of ``--reps`` after ``--warm`` untimed steps (no graph: our backward reads the per-expert counts
once).  Also per side: the host's top-level aten ops in one step (torch.profiler) and the peak memory
beyond the inputs.  Writes moe_train.json and moe_train.md.  On the CPU (``--device cpu``) a smoke
run at a small shape.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe import SHAPES, quantize  # noqa: E402
from bench_primitives import commit  # noqa: E402

from alignzoo.common.moe.op import moe_experts  # noqa: E402
from alignzoo.common.moe.vendor import experts_vendor  # noqa: E402

SMOKE = {"smoke": (64, 32, 16, 4, None)}  # the CPU's shape: hidden, width, experts, top-k, clamp


def make_experts(shape, device: str, g):
    H, I, E, _, _ = shape
    w_gu = (torch.randn(E, 2 * I, H, device=device, generator=g) * H ** -0.5).bfloat16()
    w_d = (torch.randn(E, H, I, device=device, generator=g) * I ** -0.5).bfloat16()
    return w_gu, w_d


def make_inputs(shape, T: int, device: str, frozen: bool, experts, seed: int = 0):
    """experts: (fmt, codes or None, w_gu, w_d) with bf16 weights (the decoded ones for fp8 / mxfp4)."""
    H, I, E, k, limit = shape
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, device=device, generator=g).bfloat16()
    p = torch.softmax(torch.randn(T, E, device=device, generator=g), -1)
    w, ids = p.topk(k, -1)
    w = (w / w.sum(-1, keepdim=True)).bfloat16()
    fmt, codes, w_gu, w_d = experts
    w_gu, w_d = w_gu.detach().clone(), w_d.detach().clone()
    dy = torch.randn(T, H, device=device, generator=g)
    leaves = [t.requires_grad_() for t in ((x, w) if frozen else (x, w, w_gu, w_d))]
    return fmt, codes, x, ids, w, w_gu, w_d, limit, dy, leaves


def grouped_mm_trains(device: str) -> bool:
    """Whether this torch's ``_grouped_mm`` has a backward on ``device`` (else the vendor loops over experts)."""
    if device != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    try:
        a = torch.randn(32, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(2, 64, 16, device=device, dtype=torch.bfloat16, requires_grad=True)
        torch._grouped_mm(a, b, offs=torch.tensor([16, 32], device=device, dtype=torch.int32)).sum().backward()
        return True
    except (RuntimeError, NotImplementedError):
        return False


def step(side: str, fmt, codes, x, ids, w, w_gu, w_d, limit, dy, leaves):
    """One forward + backward; -> the gradients (the leaves' .grad cleared first).  Quantized
    experts: w_gu / w_d are the masters ours' straight-through gradients go to."""
    from alignzoo.common.moe.op import moe_experts_fp8, moe_experts_mxfp4

    for t in leaves:
        t.grad = None
    if side == "vendor":
        out = experts_vendor(x, ids, w, w_gu, w_d, limit)
    elif fmt == "bf16":
        out = moe_experts(x, ids, w, w_gu, w_d, limit=limit)
    else:
        masters = {} if not w_gu.requires_grad else {"master_gate_up": w_gu, "master_down": w_d}
        fn = {"fp8": moe_experts_fp8, "mxfp4": moe_experts_mxfp4}[fmt]
        out = fn(x, ids, w, *codes, limit=limit, **masters)
    (out.float() * dy).sum().backward()
    return [t.grad for t in leaves]


def host_ops(fn) -> int:
    """aten ops one call of ``fn`` dispatches from the host, not counting those inside another aten op
    (autograd's backward nodes included, whose ops run under the engine's events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()

    def outermost(e) -> bool:
        e = e.cpu_parent
        while e is not None:
            if e.name.startswith("aten::"):
                return False
            e = e.cpu_parent
        return True

    return sum(1 for e in p.events() if e.name.startswith("aten::") and outermost(e))


def time_side(fn, device: str, warm: int, reps: int) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            fn()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e))
        else:
            import time

            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def row(name, shape, T, device, frozen, warm, reps, experts) -> dict:
    inp = make_inputs(shape, T, device, frozen, experts)
    out = {"shape": name, "format": experts[0], "tokens": T, "frozen": frozen}
    grads = {}
    for side in ("aligned", "vendor"):
        fn = lambda: step(side, *inp)  # noqa: E731
        grads[side] = [gr.float() for gr in fn()]
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        ms = time_side(fn, device, warm, reps)
        out[f"{side}_ms"] = ms
        out[f"{side}_host_ops"] = host_ops(fn)
        if device == "cuda":
            out[f"{side}_peak_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
    # the two sides are different functions (bf16 vs fp32 intermediates): how far apart, not equal
    out["grad_rel_diff"] = max(float((a - b).norm() / b.norm().clamp_min(1e-30))
                               for a, b in zip(grads["aligned"], grads["vendor"]))
    out["repeats"] = all(torch.equal(a.float(), b) for a, b in zip(step("aligned", *inp), grads["aligned"]))
    out["ratio"] = out["vendor_ms"] / out["aligned_ms"]
    return out


def render(meta, rows) -> str:
    lines = [f"# Experts forward + backward: ours vs {meta['vendor']} under autograd ({meta['device']}, torch "
             f"{meta['torch']}, `{meta['commit']}`)", "",
             "| shape | format | tokens | experts | ours ms | vendor ms | ratio | host ops ours / vendor | "
             "grads rel diff |", "|---|---|---:|---|---:|---:|---:|---|---:|"]
    lines += [f"| {r['shape']} | {r['format']} | {r['tokens']} | {'frozen' if r['frozen'] else 'trained'} | "
              f"{r['aligned_ms']:.2f} | "
              f"{r['vendor_ms']:.2f} | {r['ratio']:.2f}x | {r['aligned_host_ops']} / {r['vendor_host_ops']} | "
              f"{r['grad_rel_diff']:.1e} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_out")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", default=None, help="token counts (default 4096,16384 on cuda, 64 on cpu)")
    ap.add_argument("--shapes", default=None, help=f"of {', '.join(SHAPES)} (default all; the CPU runs a small one)")
    ap.add_argument("--frozen", action="store_true", help="experts frozen: gradients to x and the routing weights")
    ap.add_argument("--formats", default="bf16", help="bf16,fp8,mxfp4: the quantized experts against the vendor at "
                                                      "their decoded bf16 weights")
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args(argv)
    names = (a.shapes or ",".join(SHAPES)).split(",")
    shapes = SMOKE if a.device == "cpu" and a.shapes is None else {n: SHAPES[n] for n in names}
    tokens = [int(t) for t in (a.tokens or ("4096,16384" if a.device == "cuda" else "64")).split(",")]
    os.makedirs(a.out, exist_ok=True)
    vendor = "torch._grouped_mm" if grouped_mm_trains(a.device) else "a per-expert loop"
    if vendor != "torch._grouped_mm" and a.device == "cuda":  # _grouped_mm without a backward: the loop
        import alignzoo.common.moe.vendor as vendor_mod

        vendor_mod._grouped = vendor_mod.grouped_loop
    meta = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
            "commit": commit(), "command": " ".join(sys.argv), "vendor": vendor}
    rows = []
    for name, shape in shapes.items():
        w_gu, w_d = make_experts(shape, a.device, torch.Generator(device=a.device).manual_seed(1))
        for fmt in a.formats.split(","):
            q = {"codes": None, "bf16": (w_gu, w_d)} if fmt == "bf16" else quantize(fmt, w_gu, w_d)
            experts = (fmt, q["codes"], *q["bf16"])
            for T in tokens:
                rows.append(row(name, shape, T, a.device, a.frozen, a.warm, a.reps, experts))
                print(json.dumps(rows[-1]), flush=True)
            del experts, q
    with open(os.path.join(a.out, "moe_train.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    page = render(meta, rows)
    with open(os.path.join(a.out, "moe_train.md"), "w") as f:
        f.write(page)
    print(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
