"""CPU LM-head log-probabilities, batch-invariant by construction.

The contract (the CUDA kernels in ``kernel.py`` take the same steps, trees
and rounding points; CPU and CUDA bits still differ from each other — the
tensor cores order a K step their own way and exp/log are other routines —
but each is batch-invariant on its own):

1. Projection ``z[t, v] = sum_k h[t, k] * W[v, k]`` in FP32, K summed left to
   right, element-wise (``alignzoo.common.matmul.cpu.fixed_order_dot``).  The
   logits stay FP32: no BF16 rounding, so a log-probability carries the
   projection's full FP32 precision and the sampler sees the same values.
2. The vocabulary is cut into fixed groups of ``VOCAB_GROUP = 256`` logits
   (the last group padded with -inf).  Per group g:
   ``m_g = max`` and ``l_g = sum exp(fl(z - m_g))``, both over one fixed
   pairwise tree: level by level, element 2i with 2i+1 (8 levels for 256).
   (CUDA takes ``m_g`` with ``tl.max``: a max is exact in any order.)
3. Groups are merged by one explicit tree over the group index: level by
   level, group 2i with 2i+1, an odd last one carried up unchanged, with
   ``(m, l) (+) (m', l') = (M, fl(fl(l * exp(fl(m - M))) + fl(l' * exp(fl(m' - M)))))``,
   ``M = max(m, m')``.  Its shape depends on the vocabulary size only.
4. ``lse = fl(M + fl(log L))``; ``logprob = fl(z[t, target] - lse)``.

Why this is batch-invariant on the CPU: every step above is a sequence of
element-wise torch ops (``mul``, ``add``, ``sub``, ``maximum``, ``exp``,
``log``, ``where``) on slices whose pairing is fixed by the vocabulary
layout, never by T; no torch reduction (``sum``, ``amax``, ``logsumexp``)
and no BLAS call is used, since those may regroup additions with the shape
(docs/DESIGN.md, "Why the CPU paths are invariant by construction").
``add``/``mul``/``sub``/``maximum`` round each element on its own by IEEE
rules.  ``exp``/``log`` are not IEEE-exact, so their bits could
in principle depend on whether an element lands in a vector body or a scalar
tail; with torch 2.13 (MKL/AVX2 build) they do not: 0 of 450,000 elements
differed between tail and body, or between 1 and 2 threads.
``tests/test_lm_head.py::test_cpu_exp_log_position_free`` keeps checking it,
so a torch build that breaks it is caught.

Backward (``lm_head_bwd_cpu``), with the LSE saved by the forward and the
logits recomputed one vocabulary chunk at a time (no (T, V) FP32 tensor):
``p = fl(exp(fl(z - lse)))``, ``d = fl(1 - p)`` at the target and ``-p``
elsewhere, ``dz = fl(grad * d)`` rounded to the input dtype (the rounding the
CUDA kernels need to feed ``tl.dot``); ``dh[t] = sum_v dz[t, v] W[v]`` over
v = 0 .. V-1 in order, one FP32 accumulator carried across chunks, rounded
once; ``dW[v] = sum_t dz[t, v] h[t]`` over t = 0 .. T-1 in order, rounded
once.  Both are deterministic run to run; dh rows are batch-invariant.

Launch knobs that cannot change bits: ``block_m`` (rows per projection call)
and ``vocab_chunk`` (groups per projection call).  The cost is K element-wise
passes over (T, V): fine for the tiny models CI runs, not a serving path.
"""
from __future__ import annotations

import torch

from alignzoo.common.matmul.cpu import fixed_order_dot
from alignzoo.common.tree.cpu import pairwise_tree

VOCAB_GROUP = 256
# Default projection call: at most 2**15 FP32 logits (128 rows x one group,
# or fewer rows x more groups).  torch runs an element-wise op of up to 32768
# elements on one thread, and with K of them per call the OpenMP hand-off
# would otherwise dominate (5x slower on the loaded 2-core CI box).  Neither
# knob can change bits.
_CHUNK_ELEMS = 1 << 15
_DEFAULT_BLOCK_M = _CHUNK_ELEMS // 256

_NEG_INF = float("-inf")


