"""Engine throughput on the GPU: prefill and decode tokens per second of the
aligned qwen3 pair at real shapes with random weights.

    python benchmarks/bench_engine.py --config qwen3-8b --out DIR [--batches 1,8,64,256]

Prefill: B prompts of --prompt tokens with max_new_tokens=1 (prompt tokens / s).
Decode: the same prompts with --new tokens each; decode tok/s = B * (new - 1) /
(total time - the prefill time measured alone).  Writes engine.json and engine.md.
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
from bench_primitives import commit  # noqa: E402


def timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    ap.add_argument("--server-kernels", choices=("aligned", "vendor"), default="aligned",
                    help="vendor: the same engine on torch's kernels (the baseline of issue 7)")
    ap.add_argument("--out", default="gpu_out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_engine needs a CUDA device", file=sys.stderr)
        return 2
    import alignzoo
    from alignzoo import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    pair = alignzoo.load_pair("qwen3", config=args.config, device="cuda", max_batch_size=max(batches),
                              cuda_graphs=args.cuda_graphs == "on", server_kernels=args.server_kernels)
    print(f"loaded {args.config} in {time.perf_counter() - t0:.1f}s; {pair.server.num_pages} KV pages", flush=True)
    eng, V = pair.server, pair.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        prompts = [torch.randint(0, V, (args.prompt,), generator=g).tolist() for _ in range(B)]
        sp1 = SamplingParams(temperature=1.0, max_new_tokens=1, seed=1)
        spn = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=args.new, seed=1, stop_token_ids=())
        eng.generate(prompts[:1], sp1)  # warm-up (compiles)
        _, t_pre = timed(lambda: eng.generate(prompts, sp1))
        outs, t_all = timed(lambda: eng.generate(prompts, spn))
        n_dec = sum(len(o.tokens) - 1 for o in outs)
        row = {"batch": B, "prompt": args.prompt, "new": args.new, "prefill_s": t_pre, "total_s": t_all,
               "prefill_tok_s": B * args.prompt / t_pre, "decode_tok_s": n_dec / max(t_all - t_pre, 1e-9),
               "decode_step_ms": 1e3 * (t_all - t_pre) / max(args.new - 1, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    os.makedirs(args.out, exist_ok=True)
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "commit": commit(), "command": " ".join(sys.argv), "config": args.config,
            "cuda_graphs": args.cuda_graphs, "server_kernels": args.server_kernels}
    stem = "engine" if args.server_kernels == "aligned" else "engine_vendor"
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({**head, "rows": rows}, f, indent=1)
    lines = [f"# Engine throughput: qwen3 {args.config}", "", *(f"- {k}: {v}" for k, v in head.items()), "",
             "| batch | prompt | new | prefill tok/s | decode tok/s | decode step ms |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompt']} | {r['new']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
              f"{r['decode_step_ms']:.2f} |" for r in rows]
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
