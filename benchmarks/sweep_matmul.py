"""Sweep the matmul's bit-neutral launch knobs on the GPU at the reduction
order's SEG_K: time (CUDA-graph replay, L2 flushed: ``bench_primitives._time_graph``)
against cuBLAS, and whether the bits equal the default configuration's.

    python benchmarks/sweep_matmul.py [--ms 1,8,64,256] [--shapes 4096x4096,1024x4096] [--budget-s 200]

Prints, per (N, K, M): cuBLAS and default times, the fastest candidates, and
any candidate whose bits differ from the default (there should be none: every
knob here is documented bit-neutral in ``common/matmul/kernel.py``).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.matmul.kernel import matmul_fwd_triton  # noqa: E402

# (schedule, BM, BN, BK, num_warps, num_stages); BN 192: a tile of two column blocks (TMA only)
SMALL_M = [  # decode, M <= 64
    ("fused", 64, 64, 64, 4, 4), ("fused", 64, 64, 128, 4, 4), ("fused", 64, 128, 64, 4, 4),
    ("fused", 64, 256, 64, 4, 4), ("fused", 64, 32, 128, 4, 4),
    ("split", 64, 32, 128, 4, 4), ("split", 64, 64, 64, 4, 4), ("split", 64, 64, 128, 4, 4),
    ("split", 64, 128, 64, 4, 4), ("split", 64, 256, 64, 4, 4),
    ("tma", 64, 128, 128, 4, 4), ("tma", 64, 64, 128, 4, 4),
]
LARGE_M = [  # M > 64
    ("split", 64, 64, 64, 4, 4), ("split", 128, 64, 64, 4, 4), ("split", 128, 64, 64, 8, 4),
    ("split", 64, 32, 128, 4, 4), ("split", 128, 128, 64, 8, 3),
    ("tma", 128, 256, 64, 8, 3), ("tma", 128, 192, 64, 8, 4), ("tma", 128, 128, 64, 8, 4),
    ("tma", 128, 128, 128, 8, 3), ("tma", 128, 64, 128, 4, 4), ("tma", 64, 256, 64, 4, 4),
    ("tma", 64, 192, 128, 4, 3), ("tma", 64, 128, 128, 4, 4), ("tma", 64, 64, 128, 4, 4),
    ("tma", 64, 128, 64, 4, 4),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,64,128,256,512,1024,4096")
    ap.add_argument("--shapes", default="4096x4096,1024x4096,6144x4096,12288x4096,24576x4096,4096x12288",
                    help="NxK list")
    ap.add_argument("--budget-s", type=float, default=240)
    ap.add_argument("--top", type=int, default=5, help="fastest candidates printed per (N, K, M)")
    ap.add_argument("--schedules", default="fused,split,tma", help="schedules swept")
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    schedules = args.schedules.split(",")
    for shape in args.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        x = torch.randn(max(ms), K, device=dev).bfloat16()
        w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
        for M in ms:
            if time.time() > t_end:
                print(f"N={N} K={K} M={M} skipped (budget)", flush=True)
                continue
            xm = x[:M]
            ref = matmul_fwd_triton(xm, w)
            cub = _time_graph(lambda: torch.mm(xm, w.t()))
            dflt = _time_graph(lambda: matmul_fwd_triton(xm, w))
            res = []
            for sched, BM, BN, BK, nw, ns in (SMALL_M if M <= 64 else LARGE_M):
                if sched not in schedules:
                    continue
                f = lambda: matmul_fwd_triton(xm, w, schedule=sched, block_m=BM, block_n=BN, block_k=BK,
                                              num_warps=nw, num_stages=ns)
                try:
                    same = torch.equal(f(), ref)
                    res.append((_time_graph(f), sched, BM, BN, BK, nw, ns, same))
                except Exception as e:  # out of shared memory etc.
                    res.append((float("inf"), sched, BM, BN, BK, nw, ns, type(e).__name__))
            res.sort(key=lambda r: r[0])
            print(f"N={N} K={K} M={M} cublas={cub:.4f}ms default={dflt:.4f}ms ({cub / dflt:.2f}x)", flush=True)
            for r in res[:args.top]:
                print(f"   {r[0]:.4f}ms {cub / r[0]:.2f}x {r[1]} BM={r[2]} BN={r[3]} BK={r[4]} nw={r[5]} ns={r[6]} same_bits={r[7]}")
            bad = [r[1:7] for r in res if r[7] is False]
            if bad:
                print("   BITS DIFFER:", bad)


if __name__ == "__main__":
    main()
