"""/generate over HTTP against in-process ``generate`` on the same requests.

Starts ``alignzoo serve`` in a subprocess, times the requests through it (one batched /generate
call, and B concurrent clients of one request each), stops it, then builds the same pair in this
process and times ``pair.server.generate`` on the same prompts and sampling parameters.  Both sides
use the seeded init of the preset, so the tokens and FP32 log-probs must be equal bit for bit; the
report says whether they are.  Throughput is generated tokens per second of wall time, warm (each
side runs the requests once untimed first).

    python benchmarks/bench_http.py                                   # CPU smoke run, tiny preset
    python benchmarks/bench_http.py --config qwen3-0.6b --device cuda --batch 64 --prompt-len 512 --new 256

Target: HTTP >= 0.95x in-process at batch 64 with qwen3-0.6b on the H200.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_requests(batch: int, prompt_len: int, new: int, vocab: int, seed: int) -> list[tuple[list[int], dict]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # no stop tokens: every request generates exactly ``new`` tokens on both sides
    return [(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
             {"temperature": 0.8, "top_k": -1, "top_p": 0.95, "min_p": 0.0, "max_new_tokens": new,
              "sampling_seed": seed * 100_003 + i}) for i in range(batch)]


def _time(fn, repeats: int):
    fn()  # warm: graphs, caches, connections
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        res = fn()
        t = time.perf_counter() - t0
        if t < best:
            best, out = t, res
    return best, out


def bench_http(args, reqs) -> dict:
    from alignzoo.client import Client, output_logprobs

    port = _free_port()
    cmd = [sys.executable, "-m", "alignzoo.cli", "serve", args.model, "--config", args.config, "--device", args.device,
           "--port", str(port), "--max-batch-size", str(max(args.batch, 1)), "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None if args.verbose else subprocess.DEVNULL)
    client = Client(f"http://127.0.0.1:{port}", timeout=3600)
    try:
        client.wait_ready(600, proc)
        prompts, sps = [p for p, _ in reqs], [d for _, d in reqs]

        def batched():
            return client.generate(prompts, sps, return_logprob=True)

        def concurrent():
            with ThreadPoolExecutor(len(reqs)) as ex:
                return list(ex.map(lambda r: client.generate(r[0], r[1], return_logprob=True), reqs))

        out = {}
        for name, fn in (("batched", batched), ("concurrent", concurrent)):
            seconds, results = _time(fn, args.repeats)
            results = results if isinstance(results, list) else [results]
            # the server's own clock, from the parsed request to the last sample done: the rest of the
            # wall time is the request's and answer's JSON and transport
            e2e = max(r["meta_info"]["e2e_latency"] for r in results)
            out[name] = {"seconds": seconds, "server_e2e_s": e2e, "tokens": [r["output_ids"] for r in results],
                         "logprobs": [output_logprobs(r) for r in results]}
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def bench_in_process(args, reqs) -> dict:
    import alignzoo
    import torch
    from alignzoo import SamplingParams

    if args.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)  # as the server's CLI runs
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    pair = alignzoo.load_pair(args.model, config=args.config, device=args.device, dtype=dtype,
                              max_batch_size=max(args.batch, 1))
    prompts = [p for p, _ in reqs]
    sps = [SamplingParams(temperature=d["temperature"], top_k=0, top_p=d["top_p"], min_p=d["min_p"],
                          max_new_tokens=d["max_new_tokens"], seed=d["sampling_seed"]) for _, d in reqs]
    seconds, outs = _time(lambda: pair.server.generate(prompts, sps), args.repeats)
    return {"seconds": seconds, "tokens": [o.tokens for o in outs], "logprobs": [o.logprobs for o in outs]}


def _json_backend() -> str:
    from alignzoo.serve import jsonio

    return "orjson" if jsonio.orjson is not None else "json"


def main(argv=None) -> dict:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the figures here")
    ap.add_argument("--verbose", action="store_true", help="show the server's log")
    args = ap.parse_args(argv)
    from alignzoo.models import model_module
    from alignzoo.models.loading import resolve_config

    vocab = resolve_config(model_module(args.model).SPEC, None, args.config).vocab_size
    reqs = make_requests(args.batch, args.prompt_len, args.new, vocab, args.seed)
    http = bench_http(args, reqs)
    local = bench_in_process(args, reqs)
    tokens = sum(len(t) for t in local["tokens"])
    rows = {"in-process": local["seconds"], **{f"http {k}": v["seconds"] for k, v in http.items()}}
    equal = {k: v["tokens"] == local["tokens"] and all(torch.equal(a, b) for a, b in zip(v["logprobs"], local["logprobs"]))
             for k, v in http.items()}
    report = {"model": args.model, "config": args.config, "device": args.device, "batch": args.batch,
              "prompt_len": args.prompt_len, "new": args.new, "tokens": tokens,
              "tok_s": {k: tokens / s for k, s in rows.items()},
              "ratio": {k: local["seconds"] / v["seconds"] for k, v in http.items()},
              "bitwise_equal": equal, "server_e2e_s": {k: v["server_e2e_s"] for k, v in http.items()},
              "json": _json_backend()}
    print(f"bench_http: {args.model} {args.config} on {args.device}, batch {args.batch}, prompt {args.prompt_len}, "
          f"{args.new} new tokens ({tokens} in all), best of {args.repeats}")
    for k, s in rows.items():
        ratio = "" if k == "in-process" else f"  {local['seconds'] / s:.3f}x in-process, " \
                                             f"bits {'equal' if equal[k[5:]] else 'DIFFER'}"
        e2e = "" if k == "in-process" else f" (server {http[k[5:]]['server_e2e_s']:.3f} s)"
        print(f"  {k:<16} {s:8.3f} s  {tokens / s:10.1f} tok/s{ratio}{e2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
