"""Where a prefill's time goes: the wall time of ``engine.generate`` with
max_new_tokens=1 (bench_engine's prefill measurement, each run listed) against
the device time of what it launched (torch.profiler), and its top kernels,
for the aligned server and the vendor-kernel server side by side.

    python benchmarks/profile_prefill.py --config qwen3-8b --batches 1,8 --out DIR

Per batch size B (B random prompts of --prompt tokens, one warm-up run first):
  wall ms      each of --reps timed runs, and their median
  device ms    the summed device time of one profiled run (kernels, and the
               few memcpy / memset events)
  other ms     median wall - device ms: host work, launch gaps, syncs
  launches     the device events (kernels, copies) one prefill enqueued
With --host N: the N functions with the most own host time (cProfile) over
--reps more runs, ms a run, and each one's calls a run.
Writes profile_prefill.json and profile_prefill.md.
"""
from __future__ import annotations

import cProfile
import os
import pstats
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import fit_max_position, sync_device, timed  # noqa: E402
from profile_decode import each_server, kernel_table, profile_parser, run_header, write_report  # noqa: E402


def host_functions(fn, reps: int, top: int) -> list[dict]:
    """The ``top`` functions by own host time over ``reps`` calls of fn (cProfile), per call."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    return [{"function": f"{'/'.join(f.split(os.sep)[-2:])}:{line}:{name}", "calls": n / reps, "own_ms": 1e3 * own / reps,
             "cum_ms": 1e3 * cum / reps} for (f, line, name), (_, n, own, cum, _) in rows]


def profile_batch(pair, B: int, prompt: int, reps: int, g: torch.Generator, host_top: int = 0) -> dict:
    from alignzoo import SamplingParams

    eng, dev = pair.server, pair.server.runner.device
    prompts = [torch.randint(0, pair.config.vocab_size, (prompt,), generator=g).tolist() for _ in range(B)]
    sp1 = SamplingParams(temperature=1.0, max_new_tokens=1, seed=1)
    eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=2, seed=1, stop_token_ids=()))
    walls = [1e3 * timed(lambda: eng.generate(prompts, sp1), dev)[1] for _ in range(reps)]
    on_cuda = torch.device(dev).type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        eng.generate(prompts, sp1)
        sync_device(dev)
    own = (lambda e: e.self_device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
    events = sorted(prof.key_averages(), key=lambda e: -own(e))
    median = statistics.median(walls)
    device_ms = sum(own(e) for e in events) / 1e3
    out = {"batch": B, "wall_ms": walls, "wall_ms_median": median, "device_ms": device_ms,
           "other_ms": median - device_ms, "launches": sum(e.count for e in events if own(e) > 0),
           "kernels": [{"kernel": e.key[:90], "calls": e.count, "ms": own(e) / 1e3} for e in events[:12]]}
    if host_top:
        out["host"] = host_functions(lambda: (eng.generate(prompts, sp1), sync_device(dev)), reps, host_top)
    return out


def main() -> int:
    ap = profile_parser(__doc__, "1,8")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--host", type=int, default=0, metavar="N", help="list the N functions with the most host time")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_prefill needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    max_pos = fit_max_position(args.prompt + 2)
    head = run_header(args, max_pos)
    results = each_server(args, max(batches), max_pos,
                          lambda pair, g: [profile_batch(pair, B, args.prompt, args.reps, g, args.host)
                                           for B in batches])
    lines = [f"# Prefill profile: {args.config}, prompts of {args.prompt} tokens", "",
             *(f"- {k}: {v}" for k, v in head.items()), "",
             "| server | batch | wall ms (median) | wall ms (each run) | device ms | other ms | launches |",
             "|---|---|---|---|---|---|---|"]
    for kind, rows in results.items():
        lines += [f"| {kind} | {x['batch']} | {x['wall_ms_median']:.2f} | {', '.join(f'{w:.1f}' for w in x['wall_ms'])} | "
                  f"{x['device_ms']:.2f} | {x['other_ms']:.2f} | {x['launches']} |" for x in rows]
    for kind, rows in results.items():
        for x in rows:
            lines += kernel_table(f"{kind}, batch {x['batch']}: top kernels of one prefill", x["kernels"], "ms", "ms")
            if "host" in x:
                lines += ["", f"## {kind}, batch {x['batch']}: own host time by function (cProfile, a run)", "",
                          "| function | calls | own ms | cumulative ms |", "|---|---|---|---|",
                          *(f"| `{h['function']}` | {h['calls']:.0f} | {h['own_ms']:.3f} | {h['cum_ms']:.3f} |"
                            for h in x["host"])]
    write_report(args.out, "profile_prefill", head, results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
