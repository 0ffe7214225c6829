"""Every 128-1024-row launch candidate of the matmul at the Qwen3-8B shapes, timed (H200).

    python benchmarks/sweep_mid_m.py [--ms 128,192,256,384,512,768] [--budget-s 200]

For each (shape, M): each candidate's bits against the default (torch.equal),
then CUDA-graph replay with L2 flushed inside ``graph_launches()``
(bench_primitives._time_graph), printed as cuBLAS time / ours.  Candidates:
Gluon 128-row tiles (192, 128, 96, 64 wide), Triton's TMA tiles (64x64,
64x128, 128x128, 128x256) and TMA splits (64x64, 128x64, 64x128).  Session 9
found cells below 0.8x between the suite's M = 256 and 1024 (q/o 384, k/v
384-512, gate/up 384, qkv 192-768, gate_up 192); this is the data to route them.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from probe_gluon_matmul import SHAPES  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402

CANDIDATES = {  # name: matmul_fwd_triton knobs
    "g192": dict(schedule="gluon", block_n=192, block_k=64),
    "g128k128": dict(schedule="gluon", block_n=128, block_k=128),
    "g96": dict(schedule="gluon", block_n=96, block_k=64),
    "g64": dict(schedule="gluon", block_n=64, block_k=64),
    "t64x64": dict(schedule="tma", block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4),
    "t64x128": dict(schedule="tma", block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4),
    "t128x128": dict(schedule="tma", block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
    "t128x256": dict(schedule="tma", block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    "s64x64": dict(schedule="tma_split", block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4),
    "s128x64": dict(schedule="tma_split", block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4),
    "s64x128": dict(schedule="tma_split", block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,192,256,384,512,768")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=200)
    a = ap.parse_args()
    t0 = time.time()
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    print("shape,M,default," + ",".join(CANDIDATES) + ",default_x", flush=True)
    torch.manual_seed(0)
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        for M in map(int, a.ms.split(",")):
            if time.time() - t0 > a.budget_s:
                print("budget spent", flush=True)
                return
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = mm.matmul_fwd_triton(x, w)
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            out = []
            for knobs in CANDIDATES.values():
                fn = lambda knobs=knobs: mm.matmul_fwd_triton(x, w, **knobs)  # noqa: E731
                try:
                    out.append(f"{t_cub / _time_graph(fn):.3f}" if torch.equal(fn(), ref) else "NOT_EXACT")
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                    out.append(type(e).__name__)
            cfg = mm.launch_config(M, N, K)
            tag = f"{cfg['schedule']}{cfg['BLOCK_M']}x{cfg['BLOCK_N']}k{cfg['BLOCK_K']}"
            t_def = _time_graph(lambda: mm.matmul_fwd_triton(x, w))
            print(f"{name},{M},{tag}," + ",".join(out) + f",{t_cub / t_def:.3f}", flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
