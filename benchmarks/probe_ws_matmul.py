"""Probe the warp-specialized Gluon GEMM (benchmarks/ws_matmul_kernel.py) on the H200.

    python benchmarks/probe_ws_matmul.py [--ms 128,256,512,1024] [--budget-s 240] [--names]

For each Qwen3-8B (N, K) and M: the library default's time, cuBLAS's, and each
warp-specialized tile's, CUDA-graph replay with L2 flushed (bench_primitives
._time_graph), plus whether each candidate's output equals the default's
(torch.equal, also at ragged M and on rows computed alone).  ``--names``
prints the cuBLAS kernel each (N, K) runs at M = 256 (tile and cluster shape).
It also times the library's TMA kernel at tiles ``launch_config`` never picks
(same bits by construction; checked).  An experiment: the library routes
nothing to the Gluon kernel (it lost everywhere, see its docstring).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.matmul.kernel import cdiv, launch_config, matmul_fwd_triton, reduction_config  # noqa: E402
from ws_matmul_kernel import mm_pipe, mm_ws  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
          "qkv": (6144, 4096), "gate_up": (24576, 4096)}
WS_CANDIDATES = [  # (tile width, stages, block_k, shared-memory epilogue); run 7: below the pipelined kernel
    ]
PIPE_CANDIDATES = [  # the 8-warp pipelined kernel: (tile width, stages, block_k, shared-memory epilogue)
    (192, 5, 64, False), (192, 4, 64, True), (96, 7, 64, False), (96, 6, 64, True), (128, 3, 128, False),
    (128, 3, 128, True), (128, 5, 64, True)]
TMA_TILES = [  # the library's TMA kernel at tiles launch_config does not pick today: (BM, BN, BK, warps, stages)
    ]  # run 3 timed 128x96, 64x192, 64x96, 128x64 and 64x256: none beat the default where it misses


def ws(x, w, bn, stages, bk, epi, restart=True):
    """The Gluon kernel; ``restart=False`` runs all of K as one chain (other
    bits: a diagnostic of what the segment restarts cost)."""
    M, K = x.shape
    N = w.shape[0]
    seg = reduction_config(N, K)["SEG_K"]
    n_seg = cdiv(K, seg) if restart else 1
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    return mm_ws(x, w, y, seg_k=seg if n_seg > 1 else cdiv(K, bk) * bk, n_seg=n_seg, BN=bn, BK=bk, num_buf=stages,
                 smem_epilogue=epi)


def pipe(x, w, bn, stages, bk, epi=False):
    M, K = x.shape
    N = w.shape[0]
    seg = reduction_config(N, K)["SEG_K"]
    n_seg = cdiv(K, seg)
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    return mm_pipe(x, w, y, seg_k=seg if n_seg > 1 else cdiv(K, bk) * bk, n_seg=n_seg, BN=bn, BK=bk, num_buf=stages,
                   smem_epilogue=epi)


def candidates():
    """(name, fn(x, w), bits must equal the default's)."""
    out = []
    for c in WS_CANDIDATES:
        bn, st, bk, epi = c
        out.append((f"ws{bn}s{st}k{bk}{'t' if epi else 'r'}", lambda x, w, c=c: ws(x, w, *c), True))
    for c in PIPE_CANDIDATES:
        out.append(("pipe{}s{}k{}{}".format(*c[:3], "t" if c[3] else "r"), lambda x, w, c=c: pipe(x, w, *c), True))
    for t in TMA_TILES:
        out.append(("tma{}x{}k{}w{}s{}".format(*t),
                    lambda x, w, t=t: matmul_fwd_triton(x, w, schedule="tma", block_m=t[0], block_n=t[1],
                                                        block_k=t[2], num_warps=t[3], num_stages=t[4]), True))
    return out


def cublas_names(ms):
    from torch.profiler import ProfilerActivity, profile
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in ms:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            torch.mm(x, w.t())
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                torch.mm(x, w.t())
                torch.cuda.synchronize()
            ks = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
            print(f"cublas {name} M={M}: {' | '.join(ks)}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="256,512,1024")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--names", action="store_true")
    a = ap.parse_args()
    ms = [int(m) for m in a.ms.split(",")]
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    if a.names:
        cublas_names([256])
    torch.manual_seed(0)
    # bits first, at ragged sizes: each candidate = the library default, and rows alone = rows in a batch
    w = torch.randn(12288, 4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    ref = matmul_fwd_triton(x, w)
    cands = candidates()
    for name, fn, exact in cands:
        full = fn(x, w)
        alone = all(torch.equal(fn(x[:m], w), ref[:m]) for m in (1, 77, 128, 200, 333))
        print(f"bits {name}: equal_default={torch.equal(full, ref)} rows_alone={alone}", flush=True)
    print("shape,M,default_cfg,default_ms,cublas_ms,default_ratio," +
          ",".join(f"{c[0]}_ratio" for c in cands) + ",best,best_ratio,all_same_bits", flush=True)
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in ms:
            if time.time() - t0 > a.budget_s:
                print("budget spent", flush=True)
                return
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            ref = matmul_fwd_triton(x, w)
            t_def = _time_graph(lambda: matmul_fwd_triton(x, w))
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            cfg = launch_config(M, N, K)
            ratios, same = [], True
            for c_name, fn, exact in cands:
                try:
                    same &= torch.equal(fn(x, w), ref) or not exact
                    ratios.append(t_cub / _time_graph(lambda: fn(x, w)))
                except Exception as e:  # noqa: BLE001 - a candidate that does not fit is reported, not fatal
                    print(f"  {name} M={M} {c_name}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                    ratios.append(float("nan"))
            best = max(range(len(ratios)), key=lambda i: ratios[i] if ratios[i] == ratios[i] and cands[i][2] else -1)
            print(f"{name},{M},{cfg['schedule']}{cfg['BLOCK_M']}x{cfg['BLOCK_N']},{t_def:.4f},{t_cub:.4f},"
                  f"{t_cub / t_def:.3f}," + ",".join(f"{r:.3f}" for r in ratios) +
                  f",{cands[best][0]},{ratios[best]:.3f},{same}", flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
