"""RL on qwen3 with K3 == 0 on every token of every step.

A tiny Qwen3 learns, from random init on the CPU, to reverse a string of
digits: prompt [BOS d1 .. dn SEP], answer [dn .. d1 EOS], reward = fraction of
the n + 1 answer positions right.  ``--lora-mode multi`` trains two LoRA
adapters on one frozen base in the same batches: "reverse" (the task above)
and "copy" (answer [d1 .. dn EOS]); each group is served and scored under its
task's adapter, and K3 == 0 must hold on every row.  Each step: the server samples a group of
completions per prompt (temperature / top-k / top-p / min-p), GRPO turns the
rewards into advantages, the trainer scores the same tokens (``logprobs``),
the objective (CISPO by default; PPO-clip; unbounded IS) gives the gradient,
one optimizer step, ``pair.sync()``.  Before the update the trainer's log-probs
must equal the sampler's bit for bit: any difference stops the run
(``--unaligned`` serves with vendor kernels instead and only logs K3).

    python examples/qwen3_rl.py                      # ~3 minutes on 2 CPU cores
    python examples/qwen3_rl.py --stream             # backward group by group as groups complete
    python examples/qwen3_rl.py --unaligned          # the mismatch this project removes
    python examples/qwen3_rl.py --lora 8             # train rank-8 LoRA adapters on a frozen base
    python examples/qwen3_rl.py --lora 8 --lora-mode multi   # two adapters, two tasks, one batch
    python examples/qwen3_rl.py --config qwen3-0.6b --device cuda --steps 5   # real shapes on a GPU
Writes OUT/log.jsonl (one line per step) and OUT/rl.png (reward and K3 against step).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rl_common import (  # noqa: E402
    OrderedGradSum, add_rl_arguments, add_run_arguments, check_alignment, group_advantages, reward_summary,
    token_objective)

import alignzoo  # noqa: E402
from alignzoo import SamplingParams  # noqa: E402
from alignzoo.models import model_module  # noqa: E402

BOS, SEP, EOS, VOCAB = 10, 11, 12, 16  # digits are tokens 0..9


def make_prompts(n_prompts: int, n_digits: int, g: torch.Generator) -> list[list[int]]:
    return [[BOS, *torch.randint(0, 10, (n_digits,), generator=g).tolist(), SEP] for _ in range(n_prompts)]


TASKS = ("reverse", "copy")  # --lora-mode multi: one adapter per task, named by it


def reward(prompt: list[int], answer: list[int], task: str = "reverse") -> float:
    digits = prompt[1:-1]
    target = (digits[::-1] if task == "reverse" else digits) + [EOS]
    return sum(a == t for a, t in zip(answer, target)) / len(target)


MODEL = "qwen3"  # examples/qwen35_gdn_rl.py runs this script with its own model and --help text
DESCRIPTION = __doc__


def parse(argv=None):
    ap = argparse.ArgumentParser(description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=MODEL, help="the zoo model (alignzoo models)")
    add_rl_arguments(ap, steps=100, groups=8, group_size=8)
    ap.add_argument("--stream", action="store_true", help="forward/backward group by group as groups complete")
    ap.add_argument("--unaligned", action="store_true", help="serve with vendor kernels: K3 > 0 is logged, not fatal")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train LoRA adapters of rank R (lora_alpha 2R) on every projection of a frozen base (an MoE "
                         "model's experts too: --no-lora-experts); 0: off")
    ap.add_argument("--no-lora-experts", action="store_true",
                    help="with --lora on an MoE model: leave the routed experts without adapters (by default merged "
                         "and separate LoRA also adapt every expert's gate_up and down; multi mode never does)")
    ap.add_argument("--lora-mode", choices=("merged", "separate", "multi"), default="merged",
                    help="with --lora: merged: W + s·B·A is what the trainer reads and the sync ships; separate: "
                         "base + branch; multi: two adapters (tasks reverse and copy) on one frozen base")
    ap.add_argument("--config", default=None, metavar="PRESET",
                    help="a qwen3 preset (e.g. qwen3-0.6b): its shapes and vocabulary instead of the tiny task model "
                         "(random init; for timing and K3 at real shapes, the task is not learned in a few steps)")
    add_run_arguments(ap, out=f"runs/{MODEL}_rl")
    ap.add_argument("--save", default=None, help="save the trained model as a Hugging Face checkpoint here "
                                                 "(with --lora: merged, and the PEFT adapter in SAVE/adapter; "
                                                 "--lora-mode multi: each task's PEFT adapter in SAVE/<task>)")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    return args


def multi_lora(args) -> bool:
    """Two adapters, one per task (``--lora R --lora-mode multi``)."""
    return bool(args.lora) and args.lora_mode == "multi"


def lora_experts(args) -> list[str]:
    """The routed experts' parameters merged / separate LoRA adapts (an MoE model's; else none)."""
    if not args.lora or multi_lora(args) or args.no_lora_experts:
        return []
    return list(model_module(args.model).SPEC.trainer_cls.lora_param_slots)


def build_pair(args, **kw):
    cfg = args.config or {"vocab_size": VOCAB, "max_position": 64}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    lora = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"}
    if lora_experts(args):
        lora["target_parameters"] = lora_experts(args)
    if multi_lora(args):
        kw.setdefault("lora_adapters", {t: lora for t in TASKS})
    elif args.lora:
        kw |= dict(lora_mode=args.lora_mode) | ({} if "lora_adapter" in kw else dict(lora=lora))
    return alignzoo.load_pair(args.model, config=cfg, device=args.device, dtype=dtype, seed=args.seed,
                              server_kernels="vendor" if args.unaligned else "aligned", **kw)


def task_of(args, group: int) -> str:
    """The group's task; in multi-adapter mode also the adapter that serves it."""
    return TASKS[group % len(TASKS)] if multi_lora(args) else "reverse"


