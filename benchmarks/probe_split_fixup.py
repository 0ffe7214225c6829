"""The split schedule's in-kernel merge against its two-kernel form and cuBLAS (H200).

    python benchmarks/probe_split_fixup.py [--ms 1,8,64,256] [--tiles 64x64x64:4,64x32x128:4,...]

For each Qwen3-8B (N, K) and M where the default launch is the split
schedule: bits first (the one-kernel split, where the last program of a tile
to arrive merges the S partials, equals the two-kernel split, and rows
computed alone equal rows of an M = 1024 batch: torch.equal), then CUDA-graph
replay with L2 flushed (bench_primitives._time_graph) of cuBLAS, the
two-kernel split (``kernel.SPLIT_FIXUP = False``) and the one-kernel split,
as cuBLAS time / ours.  ``--tiles`` also times explicit split tiles
(BMxBNxBK:warps) with the merge in place at k/v, M = 256 (session 8's one
matmul cell below 0.8x cuBLAS).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
          "qkv": (6144, 4096), "gate_up": (24576, 4096)}


def split_fn(x, w, fixup: bool, **knobs):
    def run():
        mm.SPLIT_FIXUP = fixup
        return mm.matmul_fwd_triton(x, w, schedule="split", **knobs)
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,8,64,256")
    ap.add_argument("--tiles", default="")
    args = ap.parse_args()
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    print("shape,M,launch,bits,cublas/two_kernel,cublas/one_kernel,one/two speedup", flush=True)
    for name, (N, K) in SHAPES.items():
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        full = torch.randn(1024, K, device="cuda").bfloat16()
        ref = mm.matmul_fwd_triton(full, w)
        for M in map(int, args.ms.split(",")):
            cfg = mm.launch_config(M, N, K)
            if cfg["schedule"] != "split":
                print(f"{name},{M},{cfg['schedule']},-,-,-,-", flush=True)
                continue
            x = full[:M]
            two, one = split_fn(x, w, False)(), split_fn(x, w, True)()
            exact = torch.equal(one, two) and torch.equal(one, ref[:M])
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            t_two = _time_graph(split_fn(x, w, False))
            t_one = _time_graph(split_fn(x, w, True))
            tile = f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
            print(f"{name},{M},split {tile},{'exact' if exact else 'NOT EXACT'},{t_cub / t_two:.3f},"
                  f"{t_cub / t_one:.3f},{t_two / t_one:.3f}", flush=True)
    if args.tiles:
        N, K = SHAPES["k/v"]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        x = torch.randn(256, K, device="cuda").bfloat16()
        ref = mm.matmul_fwd_triton(x, w)
        t_cub = _time_graph(lambda: torch.mm(x, w.t()))
        print("k/v M=256 tile sweep: tile,warps,stages,bits,cublas/one_kernel", flush=True)
        for spec in args.tiles.split(","):
            tile, nw = spec.split(":")
            bm, bn, bk = map(int, tile.split("x"))
            for ns in (3, 4):
                fn = split_fn(x, w, True, block_m=bm, block_n=bn, block_k=bk, num_warps=int(nw), num_stages=ns)
                exact = torch.equal(fn(), ref)
                print(f"{tile},{nw},{ns},{'exact' if exact else 'NOT EXACT'},"
                      f"{t_cub / _time_graph(fn) if exact else float('nan'):.3f}", flush=True)
    mm.SPLIT_FIXUP = True
    print("counters zero at rest:", not any(c.any() for c in mm._COUNTERS.values()), flush=True)


if __name__ == "__main__":
    main()
