"""/generate and the OpenAI routes over HTTP against in-process ``generate`` on the same requests.

Starts ``alignzoo serve`` in a subprocess, times the requests through it (B concurrent clients of one
request each, and one batched call where the route takes a batch: /generate and /v1/completions), stops it,
then builds the same pair in this process and times ``pair.server.generate`` on the same prompt ids and
sampling parameters.  Both sides hold the same weights, so the tokens and FP32 log-probs must be equal bit
for bit; the report says whether they are.  Throughput is generated tokens per second of wall time, warm
(each side runs the requests once untimed first).

``--route generate`` (the default) serves the preset's seeded init and sends token ids to /generate.
``--route completions`` and ``--route chat`` need a tokenizer: the preset's seeded init is saved with a
word-level tokenizer covering the model's whole vocabulary and a chat template (``_text_checkpoint.py``),
and both sides load that directory.  Completions sends token ids (``prompt``: an id list, or all of them in
the batched call); chat sends one user message of random words per request, and the in-process side
generates from the ids the server's own ``render_chat`` makes of it with the checkpoint's tokenizer (the
answer's ``prompt_token_ids`` are checked against them).  Both ask for ``return_token_ids`` (an RL driver
needs the ids; the text alone does not give them back) and the chosen tokens' log-probs; a batched
/v1/completions call draws every prompt with one ``seed``, so that route gives all its requests the same
seed.  Every request sets ``ignore_eos``: each generates exactly --new tokens on both sides.

    python benchmarks/bench_http.py                                   # CPU smoke run, tiny preset
    python benchmarks/bench_http.py --route chat                      # the same through /v1/chat/completions
    python benchmarks/bench_http.py --config qwen3-0.6b --device cuda --batch 64 --prompt-len 512 --new 256 \
        --route chat

Target: HTTP >= 0.95x in-process at batch 64 with qwen3-0.6b on the H200 (/generate; chat: 64 concurrent).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_requests(batch: int, prompt_len: int, new: int, vocab: int, seed: int, *,
                  one_seed: bool = False) -> list[tuple[list[int], dict]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    # ignore_eos: every request generates exactly ``new`` tokens on both sides (a checkpoint has EOS ids)
    return [(torch.randint(0, vocab, (prompt_len,), generator=g).tolist(),
             {"temperature": 0.8, "top_k": -1, "top_p": 0.95, "min_p": 0.0, "max_new_tokens": new,
              "ignore_eos": True, "sampling_seed": seed * 100_003 + (0 if one_seed else i)}) for i in range(batch)]


def chat_requests(reqs, checkpoint, vocab: int, seed: int) -> list[list[dict]]:
    """Each request's messages: random words rendering to exactly as many ids as its prompt has, which are
    replaced (in place) by those the server's template call makes of the messages."""
    import torch

    from _text_checkpoint import chat_messages
    from alignzoo.models.text import load_tokenizer
    from alignzoo.serve.openai import ChatIn, render_chat

    tok = load_tokenizer(checkpoint, vocab)  # as the server loads it
    g = torch.Generator().manual_seed(seed + 1)
    prompt_len = len(reqs[0][0])
    overhead = len(render_chat(tok, ChatIn(messages=chat_messages(tok, 1, g)))) - 1
    if prompt_len <= overhead:
        raise ValueError(f"--prompt-len {prompt_len}: the chat template alone renders {overhead} tokens")
    out = []
    for ids, _ in reqs:
        messages = chat_messages(tok, prompt_len - overhead, g)
        ids[:] = render_chat(tok, ChatIn(messages=messages))
        if len(ids) != prompt_len:
            raise AssertionError(f"the chat template rendered {len(ids)} ids, not {prompt_len}")
        out.append(messages)
    return out


def _openai_fields(route: str, d: dict) -> dict:
    return {"max_tokens": d["max_new_tokens"], "temperature": d["temperature"], "top_p": d["top_p"],
            "top_k": d["top_k"], "min_p": d["min_p"], "seed": d["sampling_seed"], "ignore_eos": d["ignore_eos"],
            "logprobs": True if route == "chat" else 0, "return_token_ids": True}


