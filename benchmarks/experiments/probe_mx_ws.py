"""The MXFP4 experts with their decode in warps of its own (Gluon, Hopper): a probe, not the package's kernels.

The package's swapped kernels (``common/moe/kernel.py``) decode each 64-wide K step into the registers
that feed wgmma, so a step's decode cannot start before the last step's wgmma is done: the tensor cores
idle while one warpgroup waits, loads codes and decodes.  Here each kernel (gate-up, down) splits a CTA
in two partitions:

- the producer (4 warps) fills each ring stage: the step's input rows by TMA (x is gathered into
  sorted row order first, so a tile's rows are one box; the down's input already is), and the step's
  (BLOCK_N, 64) weight tile, decoded from code bytes and scales loaded two steps ahead with the
  package's bf16x2 PTX (``_E2M1X2_BF16``) and stored to shared memory;
- the MMA warpgroups (BLOCK_N / 64 of them) run wgmma on the two shared tiles, one step in flight,
  then the package's epilogue (the SwiGLU rounded once; the routing weight and the scatter).

The arithmetic is the package's: the same decoded weights, the same k16 wgmma chain into one fp32
accumulator from zero, the same epilogue expressions.  So the bits must be equal: the probe checks
``torch.equal`` on the (T, H) output against ``experts_fwd_mxfp4_triton`` for every config before it
times it, beside the package and the bf16 vendor (``bench_moe``'s) in one run, and splits the package
and the fastest config by kernel.  128-row weight tiles halve the x each weight row re-reads.

    python benchmarks/experiments/probe_mx_ws.py [--shapes glm-5,deepseek-v4-flash] [--tokens 4096,16384]  # the H200
    python benchmarks/experiments/probe_mx_ws.py --compile  # cross-compile every config for sm_90a here
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench_moe's shapes, vendor, timers

from alignzoo.common._launch import FP_FUSION
from alignzoo.common.matmul.gluon_kernel import _next_stage  # noqa: E402  (ring counters, no division a step)
from alignzoo.common.moe.kernel import _E2M1X2_BF16  # noqa: E402

_ASM = gl.constexpr(_E2M1X2_BF16.value)
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared  # 3.7 renamed it
BLOCK_K = 64  # the package's K step


@gluon.constexpr_function
def _producer_regs(block_n):
    """The producer's registers: a thread decodes 1 or 2 scale groups a step, each held three steps
    deep (two in flight); the MMA warps get the rest of ``ws_maxnreg``."""
    return 88 if block_n == 64 else 152


def ws_maxnreg(block_n: int, block_m: int) -> int:
    """Registers a thread at launch, which ptxas also takes as every partition's ceiling: a 64 x 256
    fp32 wgmma (128 accumulator registers a thread) needs ~154, so 256-row tiles launch at 168.
    A 64 x 128 tile fits 128 on 8 warps (64 weight rows): two CTAs can then share an SM, one's
    epilogue overlapping the other's steps."""
    return 128 if block_n == 64 and block_m <= 128 else 168


@gluon.jit
def _codes(p_w, p_s, o_c, o_g, i, n_k):
    """Step i's code bytes ((2·BLOCK_N, 16) uint8: row-group rg = 2·row + g, byte j) and scale bytes
    ((2·BLOCK_N,) uint8), step n_k - 1's past the end; ``o_c`` / ``o_g`` are the step-0 offsets."""
    i = gl.minimum(i, n_k - 1)
    return gl.load(p_w + o_c + i * 32), gl.load(p_s + o_g + i * 2)