def adapter_of(args, group: int) -> str | None:
    return task_of(args, group) if multi_lora(args) else None


def rollouts(pair, prompts, sps, args):
    """Yield (group index, completions of the group) as groups complete
    (streaming), or all groups in index order once every one is done."""
    n = len(sps) // len(prompts)
    if not args.stream:
        adapters = [adapter_of(args, i) for i in range(len(prompts)) for _ in range(n)]
        outs = pair.server.generate([p for p in prompts for _ in range(n)], sps, adapters=adapters)
        for i in range(len(prompts)):
            yield i, outs[i * n:(i + 1) * n]
        return
    eng = pair.server
    owner = {}
    for i, p in enumerate(prompts):
        for j in range(n):
            owner[eng.add_request(p, sps[i * n + j], adapter=adapter_of(args, i))] = (i, j)
    got = {i: [None] * n for i in range(len(prompts))}
    while eng.has_unfinished():
        for c in eng.step():
            i, j = owner[c.request_id]
            got[i][j] = c
            if all(x is not None for x in got[i]):
                yield i, got.pop(i)


def group_grads(pair, params, group, prompt, outs, sps, args, norm):
    """The group's surrogate gradient, and its alignment stats."""
    seqs = [prompt + o.tokens for o in outs]
    lps = pair.trainer.logprobs(seqs, [len(prompt)] * len(seqs), sps, adapters=adapter_of(args, group))
    stats = check_alignment(lps, [o.logprobs for o in outs])
    rewards = torch.tensor([reward(prompt, o.tokens, task_of(args, group)) for o in outs])
    adv = group_advantages(rewards)
    surrogate = sum(token_objective(args.objective, lp, o.logprobs, float(a)).sum()
                    for lp, o, a in zip(lps, outs, adv))
    grads = torch.autograd.grad(-surrogate / norm, params, allow_unused=True)
    return grads, stats, rewards


def train_step(pair, opt, step, args, g):
    params = [p for p in pair.trainer.parameters() if p.requires_grad]
    prompts = make_prompts(args.prompts, args.digits, g)
    n = args.group_size
    sps = [SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          max_new_tokens=args.digits + 1, stop_token_ids=(EOS,), seed=args.seed * 1_000_003 + step * n * len(prompts) + k)
           for k in range(n * len(prompts))]
    norm = len(prompts) * n * (args.digits + 1)
    acc = OrderedGradSum(params, len(prompts))
    all_stats, all_rewards, versions = [], [], set()
    for i, outs in rollouts(pair, prompts, sps, args):
        grads, stats, rewards = group_grads(pair, params, i, prompts[i], outs, sps[i * n:(i + 1) * n], args, norm)
        if not args.unaligned and stats["differing"]:
            raise SystemExit(f"step {step}: trainer and server disagree on {stats['differing']} of {stats['tokens']} "
                             f"tokens (K3 max {stats['k3_max']:.3g}): the aligned contract is broken")
        acc.add(i, grads)
        all_stats.append(stats)
        all_rewards.append(rewards)
        versions |= {v for o in outs for v in o.weight_versions}
    acc.write_grads()
    if args.max_grad_norm > 0:  # deterministic: one fixed-order norm over the summed gradients
        torch.nn.utils.clip_grad_norm_(params, args.max_grad_norm, foreach=False)
    opt.step()
    opt.zero_grad(set_to_none=True)
    version = pair.sync()
    tokens = sum(s["tokens"] for s in all_stats)
    return {
        "reward": float(torch.cat(all_rewards).mean()),
        "k3_mean": sum(s["k3_mean"] * s["tokens"] for s in all_stats) / max(tokens, 1),
        "k3_max": max(s["k3_max"] for s in all_stats),
        "max_abs_dlogprob": max(s["max_abs_dlogprob"] for s in all_stats),
        "differing_tokens": sum(s["differing"] for s in all_stats),
        "tokens": tokens,
        "sampled_under_version": sorted(versions),
        "weight_version": version,
    }


