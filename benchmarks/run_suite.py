"""The performance suite in one command: every speed the project reports, aligned against vendor
(kernels against their vendor ops, the engine against the same engine on torch's kernels, the
trainer against transformers), each aligned configuration's bits checked before it is timed, written to
docs/PERFORMANCE.md and DIR/results.json.

    . benchmarks/gpu_env.sh && python benchmarks/run_suite.py --out DIR [--budget-s 460]
    python benchmarks/run_suite.py --device cpu --out DIR   # tiny shapes: the code paths, not speeds

Steps, in this order; each runs in child processes with a time limit (a
compile stuck in ptxas cannot eat the call) and reports its rows as it goes.
results.json, PERFORMANCE.md and log.txt in --out, and --doc, are rewritten
after every step, so a run cut short keeps what it measured.

  env      GPU, versions, device copy bandwidth (read + write bytes of a 2 GiB
           torch copy / time)
  warm     Triton compilation in --warm-jobs parallel processes: each kernel
           benchmark's exactness check per M, untimed, and a one-layer model
           of the engine's shapes (same kernels, same specializations) running
           each batch size, each decode-graph bucket and the alignment check.
           The timed steps then load kernels from Triton's disk cache.
  engine   the aligned engine: first the alignment check of that very
           configuration (models.checks.run_ladder, what ``alignzoo check
           qwen3 --device cuda --config C`` runs); only if every rung is
           bitwise exact, prefill and decode tok/s per batch
           (bench_engine.measure), CUDA graphs on unless --cuda-graphs off
           (the CPU smoke default).  Otherwise no speed: 'not
           exact' (or 'not checked' when the check did not finish).
  vendor   the same engine on torch's kernels (server_kernels="vendor"): the
           baseline, not aligned by design, so not checked.
  kernels  each primitive against its vendor op at Qwen3-8B shapes
           (bench_primitives: rows bitwise checked before timing), one process
           per op.
  trainer  the trainer's forward + backward of chosen-token log-probs against
           transformers (sdpa, eager, bf16) and transformers + Liger on the
           same weights and tokens (bench_trainer), one process per shape
           (--trainer-shapes), each side's tok/s and peak memory.

Ratios are speeds, aligned : vendor (vendor ms / aligned ms; aligned tok/s /
vendor tok/s): >= 1 means aligned is as fast or faster.  Targets: matmul
>= 0.95, the other kernels >= 0.9, engine decode >= 0.97, prefill >= 0.9,
batch-1 decode step >= 0.85 of the bandwidth bound (weights and KV read per
step / copy bandwidth), trainer >= 1.0 of transformers.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
import bench_primitives as bp  # noqa: E402

STEPS = ("env", "warm", "engine", "vendor", "kernels", "trainer")
OPS = ("matmul", "rmsnorm", "rope", "swiglu", "lm_head", "sampling")
KERNEL_TARGETS = {"matmul": 0.95}
KERNEL_TARGET = 0.9
DECODE_TARGET, PREFILL_TARGET, BANDWIDTH_TARGET, TRAINER_TARGET = 0.97, 0.9, 0.85, 1.0
SAMPLING_MAX_M = 1024  # bench_sampling times M <= 1024 only
COPY_BYTES = 2 << 30


# ---------------------------------------------------------------- report (pure)
def kernel_target(op: str) -> float:
    return KERNEL_TARGETS.get(op, KERNEL_TARGET)


def verdict(ratio: float | None, target: float) -> str:
    """'1.02x met' / '0.93x missed' / '—' (not measured)."""
    if ratio is None or ratio != ratio:
        return "—"
    return f"{ratio:.2f}x {'met' if ratio >= target else 'missed'}"


def engine_gate(results: dict) -> str | None:
    """None when the aligned engine's check passed (its speeds may be shown),
    else the text shown instead of every aligned engine speed."""
    check = results.get("engine", {}).get("check") or {}
    if check.get("passed") is True:
        return None
    return "not exact" if check.get("passed") is False else "not checked"


def _engine_rows(results: dict, side: str) -> dict[int, dict]:
    return {r["batch"]: r for r in results.get("engine", {}).get(side, {}).get("rows", [])}


def bandwidth_bound(results: dict) -> dict | None:
    """Batch-1 decode: bound ms = (weight bytes + KV bytes at the mean
    context) / copy bandwidth, and bound / measured step per side."""
    eng, env = results.get("engine", {}), results.get("env", {})
    wb, bw = eng.get("weight_bytes"), env.get("copy_gbps")
    if not wb or not bw:
        return None
    ctx = eng.get("prompt", 0) + eng.get("new", 0) / 2
    kv = eng.get("kv_bytes_per_token", 0) * ctx
    bound_ms = (wb + kv) / (bw * 1e9) * 1e3
    out = {"weight_bytes": wb, "kv_bytes": kv, "copy_gbps": bw, "bound_ms": bound_ms}
    for side in ("aligned", "vendor"):
        r = _engine_rows(results, side).get(1)
        out[side + "_step_ms"] = r["decode_step_ms"] if r else None
        out[side + "_ratio"] = bound_ms / r["decode_step_ms"] if r else None
    return out


def _ms(v) -> str:
    return "—" if v is None or v != v else f"{v:.4f}"


def _tok(v) -> str:
    return "—" if v is None else f"{v:,.0f}"


def render(results: dict) -> str:
    """The markdown page of a results dict (any section may be missing)."""
    m = results.get("meta", {})
    L = [f"# Performance: aligned against vendor kernels ({m.get('gpu', '?')})", "", *_render_note(results),
         f"{m.get('date', '?')} · commit `{m.get('commit', '?')}` · torch {m.get('torch', '?')} · "
         f"triton {m.get('triton', '?')} · CUDA {m.get('cuda', '?')}", "",
         f"Command: `{m.get('command', '?')}`", ""]
    earlier = m.get("merged_from")
    if earlier:
        L += [f"Merged with an earlier run in `{earlier.get('file', '?')}` ({earlier.get('date', '?')}, commit "
              f"`{earlier.get('commit', '?')}`, `{earlier.get('command', '?')}`): the steps this run did not repeat "
              "are that run's.", ""]
    steps = results.get("steps", {})
    if steps:
        L.append(f"Ran {m.get('elapsed_s', 0):.0f} s of a {m.get('budget_s', 0):.0f} s budget; steps: " + " · ".join(
            f"{k} {v['status']}" + (f" ({v['seconds']:.0f} s)" if v.get("seconds") is not None else "")
            for k, v in steps.items()) + ".")
        L.append("")
    L += ["Ratios are speeds, aligned : vendor (vendor time / aligned time; aligned tok/s / vendor tok/s): "
          "≥ 1.00 means aligned is as fast or faster. No speed is shown for a configuration whose bits were not "
          "checked exact: 'not exact' where the check failed, 'not checked' where it did not finish.", ""]
    L += _render_engine(results) + _render_kernels(results) + _render_trainer(results)
    return "\n".join(L).rstrip() + "\n"


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + ("," if len(parts) > 2 else "") + " and " + parts[-1]


def _render_note(results: dict) -> list[str]:
    """The page's opening note: what it measured, at which commits, and what the dated reports time instead,
    from the sections present (a rerun writes it again rather than losing it)."""
    m = results.get("meta", {})
    merged = bool(m.get("merged_from"))
    eng = results.get("engine")
    trainer = sorted({r["config"] for r in results.get("trainer", {}).get("rows") or []})
    trained = {c.split("/")[0] if "/" in c else "qwen3" for c in trainer}  # a bare preset is qwen3's
    covered = []
    if eng:
        covered.append(f"the {eng.get('config', '?')} engine")
    if results.get("kernels"):
        covered.append("the kernels at Qwen3-8B shapes")
    covers = [_and(covered) + ", each against the same work on torch's kernels"] if covered else []
    if trainer:
        covers.append(f"the trainer ({', '.join(trainer)}) against transformers")
    elsewhere = ["qwen3's trainer"] if "qwen3" not in trained else []
    elsewhere += ["qwen35_gdn's engine" + ("" if "qwen35_gdn" in trained else " and trainer"), "the MoE experts"]
    models = trained | {"qwen3"}
    note = (f"> What this page is: the output of `benchmarks/run_suite.py` on one "
            f"{m.get('gpu', '?').removeprefix('NVIDIA ')} (a new run on a GPU rewrites it, this note included): one run "
            "at the commit named below" + (", with the steps it did not repeat taken from the earlier run it names"
                                           if merged else "") + ".")
    if covers:
        note += f" It covers {'qwen3 only' if models == {'qwen3'} else _and(sorted(models))}: {'; '.join(covers)}."
    note += (f" Its figures measure the code at {'those commits' if merged else 'that commit'}; later code is not "
             f"re-measured here. {_and(elsewhere)} are timed in the dated reports indexed in "
             "[benchmarks/results/](../benchmarks/results/README.md), each with its commit and command.")
    return [note, ""]


def _render_engine(results: dict) -> list[str]:
    eng = results.get("engine")
    if not eng:
        return []
    overlap = {True: ", decode launched ahead (overlap) in both engines", False: ", overlap off"}.get(eng.get("overlap"), "")
    L = [f"## Engine: {eng.get('config', '?')} (qwen3, random weights), max_position {eng.get('max_position', '?')}, "
         f"CUDA graphs {eng.get('cuda_graphs', '?')}{overlap}", "",
         f"Prompts of {eng.get('prompt', '?')} tokens, {eng.get('new', '?')} new tokens each (temperature 1, "
         "top-p 0.95). Prefill tok/s: prompt tokens / time of a max_new_tokens=1 run (the median of 5 runs "
         "while batch × prompt ≤ 4096 tokens, of 3 up to 8192); decode tok/s: generated tokens / (full run − "
         "that prefill time).", ""]
    check = eng.get("check")
    if check:
        rows = check.get("rows", [])
        failed = [r for r in rows if not r["passed"]]
        head = {True: "**bitwise exact**", False: "**FAILED**", None: "**did not finish**"}[check.get("passed")]
        error = f"; {check['error']}" if check.get("error") else ""
        L.append(f"Alignment check of the aligned engine (models.checks.run_ladder, {check.get('batch', '?')} "
                 f"sequences up to {check.get('length', '?')} tokens): {head}, "
                 f"{len(rows) - len(failed)}/{len(rows)} rungs passed{error}.")
        for r in failed:
            L.append(f"- rung {r['rung']} {r['check']}: {r['differing']} of {r['compared']} tokens differ")
        L.append("")
    gate = engine_gate(results)
    al, ve = _engine_rows(results, "aligned"), _engine_rows(results, "vendor")
    batches = sorted(set(eng.get("batches", [])) | set(al) | set(ve))
    L += [f"| batch | prefill tok/s aligned | vendor | ratio (≥ {PREFILL_TARGET}) | decode tok/s aligned | vendor | "
          f"ratio (≥ {DECODE_TARGET}) | decode step ms aligned | vendor |", "|---|---|---|---|---|---|---|---|---|"]
    for b in batches:
        a, v = al.get(b), ve.get(b)
        if gate:
            ap = ad = astep = pr = dr = gate
        else:
            ap, ad = _tok(a and a["prefill_tok_s"]), _tok(a and a["decode_tok_s"])
            astep = _ms(a and a["decode_step_ms"])
            pr = verdict(a["prefill_tok_s"] / v["prefill_tok_s"] if a and v else None, PREFILL_TARGET)
            dr = verdict(a["decode_tok_s"] / v["decode_tok_s"] if a and v else None, DECODE_TARGET)
        L.append(f"| {b} | {ap} | {_tok(v and v['prefill_tok_s'])} | {pr} | {ad} | {_tok(v and v['decode_tok_s'])} | "
                 f"{dr} | {astep} | {_ms(v and v['decode_step_ms'])} |")
    L += ["", "The vendor engine is the same engine and weights on torch's kernels (`serve_vendor.py`: F.linear, "
          "torch RMSNorm/RoPE/SwiGLU ops, and torch's fast attention paths from `common/attention/vendor.py`: "
          "flash varlen over the packed prefill, compiled flex_attention over the paged cache in decode, reading "
          "only each sequence's pages), captured in CUDA graphs and launched ahead like the aligned one.", ""]
    bb = bandwidth_bound(results)
    if bb:
        L += ["### Batch-1 decode against the bandwidth bound", "",
              f"Bytes read per step: weights {bb['weight_bytes'] / 1e9:.2f} GB (all but an untied embedding table) "
              f"+ KV {bb['kv_bytes'] / 1e6:.1f} MB at the mean context; device copy bandwidth "
              f"{bb['copy_gbps']:.0f} GB/s → bound {bb['bound_ms']:.3f} ms per step.", "",
              f"| server | decode step ms | bound / step (target ≥ {BANDWIDTH_TARGET} for aligned) |", "|---|---|---|",
              "| aligned | " + (f"{gate} | {gate} |" if gate else
                               f"{_ms(bb['aligned_step_ms'])} | {verdict(bb['aligned_ratio'], BANDWIDTH_TARGET)} |"),
              f"| vendor | {_ms(bb['vendor_step_ms'])} | "
              + ("—" if bb["vendor_ratio"] is None else f"{bb['vendor_ratio']:.2f}x") + " |", ""]
    return L


def _render_trainer(results: dict) -> list[str]:
    rows = results.get("trainer", {}).get("rows")
    if not rows:
        return []
    from bench_trainer import render as trainer_table

    return ["## Trainer: forward + backward of chosen-token log-probs", "",
            "Packed aligned trainer against transformers' class of the model (`Qwen3ForCausalLM`, "
            "`Qwen3_5MoeForCausalLM`; sdpa, eager, bf16) on the same "
            "weights and tokens, and the same with Liger's kernels (`benchmarks/bench_trainer.py` says what each "
            f"side computes). Target: aligned >= {TRAINER_TARGET:.2f}x hf, peak memory no higher.", "",
            trainer_table(rows), ""]


def _kernel_cell(r: dict | None) -> str:
    if r is None:
        return "—"
    if not r.get("exact"):
        return "not exact"
    return verdict(r.get("ratio"), kernel_target(r["op"]))


def _render_kernels(results: dict) -> list[str]:
    rows = results.get("kernels")
    if not rows:
        return []
    ms = sorted({r["M"] for r in rows})
    groups: dict[tuple, dict[int, dict]] = {}
    for r in rows:
        groups.setdefault((r["op"], r["shape"]), {})[r["M"]] = r
    met = sum(1 for r in rows if r.get("exact") and r.get("ratio") and r["ratio"] >= kernel_target(r["op"]))
    inexact = sum(1 for r in rows if not r.get("exact"))
    shapes = results.get("kernel_shapes", {})
    L = [f"## Kernels at Qwen3-8B shapes (hidden {shapes.get('hidden', '?')}, intermediate "
         f"{shapes.get('intermediate', '?')}, vocab {shapes.get('vocab', '?')})", "",
         f"{met} of {len(rows)} rows meet their target (matmul ≥ {kernel_target('matmul')}, others ≥ {KERNEL_TARGET}); "
         f"{inexact} not exact. Bits: each M's rows computed alone equal the same rows of the M = {max(ms)} batch "
         "(torch.equal), checked before timing; matmul rows both with the eager defaults and inside "
         "`graph_launches()` (where 128-row tiles up to 192 wide run the Gluon kernel), which is how they are "
         "timed. Times: " + results.get("kernel_timing", "triton do_bench median, L2 flushed")
         + ".", "",
         "| op | shape | target | " + " | ".join(f"M={m}" for m in ms) + " |", "|---|---|---|" + "---|" * len(ms)]
    for (op, shape), by_m in groups.items():
        L.append(f"| {op} | {shape} | ≥ {kernel_target(op)} | " + " | ".join(_kernel_cell(by_m.get(m)) for m in ms) + " |")
    L += ["", "<details><summary>Every row</summary>", "",
          "| op | shape | M | bits | aligned ms | vendor | vendor ms | ratio | target |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bits = "exact" if r.get("exact") else "NOT EXACT"
        L.append(f"| {r['op']} | {r['shape']} | {r['M']} | {bits} | {_ms(r.get('aligned_ms') if r.get('exact') else None)} | "
                 f"{r.get('vendor', '')} | {_ms(r.get('vendor_ms'))} | {_kernel_cell(r)} | ≥ {kernel_target(r['op'])} |")
    L += ["", "</details>", ""]
    return L


def write_outputs(results: dict, out: str | None, doc: str | None) -> None:
    """results.json and PERFORMANCE.md in ``out``; the page also at ``doc``."""
    page = render(results)
    for path, text in ((out and os.path.join(out, "results.json"), json.dumps(results, indent=1, default=str)),
                       (out and os.path.join(out, "PERFORMANCE.md"), page), (doc, page)):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, path)


# ---------------------------------------------------------------- child steps
class Emitter:
    """A child's reports to the parent: JSON lines appended (and flushed) to
    a file, applied in order by ``apply_lines``, so a killed child leaves
    every row it finished."""

    def __init__(self, path: str | None):
        self.path = path

    def __call__(self, key: str, value, append: bool = False) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps({"key": key, "value": value, "append": append}, default=str) + "\n")


def apply_lines(results: dict, path: str) -> None:
    """Apply a child's lines: ``key`` is a dotted path into ``results``."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        for line in f:
            try:
                msg = json.loads(line)
            except json.JSONDecodeError:  # the last line of a killed child
                continue
            *parents, leaf = msg["key"].split(".")
            d = results
            for k in parents:
                d = d.setdefault(k, {})
            if msg["append"]:
                d.setdefault(leaf, []).append(msg["value"])
            elif isinstance(msg["value"], dict) and isinstance(d.get(leaf), dict):
                d[leaf].update(msg["value"])
            else:
                d[leaf] = msg["value"]


