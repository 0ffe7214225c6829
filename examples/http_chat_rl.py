"""Multi-turn RL through the OpenAI-compatible chat API, with K3 == 0 on every token.

A tiny Qwen3 with a small word-level tokenizer and a chat template (both written here, next to the
checkpoint, with a generation_config.json whose EOS ids end a turn) learns a two-turn episode:

    user: reverse 3 1          assistant: 1 3 <|end|>
    user: again : 5 2          assistant: 2 5 <|end|>

This process holds the trainer only; ``alignzoo serve qwen3 --checkpoint DIR`` runs behind an API key
(ALIGNZOO_API_KEY) and an admin key for weight updates.  Each step, every episode's first turn is one
/v1/chat/completions call with n = group size; each sample's second turn is its own call, with the
sample's answer in the history (the calls run concurrently: the server batches them).  Every call asks
for ``logprobs`` and ``return_token_ids``, so the exact prompt and completion tokens come back with the
sampler's FP32 log-probs and, in ``metadata``, the sampling parameters they were drawn with.  The
trainer scores every returned token with those parameters; any bit that differs (K3 != 0) stops the
run.  A CISPO step on the episode's reward (both turns share it) follows, and the changed blocks ship
through /update_weights_from_tensor.  At the end the served weights' checksum must equal the trainer's
and the server must stop cleanly on SIGTERM.

    python examples/http_chat_rl.py              # 20 steps, about 30 s on 2 CPU cores
    python examples/http_chat_rl.py --steps 150  # the reward climbs
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
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_common import (  # noqa: E402
    add_rl_arguments, add_run_arguments, check_alignment, finish, free_port, group_advantages, print_step,
    token_objective)

from alignzoo import SamplingParams  # noqa: E402
from alignzoo.client import Client, choice_logprobs  # noqa: E402
from alignzoo.models import model_module  # noqa: E402
from alignzoo.models.loading import resolve_config  # noqa: E402
from alignzoo.sync import weights_checksum  # noqa: E402

WORDS = ["<pad>", "</s>", "<|user|>", "<|assistant|>", "<|end|>", "<unk>", "reverse", "again", ":",
         *map(str, range(10))]
EOS, END = WORDS.index("</s>"), WORDS.index("<|end|>")
DIGIT0 = WORDS.index("0")
CHAT_TEMPLATE = ("{%- for m in messages -%}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor -%}"
                 "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}")
KEY, ADMIN = "chat-rl-key", "chat-rl-admin"



def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rl_arguments(ap, steps=20, groups=4, group_size=6, groups_flag="--episodes")
    add_run_arguments(ap, out="runs/http_chat_rl")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def write_tokenizer(directory: str) -> None:
    """A word-level tokenizer over WORDS (one id per word, the model's whole vocabulary) with the chat
    template, and a generation_config.json: a turn ends at <|end|> (or </s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", pad_token="<pad>", unk_token="<unk>",
                                  additional_special_tokens=["<|user|>", "<|assistant|>", "<|end|>"])
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [END, EOS], "temperature": 1.0}, f)


