"""RL on glm5_sparse_fp8 (GLM-5: MLA over the positions a DSA indexer selects,
sigmoid-routed MoE, FP8 block experts) with K3 == 0 on every token of every
step: the qwen3 example's task, objectives and rollouts (``examples/qwen3_rl.py``)
on the zoo's third model, tiny preset by default.  The digits default to 32, so
a prompt (34 tokens) already outnumbers the tiny preset's top-32 selection:
every sampled token's query attends to the 32 positions the indexer picks out
of more, on the server (paged) and in the trainer (packed) alike.  Before each
update the trainer's FP32 log-probs must equal the sampler's bit for bit.

Three ways to train:
  (default)      every weight, in --dtype
  --lora R       adapters on MLA's q_a, q_b, kv_a and o projections of a frozen
                 base (--lora-mode merged|separate|multi); the experts take none yet
  --fp8          every weight, unified FP8: q_a, q_b, kv_a, o, the dense MLP and
                 every expert are FP32 masters quantized to e4m3 codes (128x128
                 blocks) once per optimizer step, and the trainer's and the
                 server's forwards both read those codes (kv_b, the indexer,
                 norms, router and embeddings stay in --dtype); each sync ships
                 only the blocks that changed

    python examples/glm5_sparse_fp8_rl.py                 # ~45 s on 2 CPU cores
    python examples/glm5_sparse_fp8_rl.py --fp8
    python examples/glm5_sparse_fp8_rl.py --lora 8 --lora-mode separate
    python examples/glm5_sparse_fp8_rl.py --unaligned     # torch's kernels serve: K3 > 0 is logged
Prints one line per step (reward, K3, the blocks and bytes the sync shipped) and
writes OUT/log.jsonl and OUT/rl.png.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import qwen3_rl  # noqa: E402
from rl_common import add_rl_arguments, add_run_arguments, finish, run_steps, seeded  # noqa: E402

import alignzoo  # noqa: E402

MODEL = "glm5_sparse_fp8"


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rl_arguments(ap, steps=8, groups=4, group_size=4)
    ap.set_defaults(digits=32)
    ap.add_argument("--stream", action="store_true", help="forward/backward group by group as groups complete")
    ap.add_argument("--unaligned", action="store_true",
                    help="serve with torch's kernels (serve_vendor.py): K3 > 0 is logged, not fatal")
    ap.add_argument("--fp8", action="store_true",
                    help="full-weight unified FP8 training: FP32 masters, every forward reads their FP8 codes")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="train LoRA adapters of rank R (lora_alpha 2R) on MLA's projections of a frozen base; 0: off")
    ap.add_argument("--lora-mode", choices=("merged", "separate", "multi"), default="merged",
                    help="with --lora: merged: W + s·B·A is what the trainer reads and the sync ships; separate: "
                         "base + branch; multi: two adapters (tasks reverse and copy) on one frozen base")
    ap.add_argument("--config", default=None, metavar="PRESET",
                    help="a glm5_sparse_fp8 preset (e.g. glm-5-h200): its shapes and vocabulary instead of the tiny "
                         "preset cut to the task's 16 tokens")
    add_run_arguments(ap, out=f"runs/{MODEL}_rl")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    if args.fp8 and args.lora:
        ap.error("--fp8 trains every weight; LoRA on an FP8 base is not supported yet (drop --fp8 or --lora)")
    return args


def build_pair(args):
    cfg = args.config or {"vocab_size": qwen3_rl.VOCAB, "max_position": max(64, 2 * args.digits + 3)}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    kw = {}
    lora = {"r": args.lora, "lora_alpha": 2 * args.lora, "target_modules": "all-linear"}
    if qwen3_rl.multi_lora(args):
        kw["lora_adapters"] = {t: lora for t in qwen3_rl.TASKS}
    elif args.lora:
        kw |= dict(lora=lora, lora_mode=args.lora_mode)
    return alignzoo.load_pair(MODEL, config=cfg, device=args.device, dtype=dtype, seed=args.seed, fp8=args.fp8,
                              server_kernels="vendor" if args.unaligned else "aligned", **kw)


def mode_of(args) -> str:
    kernels = "unaligned (torch's kernels serve)" if args.unaligned else "aligned"
    if args.fp8:
        return f"{kernels}, full-weight unified FP8"
    if args.lora:
        return f"{kernels}, LoRA r={args.lora} {args.lora_mode} on MLA's projections"
    return f"{kernels}, full-weight {args.dtype}"


def main(argv=None) -> int:
    args = parse(argv)
    g = seeded(args)
    pair = build_pair(args)
    task = "/".join(qwen3_rl.TASKS) if qwen3_rl.multi_lora(args) else "reverse"
    log = run_steps(pair, args, g, f"{MODEL} {args.config or 'tiny'} RL: {task} {args.digits} digits (prompts of "
                    f"{args.digits + 2} tokens, top-{pair.config.index_topk} selection); {args.prompts} prompts x "
                    f"{args.group_size} samples per step; {args.objective}; {mode_of(args)}; "
                    f"{'streaming' if args.stream else 'one batch'}", qwen3_rl.train_step)
    if not args.no_plot:
        path = os.path.join(args.out, "rl.png")
        qwen3_rl.plot(log, path, f"{MODEL} {args.config or 'tiny'}, {task} {args.digits} digits, {args.objective}, "
                                 f"{mode_of(args)}")
        print(f"plot: {path}")
    same = pair.weights_match()
    code = finish(log, same, None)
    return int(not same) if args.unaligned else code  # unaligned: differing tokens are the point


if __name__ == "__main__":
    sys.exit(main())
