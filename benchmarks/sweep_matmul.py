"""Sweep matmul launch/reduction parameters on the GPU: time, and whether the
bits equal the default configuration's (which knobs are bit-neutral).

    python benchmarks/sweep_matmul.py
"""
import itertools

import torch
import triton.testing

from alignzoo.common.matmul.kernel import matmul_fwd_triton


def t(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


torch.manual_seed(0)
dev = torch.device("cuda")
for N, K in [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]:
    x = torch.randn(8192, K, device=dev).bfloat16()
    w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
    for M in (1, 64, 256, 1024, 8192):
        xm = x[:M]
        ref = matmul_fwd_triton(xm, w)
        cub = t(lambda: torch.mm(xm, w.t()))
        res = []
        cands = []
        for BM, BN, BK, nw, ns in [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4),
                                   (128, 256, 64, 8, 4), (128, 128, 128, 8, 3), (64, 256, 64, 4, 4),
                                   (64, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 64, 128, 4, 4), (128, 256, 128, 8, 3)]:
            for seg in (1024, 2048):
                for sched in (("fused", "split") if M <= 256 else ("fused",)):
                    cands.append((BM, BN, BK, nw, ns, seg, sched))
        for BM, BN, BK, nw, ns, seg, sched in cands:
            try:
                f = lambda: matmul_fwd_triton(xm, w, block_m=BM, num_warps=nw, num_stages=ns, schedule=sched,
                                              block_n=BN, block_k=BK, _reduction={"SEG_K": seg})
                same = torch.equal(f(), ref)
                res.append((t(f), BM, BN, BK, nw, ns, seg, sched, same))
            except Exception as e:  # out of shared memory etc.
                res.append((float("inf"), BM, BN, BK, nw, ns, seg, sched, type(e).__name__))
        res.sort(key=lambda r: r[0])
        print(f"N={N} K={K} M={M} cublas={cub:.4f}ms default={t(lambda: matmul_fwd_triton(xm, w)):.4f}ms")
        for r in res[:6]:
            print(f"   {r[0]:.4f}ms ratio={cub / r[0]:.2f} BM={r[1]} BN={r[2]} BK={r[3]} nw={r[4]} ns={r[5]} seg={r[6]} {r[7]} same_bits={r[8]}")
        neutral = {k: set() for k in ("BM", "BN", "BK", "nw", "ns", "seg", "sched")}
        print("   bit-changing configs:", [r[1:8] for r in res if r[8] is False][:8])
