"""Engine throughput on the GPU: prefill and decode tokens per second of an
aligned pair at real shapes with random weights.

    python benchmarks/bench_engine.py --config qwen3-8b --out DIR [--batches 1,8,64,256]
    python benchmarks/bench_engine.py --config qwen35_gdn/qwen3.5-35b-a3b-4l --server-kernels vendor --out DIR

Prefill: B prompts of --prompt tokens with max_new_tokens=1 (prompt tokens / s;
the median of 5 runs while B x prompt <= 4096 tokens, of 3 up to 8192, else one run).
Decode: the same prompts with --new tokens each; decode tok/s = B * (new - 1) /
(total time - the prefill time measured alone); steady decode: B / the step time
of the last new // 2 steps (that run minus the same run stopped halfway), where
a prefill chunked past one step's token budget no longer counts.  Writes engine.json and engine.md
(engine_vendor.* with --server-kernels vendor; *_no_overlap.* with --overlap off).

The model's max_position is cut to what the benchmark uses (prompt + new,
rounded up to a page; --max-position 0 keeps the preset's): decode graphs are
captured with a block table of max_position / 64 pages, and the vendor server
gathers that whole width per sequence and step (40960 positions for the 8B
preset: tens of GB per layer at batch 256), where a vendor stack's paged
kernel reads only the cached pages.  Both engines get the same cut.
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

def fit_max_position(*lengths: int) -> int:
    """The longest of ``lengths`` rounded up to a whole KV page."""
    from alignzoo.common.kv_cache import PAGE_SIZE

    return -(-max(lengths) // PAGE_SIZE) * PAGE_SIZE


def load(config: str, *, server_kernels: str = "aligned", max_batch_size: int, cuda_graphs: bool = True,
         max_position: int | None = None, num_layers: int | None = None, device="cuda", **engine_kwargs):
    """A pair of ``config`` ("qwen3-8b", or another model's "qwen35_gdn/qwen3.5-35b-a3b-4l"; random
    weights), optionally with max_position cut and fewer layers (same kernels and shapes per layer:
    one layer compiles everything the full model runs)."""
    import alignzoo
    from alignzoo.models import loading, model_module

    model, _, preset = config.rpartition("/")
    model = model or "qwen3"
    changes = {k: v for k, v in (("max_position", max_position), ("num_layers", num_layers)) if v}
    cfg = loading.resolve_config(model_module(model).SPEC, None, preset).replace(**changes)
    return alignzoo.load_pair(model, config=cfg, device=device, max_batch_size=max_batch_size,
                              cuda_graphs=cuda_graphs, server_kernels=server_kernels, **engine_kwargs)


def decode_weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: all of them but an untied
    embedding table (only the batch's rows of it are read)."""
    w = model.weights
    skip = {"embed.weight"} if "lm_head.weight" in w else set()
    return sum(t.numel() * t.element_size() for n, t in w.items() if n not in skip)