def plot(log: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in log]
    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    a.plot(steps, [r["reward"] for r in log], color="tab:blue")
    a.set_ylabel("mean reward")
    a.set_title(title)
    a.grid(alpha=0.3)
    k3 = [r["k3_max"] for r in log]
    b.plot(steps, k3, color="tab:red", label="K3 max")
    b.plot(steps, [r["k3_mean"] for r in log], color="tab:orange", label="K3 mean")
    if any(k > 0 for k in k3):
        b.set_yscale("symlog", linthresh=1e-9)
    b.set_ylabel("K3 (trainer vs sampler)")
    differing, tokens = sum(r["differing_tokens"] for r in log), sum(r["tokens"] for r in log)
    b.text(0.02, 0.92, f"{differing} of {tokens} sampled tokens differ in any bit", transform=b.transAxes, va="top")
    b.set_xlabel("step")
    b.legend()
    b.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    from tqdm import tqdm

    args = parse(argv)
    torch.manual_seed(args.seed)
    g = torch.Generator().manual_seed(args.seed)
    pair = build_pair(args)
    opt = torch.optim.Adam([p for p in pair.trainer.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.99))
    # linear decay to 10%: late large steps undo what the policy learned
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, args.steps) / max(args.steps, 1))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "log.jsonl")
    mode = "unaligned (vendor kernels)" if args.unaligned else "aligned"
    if args.lora:
        mode += f", LoRA r={args.lora} {args.lora_mode}" + (" (experts too)" if lora_experts(args) else "")
    task = "/".join(TASKS) if multi_lora(args) else "reverse"
    print(f"{args.model} RL: {task} {args.digits} digits; {args.prompts} prompts x {args.group_size} samples per step; "
          f"{args.objective}; {mode}; {args.dtype}; {'streaming' if args.stream else 'one batch'} -> {log_path}")
    log = []
    bar = tqdm(range(args.steps), desc="RL", unit="step", file=sys.stderr)
    with open(log_path, "w") as f:
        for step in bar:
            t0 = time.perf_counter()
            row = {"step": step, **train_step(pair, opt, step, args, g), "seconds": time.perf_counter() - t0}
            sched.step()
            log.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            bar.set_postfix(reward=f"{row['reward']:.3f}", k3_max=f"{row['k3_max']:.2g}", tokens=row["tokens"])
    worst = max(r["k3_max"] for r in log)
    differing = sum(r["differing_tokens"] for r in log)
    print(f"{reward_summary([r['reward'] for r in log])}; "
          f"K3 max over the run {worst:.3g}; {differing} of {sum(r['tokens'] for r in log)} tokens differ")
    if not args.no_plot:
        path = os.path.join(args.out, "rl.png")
        plot(log, path, f"{args.model} {args.config or 'tiny'}, {task} {args.digits} digits, {args.objective}, {mode}")
        print(f"plot: {path}")
    if args.save and multi_lora(args):  # one PEFT adapter per task; reload them all
        for t in TASKS:
            pair.save_pretrained(os.path.join(args.save, t), adapter=t, adapter_only=True)
        again = build_pair(args, lora_adapters={t: os.path.join(args.save, t) for t in TASKS})
    elif args.save:
        pair.save_pretrained(args.save)
        if args.lora:  # the merged model is in SAVE; reload the seeded base with the adapter alone
            adapter = os.path.join(args.save, "adapter")
            pair.save_pretrained(adapter, adapter_only=True)
            again = build_pair(args, lora_adapter=adapter)
        else:
            again = alignzoo.load_pair(args.model, checkpoint=args.save, device=args.device,
                                       dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype])
    if args.save:
        mine, theirs = pair.trainer.forward_weights(), again.trainer.forward_weights()
        same = mine.keys() == theirs.keys() and all(torch.equal(w, theirs[n]) for n, w in mine.items())
        print(f"saved to {args.save}; reloaded {'bit-identical' if same else 'DIFFERENT'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
