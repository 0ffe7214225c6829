"""Where a decode step's time goes: the engine's step split into graph replay,
sampling and host work, the kernels of one decode forward, and the weight-read
bound — for the aligned server and the vendor-kernel server side by side.

    python benchmarks/profile_decode.py --config qwen3-8b --batches 1,64 --out DIR

Per batch size B (prompts of --prompt tokens, then decode steps timed one by one):
  step ms      wall time of ``engine.step()`` in steady decode (host included)
  replay ms    the captured decode graph replayed alone (CUDA events)
  sample ms    sampling the graph's logits with the step's params, as the engine
               does (its captured sampler for buckets <= 16, else ``sample_fwd``)
  host ms      step - replay - sample: batch building, copies, scheduling, .tolist()
  bound ms     weight bytes / copy bandwidth measured in the same run (batch 1's floor)
Then the top kernels of one eager decode forward (torch.profiler), by CUDA time.
Writes profile_decode.json and profile_decode.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import copy_bandwidth, decode_weight_bytes, fit_max_position, load, sync_device  # noqa: E402
from bench_primitives import commit  # noqa: E402


def cuda_ms(fn, reps: int = 20) -> float:
    fn()
    if not torch.cuda.is_available():  # --device cpu smoke runs: wall clock
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return 1e3 * (time.perf_counter() - t0) / reps
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def run_header(args, max_pos: int, **extra) -> dict:
    """The facts a profile page and its JSON start with."""
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    return {"gpu": gpu, "torch": torch.__version__, "date": datetime.date.today().isoformat(), "commit": commit(),
            "command": " ".join(sys.argv), "config": args.config, "max_position": max_pos, **extra}


def each_server(args, max_batch: int, max_pos: int, profile) -> dict:
    """{kind: profile(pair, generator)} for each of --kernels, one server loaded at a time."""
    results = {}
    for kind in args.kernels.split(","):
        pair = load(args.config, server_kernels=kind, max_batch_size=max_batch, max_position=max_pos,
                    cuda_graphs=args.device == "cuda", device=args.device)
        results[kind] = profile(pair, torch.Generator().manual_seed(0))
        print(json.dumps({kind: results[kind]}), flush=True)
        del pair
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return results


def write_report(out: str, stem: str, head: dict, results: dict, lines: list) -> None:
    """``stem``.json (head + results) and ``stem``.md (``lines``) in ``out``; the page printed."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, stem + ".json"), "w") as f:
        json.dump({**head, "results": results}, f, indent=1)
    with open(os.path.join(out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def kernel_table(title: str, kernels: list, key: str, label: str) -> list:
    """Markdown lines of a top-kernels table (rows: kernel, calls, ``key``)."""
    return ["", f"## {title}", "", f"| kernel | calls | {label} |", "|---|---|---|",
            *(f"| `{k['kernel']}` | {k['calls']} | {k[key]:.3f} |" for k in kernels)]


def profile_batch(pair, B: int, prompt: int, steps: int, g: torch.Generator) -> dict:
    from alignzoo import SamplingParams
    from alignzoo.common.engine.model_api import static_decode_batch
    from alignzoo.common.sampling import head_width, params_to_tensors, sample_fwd

    eng = pair.server
    runner, dev = eng.runner, eng.runner.device
    V = pair.config.vocab_size
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=steps + 8, seed=1, stop_token_ids=())
    for _ in range(B):
        eng.add_request(torch.randint(0, V, (prompt,), generator=g).tolist(), sp)
    seqs = eng.scheduler.running
    while len(seqs) < B or any(s.num_cached < len(s.prompt) for s in seqs):  # until every prompt is prefilled
        eng.step()
        seqs = eng.scheduler.running
    for _ in range(3):
        eng.step()
    sync_device(dev)
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    step_ms = 1e3 * sorted(times)[len(times) // 2]
    bucket = runner.graphs.bucket(B) if runner.graphs is not None else None
    replay_ms = cuda_ms(lambda: runner.graphs.graphs[bucket].replay()) if bucket else float("nan")
    logits = runner.graphs.logits[bucket][:B] if bucket else torch.randn(B, V, device=dev)
    host = params_to_tensors([sp] * B, [0] * B)
    head = head_width(host["temperature"], host["top_k"], V)  # as the engine does: no device read
    params = {k: v.to(dev) for k, v in host.items()}

    graphed = runner.sample_graphs is not None and bucket in runner.sample_graphs.buckets

    def sample():  # as the engine samples: its captured sampler for small buckets, else sample_fwd
        with torch.inference_mode():  # the sampler graphs' inputs are inference tensors
            tok, lp = (runner.sample_graphs.run(bucket, host, head) if graphed else
                       sample_fwd(logits, **params, head=head))
        tok.tolist()

    sample_ms = cuda_ms(sample)
    while eng.has_unfinished():
        eng.step()
    eager = static_decode_batch(B, runner.graph_widths, dev)  # pad rows: nothing is written to the cache
    on_cuda = dev.type == "cuda"
    activity = torch.profiler.ProfilerActivity.CUDA if on_cuda else torch.profiler.ProfilerActivity.CPU
    with torch.inference_mode():
        runner.model.forward(eager, runner.caches)
        sync_device(dev)
        with torch.profiler.profile(activities=[activity]) as prof:
            for _ in range(3):
                runner.model.forward(eager, runner.caches)
            sync_device(dev)
    total = (lambda e: e.device_time_total) if on_cuda else (lambda e: e.self_cpu_time_total)
    kernels = [{"kernel": e.key[:90], "calls": e.count // 3, "ms_per_forward": total(e) / 3e3}
               for e in sorted(prof.key_averages(), key=lambda e: -total(e))[:12]]
    return {"batch": B, "step_ms": step_ms, "replay_ms": replay_ms, "sample_ms": sample_ms,
            "host_ms": step_ms - replay_ms - sample_ms, "kernels": kernels}


def profile_parser(doc: str, batches: str) -> argparse.ArgumentParser:
    """The options both profiles (decode and prefill) take."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--batches", default=batches)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--kernels", default="aligned,vendor", help="server kernels to profile, comma-separated")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script (use --config tiny)")
    ap.add_argument("--out", default="gpu_out")
    return ap


def main() -> int:
    ap = profile_parser(__doc__, "1,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-position", type=int, default=None,
                    help="the model's max_position (default: prompt + steps + 16, page-rounded; 0: the preset's, "
                         "as bench_engine)")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("profile_decode needs a CUDA device (or --device cpu for a smoke run)", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    max_pos = fit_max_position(args.prompt + args.steps + 16) if args.max_position is None else args.max_position
    bw = copy_bandwidth(args.device, (2 << 30) if args.device == "cuda" else (64 << 20))
    head = run_header(args, max_pos, copy_GBps=bw / 1e9)

    def profile(pair, g):
        wb = decode_weight_bytes(pair.server.runner.model)
        rows = [profile_batch(pair, B, args.prompt, args.steps, g) for B in batches]
        return {"weight_bytes": wb, "bound_ms": 1e3 * wb / bw, "rows": rows}

    results = each_server(args, max(batches), max_pos, profile)
    lines = [f"# Decode step profile: qwen3 {args.config}", "", *(f"- {k}: {v}" for k, v in head.items()), "",
             "| server | batch | step ms | replay ms | sample ms | host ms | weight-read bound ms |",
             "|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        lines += [f"| {kind} | {x['batch']} | {x['step_ms']:.2f} | {x['replay_ms']:.2f} | {x['sample_ms']:.2f} | "
                  f"{x['host_ms']:.2f} | {r['bound_ms']:.2f} |" for x in r["rows"]]
    for kind, r in results.items():
        for x in r["rows"]:
            lines += kernel_table(f"{kind}, batch {x['batch']}: top kernels of one eager decode forward",
                                  x["kernels"], "ms_per_forward", "ms per forward")
    write_report(args.out, "profile_decode", head, results, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
