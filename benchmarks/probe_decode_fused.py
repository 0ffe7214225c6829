"""Decode matmuls without the split's merge: narrow fused tiles against the default at M = 1 and 8 (H200).

    python benchmarks/probe_decode_fused.py [--ms 1,8] [--bn 16,32] [--bk 64,128,256] [--stages 4,6]

At batch 1 the decode graph's split matmuls (qkv, o, down) and their merge
kernels took 1.97 + 0.49 ms of a 5.26 ms replay (session 9, run 1), while the
fused gate_up, which needs no merge, streamed its weight at 92% of copy
bandwidth.  The split exists to give every SM work when 64-wide tiles are too
few (qkv: 96, q/o and down: 64); 16- or 32-wide fused tiles make 2-4x as
many programs, each walking all of K with the segment chains kept in
registers, and no fp32 partials or merge launch.  Every candidate's bits are
checked equal to the default's (torch.equal) before it is timed; a 16-wide
tile runs wgmma n16, which no earlier sweep covered.

Printed per cell: cuBLAS time, the default's ratio (cuBLAS time / ours), the
best fused launch and its ratio, and every candidate; then per M the sum over
one layer's four projections (qkv, o, down, gate_up), default against the
best candidate per shape.  CUDA-graph replay with L2 flushed, inside
``graph_launches()`` (``bench_primitives._time_graph``), PDL as the engine
launches them.
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from probe_gluon_matmul import SHAPES  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402

LAYER = ("qkv", "q/o", "down", "gate_up")  # one decoder layer's projections (o has q/o's shape)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--bn", default="16,32")
    ap.add_argument("--bk", default="64,128,256")
    ap.add_argument("--stages", default="4,6")
    a = ap.parse_args()
    cands = [(bn, bk, ns) for bn in map(int, a.bn.split(",")) for bk in map(int, a.bk.split(","))
             for ns in map(int, a.stages.split(",")) if (64 + bn) * bk * 2 * ns <= mm._SMEM]
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    torch.manual_seed(0)
    layer = {}
    bad = 0
    for M in map(int, a.ms.split(",")):
        for name, (N, K) in SHAPES.items():
            w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = mm.matmul_fwd_triton(x, w)
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            t_def = _time_graph(lambda: mm.matmul_fwd_triton(x, w))
            res = {}
            for bn, bk, ns in cands:
                def fn(bn=bn, bk=bk, ns=ns):
                    return mm.matmul_fwd_triton(x, w, schedule="fused", block_m=64, block_n=bn, block_k=bk,
                                                num_warps=4, num_stages=ns)
                tag = f"f64x{bn}x{bk}s{ns}"
                try:
                    if not torch.equal(fn(), ref):
                        bad += 1
                        res[tag] = "NOT_EXACT"
                        continue
                    res[tag] = _time_graph(fn)
                except Exception as e:  # noqa: BLE001 - a launch that does not fit is reported, not fatal
                    res[tag] = type(e).__name__
            times = {k: v for k, v in res.items() if isinstance(v, float)}
            best = min(times, key=times.get) if times else None
            layer[M, name] = (t_def, times[best] if best else t_def)
            cells = " ".join(f"{k}={t_cub / v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in res.items())
            print(f"{name} M={M}: cublas {1e3 * t_cub:.1f} us  default {t_cub / t_def:.3f}x  best {best} "
                  f"{t_cub / times[best] if best else float('nan'):.3f}x | {cells}", flush=True)
        d = sum(layer[M, n][0] for n in LAYER)
        b = sum(min(layer[M, n]) for n in LAYER)
        print(f"M={M} one layer (qkv + o + down + gate_up): default {1e3 * d:.1f} us, best per shape {1e3 * b:.1f} us "
              f"-> x36 layers {36 * d:.3f} -> {36 * b:.3f} ms", flush=True)
    print(f"bits: {'all equal' if not bad else f'{bad} launches differ'}")


if __name__ == "__main__":
    main()
