"""Whole tiles for the full SM waves, a K split for the rest: does it lift the mid-M matmul cells? (H200)

    python benchmarks/probe_tail_split.py [--cells gate/up:384,qkv:384,...]

Session 9 (runs 7-9) left cells between M = 192 and 768 at 0.57-0.79x cuBLAS:
there 128-row tiles fill 1.1-1.5 waves of the 132 SMs, and no single tile or
split timed reaches 0.8x.  This probe composes two launches the library
already has on disjoint column ranges of y, each writing its own columns of
one output in place:

* the head: a persistent tile kernel (Gluon 192 / 128 wide, or Triton's TMA
  128 x 256 / 128 x 128) over the columns whose 128-row tiles fill whole
  waves of the SMs;
* the tail: the TMA split (+ its merge, PDL-paired as in the library) over
  the remaining columns, whose (tile, K segment) programs spread over every SM.

Each output element is the same segment chain added left to right whichever
launch computes it, so the bits must equal the default's (checked with
torch.equal before timing).  ``--order tail`` launches the tail first.
Printed per cell: cuBLAS time / ours for the default, and for each head the
best tail (its name and ratio) and every tail's ratio, CUDA-graph replay
with L2 flushed (``bench_primitives._time_graph``).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from probe_gluon_matmul import SHAPES  # noqa: E402
from alignzoo.common._pdl import pdl_pair  # noqa: E402
from alignzoo.common.matmul import gluon_kernel  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402

SEG_K = 1024
# head: (kind, BLOCK_N, BLOCK_K, num_stages); 128-row tiles
HEADS = {"g192": ("gluon", 192, 64, None), "g128": ("gluon", 128, 128, None),
         "t256": ("tma", 256, 64, 3), "t128": ("tma", 128, 128, 3)}
# tail: the TMA split's (BLOCK_M, BLOCK_N, BLOCK_K, num_stages), 4 warps
TAILS = {"s128x64": (128, 64, 64, 4), "s64x128": (64, 128, 64, 4), "s64x64": (64, 64, 64, 4),
         "s64x64k128": (64, 64, 128, 3), "s128x128": (128, 128, 64, 3), "s64x32": (64, 32, 128, 4)}


def full_wave_columns(M: int, N: int, bn: int, sms: int) -> int:
    """Columns of y whose 128-row tiles fill whole waves of ``sms`` programs (a multiple of bn)."""
    n_m, n_n = -(-M // 128), -(-N // bn)
    waves = (n_m * n_n) // sms
    return min(N, (waves * sms // n_m) * bn)


def head_launch(x, w, y, head, sms):
    """y = x · wᵀ by the persistent head kernel, in place (y may be a column slice)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    kind, BN, BK, ns = head
    M, K = x.shape
    N = w.shape[0]
    n_seg = -(-K // SEG_K)
    if kind == "gluon":
        gluon_kernel.matmul_fwd_gluon(x, w, y, seg_k=SEG_K, n_seg=n_seg, BN=BN, BK=BK,
                                      stages=gluon_kernel.pipeline_stages(BN, BK), sms=sms)
        return
    progs = min(sms, -(-M // 128) * -(-N // BN))
    d_w, d_y = TensorDescriptor.from_tensor(w, [BN, BK]), TensorDescriptor.from_tensor(y, [128, BN])
    mm._mm_tma_persistent_kernel[(progs,)](
        TensorDescriptor.from_tensor(x, [128, BK]), d_w, d_w, d_y, d_y, M, N, K, n_seg,
        SEG_K=SEG_K, BLOCK_M=128, BLOCK_N=BN, BLOCK_N2=0, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=progs,
        num_warps=8, num_stages=ns)


def tail_launch(x, w, y, tail):
    """The TMA split + merge into y (a column slice), as matmul_fwd_triton launches them."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    BM, BN, BK, ns = tail
    M, K = x.shape
    N = w.shape[0]
    n_seg = -(-K // SEG_K)
    ws = torch.empty((n_seg, M, N), dtype=torch.float32, device=x.device)
    pdl_split, pdl_merge = pdl_pair(x.device, M)
    mm._mm_tma_split_kernel[(-(-M // BM), -(-N // BN), n_seg)](
        TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]), ws, M, N,
        SEG_K=SEG_K, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=4, num_stages=ns, **pdl_split)
    mm._mm_merge_kernel[(-(-(M * N) // 1024),)](ws, y, M, N, y.stride(0), y.stride(1), n_seg, BLOCK=1024,
                                                **pdl_merge)


def composed(x, w, head, tail, sms, tail_first=False):
    M = x.shape[0]
    N = w.shape[0]
    cut = full_wave_columns(M, N, head[1], sms)

    def run():
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        parts = [lambda: cut and head_launch(x, w[:cut], y[:, :cut], head, sms),
                 lambda: cut < N and tail_launch(x, w[cut:], y[:, cut:], tail)]
        for p in (parts[::-1] if tail_first else parts):
            p()
        return y
    return run, cut


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="q/o:384,k/v:512,gate/up:256,gate/up:384,gate/up:768,down:384,"
                    "qkv:192,qkv:256,qkv:384,qkv:768,gate_up:192,gate_up:256,gate_up:384")
    ap.add_argument("--order", choices=("head", "tail", "both"), default="both")
    a = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    orders = {"head": [False], "tail": [True], "both": [False, True]}[a.order]
    torch.manual_seed(0)
    for cell in a.cells.split(","):
        name, M = cell.split(":")
        M, (N, K) = int(M), SHAPES[name]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        x = torch.randn(M, K, device="cuda").bfloat16()
        ref = mm.matmul_fwd_triton(x, w)
        t_cub = _time_graph(lambda: torch.mm(x, w.t()))
        t_def = _time_graph(lambda: mm.matmul_fwd_triton(x, w))
        print(f"{name} M={M}: cublas {1e3 * t_cub:.1f} us  default {t_cub / t_def:.3f}x", flush=True)
        for hname, head in HEADS.items():
            for tail_first in orders:
                res = {}
                for tname, tail in TAILS.items():
                    fn, cut = composed(x, w, head, tail, sms, tail_first)
                    try:
                        res[tname] = (t_cub / _time_graph(fn)) if torch.equal(fn(), ref) else "NOT_EXACT"
                    except Exception as e:  # noqa: BLE001 - a launch that does not fit is reported, not fatal
                        res[tname] = type(e).__name__
                num = {k: v for k, v in res.items() if isinstance(v, float)}
                best = max(num, key=num.get) if num else "-"
                cells = " ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
                print(f"  {hname}{'/tail-first' if tail_first else ''} cut={cut}/{N}: "
                      f"best {best} {num.get(best, float('nan')):.3f}x | {cells}", flush=True)


if __name__ == "__main__":
    main()
