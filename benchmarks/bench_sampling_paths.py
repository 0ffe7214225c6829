"""The full sort's sampling paths side by side (H200): today's (int64 key
sort, support kernel walking chunks from chunk 0) against the fp32 value sort,
the chunk partials, and both (the default), at V = 151936 with temperature 1,
top_p 0.95, top_k 0, min_p 0 (the engine benchmark's sampling: every row takes
the full sort).  Each path is one ``kernel.rows_triton`` draw captured in a CUDA
graph (as the engine's sampler graphs run it, PDL as ``pdl_options`` gives:
on at <= 64 rows unless ALIGNZOO_PDL=0); its tokens, lp, v0, log Z and last
keys must equal today's bitwise, eager and replayed, before it is timed.  The
sort alone (keys: order keys + sort; values: scale + sort) is timed the same
way, so support ~= path - sort.

    source benchmarks/gpu_env.sh   # the working tree as `alignzoo`
    python benchmarks/bench_sampling_paths.py [--batches 1,8,64,256] [--logits flat,peaked]
                                              [--reps 20] [--out results.json]
    TRITON_INTERPRET=1 python benchmarks/bench_sampling_paths.py --smoke   # CPU: the checks only

Logits: "flat" is randn * 1.3 (a random-weight model's spread: the top-p 0.95
cut and the draws land ~30 chunks into the sorted row), "peaked" randn * 4.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from alignzoo.common.ladder import bitwise_equal
from alignzoo.common.sampling import kernel

VOCAB = 151936
PATHS = {  # name -> rows_triton's (sort, prepass)
    "today (keys, walk)": ("keys", False),
    "keys + partials": ("keys", True),
    "values, walk": ("values", False),
    "values + partials (default)": (None, None),
}
SPREAD = {"flat": 1.3, "peaked": 4.0}


def _inputs(B: int, V: int, spread: float, dev) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, V, generator=g) * spread
    params = [torch.ones(B), torch.zeros(B, dtype=torch.int64), torch.full((B,), 0.95), torch.zeros(B),
              torch.arange(B, dtype=torch.int64) * 7919, torch.full((B,), 3, dtype=torch.int64)]
    return [x.to(dev) for x in (logits, *params)]


def _time_graph(fn, reps: int) -> tuple[float, tuple]:
    """Median ms of one replay of ``fn`` captured in a CUDA graph (5 timings of
    ``reps`` replays), and the graph's outputs after them."""
    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        for _ in range(reps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / reps)
    return statistics.median(times), out


def _same(got, ref) -> bool:
    return all(bitwise_equal(a, b) for a, b in zip(got, ref))


def run(batches, kinds, reps: int, V: int = VOCAB, smoke: bool = False) -> list[dict]:
    dev = torch.device("cpu" if smoke else "cuda")
    rows = []
    for kind in kinds:
        for B in batches:
            logits, t, k, p, m, seed, step = args = _inputs(B, V, SPREAD[kind], dev)
            ref = kernel.rows_triton(*args, None, V, sort="keys", prepass=False)
            row = {"logits": kind, "B": B, "V": V, "pdl": os.environ.get("ALIGNZOO_PDL", "1")}
            for name, (sort, prepass) in PATHS.items():
                call = lambda: kernel.rows_triton(*args, None, V, sort=sort, prepass=prepass)  # noqa: E731
                assert _same(call(), ref), f"{name} B={B} {kind}: not today's bits (eager)"
                if smoke:
                    continue
                row[name], out = _time_graph(call, reps)
                assert _same(out, ref), f"{name} B={B} {kind}: not today's bits (graph)"
            if not smoke:
                row["sort: keys"] = _time_graph(lambda: kernel.sorted_head_triton(logits, t, V), reps)[0]
                row["sort: values"] = _time_graph(lambda: kernel.sorted_values_triton(logits, t), reps)[0]
            rows.append(row)
            print(" ".join(f"{n}={v:.4f}ms" if isinstance(v, float) else f"{n}={v}" for n, v in row.items()),
                  flush=True)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--logits", default="flat,peaked")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    ap.add_argument("--smoke", action="store_true", help="CPU under TRITON_INTERPRET=1: bit checks only, V = 9000")
    a = ap.parse_args(argv)
    batches = [int(b) for b in a.batches.split(",")]
    kinds = a.logits.split(",")
    if a.smoke:
        rows = run([1, 3], kinds, a.reps, V=9000, smoke=True)
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a GPU (or --smoke under TRITON_INTERPRET=1)")
        rows = run(batches, kinds, a.reps)
        for r in rows:
            base = r["today (keys, walk)"]
            print(f"{r['logits']:6s} B={r['B']:4d}  today {base:.3f} ms  default {r['values + partials (default)']:.3f} ms"
                  f"  ({base / r['values + partials (default)']:.2f}x)  sort keys/values "
                  f"{r['sort: keys']:.3f}/{r['sort: values']:.3f} ms")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                       "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