def _samples(route: str, answer: dict | list) -> list[tuple[list[int] | None, list[int], list[float]]]:
    """(prompt ids the server generated from, or None where the answer has none; tokens; the log-probs as the
    JSON floats) of each sample of one answer."""
    if route == "generate":
        return [(None, r["output_ids"], [t[0] for t in r["meta_info"]["output_token_logprobs"]])
                for r in (answer if isinstance(answer, list) else [answer])]
    choices = sorted(answer["choices"], key=lambda c: c["index"])
    if route == "chat":
        return [(answer["prompt_token_ids"], c["token_ids"], [e["logprob"] for e in c["logprobs"]["content"]])
                for c in choices]
    return [(c["prompt_token_ids"], c["token_ids"], c["logprobs"]["token_logprobs"]) for c in choices]


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


def bench_http(args, reqs, checkpoint=None, messages=None) -> dict:
    from alignzoo.client import Client

    port = _free_port()
    source = ["--checkpoint", str(checkpoint)] if checkpoint else ["--config", args.config]
    cmd = [sys.executable, "-m", "alignzoo.cli", "serve", args.model, *source, "--device", args.device,
           "--port", str(port), "--max-batch-size", str(max(args.batch, 1)), "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None if args.verbose else subprocess.DEVNULL)
    client = Client(f"http://127.0.0.1:{port}", timeout=3600)
    route = args.route
    try:
        client.wait_ready(600, proc)
        prompts, sps = [p for p, _ in reqs], [d for _, d in reqs]
        fields = [_openai_fields(route, d) for d in sps]
        if route == "generate":
            def one(i):
                return client.generate(prompts[i], sps[i], return_logprob=True)

            def batched():
                return client.generate(prompts, sps, return_logprob=True)
        elif route == "completions":
            def one(i):
                return client.completions(prompts[i], **fields[i])

            def batched():  # one seed for all (make_requests' one_seed)
                return client.completions(prompts, **fields[0])
        else:
            def one(i):
                return client.chat(messages[i], **fields[i])

            batched = None  # a chat request holds one conversation

        def concurrent():
            with ThreadPoolExecutor(len(reqs)) as ex:
                return list(ex.map(one, range(len(reqs))))

        out = {}
        for name, fn in (("batched", batched), ("concurrent", concurrent)):
            if fn is None:
                continue
            seconds, answers = _time(fn, args.repeats)
            answers = answers if name == "concurrent" else [answers]
            samples = [s for a in answers for s in _samples(route, a)]
            # /generate's own clock, from the parsed request to the last sample done: the rest of the wall
            # time is the request's and answer's JSON and transport (the OpenAI answers carry none)
            e2e = max(r["meta_info"]["e2e_latency"] for a in answers for r in (a if isinstance(a, list) else [a])) \
                if route == "generate" else None
            out[name] = {"seconds": seconds, "server_e2e_s": e2e, "prompts": [s[0] for s in samples],
                         "tokens": [s[1] for s in samples], "logprobs": [s[2] for s in samples]}
        return out
    finally:
        proc.terminate()
        proc.wait(60)


def bench_in_process(args, reqs, checkpoint=None) -> dict:
    import alignzoo
    import torch
    from alignzoo import SamplingParams

    if args.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)  # as the server's CLI runs
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    pair = alignzoo.load_pair(args.model, checkpoint=checkpoint, config=None if checkpoint else args.config,
                              device=args.device, dtype=dtype, max_batch_size=max(args.batch, 1))
    prompts = [p for p, _ in reqs]
    sps = [SamplingParams(temperature=d["temperature"], top_k=0, top_p=d["top_p"], min_p=d["min_p"],
                          max_new_tokens=d["max_new_tokens"], ignore_eos=d["ignore_eos"], seed=d["sampling_seed"])
           for _, d in reqs]
    seconds, outs = _time(lambda: pair.server.generate(prompts, sps), args.repeats)
    return {"seconds": seconds, "tokens": [o.tokens for o in outs], "logprobs": [o.logprobs for o in outs]}


