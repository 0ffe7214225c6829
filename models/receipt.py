"""Parity receipts: what ``alignzoo check MODEL`` compared, where, and with
what result, in a JSON file a user can keep; ``verify`` re-runs it.

Schema (``alignzoo.receipt/1``; every field always present):

  model          registry name
  checkpoint     null (random init) or {"path", "sha256"}: the digest of the
                 directory's config.json and *.safetensors, names and bytes
  config         the model's config as transformers' config.json dict
  run            {"length", "batch", "seed", "dtype", "fp8", "device"}: the
                 arguments a re-run needs
  environment    {"gpu" (name or null), "torch", "triton", "python", "commit"}
  rungs          [{"rung", "check", "passed", "tokens", "differing",
                   "max_abs_logprob", "k3_max", "scored_lengths"}]: one per
                 check, ``scored_lengths`` the tokens scored per sequence
  passed         every rung passed
  started        UTC time, ISO 8601; seconds: the check's wall time
  digest         sha256 of the canonical JSON of every other field: an
                 edited receipt no longer matches its digest
"""
from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import subprocess
import time

import torch

SCHEMA = "alignzoo.receipt/1"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
RESULT_FIELDS = ("passed", "tokens", "differing", "max_abs_logprob", "k3_max", "scored_lengths")


def _canonical(d: dict) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), allow_nan=True).encode()


def digest(receipt: dict) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in receipt.items() if k != "digest"})).hexdigest()


def checkpoint_sha256(directory) -> str:
    """sha256 over config.json and the *.safetensors files, names and bytes, in name order."""
    h = hashlib.sha256()
    names = sorted(n for n in os.listdir(directory) if n == "config.json" or n.endswith(".safetensors"))
    for n in names:
        h.update(n.encode() + b"\0")
        with open(os.path.join(directory, n), "rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
    return h.hexdigest()


def _commit() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
        if out.returncode == 0:
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return os.environ.get("ALIGNZOO_COMMIT", "unknown")


def environment(device) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.device(device)
    return {"gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "torch": torch.__version__,
            "triton": triton_version, "python": platform.python_version(), "commit": _commit()}


def rung_dict(r) -> dict:
    return {"rung": r.rung, "check": r.check, "passed": bool(r.passed), "tokens": r.compared,
            "differing": r.differing, "max_abs_logprob": r.extra["max_abs"], "k3_max": r.extra["k3_max"],
            "scored_lengths": r.extra.get("scored_lengths", [])}


def make_receipt(pair, rows, *, checkpoint, run: dict, started: float, seconds: float) -> dict:
    r = {
        "schema": SCHEMA,
        "model": pair.name,
        "checkpoint": None if checkpoint is None else {"path": os.path.abspath(os.fspath(checkpoint)),
                                                       "sha256": checkpoint_sha256(checkpoint)},
        "config": pair.config.to_hf({"bf16": "bfloat16", "fp32": "float32"}[run["dtype"]]),
        "run": run,
        "environment": environment(run["device"]),
        "rungs": [rung_dict(x) for x in rows],
        "passed": all(x.passed for x in rows),
        "started": datetime.datetime.fromtimestamp(started, datetime.timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(seconds, 3),
    }
    r["digest"] = digest(r)
    return r


def write_receipt(path, receipt: dict) -> None:
    with open(path, "w") as f:
        json.dump(receipt, f, indent=2, sort_keys=True)
        f.write("\n")


class ReceiptError(ValueError):
    """A receipt that cannot be verified: unreadable, another schema, or edited."""


def read_receipt(path) -> dict:
    try:
        with open(path) as f:
            r = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, json.JSONDecodeError) as e:
        raise ReceiptError(f"{os.fspath(path)!r} is not a readable receipt: {e}") from None
    if not isinstance(r, dict) or r.get("schema") != SCHEMA:
        raise ReceiptError(f"{os.fspath(path)!r} is not an {SCHEMA} receipt (schema {r.get('schema') if isinstance(r, dict) else None!r})")
    if r.get("digest") != digest(r):
        raise ReceiptError(f"{os.fspath(path)!r} was edited after it was written: its contents no longer match its "
                           f"digest {str(r.get('digest'))[:16]}...")
    return r


def run_check(model: str, *, checkpoint, config, run: dict, progress=None):
    """Build the pair a receipt names and climb the ladder: (pair, rows, started, seconds)."""
    import alignzoo
    from .checks import run_ladder

    started = time.time()
    t0 = time.perf_counter()
    dtype = DTYPES.get(run["dtype"])
    if dtype is None:
        raise ReceiptError(f"the receipt's dtype {run['dtype']!r} is none of {', '.join(DTYPES)}")
    kw = dict(checkpoint=checkpoint) if checkpoint is not None else dict(config=config)
    pair = alignzoo.load_pair(model, device=run["device"], dtype=dtype, fp8=run["fp8"], seed=run["seed"],
                              max_batch_size=run["batch"], **kw)
    rows = run_ladder(pair, length=run["length"], batch=run["batch"], seed=run["seed"], progress=progress)
    return pair, rows, started, time.perf_counter() - t0


def verify(path, *, device=None, progress=None) -> tuple[bool, list[str]]:
    """Re-run a receipt's check (on its device, or ``device``) and compare
    every rung's result; -> (all the same, one line per finding)."""
    r = read_receipt(path)
    lines = []
    ck = r["checkpoint"]
    if ck is not None:
        if not os.path.isdir(ck["path"]):
            raise FileNotFoundError(f"the receipt's checkpoint directory {ck['path']!r} does not exist")
        if checkpoint_sha256(ck["path"]) != ck["sha256"]:
            return False, [f"checkpoint {ck['path']!r} changed since the receipt was written (sha256 differs)"]
    run = dict(r["run"])
    if device is not None:
        run["device"] = str(device)
    _, rows, _, seconds = run_check(r["model"], checkpoint=None if ck is None else ck["path"], config=r["config"],
                                    run=run, progress=progress)
    env = environment(run["device"])
    if env["gpu"] != r["environment"]["gpu"]:
        lines.append(f"note: the receipt ran on {r['environment']['gpu'] or 'the CPU'}, this re-run on "
                     f"{env['gpu'] or 'the CPU'}")
    got = [rung_dict(x) for x in rows]
    same = len(got) == len(r["rungs"])
    if not same:
        lines.append(f"the receipt has {len(r['rungs'])} rungs, the re-run {len(got)}")
    for want, have in zip(r["rungs"], got):
        diff = [f"{k} {want[k]!r} -> {have[k]!r}" for k in RESULT_FIELDS if want[k] != have[k]]
        if want["check"] != have["check"] or diff:
            same = False
            lines.append(f"rung {want['rung']} '{want['check']}': " + ("; ".join(diff) or f"now '{have['check']}'"))
        else:
            lines.append(f"rung {want['rung']} '{want['check']}': same ({have['tokens']} tokens, "
                         f"{have['differing']} differing)")
    lines.append(f"{'verified' if same else 'NOT verified'}: re-run in {seconds:.1f}s")
    return same, lines
