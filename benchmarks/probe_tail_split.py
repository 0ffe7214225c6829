"""Whole tiles for the full SM waves, a K split for the rest: does it lift the mid-M matmul cells? (H200)

    python benchmarks/probe_tail_split.py [--cells gate/up:384,qkv:384,...]

Session 9 (runs 7-9) left cells between M = 192 and 768 at 0.57-0.79x cuBLAS:
there 128-row tiles fill 1.1-1.5 waves of the 132 SMs, and no single tile or
split timed reaches 0.8x.  This probe composes two launches the library
already has on disjoint column ranges of y: the Gluon kernel over the columns
whose tiles fill whole waves, and the TMA split (+ merge) over the remaining
columns, whose (tile, segment) programs spread over every SM.  Each output
element is the same segment chain added left to right whichever launch
computes it, so the bits must equal the default's (checked, torch.equal,
before timing).  The tail is computed into its own tensor and copied in (a
library schedule would write it in place), so the times here are slightly
pessimistic.  Printed: cuBLAS time / ours for the default and each
(tile width, tail tile) pair, CUDA-graph replay with L2 flushed.

Written in session 9 after its device time was spent: not yet run.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from probe_gluon_matmul import SHAPES  # noqa: E402
from alignzoo.common.matmul import gluon_kernel  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402

TAILS = {"s128x64": dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
         "s64x128": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
         "s64x64": dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4)}


def full_wave_columns(M: int, N: int, bn: int, sms: int) -> int:
    """Columns of y whose 128-row tiles fill whole waves of ``sms`` programs (a multiple of bn)."""
    n_m, n_n = -(-M // 128), -(-N // bn)
    waves = (n_m * n_n) // sms
    return min(N, (waves * sms // n_m) * bn)


def tail_split(x, w, bn: int, tail: dict, sms: int):
    M, K = x.shape
    N = w.shape[0]
    cut = full_wave_columns(M, N, bn, sms)
    n_seg = -(-K // 1024)
    stages = gluon_kernel.pipeline_stages(bn)

    def run():
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        if cut:
            gluon_kernel.matmul_fwd_gluon(x, w[:cut], y[:, :cut], seg_k=1024, n_seg=n_seg, BN=bn, BK=64,
                                          stages=stages, sms=sms)
        if cut < N:
            y[:, cut:].copy_(mm.matmul_fwd_triton(x, w[cut:], schedule="tma_split", **tail))
        return y
    return run, cut


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="gate/up:384,qkv:384,qkv:768,q/o:384,down:384,gate_up:192,qkv:192,"
                    "gate/up:768,k/v:512")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    cols = [f"g{bn}+{t}" for bn in (192, 128) for t in TAILS]
    print("shape,M,default_x," + ",".join(f"{c}_x" for c in cols) + ",cuts", flush=True)
    torch.manual_seed(0)
    for cell in a.cells.split(","):
        name, M = cell.split(":")
        M, (N, K) = int(M), SHAPES[name]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = mm.matmul_fwd_triton(x, w)
        t_cub = _time_graph(lambda: torch.mm(x, w.t()))
        out, cuts = [f"{t_cub / _time_graph(lambda: mm.matmul_fwd_triton(x, w)):.3f}"], []
        for bn in (192, 128):
            for tail in TAILS.values():
                fn, cut = tail_split(x, w, bn, tail, sms)
                try:
                    out.append(f"{t_cub / _time_graph(fn):.3f}" if torch.equal(fn(), ref) else "NOT_EXACT")
                except Exception as e:  # noqa: BLE001 - a launch that does not fit is reported, not fatal
                    out.append(type(e).__name__)
            cuts.append(f"{bn}:{cut}")
        print(f"{name},{M}," + ",".join(out) + "," + " ".join(cuts), flush=True)


if __name__ == "__main__":
    main()