def sync_device(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device, nbytes: int, reps: int = 20) -> float:
    """Bytes per second of a device-to-device copy of ``nbytes`` (read + write
    counted): the bandwidth bound's denominator."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync_device(device)
    return 2 * nbytes * reps / (time.perf_counter() - t0)


def timed(fn, device="cuda"):
    sync_device(device)
    t0 = time.perf_counter()
    out = fn()
    sync_device(device)
    return out, time.perf_counter() - t0


def measure(eng, vocab: int, batch: int, prompt: int, new: int, seed: int = 0) -> dict:
    """Prefill and decode throughput of ``batch`` random prompts on engine ``eng``."""
    from alignzoo import SamplingParams

    dev = eng.model.device
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (prompt,), generator=g).tolist() for _ in range(batch)]
    sp1 = SamplingParams(temperature=1.0, max_new_tokens=1, seed=1)
    spn = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new, seed=1, stop_token_ids=())
    # warm-up: the timed decode run itself, once, so that no Triton compile or autotune (fla's
    # kernels tune per shape) lands in a timed run; its steps cover every prefill chunk, mixed
    # step and decode batch the timed runs meet
    eng.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new, seed=2,
                                         stop_token_ids=()))
    pre0 = eng.num_preemptions
    # prefill: the median of a few runs where one is short (one B = 1 run can read 40% slow: 2026-11-30-h200-engine.md)
    reps = 5 if batch * prompt <= 4096 else 3 if batch * prompt <= 8192 else 1  # odd: a true median
    t_pre = sorted(timed(lambda: eng.generate(prompts, sp1), dev)[1] for _ in range(reps))[reps // 2]
    outs, t_all = timed(lambda: eng.generate(prompts, spn), dev)
    n_dec = sum(len(o.tokens) - 1 for o in outs)
    # steady decode: the same run stopped halfway; the difference is the last new // 2 steps at
    # the full batch, after every prompt's prefill (which, past one step's token budget, is chunked
    # into the first decode steps and counted in decode_tok_s above)
    half = new // 2
    steady = None
    if half >= 1 and new - half >= 1:
        sph = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=new - half, seed=1, stop_token_ids=())
        t_half = timed(lambda: eng.generate(prompts, sph), dev)[1]
        steady = (t_all - t_half) / half
    return {"batch": batch, "prompt": prompt, "new": new, "prefill_s": t_pre, "total_s": t_all,
            "prefill_tok_s": batch * prompt / t_pre, "decode_tok_s": n_dec / max(t_all - t_pre, 1e-9),
            "decode_step_ms": 1e3 * (t_all - t_pre) / max(new - 1, 1),
            "steady_decode_step_ms": None if steady is None else 1e3 * steady,
            "steady_decode_tok_s": None if steady is None else batch / max(steady, 1e-9),
            "preemptions": eng.num_preemptions - pre0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--max-position", type=int, default=None,
                    help="the model's max_position (default: prompt + new, page-rounded; 0: the preset's)")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    ap.add_argument("--server-kernels", choices=("aligned", "vendor"), default="aligned",
                    help="vendor: the same engine on a conventional server's kernels (models/*/serve_vendor.py)")
    ap.add_argument("--overlap", choices=("on", "off"), default="on",
                    help="on: Engine(overlap=True), a decode step launched before the previous one's tokens are read")
    ap.add_argument("--out", default="gpu_out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_engine needs a CUDA device", file=sys.stderr)
        return 2
    batches = [int(b) for b in args.batches.split(",")]
    max_pos = fit_max_position(args.prompt + args.new) if args.max_position is None else args.max_position
    t0 = time.perf_counter()
    pair = load(args.config, server_kernels=args.server_kernels, max_batch_size=max(batches),
                cuda_graphs=args.cuda_graphs == "on", max_position=max_pos, overlap=args.overlap == "on")
    print(f"loaded {args.config} in {time.perf_counter() - t0:.1f}s; {pair.server.num_pages} KV pages", flush=True)
    rows = []
    for B in batches:
        rows.append(measure(pair.server, pair.config.vocab_size, B, args.prompt, args.new))
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": datetime.date.today().isoformat(),
            "commit": commit(), "command": " ".join(sys.argv), "config": args.config,
            "max_position": pair.config.max_position, "cuda_graphs": args.cuda_graphs,
            "server_kernels": args.server_kernels, "overlap": args.overlap}
    stem = ("engine" if args.server_kernels == "aligned" else "engine_vendor") + ("_no_overlap" if args.overlap == "off" else "")
    with open(os.path.join(args.out, stem + ".json"), "w") as f:
        json.dump({**head, "rows": rows}, f, indent=1)
    lines = [f"# Engine throughput: {args.config}", "", *(f"- {k}: {v}" for k, v in head.items()), "",
             "| batch | prompt | new | prefill tok/s | decode tok/s | decode step ms | steady decode tok/s "
             "| steady step ms |", "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompt']} | {r['new']} | {r['prefill_tok_s']:.0f} | {r['decode_tok_s']:.0f} | "
              f"{r['decode_step_ms']:.2f} | {r['steady_decode_tok_s'] or float('nan'):.0f} | "
              f"{r['steady_decode_step_ms'] or float('nan'):.2f} |" for r in rows]
    with open(os.path.join(args.out, stem + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