def start_server(checkpoint: str, args, log_path: str) -> tuple[subprocess.Popen, Client]:
    port = free_port()
    log = open(log_path, "w")
    env = {**os.environ, "ALIGNZOO_API_KEY": KEY, "ALIGNZOO_ADMIN_API_KEY": ADMIN}
    proc = subprocess.Popen([sys.executable, "-m", "alignzoo.cli", "serve", "qwen3", "--checkpoint", checkpoint,
                             "--device", args.device, "--dtype", args.dtype, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(f"http://127.0.0.1:{port}", api_key=KEY, admin_api_key=ADMIN)
    client.wait_ready(300, proc)
    return proc, client


def turn_reward(digits: list[int], tokens: list[int]) -> float:
    """1 for the digits reversed and then <|end|>; partial credit per right digit."""
    want = [DIGIT0 + d for d in reversed(digits)]
    body = tokens[:-1] if tokens and tokens[-1] in (END, EOS) else tokens
    right = sum(a == b for a, b in zip(body, want)) / len(want)
    ended = len(body) == len(want) and tokens[-1:] == [END]
    return 0.8 * right * (1.0 if len(body) == len(want) else 0.5) + 0.2 * ended


def replay(meta: dict, j: int, max_tokens: int) -> SamplingParams:
    """The SamplingParams choice j of an answer was drawn with (its ``metadata``: seed + j)."""
    p = meta["sampling_params"]
    return SamplingParams(temperature=p["temperature"], top_k=max(p["top_k"], 0), top_p=p["top_p"],
                          min_p=p["min_p"], max_new_tokens=max_tokens, seed=p["seed"] + j)


def episode(client: Client, pool, args, digits: tuple[list[int], list[int]], seed: int) -> list[list[dict]]:
    """G samples of one two-turn episode: per sample, its turns as {prompt, tokens, served, sp}."""
    n, max_tokens = args.group_size, args.digits + 1
    fields = {"max_tokens": max_tokens, "temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p,
              "min_p": args.min_p, "logprobs": True, "return_token_ids": True}
    q1 = {"role": "user", "content": "reverse " + " ".join(map(str, digits[0]))}
    first = client.chat([q1], n=n, seed=seed, **fields)
    turns = [[{"prompt": first["prompt_token_ids"], "tokens": c["token_ids"], "served": choice_logprobs(c),
               "sp": replay(first["metadata"], c["index"], max_tokens), "version": first["metadata"]["weight_version"]}]
             for c in first["choices"]]
    q2 = {"role": "user", "content": "again : " + " ".join(map(str, digits[1]))}
    histories = [[q1, {"role": "assistant", "content": c["message"]["content"]}, q2] for c in first["choices"]]
    seconds = list(pool.map(lambda jh: client.chat(jh[1], n=1, seed=seed + n + jh[0], **fields),
                            enumerate(histories)))
    for t, ans in zip(turns, seconds):
        c = ans["choices"][0]
        t.append({"prompt": ans["prompt_token_ids"], "tokens": c["token_ids"], "served": choice_logprobs(c),
                  "sp": replay(ans["metadata"], 0, max_tokens), "version": ans["metadata"]["weight_version"]})
    return turns


def train_step(client, pools, trainer, opt, pub, step, args, g) -> dict:
    t0 = time.perf_counter()
    tasks = [[torch.randint(0, 10, (args.digits,), generator=g).tolist() for _ in range(2)]
             for _ in range(args.episodes)]
    seeds = [(args.seed * 1_000_003 + step * args.episodes + i) * 4 * args.group_size for i in range(args.episodes)]
    outer, inner = pools  # episodes, and their second turns (two pools: an episode waits on its turns)
    groups = list(outer.map(lambda i: episode(client, inner, args, tasks[i], seeds[i]), range(args.episodes)))
    t_sample = time.perf_counter() - t0
    norm = args.episodes * args.group_size * 2 * (args.digits + 1)
    turns = [t for samples in groups for s in samples for t in s]  # episode-major, then sample, then turn
    lps = trainer.logprobs([t["prompt"] + t["tokens"] for t in turns], [len(t["prompt"]) for t in turns],
                           [t["sp"] for t in turns])
    served = [t["served"] for t in turns]
    stats = check_alignment(lps, served)
    if stats["differing"] or not all(torch.equal(lp.detach().cpu(), s) for lp, s in zip(lps, served)):
        raise SystemExit(f"step {step}: the trainer and the server disagree on {stats['differing']} of "
                         f"{stats['tokens']} tokens (K3 max {stats['k3_max']:.3g}): the aligned contract is broken")
    rewards = torch.tensor([[(turn_reward(task[0], s[0]["tokens"]) + turn_reward(task[1], s[1]["tokens"])) / 2
                             for s in samples] for task, samples in zip(tasks, groups)])
    adv = torch.cat([group_advantages(r) for r in rewards])  # one per sample; its two turns share it
    surrogate = sum(token_objective(args.objective, lp, t["served"], float(adv[k // 2])).sum()
                    for k, (lp, t) in enumerate(zip(lps, turns)))
    (-surrogate / norm).backward()
    versions = {t["version"] for t in turns}
    params = [p for p in trainer.parameters() if p.requires_grad]
    if args.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    trainer.invalidate_caches()
    t1 = time.perf_counter()
    payload = pub.publish()
    version = client.update_weights_from_tensor(payload)["weight_version"]
    return {"reward": float(rewards.mean()), "k3_max": stats["k3_max"], "differing_tokens": stats["differing"],
            "tokens": stats["tokens"],
            "sampled_under_version": sorted(versions), "weight_version": version,
            "sync_blocks": f"{payload.stats.blocks_changed}/{payload.stats.blocks_total}",
            "sample_s": t_sample, "sync_s": time.perf_counter() - t1}


def main(argv=None) -> int:
    args = parse(argv)
    if args.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    qwen3 = model_module("qwen3")
    cfg = resolve_config(qwen3.SPEC, None, {"vocab_size": len(WORDS), "max_position": 64})
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    trainer = qwen3.build_trainer(cfg, device=args.device, dtype=dtype, seed=args.seed)
    os.makedirs(args.out, exist_ok=True)
    init = os.path.join(args.out, "init")
    qwen3.save_pretrained(trainer, init)
    write_tokenizer(init)
    proc, client = start_server(init, args, os.path.join(args.out, "server.log"))
    log_path = os.path.join(args.out, "log.jsonl")
    log, same = [], False
    try:
        assert client.weights_checksum() == weights_checksum(trainer.forward_weights()), "the server loaded other bytes"
        pub = client.publisher(trainer.forward_weights)
        opt = torch.optim.Adam([p for p in trainer.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.99))
        print(f"http chat RL: two turns of reversing {args.digits} digits; {args.episodes} episodes x "
              f"{args.group_size} samples per step; {args.objective}; /v1/chat/completions at {client.url} -> "
              f"{log_path}", flush=True)
        with open(log_path, "w") as f, ThreadPoolExecutor(args.episodes) as outer, \
                ThreadPoolExecutor(args.episodes * args.group_size) as inner:
            for step in range(args.steps):
                t0 = time.perf_counter()
                row = {"step": step, **train_step(client, (outer, inner), trainer, opt, pub, step, args, g),
                       "seconds": time.perf_counter() - t0}
                log.append(row)
                f.write(json.dumps(row) + "\n")
                f.flush()
                print_step(step, row)
        same = client.weights_checksum() == weights_checksum(trainer.forward_weights())
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    return finish(log, same, code)


if __name__ == "__main__":
    sys.exit(main())
