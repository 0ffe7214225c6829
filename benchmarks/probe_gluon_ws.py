"""The Gluon GEMM warp-specialized (a producer warp issues every TMA load) against its one-partition form (H200).

    python benchmarks/probe_gluon_ws.py [--m 128,192,256,...] [--tiles 192:64,128:128,96:64]

Session 9's ncu of the Gluon kernel at gate/up M = 256 showed its warps
stalled at CTA barriers in ~35% of their issue gaps: Triton 3.6 emits them
around the expect + TMA issue that the one-partition kernel runs between its
wgmmas.  ``gluon_kernel._mm_ws_kernel`` moves the loads to a producer warp
(``gl.warp_specialize``) with a ready / empty barrier pair per ring stage;
its MMA warps run the same per-element arithmetic.  Printed per cell: cuBLAS
time, the default's ratio (cuBLAS time / ours), and per Gluon tile the
one-partition and the warp-specialized kernel's ratios; every output is
checked equal (torch.equal) to the eager default (Triton's kernels) first.
CUDA-graph replay with L2 flushed (``bench_primitives._time_graph``).
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


def gluon(x, w, BN, BK, ws):
    M, K = x.shape
    n_seg = -(-K // 1024)
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def run():
        y = torch.empty((M, w.shape[0]), dtype=x.dtype, device=x.device)
        return gluon_kernel.matmul_fwd_gluon(x, w, y, seg_k=1024, n_seg=n_seg, BN=BN, BK=BK,
                                             stages=gluon_kernel.pipeline_stages(BN, BK), sms=sms, ws=ws)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="128,192,256,384,512,768,1024,4096")
    ap.add_argument("--tiles", default="192:64,128:128,96:64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    tiles = [tuple(int(v) for v in t.split(":")) for t in a.tiles.split(",")]
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    print("shape,M,cublas_us,default_x," + ",".join(f"g{bn}k{bk}_{k}_x" for bn, bk in tiles for k in ("pipe", "ws")),
          flush=True)
    torch.manual_seed(0)
    bad = 0
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        for M in (int(m) for m in a.m.split(",")):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = mm.matmul_fwd_triton(x, w)  # eager: Triton's kernels
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            out = [f"{1e3 * t_cub:.1f}", f"{t_cub / _time_graph(lambda: mm.matmul_fwd_triton(x, w)):.3f}"]
            for bn, bk in tiles:
                for ws in (False, True):
                    fn = gluon(x, w, bn, bk, ws)
                    if not torch.equal(fn(), ref):
                        bad += 1
                        out.append("NOT_EXACT")
                        continue
                    out.append(f"{t_cub / _time_graph(fn):.3f}")
            print(f"{name},{M}," + ",".join(out), flush=True)
    print(f"bits: {'all equal' if not bad else f'{bad} launches differ'}")


if __name__ == "__main__":
    main()
