"""The Gluon GEMM against Triton's at the same tile, and both against cuBLAS (H200).

    python benchmarks/probe_gluon_matmul.py [--ms 128,192,256,384,512,768,1024] [--budget-s 200] [--names]

For each Qwen3-8B (N, K) and M: the library default's launch inside
``graph_launches()`` (as CUDA graphs run it), its time, the time of Triton's
TMA kernel at the same tile where that default is the Gluon kernel
(``schedule="tma"`` with the same BLOCK_M/N/K), and cuBLAS's, CUDA-graph
replay with L2 flushed (bench_primitives._time_graph).  Bits first: the
default equals Triton's kernel at the same tile and rows computed alone equal
rows in the batch (torch.equal), at ragged M.  ``--names`` prints the cuBLAS
kernel each (N, K) runs at M = 256 (its tile, stages and cluster shape).

History: session 8 measured a warp-specialized Gluon kernel (one TMA producer
warp, two consumer warpgroups) here first; it kept the bits but ran 0.65-0.80x
cuBLAS, below the software-pipelined kernel the library now has (commit
a18a19a holds it; records ...-session8-ws-probe-run{1,2,3}.txt).
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.matmul import graph_launches  # noqa: E402
from alignzoo.common.matmul.kernel import launch_config, matmul_fwd_triton  # noqa: E402

SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "gate/up": (12288, 4096), "down": (4096, 12288),
          "qkv": (6144, 4096), "gate_up": (24576, 4096)}


def triton_same_tile(x, w, cfg):
    return matmul_fwd_triton(x, w, schedule="tma", block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                             block_k=cfg["BLOCK_K"])


def ref_rows(x, w):
    return matmul_fwd_triton(x, w)  # eager default: Triton's kernels


def cublas_names():
    from torch.profiler import ProfilerActivity, profile
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(256, K, device="cuda", dtype=torch.bfloat16)
        torch.mm(x, w.t())
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.mm(x, w.t())
            torch.cuda.synchronize()
        ks = [e.key for e in prof.key_averages() if e.device_type.name == "CUDA"]
        print(f"cublas {name} M=256: {' | '.join(ks)}", flush=True)


def check_bits():
    """Default (Gluon where it picks it) = Triton's kernel at the same tile = rows alone, at ragged M."""
    ok = True
    for N, K in ((12288, 4096), (6144, 4096), (4096, 12288), (200, 2100)):
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(1000, K, device="cuda", dtype=torch.bfloat16)
        for M in (129, 256, 333, 777, 1000):
            with graph_launches():  # the defaults a CUDA graph runs: Gluon where it picks it
                cfg = launch_config(M, N, K)
                y = matmul_fwd_triton(x[:M], w)
            # Triton's TMA kernel at the same tile (run 9 of session 8 asked it of K = 2100, whose
            # rows are not 16-byte aligned: a TMA tile only where the default is one)
            tma = cfg["schedule"] in ("tma", "gluon", "gluon_ws")
            same = torch.equal(y, triton_same_tile(x[:M], w, cfg) if tma else matmul_fwd_triton(x[:M], w))
            with graph_launches():
                alone = all(torch.equal(matmul_fwd_triton(x[i:i + r], w), y[i:i + r]) for i, r in ((0, 1), (M - 77, 77)))
            tag = f"{cfg['schedule']}{cfg['BLOCK_M']}x{cfg['BLOCK_N']}k{cfg['BLOCK_K']}s{cfg['num_stages']}"
            print(f"bits N={N} K={K} M={M} {tag}: equal_triton_same_tile={same} rows_alone={alone}", flush=True)
            ok &= same and alone
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="128,192,256,384,512,768,1024")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--names", action="store_true")
    ap.add_argument("--sweep", default="", help="Gluon tiles to time too, as WIDTHxBK:STAGES[,...], e.g. "
                    "192x64:3,192x64:4,96x64:6,96x64:7,128x128:2,128x64:5 (explicit schedule='gluon')")
    a = ap.parse_args()
    sweep = [(int(t.split("x")[0]), int(t.split("x")[1].split(":")[0]), int(t.split(":")[1]))
             for t in a.sweep.split(",") if t]
    t0 = time.time()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__} commit {os.environ.get('ALIGNZOO_COMMIT', '?')}",
          flush=True)
    if a.names:
        cublas_names()
    torch.manual_seed(0)
    print(f"bits all equal: {check_bits()}", flush=True)
    print("shape,M,default,default_ms,triton_same_tile_ms,cublas_ms,default_ratio,triton_same_tile_ratio"
          + "".join(f",gluon{bn}k{bk}s{ns}_ratio" for bn, bk, ns in sweep), flush=True)
    for name in a.shapes.split(","):
        N, K = SHAPES[name]
        w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
        for M in (int(m) for m in a.ms.split(",")):
            if time.time() - t0 > a.budget_s:
                print("budget spent", flush=True)
                return
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            cfg = launch_config(M, N, K)  # what _time_graph's graph_launches() block runs
            t_def = _time_graph(lambda: matmul_fwd_triton(x, w))
            t_cub = _time_graph(lambda: torch.mm(x, w.t()))
            t_tri = _time_graph(lambda: triton_same_tile(x, w, cfg)) if cfg["schedule"] == "gluon" else float("nan")
            tag = f"{cfg['schedule']}{cfg['BLOCK_M']}x{cfg['BLOCK_N']}k{cfg['BLOCK_K']}s{cfg['num_stages']}"
            extra = ""
            for bn, bk, ns in sweep:  # same bits by construction: checked before timing
                def run(bn=bn, bk=bk, ns=ns):
                    return matmul_fwd_triton(x, w, schedule="gluon", block_n=bn, block_k=bk, num_stages=ns)
                try:
                    extra += f",{t_cub / _time_graph(run):.3f}" if torch.equal(run(), ref_rows(x, w)) else ",not_exact"
                except Exception as e:  # noqa: BLE001 - a tile that does not fit is reported, not fatal
                    extra += f",{type(e).__name__}"
            print(f"{name},{M},{tag},{t_def:.4f},{t_tri:.4f},{t_cub:.4f},{t_cub / t_def:.3f},{t_cub / t_tri:.3f}"
                  + extra, flush=True)
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
