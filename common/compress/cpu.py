"""DeepSeek-V4's KV compressors (C4 with overlap, C128 without) after the kv/gate projections,
batch-invariant by construction.

A compressed row is built by one routine, ``group_rows``, from the S slots of its window
(S = rate, or 2 * rate with overlap), gathered by copies (``window_slots``) from wherever they
are: this call's kv/gate rows, a sequence slot's ring of earlier rows (the server), or padding.
With D the compressed width and dt the kv dtype, for every (row, channel) independently:

    l_j = fp32(gate_j) + position_bias_j          fp32, one rounding; -inf on a pad slot
    m   = max_j l_j                               exact, any order
    e_j = exp(l_j - m)                            fp32 (torch.exp); a pad slot gives 0
    s   = ((0 + e_0) + e_1) + ... + e_{S-1}       fp32, left to right
    w_j = dt(e_j / s)                             IEEE division, then the cast transformers makes
    y   = dt(((0 + fp32(dt(kv_0 * w_0))) + fp32(dt(kv_1 * w_1))) + ...)   products in dt, sum
                                                  in fp32 left to right, one rounding

Slots are in source order: with overlap, slots 0..rate-1 are the previous group's rows on the
first D channels (transformers' Ca) and slots rate..2*rate-1 this group's rows on the last D
channels (Cb); the first group's previous slots are padding (zero kv, -inf logit, weight 0, as in
transformers).  Without overlap, slot j is the group's j-th row on all D channels.

Only element-wise ops (add, sub, mul, div, exp, maximum, where) and copies run, each rounding an
element on its own whatever the tensor's shape, so a row's bits depend only on its window's
values: not on the batch, its place in it, or how the sequence was split across calls.  The same
ops run on CUDA tensors (element-wise CUDA kernels, IEEE division) and stay invariant there too.
"""
from __future__ import annotations

import torch

from ..gdn.cpu import scatter_slots


