"""The softmax top-k router (Qwen3.5) as one Triton launch on CUDA, for the
server and the trainer: the torch path (``router.softmax_topk_fwd``) is ~40 small ops a layer,
and a 512-token prefill is launch-bound.

``router.py``'s rules written lane for lane over the E experts of a row: the
max and the sum by the same pairwise trees (lanes 2m, 2m + 1, level by level;
the pad is -inf before the exp, so +0.0 after it, as ``tree_sum``'s), exp from
libdevice (torch's CUDA exp), division rounded to nearest (torch's ``/``), and
the k picks by ``order_keys``' integer image of p (larger first, ties to the
smaller id; a NaN ranks as there, so the ids stay in range on any input).  The weights are the picked
probabilities divided by their left-to-right slot sum, cast once.  So on CUDA
it gives the torch path's bits (``tests/test_moe_router.py``'s gpu test), and
under the interpreter, with torch's exp patched in, the CPU path's.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from ..gdn.kernel import _exp, _launch_opts

ROUTER_BT = 4  # rows a program (a launch knob: rows are independent)
GONE = tl.constexpr(-(1 << 40))  # below every int32 image: a pad lane, or a lane already picked


@triton.jit
def _softmax_topk_kernel(p_x, p_w, p_ids, T, E, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                         LEVELS: tl.constexpr, NORMALIZE: tl.constexpr, BT: tl.constexpr, LIB: tl.constexpr):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    lane = tl.arange(0, EP)
    m_t, m_e = o_t < T, lane < E
    x = tl.load(p_x + o_t.to(tl.int64)[:, None] * E + lane[None, :], mask=m_t[:, None] & m_e[None, :],
                other=float("-inf")).to(tl.float32)
    mx = x
    for lv in tl.static_range(LEVELS):
        mx = tl.max(tl.reshape(mx, (BT, EP >> (lv + 1), 2)), axis=2)
    e = _exp(x - tl.reshape(mx, (BT, 1)), LIB)
    s = e
    for lv in tl.static_range(LEVELS):
        s = tl.sum(tl.reshape(s, (BT, EP >> (lv + 1), 2)), axis=2)
    p = tl.div_rn(e, tl.reshape(s, (BT, 1)))
    # order_keys' integer image of p (any bits, NaN included, as the torch path ranks them): the
    # picks stay in [0, E) whatever the logits (a NaN row, a pad row's stale state)
    bits = tl.where(p == 0, 0, p.to(tl.int32, bitcast=True))
    cur = tl.where(m_e[None, :], tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64), GONE)
    slot = tl.arange(0, KP)
    w = tl.zeros((BT, KP), dtype=tl.float32)
    ids = tl.zeros((BT, KP), dtype=tl.int64)
    for j in tl.static_range(K):  # the largest left, ties to the smaller id
        top = tl.max(cur, axis=1)
        idx = tl.min(tl.where(cur == top[:, None], lane[None, :], EP), axis=1)
        cur = tl.where(lane[None, :] == idx[:, None], GONE, cur)
        t32 = top.to(tl.int32)
        val = tl.where(t32 >= 0, t32, t32 ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        w = tl.where(slot[None, :] == j, val[:, None], w)
        ids = tl.where(slot[None, :] == j, idx.to(tl.int64)[:, None], ids)
        if j == 0:
            d = val
        else:
            d = d + val
    if NORMALIZE:
        w = tl.div_rn(w, d[:, None])
    offs = o_t.to(tl.int64)[:, None] * K + slot[None, :]
    m = m_t[:, None] & (slot < K)[None, :]
    tl.store(p_w + offs, w.to(p_w.dtype.element_ty), mask=m)
    tl.store(p_ids + offs, ids, mask=m)


def softmax_topk_triton(logits: torch.Tensor, top_k: int, normalize: bool = True):
    """``router.softmax_topk_fwd``'s contract and bits in one launch: (T, E) -> ((T, k) logits.dtype,
    (T, k) int64)."""
    T, E = logits.shape
    w = torch.empty(T, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=logits.device)
    if T == 0:
        return w, ids
    lib, opts = _launch_opts(logits)
    ep = max(2, next_power_of_2(E))
    _softmax_topk_kernel[(cdiv(T, ROUTER_BT),)](logits.contiguous(), w, ids, T, E, top_k,
                                                max(2, next_power_of_2(top_k)), ep, ep.bit_length() - 1,
                                                bool(normalize), ROUTER_BT, lib, **opts, enable_fp_fusion=FP_FUSION,
                                                num_warps=4)
    return w, ids
