"""Sweep TMA-kernel variants at M = 128-1024 against cuBLAS and the default's bits (H200).

    python benchmarks/sweep_matmul_variants.py [--ms 256,512] [--shapes 12288x4096] [--budget-s 200]

An experiment, not a library path.  Candidates are the library's TMA kernel
(``matmul_fwd_triton(schedule="tma", ...)``) at 16-warp and 256-row tiles
beside its own, and ``_one_loop_kernel``: the library kernel's two-column-block
tiles (192 = 128 + 64 wide) in one k-loop over all of K that restarts both
chains after each segment's last step, as its power-of-two tiles already do,
instead of a loop per segment (which drains the software pipeline at every
segment boundary).  With 8 warps that loop's four accumulators spilled
(session 5); 16 warps halve the registers each thread holds.  Each
candidate's bits are compared with the library default's (torch.equal): the
per-element k16 chain is the same whatever the tile, warps or loop shape, so
every line should say same_bits=True.  Session 7's run of it:
benchmarks/results/2026-11-30-h200-session7-matmul-variants.txt.
"""
import argparse
import os
import sys
import time

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.matmul.kernel import _tile_coords, column_blocks, matmul_fwd_triton  # noqa: E402


@triton.jit(do_not_specialize=["M"])
def _one_loop_kernel(d_x, d_w, d_w2, d_y, d_y2, M, N, K, N_SEG,
                     SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                     NUM_PROGS: tl.constexpr):
    """``_mm_tma_persistent_kernel``'s two-column-block branch, one k-loop."""
    BLOCK_W: tl.constexpr = BLOCK_N + BLOCK_N2
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_W)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGS, flatten=False):
        i_m, i_n = _tile_coords(tile, n_m, n_n, GROUP_M)
        o_m, o_n = i_m * BLOCK_M, i_n * BLOCK_W
        b_total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_total2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        b_acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        for kk in range(0, N_SEG * SEG_K, BLOCK_K):
            b_x = d_x.load([o_m, kk])
            b_acc = tl.dot(b_x, d_w.load([o_n, kk]).T, b_acc)
            b_acc2 = tl.dot(b_x, d_w2.load([o_n + BLOCK_N, kk]).T, b_acc2)
            if (kk + BLOCK_K) % SEG_K == 0:
                b_total += b_acc
                b_total2 += b_acc2
                b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                b_acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
        d_y2.store([o_m, o_n + BLOCK_N], b_total2.to(d_y2.dtype))
        d_y.store([o_m, o_n], b_total.to(d_y.dtype))


def variant(x, w, BM, BN, BK, nw, ns, one_loop):
    """One candidate: the library's TMA kernel at this tile, or (one_loop, a
    192- or 96-wide tile) ``_one_loop_kernel`` launched as the library would."""
    if not one_loop:
        return matmul_fwd_triton(x, w, schedule="tma", block_m=BM, block_n=BN, block_k=BK, num_warps=nw,
                                 num_stages=ns)
    from triton.tools.tensor_descriptor import TensorDescriptor

    M, K = x.shape
    N = w.shape[0]
    bn, bn2 = column_blocks(BN)
    if not bn2:
        raise ValueError(f"one_loop is for tiles of two column blocks, not {BN}")
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    progs = min(torch.cuda.get_device_properties(x.device).multi_processor_count, triton.cdiv(M, BM) * triton.cdiv(N, BN))
    _one_loop_kernel[(progs,)](
        TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [bn, BK]),
        TensorDescriptor.from_tensor(w, [bn2, BK]), TensorDescriptor.from_tensor(y, [BM, bn]),
        TensorDescriptor.from_tensor(y, [BM, bn2]), M, N, K, triton.cdiv(K, 1024), SEG_K=1024, BLOCK_M=BM,
        BLOCK_N=bn, BLOCK_N2=bn2, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=progs, num_warps=nw, num_stages=ns)
    return y


# (BM, BN, BK, num_warps, num_stages, one_loop)
CANDIDATES = [
    (128, 256, 64, 8, 3, False), (128, 256, 64, 16, 3, False), (128, 256, 64, 16, 4, False),
    (128, 192, 64, 8, 4, False), (128, 192, 64, 8, 4, True), (128, 192, 64, 16, 4, True),
    (128, 192, 64, 16, 3, True), (256, 128, 64, 16, 3, False), (256, 96, 64, 16, 4, True),
    (128, 96, 64, 8, 4, True),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="256,512,128,1024")
    ap.add_argument("--shapes", default="12288x4096,6144x4096,24576x4096,1024x4096")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--top", type=int, default=6)
    args = ap.parse_args()
    t_end = time.time() + args.budget_s
    torch.manual_seed(0)
    dev = torch.device("cuda")
    ms = [int(m) for m in args.ms.split(",")]
    for M in ms:
        for shape in args.shapes.split(","):
            N, K = (int(v) for v in shape.split("x"))
            if time.time() > t_end:
                print(f"N={N} K={K} M={M} skipped (budget)", flush=True)
                continue
            x = torch.randn(M, K, device=dev).bfloat16()
            w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
            ref = matmul_fwd_triton(x, w)
            cub = _time_graph(lambda: torch.mm(x, w.t()))
            dflt = _time_graph(lambda: matmul_fwd_triton(x, w))
            res = []
            for c in CANDIDATES:
                f = lambda: variant(x, w, *c)
                try:
                    same = torch.equal(f(), ref)
                    res.append((_time_graph(f), c, same))
                except Exception as e:  # out of shared memory / registers etc.
                    res.append((float("inf"), c, type(e).__name__))
            res.sort(key=lambda r: r[0])
            print(f"N={N} K={K} M={M} cublas={cub:.4f}ms default={dflt:.4f}ms ({cub / dflt:.2f}x)", flush=True)
            for t, c, same in res[:args.top]:
                print(f"   {t:.4f}ms {cub / t:.2f}x BM={c[0]} BN={c[1]} BK={c[2]} nw={c[3]} ns={c[4]} "
                      f"one_loop={c[5]} same_bits={same}", flush=True)
            bad = [c for _, c, same in res if same is False]
            if bad:
                print("   BITS DIFFER:", bad, flush=True)
            failed = [(c, same) for t, c, same in res if t == float("inf")]
            if failed:
                print("   FAILED:", failed, flush=True)


if __name__ == "__main__":
    main()