def _device(args):
    import torch

    return torch.device(args.device)


def step_env(args, emit) -> None:
    import torch
    import triton
    from bench_engine import copy_bandwidth

    dev = _device(args)
    meta = {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda}
    meta["gpu"] = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU (smoke run: tiny shapes)"
    emit("meta", meta)
    n = COPY_BYTES if dev.type == "cuda" else 64 << 20
    if dev.type == "cuda":
        n = min(n, torch.cuda.mem_get_info(dev)[0] // 4)
    bw = copy_bandwidth(dev, n)
    emit("env", {"copy_bytes": n, "copy_gbps": bw / 1e9})


def engine_max_position(args) -> int | None:
    """The engine's max_position: --max-position, or the run's longest
    sequence page-rounded (see bench_engine); None: the preset's."""
    if args.max_position is None:
        from bench_engine import fit_max_position

        return fit_max_position(args.prompt + args.new, args.check_length)
    return args.max_position or None


def step_engine(args, emit, server_kernels: str) -> None:
    from bench_engine import decode_weight_bytes, load, measure

    side = "aligned" if server_kernels == "aligned" else "vendor"
    t0 = time.perf_counter()
    pair = load(args.config, server_kernels=server_kernels, max_batch_size=max(args.batches),
                cuda_graphs=args.cuda_graphs == "on", max_position=engine_max_position(args), device=args.device)
    eng, cfg = pair.server, pair.config
    emit(f"engine.{side}", {"load_s": time.perf_counter() - t0, "num_pages": eng.num_pages})
    if side == "aligned":
        from alignzoo.common.kv_cache import PAGE_SIZE

        kv_token = sum(p.page_bytes() for p in eng.model.cache_pools().values()) // PAGE_SIZE
        emit("engine", {"weight_bytes": decode_weight_bytes(eng.model), "kv_bytes_per_token": kv_token,
                        "max_position": cfg.max_position, "overlap": eng.overlap})
        from alignzoo.models.checks import run_ladder

        emit("engine.check", {"passed": None, "length": args.check_length, "batch": args.check_batch})
        t0 = time.perf_counter()
        try:
            rows = run_ladder(pair, length=args.check_length, batch=args.check_batch, seed=0)
        except Exception as e:  # not shown exact: 'not checked', with the error
            emit("engine.check", {"error": f"{type(e).__name__}: {e}"[:300]})
            raise
        rows = [{"rung": r.rung, "check": r.check, "passed": bool(r.passed), "compared": r.compared,
                 "differing": r.differing, "max_abs": r.extra.get("max_abs")} for r in rows]
        passed = all(r["passed"] for r in rows)
        emit("engine.check", {"passed": passed, "rows": rows, "seconds": time.perf_counter() - t0})
        print(f"alignment check: {'PASS' if passed else 'FAIL'} ({sum(r['passed'] for r in rows)}/{len(rows)})", flush=True)
        if not passed:
            return  # no speed for a configuration that is not exact
    for B in args.batches:
        row = measure(eng, cfg.vocab_size, B, args.prompt, args.new)
        print(f"{side} {json.dumps(row)}", flush=True)
        emit(f"engine.{side}.rows", row, append=True)


def step_kernels(args, emit, op: str) -> None:
    import torch

    torch.manual_seed(0)
    for r in bp.op_rows(op, _device(args)):
        print(bp.format_row(r), flush=True)
        emit("kernels", r, append=True)


def step_trainer(args, emit, shape: str) -> None:
    from bench_trainer import measure

    config, seqs, length = parse_trainer_shape(shape)
    measure(config, _device(args), seqs, length, emit=lambda row: emit("trainer.rows", row, append=True))


def parse_trainer_shape(shape: str) -> tuple[str, int, int]:
    """"qwen3-0.6b:8x2048" -> ("qwen3-0.6b", 8, 2048); another model's preset as "qwen35_gdn/tiny:2x64"."""
    try:
        config, dims = shape.split(":")
        seqs, length = (int(v) for v in dims.split("x"))
    except ValueError:
        raise ValueError(f"--trainer-shapes: {shape!r} is not [MODEL/]PRESET:SEQSxLEN (e.g. qwen3-0.6b:8x2048, "
                         f"qwen35_gdn/qwen3.5-35b-a3b-4l:2x2048)") from None
    return config, seqs, length


def warm_tasks(args) -> list[dict]:
    """Compile jobs, longest first: the check, each engine batch (prefill and
    eager decode), the decode-graph buckets not among them, then one job per
    kernel op and M."""
    tasks = []
    if {"engine", "vendor"} & set(args.steps):
        tasks += [{"kind": "batch", "batch": b} for b in args.batches]
        if args.cuda_graphs == "on":
            from alignzoo.common.engine.model_runner import graph_batch_sizes

            tasks += [{"kind": "decode", "bs": b} for b in graph_batch_sizes(max(args.batches)) if b not in args.batches]
        if "engine" in args.steps:
            tasks.insert(0, {"kind": "check"})
    if "kernels" in args.steps:
        tasks += [{"kind": "kernel", "op": op, "M": m} for op in args.ops
                  for m in sorted(bp.matmul_ms() if op == "matmul" else bp.MS, reverse=True)
                  if op != "sampling" or m <= SAMPLING_MAX_M]
    return tasks


def step_warm_task(args, task: dict) -> None:
    """One compile job (no timing).  Engine jobs use one layer of the
    config: the same kernels and specializations as the whole model."""
    import torch

    if task["kind"] == "kernel":
        bp.warm_only()
        bp.MS = (task["M"],)
        for _ in bp.op_rows(task["op"], _device(args)):
            pass
        return
    from alignzoo import SamplingParams
    from alignzoo.common.kv_cache import PAGE_SIZE
    from bench_engine import fit_max_position, load

    bs = task.get("bs") or task.get("batch") or args.check_batch
    pages = {"check": args.check_batch * fit_max_position(args.check_length) // PAGE_SIZE,
             "batch": bs * fit_max_position(args.prompt + 2) // PAGE_SIZE}
    pair = load(args.config, max_batch_size=bs, cuda_graphs=False, num_layers=1, max_position=engine_max_position(args),
                num_pages=pages.get(task["kind"], 1) + 16, device=args.device)
    eng, V = pair.server, pair.config.vocab_size
    if task["kind"] == "check":
        from alignzoo.models.checks import run_ladder

        run_ladder(pair, length=args.check_length, batch=args.check_batch, seed=0)
    elif task["kind"] == "batch":
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, V, (args.prompt,), generator=g).tolist() for _ in range(bs)]
        eng.generate(prompts, SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=2, seed=1, stop_token_ids=()))
    else:  # a decode graph bucket: the forward capture_decode_graphs warms up, and the sampler at bs rows
        from alignzoo.common.engine.model_api import static_decode_batch
        from alignzoo.common.sampling import params_to_tensors, sample_fwd

        with torch.inference_mode():
            logits = eng.model.forward(static_decode_batch(bs, eng.runner.graph_widths, eng.model.device),
                                       eng.runner.caches)
            params = params_to_tensors([SamplingParams(temperature=1.0, top_p=0.95, seed=1)] * bs, [0] * bs)
            sample_fwd(logits, **{k: v.to(logits.device) for k, v in params.items()})
    from bench_engine import sync_device

    sync_device(_device(args))


