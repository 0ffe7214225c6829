"""RL on deepseek_v4_mhc_mxfp4 (DeepSeek-V4: four mHC residual streams, shared-KV attention over a sliding window
plus C4 rows an indexer picks and C16 rows read whole, with sinks; hash- and learned-routed experts) with K3 == 0
on every token of every step: the qwen3 example's task, objectives and rollouts (``examples/qwen3_rl.py``), LoRA
on a frozen base.  The digits default to 40, so a prompt (42 tokens) already outruns the tiny preset's 40-token
window: every sampled token's query reads compressed rows of positions the window has left, built on the server
one decode step at a time and in the trainer from the packed sequence.  Before each update the trainer's FP32
log-probs must equal the sampler's bit for bit.

The adapters (rank --lora, lora_alpha 2R):
  separate (default)  on the attention's q_a, q_b, kv and o_b and inside the routed experts, each a branch beside
                      its frozen base on both sides; the sync ships the adapters alone
  merged              the same targets, W + s·B·A is what the trainer reads and the sync ships (not with --mxfp4)
  multi               two attention adapters (tasks reverse and copy) on one frozen base
  --mxfp4             the tiny-mxfp4 preset: the experts are frozen MXFP4 codes, computed packed; their adapters
                      run inside the packed kernel, the codes never unpacked in the forward

    python examples/deepseek_v4_mhc_mxfp4_rl.py                # ~40 s on 2 CPU cores, 0 of ~4,800 tokens differ
    python examples/deepseek_v4_mhc_mxfp4_rl.py --mxfp4
    python examples/deepseek_v4_mhc_mxfp4_rl.py --lora-mode merged
Prints one line per step (reward, K3, the blocks and bytes the sync shipped) and writes OUT/log.jsonl and
OUT/rl.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_rl  # noqa: E402
from rl_common import add_rl_arguments, add_run_arguments, finish, run_steps, seeded  # noqa: E402

from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4  # noqa: E402

MODEL = V4.NAME


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rl_arguments(ap, steps=8, groups=4, group_size=4)
    ap.set_defaults(digits=40, lr=1e-2)
    ap.add_argument("--stream", action="store_true", help="forward/backward group by group as groups complete")
    ap.add_argument("--lora", type=int, default=8, metavar="R", help="the adapters' rank (lora_alpha 2R)")
    ap.add_argument("--lora-mode", choices=("merged", "separate", "multi"), default="separate",
                    help="separate: base + branch on attention and experts; merged: W + s·B·A is what the trainer "
                         "reads and the sync ships; multi: two attention adapters (tasks reverse and copy)")
    ap.add_argument("--mxfp4", action="store_true", help="the tiny-mxfp4 preset: frozen MXFP4 experts, computed packed")
    add_run_arguments(ap, out=f"runs/{MODEL}_rl")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.lora < 1:
        ap.error(f"--lora must be >= 1 (this example trains adapters on a frozen base), got {args.lora}")
    if args.mxfp4 and args.lora_mode == "merged":
        ap.error("--mxfp4 takes --lora-mode separate or multi: a merged W' would be requantized every step")
    args.unaligned = False  # qwen3_rl.train_step's flag: this model has no vendor server yet
    return args


def build_pair(args):
    cfg = V4.PRESETS["tiny-mxfp4" if args.mxfp4 else "tiny"].replace(vocab_size=qwen3_rl.VOCAB,
                                                                       max_position=max(64, 2 * args.digits + 3))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    attention = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"}
    if qwen3_rl.multi_lora(args):
        kw = {"lora_adapters": {t: attention for t in qwen3_rl.TASKS}}
    else:
        kw = {"lora": attention | {"target_parameters": list(V4.DeepseekV4Trainer.lora_param_slots)},
              "lora_mode": args.lora_mode}
    return V4.load(config=cfg, device=args.device, dtype=dtype, seed=args.seed, **kw)


def mode_of(args) -> str:
    targets = "the attention" if qwen3_rl.multi_lora(args) else "the attention and the experts"
    experts = "MXFP4 experts" if args.mxfp4 else f"{args.dtype} experts"
    return f"LoRA r={args.lora} {args.lora_mode} on {targets}, {experts}"


def main(argv=None) -> int:
    args = parse(argv)
    g = seeded(args)
    pair = build_pair(args)
    task = "/".join(qwen3_rl.TASKS) if qwen3_rl.multi_lora(args) else "reverse"
    log = run_steps(pair, args, g, f"{MODEL} {'tiny-mxfp4' if args.mxfp4 else 'tiny'} RL: {task} {args.digits} digits "
                    f"(prompts of {args.digits + 2} tokens, a {pair.config.sliding_window}-token window); "
                    f"{args.prompts} prompts x {args.group_size} samples per step; {args.objective}; {mode_of(args)}; "
                    f"{'streaming' if args.stream else 'one batch'}", qwen3_rl.train_step)
    if not args.no_plot:
        path = os.path.join(args.out, "rl.png")
        qwen3_rl.plot(log, path, f"{MODEL}, {task} {args.digits} digits, {args.objective}, {mode_of(args)}")
        print(f"plot: {path}")
    return finish(log, pair.weights_match(), None)


if __name__ == "__main__":
    sys.exit(main())
