"""Benchmark each primitive against its vendor path at Qwen3-8B shapes (H200).

    python benchmarks/bench_primitives.py [--ops matmul,rmsnorm,...] [--out DIR]

For every (op, shape, M) it first checks that the aligned kernel's rows are
bitwise the rows of the M = 8192 batch (rung 2 on the spot) and refuses to
report a speed for a configuration that is not exact; then it times aligned
and vendor side by side in one process (triton.testing.do_bench, median,
L2 flushed between reps) and reports the ratio vendor_time / aligned_time
(> 1: aligned is faster).  Writes results.json and results.md to --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import torch
import triton
import triton.testing

HIDDEN, INTER, VOCAB = 4096, 12288, 151936
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
MAX_POSITION = 40960
MS = (1, 8, 64, 256, 1024, 4096, 8192)
# matmul also between them, where 128-row tiles fill 1.1-1.5 SM waves: its slowest cells against cuBLAS
MATMUL_MID_MS = (128, 192, 384, 512, 768)


def matmul_ms() -> tuple:
    """The matmul rows' M: ``MS`` and the ``MATMUL_MID_MS`` inside its range (none when MS is one M)."""
    return tuple(sorted(set(MS) | {m for m in MATMUL_MID_MS if min(MS) < m < max(MS)}))


_GRAPHS = False  # --cuda-graphs
_TIMER = None  # replaces _time: smoke_shapes() (CPU wall clock) or warm_only() (no timing at all)
_WARM = False