def merge_groups(m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge per-group (max, sum-exp) stats, (T, G) each, by the fixed tree over
    the group index: level by level, 2i with 2i+1, an odd last one carried up.
    Returns (M, L), (T,) each."""
    while m.shape[1] > 1:
        n = m.shape[1]
        half = n // 2
        m_a, m_b = m[:, 0 : 2 * half : 2], m[:, 1 : 2 * half : 2]
        l_a, l_b = l[:, 0 : 2 * half : 2], l[:, 1 : 2 * half : 2]
        big = torch.maximum(m_a, m_b)
        merged = l_a * torch.exp(m_a - big) + l_b * torch.exp(m_b - big)
        if n % 2:
            big = torch.cat([big, m[:, -1:]], dim=1)
            merged = torch.cat([merged, l[:, -1:]], dim=1)
        m, l = big, merged
    return m[:, 0], l[:, 0]


def group_stats(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, n * VOCAB_GROUP) FP32 logits, -inf padded -> per-group (max, sum exp(z - max)), (T, n) each."""
    T = z.shape[0]
    zg = z.view(T, z.shape[1] // VOCAB_GROUP, VOCAB_GROUP)  # (T, n, 256)
    m = pairwise_tree(zg, torch.maximum)  # (T, n): x[2i] op x[2i+1] over the group's 256 lanes
    e = torch.exp(zg - m.unsqueeze(-1))
    return m, pairwise_tree(e, torch.add)


def _vocab_chunks(T: int, V: int, vocab_chunk: int | None, block_m: int | None = None):
    """(v0, v1) spans of whole vocabulary groups; the last one may end mid-group."""
    if vocab_chunk is None:
        rows = max(1, min(T, block_m or _DEFAULT_BLOCK_M))
        vocab_chunk = max(1, _CHUNK_ELEMS // (rows * VOCAB_GROUP))
    step = vocab_chunk * VOCAB_GROUP
    for v0 in range(0, V, step):
        yield v0, min(v0 + step, V)


def _project(h: torch.Tensor, w: torch.Tensor, block_m: int | None) -> torch.Tensor:
    """FP32 h @ w.T, K in order; ``block_m`` rows per call (rows are independent)."""
    block_m = block_m or _DEFAULT_BLOCK_M
    if block_m >= h.shape[0]:
        return fixed_order_dot(h, w)
    return torch.cat([fixed_order_dot(c, w) for c in h.split(block_m)])


def _forward(h, w, targets, block_m, vocab_chunk, keep_logits, want_stats=True):
    T, V = h.shape[0], w.shape[0]
    n_groups = -(-V // VOCAB_GROUP)
    m = torch.empty(T, n_groups, dtype=torch.float32)
    l = torch.empty(T, n_groups, dtype=torch.float32)
    # NaN, not garbage, if a target were ever out of range
    z_tgt = torch.full((T,), float("nan"), dtype=torch.float32)
    logits = torch.empty(T, V, dtype=torch.float32) if keep_logits else None
    for v0, v1 in _vocab_chunks(T, V, vocab_chunk, block_m):
        z = _project(h, w[v0:v1], block_m)  # (T, v1 - v0)
        if keep_logits:
            logits[:, v0:v1] = z
        if not want_stats:
            continue
        g0, g1 = v0 // VOCAB_GROUP, -(-v1 // VOCAB_GROUP)
        if (v1 - v0) % VOCAB_GROUP:
            z = torch.cat([z, z.new_full((T, (g1 - g0) * VOCAB_GROUP - (v1 - v0)), _NEG_INF)], dim=1)
        m[:, g0:g1], l[:, g0:g1] = group_stats(z)
        if targets is not None:
            rows = ((targets >= v0) & (targets < v1)).nonzero().squeeze(1)
            z_tgt[rows] = z[rows, targets[rows] - v0]
    if not want_stats:
        return None, None, logits
    big, total = merge_groups(m, l)
    lse = big + torch.log(total)
    lp = z_tgt - lse if targets is not None else None
    return lp, lse, logits


def lm_head_fwd_cpu(h, w, targets, *, block_m=None, vocab_chunk=None):
    """(T, K), (V, K), (T,) int64 -> (logprobs (T,), lse (T,)), FP32."""
    lp, lse, _ = _forward(h, w, targets, block_m, vocab_chunk, keep_logits=False)
    return lp, lse


def lm_head_logits_cpu(h, w, *, return_lse=False, block_m=None, vocab_chunk=None):
    """(T, K), (V, K) -> FP32 logits (T, V), the forward's exact projection
    bits; with ``return_lse`` also the forward's exact (T,) LSE."""
    _, lse, logits = _forward(h, w, None, block_m, vocab_chunk, keep_logits=True, want_stats=return_lse)
    return (logits, lse) if return_lse else logits


def _acc_dot(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (M, N) FP32 += a (M, L) @ b (L, N), the L-sum continued left to right
    element-wise from acc's current value (so chunking over L cannot regroup it)."""
    a_LM = a.t().float().contiguous()  # (L, M)
    b_LN = b.float().contiguous()  # (L, N)
    tmp = torch.empty_like(acc)
    for j in range(a_LM.shape[0]):
        torch.mul(a_LM[j].unsqueeze(1), b_LN[j].unsqueeze(0), out=tmp)
        acc.add_(tmp)


def lm_head_bwd_cpu(h, w, targets, lse, grad, *, block_m=None, vocab_chunk=None):
    """Gradients of sum_t grad[t] * logprob[t] -> (dh (T, K) h.dtype, dW (V, K) w.dtype).

    Recomputes the logits one vocabulary chunk at a time from the saved (T,)
    LSE; the largest FP32 temporary is (T, chunk)."""
    T, K = h.shape
    V = w.shape[0]
    grad = grad.float().contiguous()
    dh = torch.zeros(T, K, dtype=torch.float32)
    dw = torch.empty(V, K, dtype=w.dtype)
    h_KT = h.t()  # (K, T): fixed_order_dot(dzᵀ, hᵀ) sums over t = 0..T-1 in order
    for v0, v1 in _vocab_chunks(T, V, vocab_chunk, block_m):
        z = _project(h, w[v0:v1], block_m)  # (T, Vc)
        p = torch.exp(z - lse.unsqueeze(1))
        is_tgt = targets.unsqueeze(1) == torch.arange(v0, v1).unsqueeze(0)
        d = torch.where(is_tgt, 1.0 - p, -p)
        dz = (grad.unsqueeze(1) * d).to(h.dtype)  # (T, Vc)
        _acc_dot(dh, dz, w[v0:v1])
        dw[v0:v1] = fixed_order_dot(dz.t(), h_KT).to(w.dtype)
    return dh.to(h.dtype), dw
