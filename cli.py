"""The ``alignzoo`` command line.

    alignzoo check [PRIMITIVE ...] [--device cpu|cuda]   ladder rungs 1-2 per primitive
    alignzoo check MODEL [--checkpoint DIR | --config PRESET] [--fp8] [--device D] [--length N] [--batch B]
                                                          ladder rungs 1-4 on a model's pair
    alignzoo check MODEL ... --receipt FILE.json          ... and write a parity receipt
    alignzoo receipt verify FILE.json [--device D]        re-run a receipt's check and compare
    alignzoo bisect MODEL [--against server|vendor|trainer-fp32] [--length N]
                                                          the first op where a path parts from the trainer
    alignzoo models                                       models whose pair works
    alignzoo generate MODEL --prompt "1 2 3" [...]        sample a completion (token ids, or text with a tokenizer)
    alignzoo serve MODEL [--host H] [--port P] [...]      an HTTP server with SGLang's RL API
    alignzoo serve MODEL --tp N [...]                     ... over N tensor-parallel processes (or torchrun's)

A bad argument is one line on stderr (``alignzoo: error: ...``) and exit status 2.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from .models.receipt import DTYPES

# What the library raises for input it refuses: a one-line message, exit 2.  Anything else is a bug
# and keeps its traceback.
USER_ERRORS = (ValueError, TypeError, FileNotFoundError, NotADirectoryError, NotImplementedError)


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths]), *map(line, rows)])


def _say(msg: str) -> None:
    print(f"alignzoo: {msg}", file=sys.stderr, flush=True)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


# --- argument types: argparse turns their ArgumentTypeError into "argument --x: ..." and exit 2 ------

def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {v}")
        return v
    parse.__name__ = f"integer >= {low}"
    return parse


def _seed(text: str) -> int:
    v = _at_least(0)(text)
    if v >= 2**63:
        raise argparse.ArgumentTypeError(f"must fit in int64, got {v}")
    return v


def _sampling_field(name: str, kind: type):
    """Parse one ``SamplingParams`` field and let ``SamplingParams`` itself judge its range, so the
    CLI refuses exactly what the library refuses."""
    def parse(text: str):
        from .common.sampling import SamplingParams

        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        try:
            SamplingParams(**{name: v})
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return v
    parse.__name__ = name
    return parse


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"{text!r}: alignzoo runs on cpu or cuda[:N]")
    if device.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if n == 0:
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but torch sees no CUDA device")
        if device.index is not None and device.index >= n:
            raise argparse.ArgumentTypeError(f"{text!r} asked for, but torch sees {n} CUDA device(s)")
    return device


def _checkpoint(text: str) -> str:
    if not os.path.exists(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a file; give the checkpoint's directory")
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} has no config.json: not a Hugging Face checkpoint directory")
    return text


def _prompt(text: str) -> list[int] | str:
    """Token ids ("1 2 3"), or else text (taken once the checkpoint is known to ship a tokenizer)."""
    parts = text.replace(",", " ").split()
    if not parts:
        raise argparse.ArgumentTypeError("the prompt is empty: give token ids, e.g. \"1 2 3\", or text")
    if all(t.isascii() and t.isdigit() for t in parts):
        return [int(t) for t in parts]
    return text


def _check_generate(args: argparse.Namespace) -> None:
    """Text prompts need the checkpoint's tokenizer: without one, the first word that is no token id is
    refused as a parse error."""
    from .models.text import has_tokenizer

    if has_tokenizer(args.checkpoint):
        return
    for p in args.prompt:
        if isinstance(p, str):
            bad = next(t for t in p.replace(",", " ").split() if not (t.isascii() and t.isdigit()))
            args.parser.error(f"argument --prompt: {bad!r} is not a token id: prompts are non-negative integers "
                              f"(token ids), e.g. \"1 2 3\"; text prompts need a --checkpoint with a tokenizer")


# --- commands ---------------------------------------------------------------------------------------

def _load_pair(args: argparse.Namespace, max_batch_size: int, **kw):
    import logging

    from . import load_pair

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    extra = {"fp8": True} if args.fp8 else {}
    config = None if args.checkpoint else _preset(args)
    return load_pair(args.model, checkpoint=args.checkpoint, config=config, device=args.device,
                     dtype=DTYPES[args.dtype], progress=sys.stderr.isatty(), max_batch_size=max_batch_size, **extra,
                     **kw)


def _check_length(args: argparse.Namespace, pair) -> None:
    if args.length > pair.config.max_position:
        raise ValueError(f"--length {args.length} is past the model's {pair.config.max_position} positions")


def _preset(args: argparse.Namespace) -> str:
    return "tiny" if args.config is None else args.config


def _where(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _progress(t0: float):
    """A progress callback: each step on stderr with the seconds since ``t0``."""
    return lambda s: _say(f"[{time.perf_counter() - t0:6.1f}s] {s}")


def cmd_check_model(args: argparse.Namespace) -> int:
    from .models.checks import run_ladder

    t0 = time.perf_counter()
    _say(f"building the {args.model} pair ({args.checkpoint or _preset(args)}) on {args.device}")
    pair = _load_pair(args, args.batch)
    _check_length(args, pair)
    c = pair.config
    print(f"alignzoo check {args.model} on {_where(args.device)} (torch {torch.__version__}): "
          f"{args.checkpoint or _preset(args)}, {c.num_layers} layers, hidden {c.hidden_size}, "
          f"vocab {c.vocab_size}, {args.dtype}{' + fp8' if args.fp8 else ''}; "
          f"{args.batch} sequences up to {args.length} tokens; loaded in {time.perf_counter() - t0:.1f}s", flush=True)
    started, t_check = time.time(), time.perf_counter()
    rows = run_ladder(pair, length=args.length, batch=args.batch, seed=args.seed, progress=_progress(t0))
    if args.receipt:
        from .models.receipt import make_receipt, write_receipt

        run = {"length": args.length, "batch": args.batch, "seed": args.seed, "dtype": args.dtype, "fp8": args.fp8,
               "device": str(args.device)}
        write_receipt(args.receipt, make_receipt(pair, rows, checkpoint=args.checkpoint, run=run, started=started,
                                                 seconds=time.perf_counter() - t_check))
        _say(f"receipt written to {args.receipt}")
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

    if args.targets and args.targets[0] in list_models():
        if len(args.targets) > 1:
            raise ValueError(f"check one model at a time (got {' '.join(args.targets)})")
        args.model = args.targets[0]
        return cmd_check_model(args)
    if args.receipt:
        raise ValueError("--receipt writes a model check's receipt: name a model (alignzoo check MODEL --receipt F)")
    names = args.targets or available_primitives()
    unknown = [n for n in names if n not in available_primitives()]
    if unknown:
        raise ValueError(f"unknown primitive(s) or model {', '.join(unknown)}; primitives: "
                         f"{', '.join(available_primitives())}; models: {', '.join(list_models())}")
    rows, failed = [], 0
    print(f"alignzoo check on {_where(args.device)} (torch {torch.__version__})")
    for name in tqdm(names, desc="primitives", unit="op", file=sys.stderr, disable=not sys.stderr.isatty()):
        t0 = time.perf_counter()
        results = run_primitive(name, args.device)
        dt = time.perf_counter() - t0
        for r in results:
            failed += not r.passed
            rung = {0: "acc", 1: "1", 2: "2"}.get(r.rung, str(r.rung))
            rows.append([name, rung, r.check, "PASS" if r.passed else "FAIL", r.compared, r.differing, r.detail, f"{dt:.1f}s"])
    print(_table(rows, ["primitive", "rung", "check", "result", "compared", "differing", "detail", "time"]))
    print(f"\n{len(rows) - failed}/{len(rows)} checks passed")
    return 1 if failed else 0


def cmd_bisect(args: argparse.Namespace) -> int:
    from .models.bisect import bisect

    t0 = time.perf_counter()
    _say(f"building the {args.model} pair ({args.checkpoint or _preset(args)}) on {args.device}, eager")
    pair = _load_pair(args, args.batch, cuda_graphs=False)
    _check_length(args, pair)
    reports = bisect(pair, against=args.against, length=args.length, batch=args.batch, seed=args.seed,
                     progress=_progress(t0))
    print(f"alignzoo bisect {args.model} against {args.against} on {_where(args.device)}: {args.batch} sequences "
          f"up to {args.length} tokens")
    for r in reports:
        print("\n".join(r.lines()))
    return 0 if all(r.equal for r in reports) else 1


def cmd_receipt(args: argparse.Namespace) -> int:
    from .models.receipt import verify

    t0 = time.perf_counter()
    ok, lines = verify(args.file, device=args.device, progress=_progress(t0))
    print("\n".join(lines))
    return 0 if ok else 1


def cmd_models(args: argparse.Namespace) -> int:
    from . import list_models

    names = list_models()
    print("\n".join(names) if names else "(no model pair has landed yet)")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in ("temperature", "top_k", "top_p", "min_p")
             if getattr(args, name) is not None}
    pair = _load_pair(args, len(args.prompt))
    # the checkpoint's generation_config.json under the flags given
    sp = pair.sampling_params(**given, max_new_tokens=args.max_new_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    if args.checkpoint is None:
        _say(f"note: no --checkpoint given: sampling from a {args.model} '{_preset(args)}' model with "
             f"random weights (init seed 0; sampling seed {args.seed}), so the tokens mean nothing. "
             f"Pass --checkpoint DIR for a trained model.")
    tok = pair.tokenizer
    prompts = [tok.encode(p) if isinstance(p, str) else p for p in args.prompt]
    errors = 0
    for i, (prompt, out) in enumerate(zip(prompts, pair.server.generate(prompts, sp))):
        if out.error:
            _say(f"error: prompt {i + 1}: {out.error}")
            errors += 1
            continue
        why = f"stop at {out.matched!r}" if out.finish_reason == "stop" else out.finish_reason
        print(f"prompt {prompt} -> {out.tokens}  ({why}, weight version {out.weight_version})")
        if tok is not None:
            print(f"  text {tok.decode(out.tokens, skip_special_tokens=True)!r}")
        print("  logprobs " + " ".join(f"{x:.4f}" for x in out.logprobs.tolist()))
    return 2 if errors else 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .serve.server import serve
    except ImportError as e:
        raise NotImplementedError(f"alignzoo serve needs fastapi and uvicorn ({e}): pip install 'alignzoo[serve]'") from None
    kw = dict(host=args.host, port=args.port, checkpoint=args.checkpoint,
              config=None if args.checkpoint else _preset(args), device=args.device, dtype=DTYPES[args.dtype],
              fp8=args.fp8, seed=args.seed, max_batch_size=args.max_batch_size,
              max_batch_tokens=args.max_batch_tokens, api_key=args.api_key, admin_api_key=args.admin_api_key,
              allow_unauthenticated=args.allow_unauthenticated, weights_dirs=args.weights_dir,
              served_model_name=args.served_model_name)
    if args.tp > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun's ranks take the TP path too
        from .serve.tp_launch import launch

        return launch(args.model, args.tp, timeout_s=args.tp_timeout, **kw)
    return serve(args.model, **kw)


# --- parser -----------------------------------------------------------------------------------------

def _model_args(c: argparse.ArgumentParser) -> None:
    src = c.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", type=_checkpoint, default=None, help="Hugging Face checkpoint directory")
    src.add_argument("--config", default=None, help="preset when no checkpoint is given (default tiny)")
    c.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    c.add_argument("--fp8", action="store_true", help="unified FP8 projections (FP32 masters, e4m3 128x128 blocks)")
    c.add_argument("--seed", type=_seed, default=0)
    _threads_arg(c)


def _threads_arg(c: argparse.ArgumentParser) -> None:
    c.add_argument("--threads", type=_at_least(1), default=None,
                   help="torch CPU threads (default: OMP_NUM_THREADS if set, else 1)")


def _set_threads(args: argparse.Namespace) -> None:
    # One thread unless asked: a second gains little on a tiny model, and OpenMP's spinning threads slow a busy one.
    n = args.threads or (None if os.environ.get("OMP_NUM_THREADS") else 1)
    if n and (args.device is None or args.device.type == "cpu"):
        torch.set_num_threads(n)


def parser() -> argparse.ArgumentParser:
    from . import list_models
    from .models.bisect import AGAINST

    p = _Parser(prog="alignzoo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = sub.add_parser("check", help="ladder rungs 1-2 (and accuracy) per primitive, or rungs 1-4 on a model")
    c.add_argument("targets", nargs="*", help="primitives to check (default: all), or one model name")
    c.add_argument("--device", type=_device, default=device)
    # 2 tokens at least: one prompt token and one to sample
    c.add_argument("--length", type=_at_least(2), default=1024, help="longest sequence of a model check")
    c.add_argument("--batch", type=_at_least(1), default=4, help="sequences in a model check")
    c.add_argument("--receipt", default=None, metavar="FILE.json", help="write a parity receipt (model checks)")
    _model_args(c)
    c.set_defaults(fn=cmd_check)
    b = sub.add_parser("bisect", help="the first op where the trainer and another path part, and the ops after")
    b.add_argument("model", choices=list_models())
    b.add_argument("--against", choices=AGAINST, default="server")
    b.add_argument("--device", type=_device, default=device)
    b.add_argument("--length", type=_at_least(2), default=300, help="longest sequence")
    b.add_argument("--batch", type=_at_least(1), default=3, help="sequences")
    _model_args(b)
    b.set_defaults(fn=cmd_bisect)
    r = sub.add_parser("receipt", help="verify a parity receipt by re-running its check")
    r.add_argument("action", choices=("verify",))
    r.add_argument("file", help="the receipt (alignzoo check MODEL --receipt FILE.json)")
    r.add_argument("--device", type=_device, default=None, help="re-run there instead of the receipt's device")
    _threads_arg(r)
    r.set_defaults(fn=cmd_receipt)
    g = sub.add_parser("generate", help="sample completions of prompts (token ids, or text with a tokenizer)")
    g.add_argument("model", choices=list_models())
    g.add_argument("--prompt", type=_prompt, action="append", required=True,
                   help='token ids, e.g. "1 2 3", or text when the checkpoint ships a tokenizer (repeatable)')
    g.add_argument("--device", type=_device, default=device)
    # None: the checkpoint's generation_config.json, else SamplingParams' default (1.0, off, off, off)
    g.add_argument("--temperature", type=_sampling_field("temperature", float), default=None)
    g.add_argument("--top-k", type=_sampling_field("top_k", int), default=None)
    g.add_argument("--top-p", type=_sampling_field("top_p", float), default=None)
    g.add_argument("--min-p", type=_sampling_field("min_p", float), default=None)
    g.add_argument("--max-new-tokens", type=_sampling_field("max_new_tokens", int), default=16)
    g.add_argument("--ignore-eos", action="store_true", help="run past the model's EOS ids to --max-new-tokens")
    _model_args(g)
    g.set_defaults(fn=cmd_generate, post_parse=_check_generate, parser=g)
    from .serve import host_arg, port_arg

    sv = sub.add_parser("serve", help="serve a model over HTTP with SGLang's RL API (/generate, weight updates)")
    sv.add_argument("model", choices=list_models())
    sv.add_argument("--device", type=_device, default=device)
    sv.add_argument("--host", type=host_arg, default="127.0.0.1", help="address to bind (default: loopback only)")
    sv.add_argument("--port", type=port_arg, default=30000)
    sv.add_argument("--max-batch-size", type=_at_least(1), default=256, help="requests in one engine step")
    sv.add_argument("--max-batch-tokens", type=_at_least(1), default=8192, help="tokens in one engine step")
    sv.add_argument("--api-key", default=None,
                    help="every route then needs 'Authorization: Bearer KEY' (default: $ALIGNZOO_API_KEY; the "
                         "environment keeps it out of the process list)")
    sv.add_argument("--admin-api-key", default=None,
                    help="the only key that opens weight updates and control routes (default: "
                         "$ALIGNZOO_ADMIN_API_KEY)")
    sv.add_argument("--allow-unauthenticated", action="store_true",
                    help="bind beyond loopback without an API key (refused otherwise)")
    sv.add_argument("--weights-dir", action="append", default=None, metavar="DIR",
                    help="a directory /update_weights_from_disk may read under (repeatable; default: the "
                         "checkpoint's parent directory, none for a preset)")
    sv.add_argument("--served-model-name", default=None,
                    help="the model's id in the OpenAI API (default: the checkpoint path, or the model name)")
    sv.add_argument("--tp", type=_at_least(1), default=1,
                    help="tensor-parallel degree: N processes (or torchrun's), each holding its shards of the "
                         "weights by the model's tp_plan, rank 0 serving HTTP; same rows, bit for bit. Gloo on the "
                         "CPU, nccl on CUDA. Weight updates are refused under --tp > 1 (default 1: one process)")
    sv.add_argument("--tp-timeout", type=_at_least(1), default=60, metavar="SECONDS",
                    help="how long any --tp collective waits for a rank before the server fails its requests "
                         "and exits 1 (default 60)")
    _model_args(sv)
    sv.set_defaults(fn=cmd_serve)
    m = sub.add_parser("models", help="list the models whose aligned pair works")
    m.set_defaults(fn=cmd_models)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (argparse's own errors and --help included)."""
    try:
        args = parser().parse_args(argv)
        if hasattr(args, "post_parse"):
            args.post_parse(args)
    except SystemExit as e:
        return 0 if e.code is None else e.code if isinstance(e.code, int) else 2
    threads = torch.get_num_threads()
    try:
        if hasattr(args, "device"):
            _set_threads(args)
        return args.fn(args)
    except USER_ERRORS as e:
        _say("error: " + " ".join(str(e).split("\n")))
        return 2
    finally:
        torch.set_num_threads(threads)  # an in-process caller (a test) keeps its own setting


if __name__ == "__main__":
    sys.exit(main())
