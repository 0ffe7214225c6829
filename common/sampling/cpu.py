"""CPU sampling transforms, batch-invariant by construction.

Each row goes through the per-row program of ``op.py`` (scale, sort, top-k,
top-p, min-p, fixed-order sums, inverse-CDF draw).  Why no row's bits can
depend on the batch around it:

* Scaling, the sort key, masks, comparisons, ``where`` and ``gather`` are
  element-wise (or exact integer) operations: each element is one IEEE
  operation on that row's own values.
* ``torch.exp`` / ``torch.log``: ATen evaluates every float element, the
  vector tail included, with the same vectorised routine (``vec::map`` loads a
  partial vector for the tail), so an element's result does not depend on
  where it sits in memory or how the work is split across threads.
  ``tests/test_sampling.py::test_cpu_exp_log_do_not_depend_on_position``
  pins this down; the path relies on it.
* The sort is over int64 keys that are distinct within a row
  (``rules.order_keys``): its output is the unique sorted permutation of the
  row, whatever algorithm, stability or batch torch uses.
* The only floating-point reduction, the prefix sum over sorted positions, is
  written as element-wise adds on slices in one fixed order
  (``prefix_sums``); torch's ``cumsum``/``sum``/``logsumexp`` are not used.
* "First index where ..." cuts are integer ``amin`` reductions: exact in any
  order.

Reduction order and rounding points (per row, fp32): positions are cut into
chunks of C = min(256, V) consecutive sorted positions;

    P[c, i] = fl(P[c, i-1] + e[c*C + i])        i = 1 .. C-1, left to right
    carry[0] = 0, carry[c+1] = fl(carry[c] + P[c, C-1])   chunk by chunk
    S[c*C + i] = fl(carry[c] + P[c, i])

so S at a chunk's last position is the next chunk's carry.  ``log`` is taken
once per row, on the sum S[n-1] over the kept support.
"""
from __future__ import annotations

import torch

from .rules import key_values

CHUNK = 256  # sorted positions per chunk of the fixed-order prefix sum


def prefix_sums(e: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """Inclusive prefix sums along the last dim in the fixed order above.

    e: (B, V) fp32 -> (B, V) fp32.  ``chunk`` may depend on V, never on B."""
    B, V = e.shape
    c = min(chunk, V)
    nc = -(-V // c)
    e_pad = torch.zeros(B, nc * c, dtype=torch.float32)
    e_pad[:, :V] = e
    E = e_pad.view(B, nc, c).permute(2, 0, 1).contiguous()  # (c, B, nc): E[i] is lane i of every chunk
    P = torch.empty_like(E)
    P[0] = E[0]
    for i in range(1, c):
        torch.add(P[i - 1], E[i], out=P[i])
    last = P[c - 1].t().contiguous()  # (nc, B)
    carry = torch.zeros(nc, B, dtype=torch.float32)
    for j in range(1, nc):
        torch.add(carry[j - 1], last[j - 1], out=carry[j])
    S = carry.t().unsqueeze(0) + P  # (c, B, nc)
    return S.permute(1, 2, 0).reshape(B, nc * c)[:, :V]


def support_cpu(
    skeys: torch.Tensor,  # (B, V) int64 sorted keys
    k: torch.Tensor,  # (B,) int64 top-k size, already in [1, V]
    top_p: torch.Tensor,  # (B,) fp32
    min_p: torch.Tensor,  # (B,) fp32
    u: torch.Tensor,  # (B,) fp32 uniform in [0, 1)
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Support size n, log of the support's sum, drawn sorted position; see
    ``op.py`` for the per-row program.  Returns (n int64, logz fp32, pick int64)."""
    B, V = skeys.shape
    v = key_values(skeys)  # (B, V) fp32, descending
    idx = torch.arange(V).expand(B, V)
    in_k = idx < k[:, None]
    e = torch.where(in_k, torch.exp(v - v[:, :1]), torch.zeros_like(v))  # (B, V)
    S = prefix_sums(e, chunk)  # (B, V)
    big = torch.full_like(idx, V)

    z_k = S.gather(1, (k - 1)[:, None]).squeeze(1)
    n_m = torch.where(in_k & (idx >= 1) & (e < min_p[:, None]), idx, big).amin(1)
    n = torch.minimum(k, n_m)
    t = top_p * z_k
    n_p = torch.where((idx < n[:, None]) & (S >= t[:, None]), idx + 1, big).amin(1)
    n = torch.where(top_p < 1.0, torch.minimum(n, n_p), n)

    z = S.gather(1, (n - 1)[:, None]).squeeze(1)
    target = u * z
    pick = torch.where((idx < n[:, None]) & (S > target[:, None]), idx, big).amin(1)
    pick = torch.minimum(pick, n - 1)
    return n, torch.log(z), pick