@gluon.jit
def _producer(x_desc, p_w, p_s, xs, ws, x_ready, w_ready, empty, r0, row0, I, K, n_k, GU: gl.constexpr,
              STAGES: gl.constexpr, BLOCK_N: gl.constexpr):
    """Four warps fill stage i % STAGES for step i once the MMA of step i - STAGES has released it:
    the input rows [r0, r0 + BLOCK_M) x [64 i, 64 i + 64) by TMA (rows past the end come back zero;
    rows of the next expert fill columns that are never stored), and the (BLOCK_N, 64) weight tile
    decoded from codes and scales loaded two steps ahead (an HBM read outlasts a step's wgmma).
    The tile is BLOCK_N rows from ``row0``, or for the gate-up (GU) BLOCK_N / 64 groups of 32 gate
    rows from ``row0`` then their 32 up rows I further, so each MMA warpgroup's 64 rows hold whole
    SwiGLU pairs.  A thread decodes whole 32-weight scale groups."""
    L: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [4, 1], [1, 0])  # (2·BLOCK_N, 16)
    rg = gl.arange(0, 2 * BLOCK_N, layout=gl.SliceLayout(1, L))
    j = gl.arange(0, 16, layout=gl.SliceLayout(0, L))
    r = rg // 2
    if GU:
        rr = r % 64  # 32 gate rows then their 32 up rows in each 64
        row = (row0 + (r // 64) * 32 + rr % 32 + (rr // 32) * I).to(gl.int64)
    else:
        row = (row0 + r).to(gl.int64)
    o_c = row[:, None] * (K // 2) + (rg % 2)[:, None] * 16 + j[None, :]
    o_g = row * (K // 32) + rg % 2
    b0, s0 = _codes(p_w, p_s, o_c, o_g, 0, n_k)
    b1, s1 = _codes(p_w, p_s, o_c, o_g, 1, n_k)
    st = 0
    phase = 0
    for i in range(n_k):
        b2, s2 = _codes(p_w, p_s, o_c, o_g, i + 2, n_k)
        sc = (s0.to(gl.int32) * 0x00800080)[:, None]  # the scale byte under both halves' bf16 exponent fields
        lo, hi = gl.inline_asm_elementwise(_ASM, "=h,=h,r,r", [b0.to(gl.int32), sc],
                                           dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
        w = gl.reshape(gl.reshape(gl.join(lo, hi), [2 * BLOCK_N, 32]), [BLOCK_N, 64])  # low nibble first
        mbarrier.wait(empty.index(st), phase ^ 1)  # a fresh barrier passes phase 1: the ring starts empty
        mbarrier.expect(x_ready.index(st), x_desc.block_type.nbytes)
        _tma_load(x_desc, [r0, i * 64], x_ready.index(st), xs.index(st))
        ws.index(st).store(w)
        fence_async_shared()
        mbarrier.arrive(w_ready.index(st), count=1)
        b0, s0, b1, s1 = b1, s1, b2, s2
        st, phase = _next_stage(st, phase, STAGES)


@gluon.jit
def _mma(xs, ws, x_ready, w_ready, empty, n_k, STAGES: gl.constexpr, BLOCK_M: gl.constexpr,
         BLOCK_N: gl.constexpr):
    """accᵀ (BLOCK_N, BLOCK_M) = Σ_i W_i (BN, 64) · x_iᵀ (64, BM): one fp32 accumulator from zero, the
    package's k16 chain, 64 rows a warpgroup; the MMA of step i - 1 retires before its stage is
    released."""
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[BLOCK_N // 16, 1],
                                                    instr_shape=[16, BLOCK_M, 16])
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, acc_l)
    s = 0
    phase = 0
    prev = 0
    for i in range(n_k):
        mbarrier.wait(x_ready.index(s), phase)
        mbarrier.wait(w_ready.index(s), phase)
        acc = warpgroup_mma(ws.index(s), xs.index(s).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        mbarrier.arrive(empty.index(prev), count=1, pred=i > 0)  # step i - 1's wgmmas are done
        prev = s
        s, phase = _next_stage(s, phase, STAGES)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc,)),)  # the default partition returns a tuple


@gluon.jit
def _ws_chain(x_desc, p_w, p_s, r0, row0, I, K, GU: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr):
    """One tile's accᵀ (BLOCK_N weight rows, BLOCK_M sorted rows from r0) over K by the two
    partitions; returned to the MMA warpgroups (the kernel's BLOCK_N / 16 warps) for the epilogue."""
    n_k = K // 64
    xs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_M, 64], x_desc.layout)
    w_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], gl.bfloat16)
    ws = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, 64], w_l)
    x_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    w_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(x_ready.index(s), count=1)
        mbarrier.init(w_ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    acc, = gl.warp_specialize([
        (_mma, (xs, ws, x_ready, w_ready, empty, n_k, STAGES, BLOCK_M, BLOCK_N)),
        (_producer, (x_desc, p_w, p_s, xs, ws, x_ready, w_ready, empty, r0, row0, I, K, n_k, GU, STAGES,
                     BLOCK_N)),
    ], [4], [_producer_regs(BLOCK_N)])
    return acc


@gluon.jit
def _tile(p_te, p_r0, p_r1, N, COLS: gl.constexpr):
    """(expert, r0, r1, column block) of this program on the package's 1-D grid."""
    nn = N // COLS
    pid = gl.program_id(0)
    i_t = pid // nn
    return gl.load(p_te + i_t), gl.load(p_r0 + i_t), gl.load(p_r1 + i_t), pid % nn


@gluon.jit
def _gate_up_ws_kernel(x_desc, p_w, p_s, p_te, p_r0, p_r1, p_a, H, I, LIMIT, HAS_LIMIT: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    NH: gl.constexpr = BLOCK_N // 2  # intermediate columns a tile
    e, r0, r1, i_n = _tile(p_te, p_r0, p_r1, I, NH)
    if e < 0:
        return
    acc = _ws_chain(x_desc, p_w, p_s, r0, e * (2 * I) + i_n * NH, I, H, True, BLOCK_M, BLOCK_N, STAGES)
    # the package's SwiGLU epilogue: each 64 rows of accᵀ are 32 gate rows then their up rows, split
    # through shared memory
    scratch = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    scratch.store(acc)
    E_L: gl.constexpr = gl.BlockedLayout([8, 1], [4, 8], [1, BLOCK_N // 16], [0, 1])  # (32, BLOCK_M)
    o_r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, E_L))
    for q in gl.static_range(BLOCK_N // 64):
        g = scratch.slice(q * 64, 32, dim=0).load(E_L)
        u = scratch.slice(q * 64 + 32, 32, dim=0).load(E_L)
        if HAS_LIMIT:
            g = gl.minimum(g, LIMIT)
            u = gl.minimum(gl.maximum(u, -LIMIT), LIMIT)
        a = g / (1.0 + gl.exp(-g)) * u
        o_j = i_n * NH + q * 32 + gl.arange(0, 32, layout=gl.SliceLayout(1, E_L))
        gl.store(p_a + o_r[None, :].to(gl.int64) * I + o_j[:, None], a.to(gl.bfloat16),
                 mask=(o_r < r1)[None, :] & (o_j < I)[:, None])


@gluon.jit
def _down_ws_kernel(a_desc, p_w, p_s, p_wt, p_dst, p_te, p_r0, p_r1, p_c, H, I, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    e, r0, r1, i_n = _tile(p_te, p_r0, p_r1, H, BLOCK_N)
    if e < 0:
        return
    acc = _ws_chain(a_desc, p_w, p_s, r0, e * H + i_n * BLOCK_N, I, I, False, BLOCK_M, BLOCK_N, STAGES)
    # the package's epilogue: c[(token, slot)] = fp32 product · routing weight, scattered back
    scratch = gl.allocate_shared_memory(gl.float32, [BLOCK_N, BLOCK_M],
                                        gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    scratch.store(acc)
    D_L: gl.constexpr = gl.BlockedLayout([4, 1], [16, 2], [1, BLOCK_N // 16], [0, 1])  # 4 columns a thread
    c = scratch.load(D_L)
    o_n = i_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, D_L))
    o_r = r0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, D_L))
    m_r = o_r < r1
    wt = gl.load(p_wt + o_r, mask=m_r, other=0.0)
    dst = gl.load(p_dst + o_r, mask=m_r, other=0).to(gl.int64)
    gl.store(p_c + dst[None, :] * H + o_n[:, None], c * wt[None, :], mask=m_r[None, :] & (o_n < H)[:, None])


def _desc(rows, block_m):
    """A TMA descriptor over sorted rows (R, K) bf16, one (block_m, 64) box a step."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    layout = gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.bfloat16)
    return TensorDescriptor.from_tensor(rows, [block_m, 64], layout)


def experts_ws(x, ids, weights, gc, gs, dc, ds, limit=None, block_m=None, block_n=64, stages=3):
    """``experts_fwd_mxfp4_triton``'s contract at prefill sizes (T·k >= E) with the two warp-specialised
    kernels: x gathered into sorted row order, gate-up, down, then the package's slot sum -> (T, H) fp32."""
    from alignzoo.common._host import cdiv
    from alignzoo.common.moe.kernel import _slot_sum_kernel, mx_block_m, sorted_map_triton
    from alignzoo.common.swiglu.cpu import limit_in

    T, k = ids.shape
    E, I2, _ = gc.shape
    I, H = I2 // 2, x.shape[1]
    if H % max(64, block_n) or I % 64 or T * k < E:
        raise ValueError(f"the probe needs H % {max(64, block_n)} == I % 64 == 0 and T·k >= E "
                         f"(H={H}, I={I}, T·k={T * k})")
    block_m = mx_block_m(ids.numel() / E) if block_m is None else block_m
    _, tok, dst, wt, te, r0, r1 = sorted_map_triton(ids, weights, E, block_m)
    xg = x[tok.long()]  # sorted row order: a tile's rows are one TMA box
    a = torch.empty(T * k, I, dtype=x.dtype, device=x.device)
    c = torch.empty(T * k, H, dtype=torch.float32, device=x.device)
    lim = 0.0 if limit is None else limit_in(x.dtype, limit)
    if block_n not in (64, 128):
        raise ValueError(f"block_n is 64 or 128 (one or two MMA warpgroups), got {block_n}")
    knobs = dict(BLOCK_M=block_m, BLOCK_N=block_n, STAGES=stages, num_warps=block_n // 16,
                 maxnreg=ws_maxnreg(block_n, block_m))
    _gate_up_ws_kernel[(te.shape[0] * (I // (block_n // 2)),)](
        _desc(xg, block_m), gc, gs, te, r0, r1, a, H, I, lim, HAS_LIMIT=limit is not None, **knobs,
        enable_fp_fusion=FP_FUSION)
    _down_ws_kernel[(te.shape[0] * (H // block_n),)](_desc(a, block_m), dc, ds, wt, dst, te, r0, r1, c, H, I,
                                                      **knobs, enable_fp_fusion=FP_FUSION)
    y = torch.empty(T, H, dtype=torch.float32, device=x.device)
    _slot_sum_kernel[(cdiv(T * H, 1024),)](c, y, T * H, H, k, 1024, enable_fp_fusion=FP_FUSION, num_warps=4)
    return y


def compile_only(kernel: str, block_m: int = 256, n_stages: int = 3, block_n: int = 64):
    """Cross-compile a probe kernel for sm_90a (no GPU): its PTX and cubin under /tmp/probe_mx_ws,
    and ptxas's registers and spills."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton._C.libtriton import ir

    x_l = gl.NVMMASharedLayout.get_default_for([block_m, 64], gl.bfloat16)
    desc = f"tensordesc<bf16[{block_m}, 64],{x_l!r}>"
    types = dict(x_desc=desc, a_desc=desc, p_w="*u8", p_s="*u8", p_te="*i32", p_r0="*i32", p_r1="*i32", p_a="*bf16",
                 p_wt="*fp32", p_dst="*i32", p_c="*fp32", H="i32", I="i32", LIMIT="fp32")
    fn = {"gate_up": _gate_up_ws_kernel, "down": _down_ws_kernel}[kernel]
    names = fn.arg_names
    cx = dict(HAS_LIMIT=False, BLOCK_M=block_m, BLOCK_N=block_n, STAGES=n_stages)
    cx = {n: v for n, v in cx.items() if n in names}
    sig = {n: types.get(n, "constexpr") for n in names}
    aligned = [n for n, t in types.items() if t.startswith("*") and n in names] + ["H", "I"]
    src = GluonASTSource(fn, sig, {(names.index(n),): v for n, v in cx.items()},
                         {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    target = GPUTarget("cuda", 90, 32)
    be = make_backend(target)
    options = be.parse_options({"num_warps": block_n // 16, "maxnreg": ws_maxnreg(block_n, block_m),
                                "enable_fp_fusion": FP_FUSION})
    stages = {}
    be.add_stages(stages, options, src.language)
    ctx = ir.context()
    ir.load_dialects(ctx)
    be.load_dialects(ctx)
    mod = src.make_ir(target, options, be.get_codegen_implementation(options), be.get_module_map(), ctx)
    md = {}
    out = {}
    for ext in ("ttgir", "llir", "ptx", "cubin"):
        mod = stages[ext](mod, md)
        out[ext] = mod
    d = f"/tmp/probe_mx_ws/{kernel}_{block_m}_{n_stages}_{block_n}"
    os.makedirs(d, exist_ok=True)
    for ext in ("ptx", "cubin"):
        with open(f"{d}/k.{ext}", "wb" if ext == "cubin" else "w") as f:
            f.write(out[ext])
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/ptxas")
    info = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f"{d}/k.ptx", "-o", f"{d}/ptxas.cubin"],
                          capture_output=True, text=True).stderr
    print(f"{kernel}, {block_m} x {block_n}, {n_stages} stages: {md.get('num_warps')} warps, "
          f"{md.get('shared')} bytes of shared memory;",
          " ".join(re.findall(r"Used \d+ registers|\d+ bytes spill stores", info)), f"-> {d}")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile", action="store_true", help="cross-compile for sm_90a here, no GPU")
    ap.add_argument("--shapes", default="glm-5,deepseek-v4-flash")
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--configs", default='[{}, {"stages": 4}, {"block_m": 128, "stages": 4}, {"block_n": 128}, '
                                         '{"block_n": 128, "stages": 4}]',
                    help="a JSON list of experts_ws knob dicts (block_m, block_n, stages): each checked for the "
                         "package's bits, then timed; the fastest exact one is reported")
    ap.add_argument("--out", default="gpu_out")
    a = ap.parse_args(argv)
    if a.compile:
        return max(compile_only(kern, bm, st, bn) for kern in ("gate_up", "down") for bm in (256, 128)
                   for st in (2, 3, 4) for bn in (64, 128))
    import bench_moe
    from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton

    rows = []
    os.makedirs(a.out, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in a.shapes.split(","):
        H, I, E, k, limit = bench_moe.SHAPES[name]
        w_gu = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5).bfloat16()
        w_d = (torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5).bfloat16()
        qd = bench_moe.quantize("mxfp4", w_gu, w_d)
        del w_gu, w_d
        for T in map(int, a.tokens.split(",")):
            x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
            p = torch.softmax(torch.randn(T, E, device="cuda", generator=g), -1)
            w, ids = p.topk(k, -1)
            w = (w / w.sum(-1, keepdim=True)).bfloat16()
            package = lambda: experts_fwd_mxfp4_triton(x, ids, w, *qd["codes"], limit)  # noqa: E731
            want = package()
            row = {"shape": name, "tokens": T, "configs": {}}
            row["package_ms"] = bench_moe.time_graph(package)
            row["vendor_ms"] = bench_moe.time_graph(lambda: bench_moe.vendor(x, ids, w, *qd["bf16"], limit))
            row["package_by_kernel"] = bench_moe.by_kernel(package)
            best = None
            for cfg in json.loads(a.configs):
                ws = lambda: experts_ws(x, ids, w, *qd["codes"], limit, **cfg)  # noqa: E731
                res = {}
                try:
                    got = ws()
                    torch.cuda.synchronize()
                    res["bits_equal"] = bool(torch.equal(got, want))
                    res["max_abs"] = float((got - want).abs().max())
                    if res["bits_equal"]:
                        res["ms"] = bench_moe.time_graph(ws)
                        if best is None or res["ms"] < best[0]:
                            best = (res["ms"], cfg, bench_moe.by_kernel(ws))
                except Exception as ex:  # noqa: BLE001  (a probe: report and go on)
                    res["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                row["configs"][json.dumps(cfg)] = res
                print(name, T, cfg, json.dumps(res), flush=True)
            row["bits_equal"] = all(r.get("bits_equal") for r in row["configs"].values())
            if best is not None:
                row["ws_ms"], row["ws_config"], row["ws_by_kernel"] = best
            rows.append(row)
            print(json.dumps(row), flush=True)
            with open(os.path.join(a.out, "probe_mx_ws.json"), "w") as f:  # each row as it comes: a hang keeps them
                json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    print("| shape | tokens | every config's bits | package ms | ws ms (config) | vendor ms | vendor / package | "
          "vendor / ws |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        ws_ms = r.get("ws_ms", float("nan"))
        print(f"| {r['shape']} | {r['tokens']} | {r['bits_equal']} | {r['package_ms']:.3f} | {ws_ms:.3f} "
              f"({r.get('ws_config')}) | {r['vendor_ms']:.3f} | {r['vendor_ms'] / r['package_ms']:.2f}x | "
              f"{r['vendor_ms'] / ws_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