def slot_order(rate: int, overlap: bool, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Per window slot j: (back (S,), half (S,)): the slot's source is ``back`` positions before
    the closing token, on channel half ``half`` (0: [:D], 1: [D:]; always 0 without overlap)."""
    S = 2 * rate if overlap else rate
    j = torch.arange(S, device=device)
    half = (j >= rate).long() if overlap else torch.zeros_like(j)
    return S - 1 - j, half


def slot_bias(position_bias: torch.Tensor, rate: int, overlap: bool) -> torch.Tensor:
    """position_bias (rate, C) -> the bias of each window slot (S, D), slot order above."""
    if not overlap:
        return position_bias
    D = position_bias.shape[1] // 2
    return torch.cat((position_bias[:, :D], position_bias[:, D:]), dim=0)


def token_coords(idx: torch.Tensor, cu_seqlens: torch.Tensor, starts: torch.Tensor | None):
    """Packed token indices (G,) -> (seq (G,), local (G,), pos (G,)): its sequence, its index in
    this call's part of the sequence, and its absolute position.  No host reads."""
    cu = cu_seqlens.long()
    seq = torch.searchsorted(cu[1:], idx, right=True).clamp(max=max(cu.shape[0] - 2, 0))
    local = idx - cu[seq]
    pos = local + (starts.long()[seq] if starts is not None else 0)
    return seq, local, pos


def window_slots(kv, gate, at, cu_seqlens, *, rate, overlap, starts=None, slots=None, ring_kv=None, ring_gate=None):
    """Gather the window closed by each token ``at`` (G,) -> (kv_s (G, S, D), gate_s (G, S, D), pad (G, S)).

    A slot at position q (= pos - back) comes from this call's rows when q >= the sequence's start,
    from the slot's ring (``ring_*[slot, q % B]``) when 0 <= q < start, and is padding when q < 0.
    Copies only.  A token that closes no group gathers a window too (its row is zeroed later)."""
    T, C = kv.shape
    H2 = 2 if overlap else 1
    D = C // H2
    back, half = slot_order(rate, overlap, kv.device)
    seq, local, pos = token_coords(at, cu_seqlens, starts)
    d = local[:, None] - back[None, :]  # (G, S): this call's local index of the slot's row
    src = ((at[:, None] - back[None, :]).clamp(min=0) * H2 + half) if T else torch.zeros_like(d)
    kv_s = kv.reshape(T * H2, D)[src] if T else kv.new_zeros(*d.shape, D)
    gate_s = gate.reshape(T * H2, D)[src] if T else gate.new_zeros(*d.shape, D)
    q = pos[:, None] - back[None, :]
    pad = q < 0
    if ring_kv is not None:
        B = ring_kv.shape[1]
        r = (slots.long().clamp(min=0)[seq][:, None] * B + q.remainder(B)) * H2 + half
        old = ((d < 0) & ~pad)[..., None]
        kv_s = torch.where(old, ring_kv.reshape(-1, D)[r], kv_s)
        gate_s = torch.where(old, ring_gate.reshape(-1, D)[r], gate_s)
    else:
        pad = pad | (d < 0)
    kv_s = torch.where(pad[..., None], torch.zeros((), dtype=kv.dtype, device=kv.device), kv_s)
    return kv_s, gate_s, pad


def group_probs(gate_s: torch.Tensor, bias_s: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The window softmax in fp32 (module docstring) -> p (G, S, D)."""
    S = gate_s.shape[1]
    logit = torch.where(pad[..., None], float("-inf"), gate_s.float() + bias_s.float())
    m = logit[:, 0]
    for j in range(1, S):
        m = torch.maximum(m, logit[:, j])
    e = torch.exp(logit - m[:, None])
    s = torch.zeros_like(m)
    for j in range(S):
        s = s + e[:, j]
    return e / s[:, None]


def group_rows(kv_s: torch.Tensor, gate_s: torch.Tensor, bias_s: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """The one per-group routine: windows (G, S, D) -> compressed rows (G, D) in kv's dtype."""
    w = group_probs(gate_s, bias_s, pad).to(kv_s.dtype)
    prod = kv_s * w  # rounds each product to the kv dtype, as transformers' (kv * w) does
    acc = torch.zeros(prod.shape[0], prod.shape[2], dtype=torch.float32, device=prod.device)
    for j in range(prod.shape[1]):
        acc = acc + prod[:, j].float()
    return acc.to(kv_s.dtype)


def ring_update(kv, gate, cu_seqlens, starts, slots, ring_kv, ring_gate):
    """Each slot >= 0 keeps its sequence's last B rows (position q at ring index q % B): rows of
    this call where they exist, its old ring entries elsewhere.  Fixed shapes, no host reads."""
    B = ring_kv.shape[1]
    cu = cu_seqlens.long()
    st = starts.long()[:, None]
    last = st + (cu[1:] - cu[:-1])[:, None] - 1  # (N, 1)
    r = torch.arange(B, device=kv.device)[None, :]
    q = last - (last - r).remainder(B)  # (N, B): the latest position with ring index r
    new = q >= st
    src = (cu[:-1, None] + q - st).clamp(min=0, max=max(kv.shape[0] - 1, 0))
    sl = slots.long().clamp(min=0)
    for ring, x in ((ring_kv, kv), (ring_gate, gate)):
        old = ring[sl]  # (N, B, C)
        own = x[src] if x.shape[0] else old
        scatter_slots(ring, slots.long(), torch.where(new[..., None], own, old))


def compress_rows_cpu(kv, gate, position_bias, cu_seqlens, at, *, rate, overlap, starts=None, slots=None,
                      ring_kv=None, ring_gate=None) -> torch.Tensor:
    """Rows (G, D) of the groups closed by the tokens ``at`` (zeros for a token that closes none),
    reading the slots' rings, not writing them."""
    kv_s, gate_s, pad = window_slots(kv, gate, at, cu_seqlens, rate=rate, overlap=overlap, starts=starts,
                                     slots=slots, ring_kv=ring_kv, ring_gate=ring_gate)
    rows = group_rows(kv_s, gate_s, slot_bias(position_bias, rate, overlap), pad)
    closes = (token_coords(at, cu_seqlens, starts)[2] + 1).remainder(rate) == 0
    return torch.where(closes[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def compress_bwd_cpu(dy, kv, gate, position_bias, cu_seqlens, at, *, rate, overlap):
    """Gradients of the trainer's rows (every sequence from position 0, no ring) -> (dkv, dgate, dpb).

    With p the forward's fp32 softmax and w = dt(p) (the casts pass gradients straight through):
    dkv_j = dy * w_j, dl_j = p_j * (dy * kv_j - sum_k p_k * dy * kv_k) (the sum left to right),
    dgate_j = dl_j and dpb = sum over groups of dl.  Every (token, channel) feeds at most one slot
    (with overlap its first D channels the next group, its last D its own), so the scatter back has
    no collisions."""
    T, C = kv.shape
    H2 = 2 if overlap else 1
    D = C // H2
    kv_s, gate_s, pad = window_slots(kv, gate, at, cu_seqlens, rate=rate, overlap=overlap)
    p = group_probs(gate_s, slot_bias(position_bias, rate, overlap), pad)
    g = dy.float()[:, None, :]
    dkv_s = g * p.to(kv.dtype).float()
    dw = g * kv_s.float()
    dot = torch.zeros_like(dw[:, 0])
    for j in range(dw.shape[1]):
        dot = dot + p[:, j] * dw[:, j]
    dl = p * (dw - dot[:, None])
    dl = torch.where(pad[..., None], 0.0, dl)
    back, half = slot_order(rate, overlap, kv.device)
    src = (at[:, None] - back[None, :]).clamp(min=0) * H2 + half
    keep = ~pad
    dkv = torch.zeros(T * H2, D, dtype=torch.float32, device=kv.device)
    dgate = torch.zeros_like(dkv)
    dkv[src[keep]] = dkv_s[keep]
    dgate[src[keep]] = dl[keep]
    dbias = dl.sum(0)  # (S, D)
    dpb = dbias if not overlap else torch.cat((dbias[:rate], dbias[rate:]), dim=1)
    return dkv.view(T, C).to(kv.dtype), dgate.view(T, C).to(gate.dtype), dpb.to(position_bias.dtype)
