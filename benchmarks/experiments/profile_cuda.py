"""Where a model's time goes on CUDA: wall time per phase (generate, trainer log-probs, server score), then
torch.profiler's top ops by GPU time and by host time for the slowest phase.  Asks why a long prompt is slow,
not how fast the model is.

    python benchmarks/experiments/profile_cuda.py --model deepseek_v4_mhc_mxfp4 --config tiny --lens 2100,65 --new 4
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import alignzoo
from alignzoo import SamplingParams


def _load(model: str, config: str):
    return alignzoo.load_pair(model, config=config, device="cuda", dtype=torch.bfloat16, seed=1, cuda_graphs=False)


def _timed(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--lens", default="2100,65")
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--rows", type=int, default=25, help="rows of each profiler table")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    pair, t_load = _timed(lambda: _load(args.model, args.config))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    sps = [SamplingParams(temperature=0.8, max_new_tokens=args.new, seed=i, ignore_eos=True) for i in range(len(lens))]
    pair.server.generate([p[:70] for p in prompts], sps)  # compile the kernels outside the timings
    outs, t_gen = _timed(lambda: pair.server.generate(prompts, sps))
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    plens = [len(p) for p in prompts]
    with torch.no_grad():
        lp, t_train = _timed(lambda: pair.trainer.logprobs(seqs, plens, sps))
    _, t_score = _timed(lambda: pair.server.score(seqs, plens, sps))
    res = {"model": args.model, "config": args.config, "lens": lens, "new": args.new, "load_s": round(t_load, 2),
           "generate_s": round(t_gen, 2), "trainer_logprobs_s": round(t_train, 2),
           "server_score_s": round(t_score, 2),
           "trainer_eq_sampled": all(torch.equal(a.cpu(), o.logprobs) for a, o in zip(lp, outs))}
    print(json.dumps(res), flush=True)
    phases = {"generate": lambda: pair.server.generate(prompts, sps),
              "trainer": lambda: pair.trainer.logprobs(seqs, plens, sps)}
    for name, fn in phases.items():
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.no_grad(), torch.profiler.profile(activities=acts) as prof:
            fn()
            torch.cuda.synchronize()
        ka = prof.key_averages()
        print(f"== {name}: by GPU time", flush=True)
        print(ka.table(sort_by="self_cuda_time_total", row_limit=args.rows), flush=True)
        print(f"== {name}: by host time", flush=True)
        print(ka.table(sort_by="self_cpu_time_total", row_limit=args.rows), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