def compare(http: dict, local: dict, prompts: list[list[int]]) -> tuple[bool, bool]:
    """(bits equal: the prompt ids the server used where it says, the tokens, and the log-probs' FP32 bits;
    JSON exact: every JSON float is the FP32 value itself, read as a double, not a decimal that merely
    rounds back to it)."""
    import torch

    bits = http["tokens"] == local["tokens"] and all(p is None or p == q for p, q in zip(http["prompts"], prompts))
    exact = True
    for floats, lp in zip(http["logprobs"], local["logprobs"]):
        lp = lp.cpu()
        got = torch.tensor(floats, dtype=torch.float32)
        bits = bits and got.shape == lp.shape and torch.equal(got.view(torch.int32), lp.view(torch.int32))
        exact = exact and got.shape == lp.shape and torch.equal(torch.tensor(floats, dtype=torch.float64), lp.double())
    return bits, exact


def _json_backend() -> str:
    from alignzoo.serve import jsonio

    return "orjson" if jsonio.orjson is not None else "json"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--route", choices=tuple(PATHS), default="generate",
                    help="/generate, /v1/completions or /v1/chat/completions")
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
    reqs = make_requests(args.batch, args.prompt_len, args.new, vocab, args.seed,
                         one_seed=args.route == "completions")
    with tempfile.TemporaryDirectory(prefix="bench_http_") as tmp:
        checkpoint = messages = None
        if args.route != "generate":
            import torch

            from _text_checkpoint import write_checkpoint

            dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
            # built on the CPU: this process holds no GPU memory while the server sizes its KV cache
            checkpoint = write_checkpoint(Path(tmp) / "checkpoint", args.model, args.config, dtype=dtype,
                                          seed=args.seed)
            if args.route == "chat":
                messages = chat_requests(reqs, checkpoint, vocab, args.seed)
        http = bench_http(args, reqs, checkpoint, messages)
        local = bench_in_process(args, reqs, checkpoint)
    tokens = sum(len(t) for t in local["tokens"])
    rows = {"in-process": local["seconds"], **{f"http {k}": v["seconds"] for k, v in http.items()}}
    checks = {k: compare(v, local, [p for p, _ in reqs]) for k, v in http.items()}
    equal = {k: bits for k, (bits, _) in checks.items()}
    report = {"model": args.model, "config": args.config, "device": args.device, "route": args.route,
              "path": PATHS[args.route], "batch": args.batch, "prompt_len": args.prompt_len, "new": args.new,
              "tokens": tokens, "tok_s": {k: tokens / s for k, s in rows.items()},
              "ratio": {k: local["seconds"] / v["seconds"] for k, v in http.items()},
              "bitwise_equal": equal, "logprobs_json_exact": {k: exact for k, (_, exact) in checks.items()},
              "server_e2e_s": {k: v["server_e2e_s"] for k, v in http.items()},
              "checkpoint": None if args.route == "generate" else
              f"{args.config} seeded init (seed {args.seed}) + word-level tokenizer of {vocab} words",
              "json": _json_backend()}
    print(f"bench_http: {args.model} {args.config} on {args.device}, {PATHS[args.route]}, batch {args.batch}, "
          f"prompt {args.prompt_len}, {args.new} new tokens ({tokens} in all), best of {args.repeats}")
    for k, s in rows.items():
        ratio = e2e = ""
        if k != "in-process":
            name = k[5:]
            ratio = f"  {local['seconds'] / s:.3f}x in-process, bits {'equal' if equal[name] else 'DIFFER'}"
            if not checks[name][1]:
                ratio += " (JSON log-probs not the FP32 values exactly)"
            if http[name]["server_e2e_s"] is not None:
                e2e = f" (server {http[name]['server_e2e_s']:.3f} s)"
        print(f"  {k:<16} {s:8.3f} s  {tokens / s:10.1f} tok/s{ratio}{e2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return report


if __name__ == "__main__":
    main()
