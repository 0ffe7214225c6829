"""Does a row of a Triton ``tl.dot`` depend on anything but that row?  The question an MMA form of
an exact kernel stands on: a decode step that pads its one row into the prefill's tile must get
the prefill's bits for that row.

    python benchmarks/experiments/probe_mma_rows.py --out DIR   # CUDA; writes probe_mma_rows.json / .md

For fp32 operands, per input precision (tf32x3, tf32, ieee) and tile (M rows, N columns, K-step BK,
warps), against the full tile's product (random A (M, K), B (K, N), K = 128):

  alone     row r of A with every other row zero
  moved     row r of A at another row of the tile (the rows rotated)
  stale     A's columns k >= K/2 zero in row r, and B's rows k >= K/2 other finite values: the row
            must not see them (a masked, stale operand)
  bk        the same tile with the K loop in steps of another BK
  m16/m64   the same row through a 16-row tile and a 64-row tile (mma.sync against wgmma)

Each cell: how many of the rows checked were bit-equal.  Also the instruction the tile compiled
to (wgmma or mma.sync, from the PTX) and the worst error against float64, relative to the
largest |C|.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

from alignzoo.common._launch import FP_FUSION


@triton.jit
def _dot_kernel(p_a, p_b, p_c, M: tl.constexpr, N: tl.constexpr, K: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr):
    o_m, o_n = tl.arange(0, M), tl.arange(0, N)
    acc = tl.zeros([M, N], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        a = tl.load(p_a + o_m[:, None] * K + o_k[None, :])
        b = tl.load(p_b + o_k[:, None] * N + o_n[None, :])
        acc = tl.dot(a, b, acc, input_precision=PREC)
    tl.store(p_c + o_m[:, None] * N + o_n[None, :], acc)


def dot(a, b, *, bk, warps, prec):
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty(M, N, dtype=torch.float32, device=a.device)
    h = _dot_kernel[(1,)](a, b, c, M, N, K, bk, prec, num_warps=warps, enable_fp_fusion=FP_FUSION)
    return c, h


def instruction(h) -> str:
    ptx = h.asm.get("ptx", "")
    return "wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma"


def probe(prec, M, N, bk, warps, g, K=128):
    a = torch.randn(M, K, generator=g).cuda()
    b = torch.randn(K, N, generator=g).cuda()
    full, h = dot(a, b, bk=bk, warps=warps, prec=prec)
    rows = sorted({0, 1, M // 2, M - 1, 5 % M})
    cell = {"alone": 0, "moved": 0, "stale": 0, "bk": 0}
    for r in rows:
        z = torch.zeros_like(a)
        z[r] = a[r]
        cell["alone"] += torch.equal(dot(z, b, bk=bk, warps=warps, prec=prec)[0][r], full[r])
        s = (r + 7) % M
        z = torch.zeros_like(a)
        z[s] = a[r]
        cell["moved"] += torch.equal(dot(z, b, bk=bk, warps=warps, prec=prec)[0][s], full[r])
        a2 = a.clone()
        a2[r, K // 2:] = 0
        b2 = b.clone()
        b2[K // 2:] = torch.randn(K - K // 2, N, generator=g).cuda() * 1e3
        want = dot(a2, b, bk=bk, warps=warps, prec=prec)[0][r]
        cell["stale"] += torch.equal(dot(a2, b2, bk=bk, warps=warps, prec=prec)[0][r], want)
        other = 32 if bk != 32 else 64
        cell["bk"] += torch.equal(dot(a, b, bk=other, warps=warps, prec=prec)[0][r], full[r])
    ref = a.double() @ b.double()
    err = ((full.double() - ref).abs().max() / ref.abs().max()).item()
    return {"prec": prec, "M": M, "N": N, "BK": bk, "warps": warps, "rows": len(rows), "instr": instruction(h),
            "rel_err": err, **cell}


def cross(prec, N, bk, g, K=128):
    """Rows 0..15 through a 16-row tile (1 warp) and the same rows as rows 0..15 and 48..63 of a
    64-row tile (4 warps): equal rows of 16."""
    a = torch.randn(64, K, generator=g).cuda()
    b = torch.randn(K, N, generator=g).cuda()
    c64, h64 = dot(a, b, bk=bk, warps=4, prec=prec)
    top, h16 = dot(a[:16].contiguous(), b, bk=bk, warps=1, prec=prec)
    bot, _ = dot(a[48:].contiguous(), b, bk=bk, warps=1, prec=prec)
    eq = sum(torch.equal(top[i], c64[i]) for i in range(16)) + sum(torch.equal(bot[i], c64[48 + i]) for i in range(16))
    return {"prec": prec, "N": N, "BK": bk, "m16": instruction(h16), "m64": instruction(h64), "equal_of_32": eq}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="gpu_out")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("probe_mma_rows needs a CUDA device", file=sys.stderr)
        return 2
    g = torch.Generator().manual_seed(0)
    rows, crosses = [], []
    for prec in ("tf32x3", "tf32", "ieee"):
        for M, N, bk, warps in ((16, 16, 32, 1), (16, 64, 32, 1), (64, 16, 32, 4), (64, 64, 32, 4),
                                (64, 64, 128, 4), (64, 64, 32, 8), (128, 64, 32, 4)):
            rows.append(probe(prec, M, N, bk, warps, g))
            print(json.dumps(rows[-1]), flush=True)
        for N, bk in ((16, 32), (64, 32)):
            crosses.append(cross(prec, N, bk, g))
            print(json.dumps(crosses[-1]), flush=True)
    head = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_mma_rows.json"), "w") as f:
        json.dump({**head, "tiles": rows, "cross": crosses}, f, indent=1)
    lines = ["# tl.dot rows: bit-equal rows of those checked", "", *(f"- {k}: {v}" for k, v in head.items()), "",
             "| precision | M | N | BK | warps | instruction | rel err | alone | moved | stale | other BK |",
             "|---|---|---|---|---|---|---|---|---|---|---|",
             *(f"| {r['prec']} | {r['M']} | {r['N']} | {r['BK']} | {r['warps']} | {r['instr']} | {r['rel_err']:.1e} | "
               f"{r['alone']}/{r['rows']} | {r['moved']}/{r['rows']} | {r['stale']}/{r['rows']} | {r['bk']}/{r['rows']} |"
               for r in rows),
             "", "| precision | N | BK | 16-row tile | 64-row tile | rows equal |", "|---|---|---|---|---|---|",
             *(f"| {c['prec']} | {c['N']} | {c['BK']} | {c['m16']} | {c['m64']} | {c['equal_of_32']}/32 |"
               for c in crosses)]
    with open(os.path.join(args.out, "probe_mma_rows.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
