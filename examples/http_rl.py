"""RL over HTTP with K3 == 0 on every token: examples/qwen3_rl.py's task, the sampler an ``alignzoo serve``
process driven the way an RL framework drives SGLang.

A tiny Qwen3 learns to reverse a string of digits.  This process holds the trainer only; it saves its
seeded init as a Hugging Face checkpoint, starts ``alignzoo serve qwen3 --checkpoint DIR`` on a free
port, opens a torch.distributed group with it (/init_weights_update_group; gloo on the CPU, NCCL on
the GPU) and then, each step: samples every group with one /generate call (n = group size,
return_logprob), scores the same tokens with the trainer, checks the two log-probs equal bit for bit
(``torch.equal``: any difference stops the run), takes a CISPO step and ships the changed blocks through
/update_weights_from_distributed (the server checks the payload before it applies it, between engine
steps).  At the end the served weights' checksum must equal the trainer's, and the server must stop
cleanly on SIGTERM.

    python examples/http_rl.py                 # 20 steps, about 15 s on 2 CPU cores
    python examples/http_rl.py --steps 100     # the reward climbs as in qwen3_rl.py
Writes OUT/log.jsonl (one line per step).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from qwen3_rl import EOS, VOCAB, make_prompts, reward  # noqa: E402
from rl_common import (  # noqa: E402
    add_rl_arguments, add_run_arguments, check_alignment, finish, free_port, group_advantages, print_step,
    token_objective)

from alignzoo import SamplingParams  # noqa: E402
from alignzoo.client import Client, output_logprobs  # noqa: E402
from alignzoo.models import model_module  # noqa: E402
from alignzoo.models.loading import resolve_config  # noqa: E402
from alignzoo.sync import weights_checksum  # noqa: E402



def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rl_arguments(ap, steps=20, groups=8, group_size=8)
    add_run_arguments(ap, out="runs/http_rl")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def start_server(checkpoint: str, args, log_path: str) -> tuple[subprocess.Popen, Client]:
    port = free_port()
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "alignzoo.cli", "serve", "qwen3", "--checkpoint", checkpoint,
                             "--device", args.device, "--dtype", args.dtype, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    client = Client(f"http://127.0.0.1:{port}")
    client.wait_ready(300, proc)
    return proc, client


def sampling(args, seed: int) -> dict:
    return {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
            "max_new_tokens": args.digits + 1, "stop_token_ids": [EOS], "sampling_seed": seed, "n": args.group_size}


def as_params(d: dict, j: int) -> SamplingParams:
    """The SamplingParams the server sampled sample j of a prompt with (seed + j)."""
    return SamplingParams(temperature=d["temperature"], top_k=d["top_k"], top_p=d["top_p"], min_p=d["min_p"],
                          max_new_tokens=d["max_new_tokens"], stop_token_ids=tuple(d["stop_token_ids"]),
                          seed=d["sampling_seed"] + j)


def train_step(client, trainer, opt, pub, step, args, g) -> dict:
    t0 = time.perf_counter()
    prompts = make_prompts(args.prompts, args.digits, g)
    n = args.group_size
    sps = [sampling(args, (args.seed * 1_000_003 + step * len(prompts) + i) * n) for i in range(len(prompts))]
    results = client.generate(prompts, sps, return_logprob=True)  # prompt-major: group i is results[i*n:(i+1)*n]
    t_sample = time.perf_counter() - t0
    params = [p for p in trainer.parameters() if p.requires_grad]
    norm = len(prompts) * n * (args.digits + 1)
    all_stats, rewards, versions = [], [], set()
    for i, prompt in enumerate(prompts):
        group = results[i * n:(i + 1) * n]
        answers = [r["output_ids"] for r in group]
        served = [output_logprobs(r) for r in group]
        versions |= {r["meta_info"]["weight_version"] for r in group}
        lps = trainer.logprobs([prompt + a for a in answers], [len(prompt)] * n, [as_params(sps[i], j) for j in range(n)])
        stats = check_alignment(lps, served)
        if stats["differing"] or not all(torch.equal(lp.detach().cpu(), s) for lp, s in zip(lps, served)):
            raise SystemExit(f"step {step}: the trainer and the server disagree on {stats['differing']} of "
                             f"{stats['tokens']} tokens (K3 max {stats['k3_max']:.3g}): the aligned contract is broken")
        r = torch.tensor([reward(prompt, a) for a in answers])
        adv = group_advantages(r)
        surrogate = sum(token_objective(args.objective, lp, s, float(a)).sum() for lp, s, a in zip(lps, served, adv))
        (-surrogate / norm).backward()
        all_stats.append(stats)
        rewards.append(r)
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    trainer.invalidate_caches()  # derived weights (FP8 codes) rebuilt from the masters, as pair.sync() does
    t1 = time.perf_counter()
    payload = pub.publish()
    version = client.update_weights_from_distributed(payload)["weight_version"]
    tokens = sum(s["tokens"] for s in all_stats)
    return {"reward": float(torch.cat(rewards).mean()), "k3_max": max(s["k3_max"] for s in all_stats),
            "differing_tokens": sum(s["differing"] for s in all_stats), "tokens": tokens,
            "sampled_under_version": sorted(versions), "weight_version": version,
            "sync_blocks": f"{payload.stats.blocks_changed}/{payload.stats.blocks_total}",
            "sample_s": t_sample, "sync_s": time.perf_counter() - t1}


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)  # the tiny model gains nothing from more; spinning threads cost a busy machine
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    qwen3 = model_module("qwen3")
    cfg = resolve_config(qwen3.SPEC, None, {"vocab_size": VOCAB, "max_position": 64})
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    trainer = qwen3.build_trainer(cfg, device=args.device, dtype=dtype, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    init = os.path.join(args.out, "init")
    qwen3.save_pretrained(trainer, init)  # the server starts from the trainer's bytes
    proc, client = start_server(init, args, os.path.join(args.out, "server.log"))
    log_path = os.path.join(args.out, "log.jsonl")
    try:
        assert client.weights_checksum() == weights_checksum(trainer.forward_weights()), "the server loaded other bytes"
        backend = "nccl" if torch.device(args.device).type == "cuda" else "gloo"
        client.init_weights_update_group("127.0.0.1", free_port(), backend=backend)
        pub = client.publisher(trainer.forward_weights)  # its first payload (full) is the server's next version
        opt = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.99))
        print(f"http RL: reverse {args.digits} digits; {args.prompts} prompts x {args.group_size} samples per step; "
              f"{args.objective}; sampler {client.url} (gloo/NCCL sync: {backend}) -> {log_path}", flush=True)
        log = []
        with open(log_path, "w") as f:
            for step in range(args.steps):
                t0 = time.perf_counter()
                row = {"step": step, **train_step(client, trainer, opt, pub, step, args, g),
                       "seconds": time.perf_counter() - t0}
                log.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print_step(step, row)
        same = client.weights_checksum() == weights_checksum(trainer.forward_weights())
        client.destroy_weights_update_group()
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    return finish(log, same, code)


if __name__ == "__main__":
    sys.exit(main())
