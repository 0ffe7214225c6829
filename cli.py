"""The ``alignzoo`` command line.

    alignzoo check [PRIMITIVE ...] [--device cpu|cuda]   ladder rungs 1-2 per primitive
    alignzoo check MODEL [--checkpoint DIR | --config PRESET] [--fp8] [--device D] [--length N] [--batch B]
                                                          ladder rungs 1-4 on a model's pair
    alignzoo models                                       models whose pair works
    alignzoo generate MODEL --prompt "1 2 3" [...]        sample a completion (token ids)
"""
from __future__ import annotations

import argparse
import sys
import time

import torch


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _device(name: str) -> torch.device | None:
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return None
    return device


def _load_pair(args: argparse.Namespace, device: torch.device, max_batch_size: int):
    import logging

    from . import load_pair

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    extra = {"fp8": True} if args.fp8 else {}
    return load_pair(args.model, checkpoint=args.checkpoint, config=None if args.checkpoint else args.config,
                     device=device, dtype=dtype, progress=sys.stderr.isatty(), max_batch_size=max_batch_size, **extra)


def cmd_check_model(args: argparse.Namespace, device: torch.device) -> int:
    from tqdm import tqdm

    from .models.checks import run_ladder

    t0 = time.perf_counter()
    pair = _load_pair(args, device, args.batch)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    c = pair.config
    print(f"alignzoo check {args.model} on {where} (torch {torch.__version__}): {args.checkpoint or args.config}, "
          f"{c.num_layers} layers, hidden {c.hidden_size}, vocab {c.vocab_size}, {args.dtype}{' + fp8' if args.fp8 else ''}; "
          f"{args.batch} sequences up to {args.length} tokens; loaded in {time.perf_counter() - t0:.1f}s")
    bar = tqdm(total=4, desc="rungs", file=sys.stderr, disable=not sys.stderr.isatty())
    rows = run_ladder(pair, length=args.length, batch=args.batch, seed=args.seed,
                      progress=lambda s: (bar.set_description(s), bar.update(s.startswith("rung") and s[5] != "1")))
    bar.close()
    table = [[r.rung, r.check, "PASS" if r.passed else "FAIL", r.compared, r.differing,
              f"{r.extra['max_abs']:.3g}", f"{r.extra['k3_max']:.3g}"] for r in rows]
    print(_table(table, ["rung", "check", "result", "tokens", "differing", "max|d|", "K3 max"]))
    failed = sum(not r.passed for r in rows)
    print(f"\n{len(rows) - failed}/{len(rows)} checks passed in {time.perf_counter() - t0:.1f}s")
    return 1 if failed else 0


def cmd_check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from . import list_models
    from .common.checks import available_primitives, run_primitive

    device = _device(args.device)
    if device is None:
        return 2
    if args.targets and args.targets[0] in list_models():
        if len(args.targets) > 1:
            print("error: check one model at a time", file=sys.stderr)
            return 2
        args.model = args.targets[0]
        return cmd_check_model(args, device)
    names = args.targets or available_primitives()
    unknown = [n for n in names if n not in available_primitives()]
    if unknown:
        print(f"error: unknown primitive(s) {', '.join(unknown)}; known: {', '.join(available_primitives())}; "
              f"models: {', '.join(list_models())}", file=sys.stderr)
        return 2
    rows, failed = [], 0
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"alignzoo check on {where} (torch {torch.__version__})")
    for name in tqdm(names, desc="primitives", unit="op", file=sys.stderr, disable=not sys.stderr.isatty()):
        t0 = time.perf_counter()
        results = run_primitive(name, device)
        dt = time.perf_counter() - t0
        for r in results:
            failed += not r.passed
            rung = {0: "acc", 1: "1", 2: "2"}.get(r.rung, str(r.rung))
            rows.append([name, rung, r.check, "PASS" if r.passed else "FAIL", r.compared, r.differing, r.detail, f"{dt:.1f}s"])
    print(_table(rows, ["primitive", "rung", "check", "result", "compared", "differing", "detail", "time"]))
    print(f"\n{len(rows) - failed}/{len(rows)} checks passed")
    return 1 if failed else 0


def cmd_models(args: argparse.Namespace) -> int:
    from . import list_models

    names = list_models()
    print("\n".join(names) if names else "(no model pair has landed yet)")
    return 0


def _ids(text: str) -> list[int]:
    return [int(t) for t in text.replace(",", " ").split()]


def cmd_generate(args: argparse.Namespace) -> int:
    from .common.sampling import SamplingParams

    device = _device(args.device)
    if device is None:
        return 2
    pair = _load_pair(args, device, len(args.prompt))
    sp = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                        max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompts = [_ids(p) for p in args.prompt]
    for prompt, out in zip(prompts, pair.server.generate(prompts, sp)):
        if out.error:
            print(f"error: {out.error}", file=sys.stderr)
            continue
        print(f"prompt {prompt} -> {out.tokens}  ({out.finish_reason}, weight version {out.weight_version})")
        print("  logprobs " + " ".join(f"{x:.4f}" for x in out.logprobs.tolist()))
    return 0


def _model_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--checkpoint", default=None, help="Hugging Face checkpoint directory")
    c.add_argument("--config", default="tiny", help="preset when no checkpoint is given (default tiny)")
    c.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    c.add_argument("--fp8", action="store_true", help="unified FP8 projections (FP32 masters, e4m3 128x128 blocks)")
    c.add_argument("--seed", type=int, default=0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="alignzoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = sub.add_parser("check", help="ladder rungs 1-2 (and accuracy) per primitive, or rungs 1-4 on a model")
    c.add_argument("targets", nargs="*", help="primitives to check (default: all), or one model name")
    c.add_argument("--device", default=device)
    c.add_argument("--length", type=int, default=1024, help="longest sequence of a model check")
    c.add_argument("--batch", type=int, default=4, help="sequences in a model check")
    _model_args(c)
    c.set_defaults(fn=cmd_check)
    g = sub.add_parser("generate", help="sample completions of token-id prompts")
    g.add_argument("model")
    g.add_argument("--prompt", action="append", required=True, help='token ids, e.g. "1 2 3" (repeatable)')
    g.add_argument("--device", default=device)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-new-tokens", type=int, default=16)
    _model_args(g)
    g.set_defaults(fn=cmd_generate)
    m = sub.add_parser("models", help="list the models whose aligned pair works")
    m.set_defaults(fn=cmd_models)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
