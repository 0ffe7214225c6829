"""Split-K launches of the matmul against cuBLAS at small and middle M (H200).

    python benchmarks/probe_split_matmul.py [--cells k/v:256,q/o:1,...] [--tiles 64x64x128:4:3,...]

For each (shape, M) cell: bits first (every variant equals the library's
default launch, rows of an M = 1024 batch: torch.equal), then CUDA-graph replay
with L2 flushed (bench_primitives._time_graph) as cuBLAS time / ours, of
  default      the library's launch_config pick
  split        the pointer-load split kernel + merge kernel (the default at M <= 64)
  split+pdl    the same two kernels, the merge launched with PDL (its launch
               overlaps the split's last wave; the split is compiled to trigger
               it but launched plainly)
  tma_split T  the TMA-load split kernel + merge at tile T = BMxBNxBK:warps:stages
Session 9 asks whether TMA loads lift k/v at M = 256 (0.78-0.81x in session 8)
and the decode streams.
"""
import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from probe_gluon_matmul import SHAPES  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402



def split_pdl(x, w, cfg):
    """The default split's kernels with the merge as a PDL dependent."""
    M, K = x.shape
    N = w.shape[0]
    S, BM, BN = triton.cdiv(K, 1024), cfg["BLOCK_M"], cfg["BLOCK_N"]

    def run():
        y = torch.empty((M, N), dtype=x.dtype, device=x.device)
        ws = torch.empty((S, M, N), dtype=torch.float32, device=x.device)
        mm._mm_split_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), S)](
            x, w, ws, M, N, K, x.stride(0), 1, w.stride(0), 1, SEG_K=1024, BLOCK_M=BM, BLOCK_N=BN,
            BLOCK_K=cfg["BLOCK_K"], IEEE=False, PDL=True, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        mm._mm_merge_kernel[(triton.cdiv(M * N, 1024),)](ws, y, M, N, N, 1, S, BLOCK=1024, PDL=True, launch_pdl=True)
        return y
    return run


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cells", default="k/v:256,k/v:1,k/v:64,q/o:1,q/o:64,down:1,down:64,qkv:1,qkv:64,gate/up:1")
    ap.add_argument("--tiles", default="64x64x128:4:3,64x64x64:4:4,128x64x64:4:4,128x64x64:8:4,64x128x64:4:4,"
                    "64x32x128:4:4,128x128x64:8:3")
    args = ap.parse_args()
    tiles = [(tuple(map(int, t.split(":")[0].split("x"))), *map(int, t.split(":")[1:])) for t in args.tiles.split(",")]
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    print("shape,M,default,default_x,split_x,split+pdl_x," + ",".join(
        f"tma_split{bm}x{bn}x{bk}w{nw}s{ns}_x" for (bm, bn, bk), nw, ns in tiles), flush=True)
    torch.manual_seed(0)
    for cell in args.cells.split(","):
        name, M = cell.split(":")
        M, (N, K) = int(M), SHAPES[name]
        w = (torch.randn(N, K, device="cuda") / K**0.5).bfloat16()
        full = torch.randn(1024, K, device="cuda").bfloat16()
        x = full[:M]
        ref = mm.matmul_fwd_triton(full, w)[:M]
        cfg = mm.launch_config(M, N, K)
        scfg = cfg if cfg["schedule"] == "split" else mm._split_config(M, N, K // 1024, 132)
        variants = [lambda: mm.matmul_fwd_triton(x, w),
                    lambda: mm.matmul_fwd_triton(x, w, schedule="split", block_m=scfg["BLOCK_M"],
                                                 block_n=scfg["BLOCK_N"], block_k=scfg["BLOCK_K"]),
                    split_pdl(x, w, scfg)]
        for (bm, bn, bk), nw, ns in tiles:
            variants.append(lambda bm=bm, bn=bn, bk=bk, nw=nw, ns=ns: mm.matmul_fwd_triton(
                x, w, schedule="tma_split", block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns))
        t_cub = _time_graph(lambda: torch.mm(x, w.t()))
        out = []
        for fn in variants:
            try:
                out.append(f"{t_cub / _time_graph(fn):.3f}" if torch.equal(fn(), ref) else "NOT_EXACT")
            except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                out.append(type(e).__name__)
        tag = f"{cfg['schedule']}{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
        print(f"{name},{M},{tag}," + ",".join(out), flush=True)


if __name__ == "__main__":
    main()