def commit() -> str:
    """The commit a result belongs to: ALIGNZOO_COMMIT when set (the device's
    copy of .git can lag the working tree), else git's HEAD, else "unknown"."""
    if os.environ.get("ALIGNZOO_COMMIT"):
        return os.environ["ALIGNZOO_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=os.path.dirname(os.path.abspath(__file__)))
        return r.stdout.strip() or "unknown"
    except Exception:
        return "unknown"


def _time(fn) -> float:
    """Median kernel time (ms): triton's do_bench (L2 flushed between reps; at
    small M it also counts Python launch overhead, ~0.07 ms for a Triton
    launch), or with --cuda-graphs ``_time_graph``."""
    if _TIMER is not None:
        return _TIMER(fn)
    if _GRAPHS:
        try:
            return _time_graph(fn)
        except Exception as e:
            torch.cuda.synchronize()
            print(f"graph timing failed ({type(e).__name__}: {e}); this row: do_bench", file=sys.stderr)
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


_FLUSH: torch.Tensor | None = None


def _time_graph(fn, replays: int = 10) -> float:
    """Median time of one call replayed from a CUDA graph, L2 flushed before
    each call (a 256 MB write whose own graph time is subtracted): the GPU's
    time with weights read from HBM, as in a decode step, without launch
    overhead.  (Without the flush a replay reads q/o_proj's 32 MB weight from L2.)
    Warm-up and capture run inside ``graph_launches()``, as the engine's
    decode graphs do: the matmul's defaults may pick its Gluon kernel."""
    from alignzoo.common.matmul import graph_launches

    with graph_launches():
        return _time_graph_captured(fn, replays)


def _time_graph_captured(fn, replays: int) -> float:
    global _FLUSH
    if _FLUSH is None:
        _FLUSH = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    reps = max(1, min(50, int(5.0 / max(start.elapsed_time(end), 1e-3))))  # ~5 ms of work per replay

    def capture(body):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(reps):
                _FLUSH.zero_()
                body()
        return g

    def median_ms(g):
        g.replay()
        ts = []
        for _ in range(replays):
            start.record()
            g.replay()
            end.record()
            end.synchronize()
            ts.append(start.elapsed_time(end))
        return sorted(ts)[len(ts) // 2]

    g_fn, g_flush = capture(fn), capture(lambda: None)
    return max(median_ms(g_fn) - median_ms(g_flush), 0.0) / reps


_FULL: dict = {}


def _rows_match(aligned, M_full: int, M: int) -> bool:
    """The first M rows computed alone equal the same rows of the full batch
    (the full batch is computed once per benchmark function and shape).
    warm_only(): computes the M rows only (each M is warmed by its own process)."""
    if _WARM:
        aligned(M)
        return True
    key = (aligned.__code__, tuple(id(c.cell_contents) for c in (aligned.__closure__ or ()) if not isinstance(c.cell_contents, int)))
    if key not in _FULL:
        _FULL.clear()
        _FULL[key] = aligned(M_full)
    full = _FULL[key]
    part = aligned(M)
    fo = full if isinstance(full, (tuple, list)) else (full,)
    po = part if isinstance(part, (tuple, list)) else (part,)
    return all(torch.equal(a[:M], b) for a, b in zip(fo, po))


def bench_matmul(dev):
    from alignzoo.common.matmul import graph_launches, matmul_fwd

    def both_launches(x, w):  # eager defaults (Triton's kernels) and graph_launches() ones (may be Gluon)
        with graph_launches():
            graphed = matmul_fwd(x, w)
        return matmul_fwd(x, w), graphed

    # transformers' projections, then the fused ones qwen3's trainer and server run ([q|k|v], [gate|up])
    shapes = {"q/o_proj": (HEADS * HEAD_DIM, HIDDEN), "k/v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
              "gate/up": (INTER, HIDDEN), "down": (HIDDEN, INTER),
              "qkv (fused)": ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), "gate_up (fused)": (2 * INTER, HIDDEN)}
    for name, (N, K) in shapes.items():
        x = torch.randn(max(MS), K, device=dev).bfloat16()
        w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
        for M in matmul_ms():
            xm = x[:M]
            exact = _rows_match(lambda m: both_launches(x[:m], w), max(MS), M)
            yield dict(op="matmul", shape=f"{name} N={N} K={K}", M=M, exact=exact,
                       aligned_ms=_time(lambda: matmul_fwd(xm, w)) if exact else None,
                       vendor="torch.mm (cuBLAS)", vendor_ms=_time(lambda: torch.mm(xm, w.t())))


def bench_tree(dev):
    from alignzoo.common.tree import tree_reduce_fwd

    for n in (8, 16):
        parts = torch.randn(n, max(MS), HIDDEN, device=dev).bfloat16()
        for M in MS:
            p = parts[:, :M]
            exact = _rows_match(lambda m: tree_reduce_fwd(parts[:, :m].contiguous(), torch.bfloat16), max(MS), M)
            pc = p.contiguous()
            yield dict(op="tree", shape=f"N={n} H={HIDDEN}", M=M, exact=exact,
                       aligned_ms=_time(lambda: tree_reduce_fwd(pc, torch.bfloat16)) if exact else None,
                       vendor="torch.sum(fp32)", vendor_ms=_time(lambda: pc.float().sum(0).bfloat16()))


def bench_rmsnorm(dev):
    import torch.nn.functional as F

    from alignzoo.common.rmsnorm import rmsnorm_fwd

    x = torch.randn(max(MS), HIDDEN, device=dev).bfloat16()
    r = torch.randn(max(MS), HIDDEN, device=dev).bfloat16()
    w = (1 + 0.1 * torch.randn(HIDDEN, device=dev)).bfloat16()
    for M in MS:
        xm, rm = x[:M], r[:M]
        exact = _rows_match(lambda m: rmsnorm_fwd(x[:m], w, 1e-6)[0], max(MS), M)
        yield dict(op="rmsnorm", shape=f"H={HIDDEN}", M=M, exact=exact,
                   aligned_ms=_time(lambda: rmsnorm_fwd(xm, w, 1e-6)) if exact else None,
                   vendor="F.rms_norm", vendor_ms=_time(lambda: F.rms_norm(xm, (HIDDEN,), w, 1e-6)))
        exact = _rows_match(lambda m: rmsnorm_fwd(x[:m], w, 1e-6, residual=r[:m])[:2], max(MS), M)
        yield dict(op="rmsnorm+res", shape=f"H={HIDDEN}", M=M, exact=exact,
                   aligned_ms=_time(lambda: rmsnorm_fwd(xm, w, 1e-6, residual=rm)) if exact else None,
                   vendor="add + F.rms_norm", vendor_ms=_time(lambda: F.rms_norm(xm + rm, (HIDDEN,), w, 1e-6)))


def bench_swiglu(dev):
    import torch.nn.functional as F

    from alignzoo.common.swiglu import swiglu_fwd

    g = torch.randn(max(MS), INTER, device=dev).bfloat16()
    u = torch.randn(max(MS), INTER, device=dev).bfloat16()
    for M in MS:
        gm, um = g[:M], u[:M]
        exact = _rows_match(lambda m: swiglu_fwd(g[:m], u[:m]), max(MS), M)
        yield dict(op="swiglu", shape=f"I={INTER}", M=M, exact=exact,
                   aligned_ms=_time(lambda: swiglu_fwd(gm, um)) if exact else None,
                   vendor="F.silu(g) * u", vendor_ms=_time(lambda: F.silu(gm) * um))


def bench_rope(dev):
    from alignzoo.common.rope import RopeSpec, rope_fwd, rope_table

    spec = RopeSpec(rotary_dim=HEAD_DIM, base=1_000_000.0, max_position=MAX_POSITION, pairing="half")
    cos, sin = rope_table(spec, dev)
    q = torch.randn(max(MS), HEADS, HEAD_DIM, device=dev).bfloat16()
    pos = torch.randint(0, MAX_POSITION, (max(MS),), device=dev)

    def vendor(x, p):  # transformers-style eager rotate_half in fp32 (Class B)
        c = torch.cat([cos[p], cos[p]], -1)[:, None]
        s_ = torch.cat([sin[p], sin[p]], -1)[:, None]
        xf = x.float()
        x1, x2 = xf[..., : HEAD_DIM // 2], xf[..., HEAD_DIM // 2:]
        return (xf * c + torch.cat([-x2, x1], -1) * s_).to(x.dtype)

    for M in MS:
        qm, pm = q[:M], pos[:M]
        exact = _rows_match(lambda m: rope_fwd(q[:m], pos[:m], spec, check=False), max(MS), M)
        yield dict(op="rope", shape=f"q H={HEADS} D={HEAD_DIM}", M=M, exact=exact,
                   aligned_ms=_time(lambda: rope_fwd(qm, pm, spec, check=False)) if exact else None,
                   vendor="eager rotate_half fp32", vendor_ms=_time(lambda: vendor(qm, pm)))


def bench_qk_norm_rope(dev):
    """The server's fused q/k RMSNorm + RoPE + KV write against the unfused
    launchers it replaced (rmsnorm_fwd and rope_fwd of q and k, write_kv_fwd,
    the .contiguous() copies): the "vendor" column is our own unfused path."""
    from alignzoo.common.kv_cache import PAGE_SIZE, allocate_kv_cache
    from alignzoo.common.qk_norm_rope import qk_norm_rope_kv_fwd
    from alignzoo.common.qk_norm_rope.checks import unfused
    from alignzoo.common.rope import RopeSpec, rope_table

    spec = RopeSpec(rotary_dim=HEAD_DIM, base=1_000_000.0, max_position=MAX_POSITION, pairing="half")
    rope_table(spec, dev)
    qkv = torch.randn(max(MS), (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev).bfloat16()
    q_w, k_w = ((torch.rand(HEAD_DIM, device=dev) + 0.5).bfloat16() for _ in range(2))
    pos = torch.randint(0, MAX_POSITION, (max(MS),), device=dev)
    kc, vc = allocate_kv_cache(-(-max(MS) // PAGE_SIZE), KV_HEADS, HEAD_DIM, device=dev)
    slots = torch.arange(max(MS), device=dev)

    def call(fn, m):
        return fn(qkv[:m], q_w, k_w, 1e-6, pos[:m], spec, kc, vc, slots[:m], HEADS, KV_HEADS)

    def rows(m):  # q and the k, v rows the call wrote (slot i = token i)
        q = call(qk_norm_rope_kv_fwd, m)
        return q, kc.view(-1, KV_HEADS, HEAD_DIM)[:m].clone(), vc.view(-1, KV_HEADS, HEAD_DIM)[:m].clone()

    for M in MS:
        exact = _rows_match(rows, max(MS), M)
        yield dict(op="qk_norm_rope", shape=f"Hq={HEADS} Hkv={KV_HEADS} D={HEAD_DIM}", M=M, exact=exact,
                   aligned_ms=_time(lambda: call(qk_norm_rope_kv_fwd, M)) if exact else None,
                   vendor="our unfused launchers", vendor_ms=_time(lambda: call(unfused, M)))


def bench_lm_head(dev):
    from alignzoo.common.lm_head import lm_head_fwd

    h = torch.randn(max(MS), HIDDEN, device=dev).bfloat16()
    W = (torch.randn(VOCAB, HIDDEN, device=dev) / HIDDEN**0.5).bfloat16()
    tgt = torch.randint(0, VOCAB, (max(MS),), device=dev)
    for M in MS:
        hm, tm = h[:M], tgt[:M]
        exact = _rows_match(lambda m: lm_head_fwd(h[:m], W, tgt[:m], check_range=False), max(MS), M)
        yield dict(op="lm_head", shape=f"V={VOCAB} K={HIDDEN}", M=M, exact=exact,
                   aligned_ms=_time(lambda: lm_head_fwd(hm, W, tm, check_range=False)) if exact else None,
                   vendor="mm + fp32 log_softmax + gather",
                   vendor_ms=_time(lambda: torch.mm(hm, W.t()).float().log_softmax(-1).gather(1, tm[:, None])))


def bench_sampling(dev):
    from alignzoo.common.sampling import head_width, sample_fwd

    rows = max(m for m in MS if m <= 1024)
    logits = torch.randn(rows, VOCAB, device=dev) * 3
    temp = torch.full((rows,), 0.8, device=dev)
    top_k = torch.full((rows,), 50, device=dev, dtype=torch.int64)
    top_p = torch.full((rows,), 0.9, device=dev)
    min_p = torch.full((rows,), 0.05, device=dev)
    seed = torch.arange(rows, device=dev, dtype=torch.int64)
    step = torch.zeros(rows, device=dev, dtype=torch.int64)

    def vendor(lg):  # temperature -> top-k -> top-p -> min-p with torch ops, then multinomial
        z = lg / 0.8
        v, i = z.topk(50, dim=-1)
        p = v.softmax(-1)
        keep = (p.cumsum(-1) - p) < 0.9
        keep &= p >= 0.05 * p[:, :1]
        p = torch.where(keep, p, 0)
        j = torch.multinomial(p, 1)
        return i.gather(1, j), (p.gather(1, j) / p.sum(-1, keepdim=True)).log()

    head = head_width(temp.cpu(), top_k.cpu(), VOCAB)  # as the engine does, from host copies: no sync
    for M in [m for m in MS if m <= rows]:
        args = (logits[:M], temp[:M], top_k[:M], top_p[:M], min_p[:M], seed[:M], step[:M])
        exact = _rows_match(lambda m: sample_fwd(logits[:m], temp[:m], top_k[:m], top_p[:m], min_p[:m], seed[:m], step[:m]),
                            rows, M)
        yield dict(op="sampling", shape=f"V={VOCAB} t=.8 k=50 p=.9 minp=.05", M=M, exact=exact,
                   aligned_ms=_time(lambda: sample_fwd(*args, head=head)) if exact else None,
                   vendor="torch topk/softmax/cumsum/multinomial", vendor_ms=_time(lambda: vendor(logits[:M])))


BENCHES = {"matmul": bench_matmul, "tree": bench_tree, "rmsnorm": bench_rmsnorm, "swiglu": bench_swiglu,
           "rope": bench_rope, "qk_norm_rope": bench_qk_norm_rope, "lm_head": bench_lm_head,
           "sampling": bench_sampling}


def _extra_benches():
    """Primitives whose folders provide ``bench.py`` with ``bench(dev, MS)``."""
    import importlib

    for op in ("rmsnorm", "rope", "swiglu", "lm_head", "sampling"):
        try:
            mod = importlib.import_module(f"alignzoo.common.{op}.bench")
        except ModuleNotFoundError:
            continue
        BENCHES[op] = (lambda m: (lambda dev: m.bench(dev, MS, _time, _rows_match)))(mod)


def op_rows(op: str, dev):
    """The rows of one op's benchmark, each with ``ratio`` = vendor ms /
    aligned ms (None where the rows were not exact: no speed is reported)."""
    for r in BENCHES[op](dev):
        r["ratio"] = (r["vendor_ms"] / r["aligned_ms"]) if r["aligned_ms"] else None
        yield r


def format_row(r: dict) -> str:
    ratio = f"{r['ratio']:.2f}" if r["ratio"] else "n/a"
    a, v = (float("nan") if t is None else t for t in (r["aligned_ms"], r["vendor_ms"]))
    return (f"{r['op']:8s} {r['shape']:28s} M={r['M']:5d} exact={r['exact']!s:5s} "
            f"aligned={a:.4f}ms vendor={v:.4f}ms ratio={ratio}")


def warm_only() -> None:
    """Run the exactness checks but time nothing: compiles every kernel a
    later timing run uses into Triton's disk cache (several such processes
    compile in parallel; a cold cache spends minutes in ptxas otherwise)."""
    global _TIMER, _WARM
    _TIMER, _WARM = (lambda fn: float("nan")), True


def _time_wall(fn) -> float:
    """smoke_shapes(): median of 3 wall-clock runs, ms."""
    fn()
    ts = []
    for _ in range(3):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[1] * 1e3


def smoke_shapes() -> None:
    """Tiny shapes timed by the wall clock, for exercising the code paths on
    the CPU (the numbers mean nothing)."""
    global HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM, MAX_POSITION, MS, _TIMER
    HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM, MAX_POSITION = 64, 96, 1000, 4, 2, 16, 512
    MS = (1, 8, 16)
    _TIMER = _time_wall


def ensure_alignzoo() -> None:
    """``alignzoo`` is the repository root; without an install (the device)
    make it importable as gpu_env.sh does, for this process and its children."""
    import importlib
    import tempfile

    try:
        importlib.import_module("alignzoo")
    except ImportError:
        tmp = tempfile.mkdtemp(prefix="alignzoo_pkg_")
        os.symlink(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.join(tmp, "alignzoo"))
        sys.path.insert(0, tmp)
        os.environ["PYTHONPATH"] = tmp + os.pathsep + os.environ.get("PYTHONPATH", "")


def main():
    global MS, _GRAPHS
    _extra_benches()
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default=",".join(BENCHES))
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts to time")
    ap.add_argument("--cuda-graphs", action="store_true", help="time CUDA-graph replays, L2 flushed (see _time_graph)")
    args = ap.parse_args()
    MS = tuple(int(m) for m in args.ms.split(","))
    _GRAPHS = args.cuda_graphs
    dev = torch.device("cuda")
    torch.manual_seed(0)
    rows = []
    for op in args.ops.split(","):
        for r in op_rows(op, dev):
            rows.append(r)
            print(format_row(r), flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), date=datetime.date.today().isoformat(), commit=commit(),
                command=" ".join([os.path.basename(sys.executable)] + sys.argv), torch=torch.__version__, triton=triton.__version__)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "primitives.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    lines = [f"# Primitive benchmarks ({meta['gpu']}, {meta['date']}, commit {meta['commit']})", "",
             f"Command: `{meta['command']}` · torch {meta['torch']} · triton {meta['triton']}", "",
             "ratio = vendor time / aligned time (≥ 1: aligned as fast or faster). "
             "'exact' = rows bitwise equal to the same rows of the M=8192 batch.", "",
             "| op | shape | M | exact | aligned ms | vendor | vendor ms | ratio |", "|---|---|---|---|---|---|---|---|"]
    lines[2] += " · times: " + ("CUDA-graph replay median, L2 flushed" if _GRAPHS else "do_bench median, L2 flushed")
    for r in rows:
        a = f"{r['aligned_ms']:.4f}" if r["aligned_ms"] else "—"
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "not exact"
        lines.append(f"| {r['op']} | {r['shape']} | {r['M']} | {r['exact']} | {a} | {r['vendor']} | {r['vendor_ms']:.4f} | {ratio} |")
    with open(os.path.join(args.out, "primitives.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
