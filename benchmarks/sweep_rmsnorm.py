"""Sweep RMSNorm's bit-neutral launch knobs (rows per program, num_warps) on
the GPU at Qwen3-8B's hidden size: time (CUDA-graph replay, L2 flushed)
against F.rms_norm, and whether the bits equal the default's.

    python benchmarks/sweep_rmsnorm.py [--ms 1,8,64,256,1024,4096,8192] [--h 4096,128]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402

from alignzoo.common.rmsnorm import rmsnorm_fwd  # noqa: E402

KNOBS = [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2), (4, 2), (4, 4), (8, 4), (8, 8), (16, 8)]  # (block_rows, num_warps)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,8,64,256,1024,4096,8192")
    ap.add_argument("--h", default="4096")
    args = ap.parse_args()
    ms = [int(m) for m in args.ms.split(",")]
    for H in (int(h) for h in args.h.split(",")):
        x = torch.randn(max(ms), H, device="cuda").bfloat16()
        r = torch.randn(max(ms), H, device="cuda").bfloat16()
        w = (1 + 0.1 * torch.randn(H, device="cuda")).bfloat16()
        for res in (None, r):
            for M in ms:
                xm, rm = x[:M], None if res is None else r[:M]
                ref = rmsnorm_fwd(xm, w, 1e-6, residual=rm)
                vendor = _time_graph(lambda: F.rms_norm(xm if rm is None else xm + rm, (H,), w, 1e-6))
                out = []
                for bm, nw in KNOBS:
                    f = lambda: rmsnorm_fwd(xm, w, 1e-6, residual=rm, block_rows=bm, num_warps=nw)
                    same = all(torch.equal(a, b) for a, b in zip(f()[:2], ref[:2]) if a is not None)
                    out.append((_time_graph(f), bm, nw, same))
                dflt = _time_graph(lambda: rmsnorm_fwd(xm, w, 1e-6, residual=rm))
                out.sort()
                best = " ".join(f"bm{bm}/nw{nw}:{vendor / t:.2f}x{'' if same else '!BITS'}" for t, bm, nw, same in out[:4])
                print(f"H={H} {'fused' if rm is not None else 'plain'} M={M} vendor={vendor:.4f}ms "
                      f"default={vendor / dflt:.2f}x best: {best}", flush=True)
                bad = [(bm, nw) for _, bm, nw, same in out if not same]
                if bad:
                    print("   BITS DIFFER:", bad)


if __name__ == "__main__":
    main()