def run_child(args) -> int:
    emit = Emitter(args.rows)
    try:
        if args.step == "env":
            step_env(args, emit)
        elif args.step in ("engine", "vendor"):
            step_engine(args, emit, "aligned" if args.step == "engine" else "vendor")
        elif args.step == "kernels":
            step_kernels(args, emit, args.op)
        elif args.step == "trainer":
            step_trainer(args, emit, args.task)
        elif args.step == "warm-task":
            step_warm_task(args, json.loads(args.task))
        else:
            raise ValueError(f"unknown step {args.step!r}")
    except Exception:
        traceback.print_exc()
        return 1
    return 0


# ---------------------------------------------------------------- parent
class Suite:
    def __init__(self, args, argv: list[str]):
        self.args, self.argv = args, argv
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.results: dict = {"meta": {}, "steps": {}}
        if args.merge:  # an earlier run's steps, kept where this run does not redo them
            with open(args.merge) as f:
                earlier = json.load(f)
            self.results = {k: v for k, v in earlier.items() if k not in ("meta",) and not (k == "kernels" and "kernels" in args.steps)}
            self.results["steps"] = {k: v for k, v in earlier.get("steps", {}).items() if k not in args.steps}
            self.results["meta"] = {"merged_from": {"file": os.path.basename(args.merge), **earlier.get("meta", {})}}
        self.running: list[subprocess.Popen] = []
        self.current: tuple[str, str, str] | None = None  # the timed child's (name, rows, log)
        self.tmp = tempfile.mkdtemp(prefix="run_suite_")
        self.log = os.path.join(args.out, "log.txt")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def meta(self) -> None:
        import torch
        import triton

        a = self.args
        self.results["meta"].update(
            date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=bp.commit(),
            command=" ".join(["python", os.path.relpath(__file__, ROOT)] + [shlex.quote(x) for x in self.argv]),
            torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, device=a.device,
            budget_s=a.budget_s)
        self.results["kernel_shapes"] = {"hidden": bp.HIDDEN, "intermediate": bp.INTER, "vocab": bp.VOCAB,
                                         "heads": bp.HEADS, "kv_heads": bp.KV_HEADS, "head_dim": bp.HEAD_DIM}
        self.results["kernel_timing"] = (
            "CUDA-graph replay median, L2 flushed before each call (bench_primitives._time_graph)"
            if a.kernel_timing == "graph" and a.device == "cuda"
            else "triton do_bench median, L2 flushed (small M includes Python launch overhead)")
        if {"engine", "vendor"} & set(a.steps):
            self.results.setdefault("engine", {}).update(
                config=a.config, prompt=a.prompt, new=a.new, batches=a.batches,
                max_position=engine_max_position(a) or "preset's", cuda_graphs=a.cuda_graphs)

    def write(self) -> None:
        self.results["meta"]["elapsed_s"] = time.monotonic() - self.t0
        write_outputs(self.results, self.args.out, self.args.doc or None)

    def spawn(self, extra: list[str], log_path: str, rows_path: str | None = None) -> subprocess.Popen:
        cmd = [sys.executable, os.path.abspath(__file__), *self.argv, *extra]
        if rows_path:
            cmd += ["--rows", rows_path]
        f = open(log_path, "w")
        # its own process group (killed as one, ptxas included), in this session (a device harness that
        # ends the session's processes ends it too)
        p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, process_group=0, cwd=ROOT)
        f.close()
        self.running.append(p)
        return p

    def kill(self, p: subprocess.Popen) -> None:
        """Kill a child and what it started (ptxas), by its own process group."""
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(wait)
            except subprocess.TimeoutExpired:
                pass
        if p in self.running:
            self.running.remove(p)

    def append_log(self, title: str, path: str) -> None:
        with open(self.log, "a") as out, open(path, errors="replace") as f:
            out.write(f"\n===== {title}\n{f.read()}")

    def run(self, name: str, extra: list[str], cap: float) -> str:
        """One child, at most ``cap`` seconds (and the budget); its rows are
        applied whatever its fate.  Returns 'ok', 'failed (rc N)' or 'timeout'."""
        rows, log = os.path.join(self.tmp, name + ".rows"), os.path.join(self.tmp, name + ".log")
        limit = min(cap, self.left())
        print(f"[{time.monotonic() - self.t0:5.0f}s] {name} (limit {limit:.0f}s)", flush=True)
        p = self.spawn(extra, log, rows)
        self.current = (name, rows, log)
        try:
            rc = p.wait(timeout=max(limit, 1))
            status = "ok" if rc == 0 else f"failed (rc {rc})"
        except subprocess.TimeoutExpired:
            self.kill(p)
            status = "timeout"
        if p in self.running:
            self.running.remove(p)
        self.current = None
        apply_lines(self.results, rows)
        self.append_log(f"{name}: {status}", log)
        if status != "ok":
            with open(log, errors="replace") as f:
                print("".join(f.readlines()[-15:]), end="", flush=True)
        return status

    def each(self, children: list[tuple[str, str, list[str]]], cap: float) -> str:
        """One child per (label, name, arguments), each at most ``cap`` seconds, while budget is left."""
        return "; ".join(f"{label} {self.run(name, extra, cap)}" if self.left() >= 10 else f"{label} skipped (budget)"
                         for label, name, extra in children)

    def step(self, name: str, fn) -> None:
        t = time.monotonic()
        if self.left() < 10:
            self.results["steps"][name] = {"status": "skipped (budget)", "seconds": None}
        else:
            self.results["steps"][name] = {"status": "running", "seconds": None}
            status = fn()
            self.results["steps"][name] = {"status": status, "seconds": time.monotonic() - t}
        self.write()

    def warm(self) -> str:
        tasks = warm_tasks(self.args)
        deadline = time.monotonic() + min(self.args.warm_s, self.left())
        pending, running, done, failed = list(tasks), {}, 0, []
        while (pending or running) and time.monotonic() < deadline:
            while pending and len(running) < self.args.warm_jobs:
                task = pending.pop(0)
                log = os.path.join(self.tmp, f"warm{len(tasks) - len(pending)}.log")
                running[self.spawn(["--step", "warm-task", "--task", json.dumps(task)], log)] = (task, log)
            time.sleep(0.5)
            for p in [p for p in running if p.poll() is not None]:
                task, log = running.pop(p)
                self.running.remove(p)
                if p.returncode == 0:
                    done += 1
                else:
                    failed.append(task)
                    self.append_log(f"warm {json.dumps(task)}: rc {p.returncode}", log)
        for p, (task, log) in running.items():
            self.kill(p)
        unfinished = len(running) + len(pending)
        self.results["warm"] = {"tasks": len(tasks), "done": done, "failed": failed, "unfinished": unfinished}
        print(f"warm: {done}/{len(tasks)} compile jobs done, {len(failed)} failed, {unfinished} cut off", flush=True)
        return f"{done}/{len(tasks)} jobs" + (f", {len(failed)} failed" if failed else "") + \
            (f", {unfinished} cut off" if unfinished else "")

    def main(self) -> int:
        a = self.args
        os.makedirs(a.out, exist_ok=True)
        open(self.log, "w").close()
        self.meta()
        self.write()
        for name in a.steps:
            if name == "env":
                self.step(name, lambda: self.run("env", ["--step", "env"], a.env_s))
            elif name == "warm":
                self.step(name, self.warm)
            elif name in ("engine", "vendor"):
                self.step(name, lambda n=name: self.run(n, ["--step", n], a.engine_s if n == "engine" else a.vendor_s))
            elif name == "kernels":
                self.step(name, lambda: self.each([(op, "kernels-" + op, ["--step", "kernels", "--op", op])
                                                   for op in a.ops], a.op_s))
            elif name == "trainer":
                self.step(name, lambda: self.each([(sh, "trainer-" + sh.replace(":", "-").replace("/", "-"),
                                                    ["--step", "trainer", "--task", sh])
                                                   for sh in a.trainer_shapes], a.trainer_s))
        print(f"done in {time.monotonic() - self.t0:.0f}s: {os.path.join(a.out, 'PERFORMANCE.md')}"
              + (f" and {a.doc}" if a.doc else ""), flush=True)
        return 0

    def abort(self, *_):
        """SIGTERM (an outer timeout): keep what the children finished."""
        for p in list(self.running):
            self.kill(p)
        if self.current:
            name, rows, log = self.current
            apply_lines(self.results, rows)
            self.append_log(f"{name}: killed", log)
        for st in self.results["steps"].values():
            if st["status"] == "running":
                st["status"] = "killed (SIGTERM)"
        self.results["meta"]["aborted"] = True
        self.write()
        sys.exit(124)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: tiny shapes and the tiny model, no CUDA graphs (a smoke run of the code paths)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_out"), help="results.json, PERFORMANCE.md, log.txt")
    ap.add_argument("--doc", default=None, help="where else to write the page (default docs/PERFORMANCE.md on cuda; '' none)")
    ap.add_argument("--budget-s", type=float, default=460, help="the whole run; steps left without time are 'skipped'")
    ap.add_argument("--steps", default=",".join(STEPS), help=f"subset of {','.join(STEPS)}, run in this order")
    ap.add_argument("--skip", default="", help="steps to leave out")
    ap.add_argument("--merge", default=None, metavar="RESULTS.json",
                    help="start from an earlier run's results (steps this run does not repeat are kept, and the "
                         "page says so): a suite split over two device calls")
    g = ap.add_argument_group("kernels")
    g.add_argument("--ops", default=",".join(OPS))
    g.add_argument("--ms", default=None, help="row counts (default 1,8,64,256,1024,4096,8192)")
    g.add_argument("--kernel-timing", choices=("graph", "do_bench"), default="graph",
                   help="graph: CUDA-graph replay, L2 flushed (bench_primitives._time_graph); do_bench: also counts "
                        "Python launch overhead at small M")
    g = ap.add_argument_group("engine")
    g.add_argument("--config", default=None, help="qwen3 preset (default qwen3-8b; cpu: tiny)")
    g.add_argument("--batches", default=None, help="decode batch sizes (default 1,8,64,256; cpu: 1,2)")
    g.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; cpu: 16)")
    g.add_argument("--new", type=int, default=None, help="new tokens per request (default 256; cpu: 8)")
    g.add_argument("--max-position", type=int, default=None,
                   help="model max_position (default: the run's longest sequence, page-rounded; 0: the preset's)")
    g.add_argument("--check-length", type=int, default=None,
                   help="alignment check: longest sequence (default prompt + new)")
    g.add_argument("--check-batch", type=int, default=3, help="alignment check: sequences")
    g.add_argument("--cuda-graphs", choices=("on", "off"), default=None, help="decode graphs (default on; cpu: off)")
    g = ap.add_argument_group("trainer")
    g.add_argument("--trainer-shapes", default=None,
                   help="[MODEL/]PRESET:SEQSxLEN,... (default qwen3-0.6b:8x2048,qwen3-8b:2x2048,"
                        "qwen35_gdn/qwen3.5-35b-a3b-4l:2x2048; cpu: tiny:2x64)")
    g = ap.add_argument_group("time limits (seconds; each also capped by what is left of --budget-s)")
    g.add_argument("--warm-s", type=float, default=200)
    g.add_argument("--warm-jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    g.add_argument("--env-s", type=float, default=60)
    g.add_argument("--engine-s", type=float, default=150)
    g.add_argument("--vendor-s", type=float, default=100)
    g.add_argument("--op-s", type=float, default=90, help="per kernel op")
    g.add_argument("--trainer-s", type=float, default=150, help="per trainer shape")
    for hidden in ("--step", "--rows", "--op", "--task"):  # a child process's own arguments
        ap.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cpu = args.device == "cpu"
    for name, gpu, smoke in (("config", "qwen3-8b", "tiny"), ("batches", "1,8,64,256", "1,2"), ("prompt", 512, 16),
                             ("new", 256, 8), ("cuda_graphs", "on", "off"),
                             ("trainer_shapes", "qwen3-0.6b:8x2048,qwen3-8b:2x2048,qwen35_gdn/qwen3.5-35b-a3b-4l:2x2048", "tiny:2x64")):
        if getattr(args, name) is None:
            setattr(args, name, smoke if cpu else gpu)
    if args.check_length is None:
        args.check_length = args.prompt + args.new
    if args.doc is None:
        args.doc = "" if cpu else str(ROOT / "docs" / "PERFORMANCE.md")
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.ops = [o for o in args.ops.split(",") if o]
    args.trainer_shapes = [t for t in args.trainer_shapes.split(",") if t]
    for t in args.trainer_shapes:
        try:
            parse_trainer_shape(t)
        except ValueError as e:
            ap.error(str(e))
    skip = set(args.skip.split(","))
    args.steps = [s for s in args.steps.split(",") if s and s not in skip]
    bad = [s for s in args.steps if s not in STEPS]
    if bad:
        ap.error(f"unknown steps {bad}; known: {', '.join(STEPS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    bp.ensure_alignzoo()
    if args.device == "cpu":
        bp.smoke_shapes()
    if args.ms:
        bp.MS = tuple(int(m) for m in args.ms.split(","))
    bp._GRAPHS = args.kernel_timing == "graph" and args.device == "cuda"
    bp._extra_benches()
    unknown = [o for o in args.ops if o not in bp.BENCHES]
    if unknown:
        print(f"unknown ops {unknown}; known: {', '.join(bp.BENCHES)}", file=sys.stderr)
        return 2
    if args.step:
        return run_child(args)
    child_argv = [x for x in argv]
    suite = Suite(args, child_argv)
    signal.signal(signal.SIGTERM, suite.abort)
    try:
        return suite.main()
    except KeyboardInterrupt:
        suite.abort()
    return 124


if __name__ == "__main__":
    sys.exit(main())
