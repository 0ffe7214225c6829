"""CPU matmul, batch-invariant by construction.

torch's CPU ``mm``/``linear``/``bmm`` are not batch-invariant: the BLAS picks
blocking and threading from the whole problem's shape, so a row's sum over K
is regrouped when M changes (254 of 300 rows changed bits: docs/DESIGN.md,
"Why the CPU paths are invariant by construction").

Here every output element is built by element-wise IEEE operations only:

    acc[i, j] = 0
    for k in 0 .. K-1:            # one fixed order, the same for every row
        acc[i, j] = fl32(acc[i, j] + fl32(a[i, k] * b[j, k]))

An element-wise ``mul``/``add`` rounds each element on its own, whatever the
vector width, thread split or tensor shape, so ``acc[i, j]`` depends only on
row i of ``a`` and row j of ``b``: the same bits for any batch, any row order.
(For bf16 inputs the product of two bf16 values is exact in fp32 — 8+8
significand bits — so only the additions round.)  The cost is K passes over an
(M, N) fp32 buffer: fine for the tiny models CI runs, not a serving path.
"""
from __future__ import annotations

import torch


def fixed_order_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """FP32 ``a @ b.T`` with the K-sum taken left to right, element-wise.

    a: (M, K), b: (N, K) of any float dtype -> (M, N) float32.
    """
    M, K = a.shape
    N = b.shape[0]
    a_KM = a.t().float().contiguous()  # (K, M): a_KM[k] is column k of a
    b_KN = b.t().float().contiguous()  # (K, N)
    acc = torch.zeros(M, N, dtype=torch.float32, device=a.device)
    tmp = torch.empty(M, N, dtype=torch.float32, device=a.device)
    for k in range(K):
        torch.mul(a_KM[k].unsqueeze(1), b_KN[k].unsqueeze(0), out=tmp)
        acc.add_(tmp)
    return acc


def matmul_fwd_cpu(x: torch.Tensor, w: torch.Tensor, row_chunk: int | None = None) -> torch.Tensor:
    """y = x @ w.T rounded once to x.dtype.  x: (M, K), w: (N, K) -> (M, N).

    ``row_chunk`` splits the rows into independent calls (a launch-shape knob
    for the rung-2 checks; it cannot change bits, see the module docstring).
    """
    if row_chunk is None or row_chunk >= x.shape[0]:
        return fixed_order_dot(x, w).to(x.dtype)
    return torch.cat([fixed_order_dot(c, w) for c in x.split(row_chunk)]).to(x.dtype)
