"""Time the norm that merges a split matmul's partials against the merge
kernel followed by the norm (what it replaces), side by side, on the GPU.

    python benchmarks/bench_merge_norm.py [--ms 1,8,64] [--warps 2,4,8]

Per (K, M): the o projection (K = 4096, 4 segments) and the down projection
(K = 12288, 12 segments) of Qwen3-8B feeding the fused residual-add RMSNorm
(H = 4096).  Times are CUDA-graph replays of 20 calls each (PDL as the
engine launches them), median of 10; every variant's (y, residual, rstd) is
checked bitwise against the unfused pair first.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from alignzoo.common.matmul import matmul_partials_fwd  # noqa: E402
from alignzoo.common.matmul.kernel import _mm_merge_kernel  # noqa: E402
from alignzoo.common._pdl import pdl_options  # noqa: E402
from alignzoo.common.rmsnorm.kernel import rmsnorm_fwd_cuda, rmsnorm_merge_fwd_cuda  # noqa: E402


def merge(ws, dtype):
    S, M, N = ws.shape
    y = torch.empty(M, N, dtype=dtype, device=ws.device)
    _mm_merge_kernel[((M * N + 1023) // 1024,)](ws, y, M, N, N, 1, S, BLOCK=1024, **pdl_options(ws.device, M))
    return y


def time_graph(fn, calls=20, reps=10):
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / calls)
    return sorted(ts)[len(ts) // 2]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,64")
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args()
    dev, H, eps = torch.device("cuda"), 4096, 1e-6
    torch.manual_seed(0)
    w = (1 + 0.1 * torch.randn(H, device=dev)).bfloat16()
    for K in (4096, 12288):
        wt = (torch.randn(H, K, device=dev) / K**0.5).bfloat16()
        for M in (int(m) for m in args.ms.split(",")):
            x = torch.randn(M, K, device=dev).bfloat16()
            res = torch.randn(M, H, device=dev).bfloat16()
            ws = matmul_partials_fwd(x, wt)
            want = rmsnorm_fwd_cuda(merge(ws, x.dtype), w, eps, res)
            t_old = time_graph(lambda: rmsnorm_fwd_cuda(merge(ws, x.dtype), w, eps, res))
            row = [f"K={K} S={ws.shape[0]} M={M}: merge + norm {t_old * 1e3:.2f} us"]
            for nw in (int(n) for n in args.warps.split(",")):
                got = rmsnorm_merge_fwd_cuda(ws, x.dtype, w, eps, res, num_warps=nw)
                same = all(torch.equal(a, b) for a, b in zip(got, want))
                t = time_graph(lambda: rmsnorm_merge_fwd_cuda(ws, x.dtype, w, eps, res, num_warps=nw))
                row.append(f"merged nw={nw} {t * 1e3:.2f} us ({t_old / t:.2f}x) same_bits={same}")
            print(" | ".join(row), flush=True)


if __name__ == "__main__":
    main()
