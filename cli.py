"""The ``alignzoo`` command line.

    alignzoo check [PRIMITIVE ...] [--device cpu|cuda]   ladder rungs 1-2 per primitive
    alignzoo models                                       models whose pair works
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


def cmd_check(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .common.checks import available_primitives, run_primitive

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda asked for, but torch sees no CUDA device", file=sys.stderr)
        return 2
    names = args.targets or available_primitives()
    unknown = [n for n in names if n not in available_primitives()]
    if unknown:
        print(f"error: unknown primitive(s) {', '.join(unknown)}; known: {', '.join(available_primitives())}", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="alignzoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check", help="run ladder rungs 1-2 (and accuracy) for every primitive")
    c.add_argument("targets", nargs="*", help="primitives to check (default: all)")
    c.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    c.set_defaults(fn=cmd_check)
    m = sub.add_parser("models", help="list the models whose aligned pair works")
    m.set_defaults(fn=cmd_models)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
