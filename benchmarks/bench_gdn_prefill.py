"""The Gated DeltaNet prefill / trainer forward on the GPU: the chunk-parallel kernel
(``common/gdn/chunk_kernel.py``) against the row-by-row scan (``kernel.gdn_scan_triton``), at
Qwen3.5-35B-A3B's GDN shapes (Hk 16, Hv 32, K = V = 128), with the chunk kernel's time split by
kernel (torch.profiler) and a few launch knobs, each checked for the scan's bits first (the scan of
its form: ``{"mma": false}`` runs the trees); and the
decode step (``kernel.gdn_decode_triton``) at a few batch sizes and knob sets, each sequence at row
37 of an open chunk after a 293-token prefill (the step writes that row again with the same bits, so
repeats time the same work).

    python benchmarks/bench_gdn_prefill.py [--shapes 8x512,1x4096] [--knobs JSON]
        [--decode-batches 1,64,256] [--decode-knobs JSON] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import commit  # noqa: E402

KNOBS = [dict(), dict(fused=True), dict(fused=False), dict(mma=False)]  # o in the state or output kernel; trees


def inputs(B, L, Hk=16, Hv=32, K=128, V=128, seed=0):
    from alignzoo.common.gdn import l2norm_fwd

    g = torch.Generator(device="cuda").manual_seed(seed)
    T = B * L
    q = l2norm_fwd(torch.randn(T, Hk, K, generator=g, device="cuda")) * K ** -0.5
    k = l2norm_fwd(torch.randn(T, Hk, K, generator=g, device="cuda"))
    v = torch.randn(T, Hv, V, generator=g, device="cuda")
    gg = -torch.rand(T, Hv, generator=g, device="cuda") * 0.5
    beta = torch.rand(T, Hv, generator=g, device="cuda")
    cu = torch.arange(0, T + 1, L, device="cuda")
    return q, k, v, gg, beta, cu


def timed(fn, reps=5):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]


def decode_rows(B, knob_sets, L=293):
    """The decode step at batch B, each knob set's o and cache checked equal to the default's."""
    from alignzoo.common.gdn import gdn_cache
    from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
    from alignzoo.common.gdn.kernel import gdn_decode_triton

    q, k, v, g, beta, cu = inputs(B, L + 1, seed=1)
    last = cu[1:] - 1
    pre = torch.ones(B * (L + 1), dtype=torch.bool, device="cuda")
    pre[last] = False
    cache = gdn_cache(B, 16, 32, 128, 128, "cuda")
    ar, z = torch.arange(B, device="cuda"), torch.zeros(B, dtype=torch.long, device="cuda")
    gdn_chunk_triton(*(t[pre].contiguous() for t in (q, k, v, g, beta)), torch.arange(0, B * L + 1, L, device="cuda"),
                     z, ar, cache)
    step = [t[last].contiguous() for t in (q, k, v, g, beta)]
    pos = torch.full((B,), L, dtype=torch.long, device="cuda")
    base = {n: t.clone() for n, t in cache.items()}

    def run(**kw):
        for n, t in cache.items():
            t.copy_(base[n])
        return gdn_decode_triton(*step, pos, ar, cache, **kw)

    refs = {}  # the default's o and cache, per form (an "mma" knob changes the bits)
    out = []
    for knobs in knob_sets:
        m = knobs.get("mma")
        if m not in refs:
            refs[m] = (run(mma=m), {n: t.clone() for n, t in cache.items()})
        ref, ref_cache = refs[m]
        same = torch.equal(run(**knobs), ref) and all(torch.equal(cache[n], ref_cache[n]) for n in cache)
        ms = timed(lambda: gdn_decode_triton(*step, pos, ar, cache, **knobs), reps=21) if same else float("nan")
        out.append({"decode_batch": B, "knobs": knobs, "decode_ms": ms, "bits_equal": same})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    from alignzoo.common.gdn import gdn_cache
    from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
    from alignzoo.common.gdn.kernel import gdn_scan_triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8x512,1x4096")
    ap.add_argument("--knobs", default=None, help='a JSON list of gdn_chunk_triton knob dicts to sweep, e.g. '
                                                  '\'[{"bv": 4, "br": 16}, {"bv": 2, "br": 64}]\' (default: KNOBS)')
    ap.add_argument("--decode-batches", default="1,64,256", help="decode batch sizes ('' for none)")
    ap.add_argument("--decode-knobs", default='[{}]', help="a JSON list of gdn_decode_triton knob dicts")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = []
    for B in [int(b) for b in args.decode_batches.split(",") if b]:
        rows += decode_rows(B, json.loads(args.decode_knobs))
    for shape in filter(None, args.shapes.split(",")):
        B, L = map(int, shape.split("x"))
        q, k, v, g, beta, cu = inputs(B, L)
        z, ar = torch.zeros(B, dtype=torch.long, device="cuda"), torch.arange(B, device="cuda")

        def run(fn, **kw):
            return fn(q, k, v, g, beta, cu, z, ar, gdn_cache(B, 16, 32, 128, 128, "cuda"), **kw)

        refs = {}  # the scan's o per form: an "mma" knob changes the bits
        scan_ms = timed(lambda: run(gdn_scan_triton))
        for knobs in json.loads(args.knobs) if args.knobs else KNOBS:
            m = knobs.get("mma")
            if m not in refs:
                refs[m] = run(gdn_scan_triton, mma=m)
            same = torch.equal(run(gdn_chunk_triton, **knobs), refs[m])
            ms = timed(lambda: run(gdn_chunk_triton, **knobs)) if same else float("nan")
            rows.append({"shape": shape, "knobs": knobs, "chunk_ms": ms, "scan_ms": scan_ms, "bits_equal": same})
            print(json.dumps(rows[-1]), flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run(gdn_chunk_triton)
            torch.cuda.synchronize()
        print(f"-- {shape}: chunk kernel's default call by kernel")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gdn_prefill.json"), "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
