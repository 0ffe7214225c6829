"""Triton kernels of the sampling transforms, and their CUDA launchers.

The GPU path of one block of rows (``rows_cuda``) forms the sorted head the
rows read (``sorted_head_cuda``), then runs the support kernel:

    head < V and head <= ``op._HEAD_MAX`` (``op.partial_head``; ``op.head_width``
    gives such heads or V):
    torch.topk          fp32 logits -> head + 1 candidates (value, id)   torch, no keys
    _head_keys_kernel   candidates (the row, on a tie at the cut) ->
                        head + 1 int64 keys, the head's among them, in   Triton, one program per row
                        rows of key_row_stride(head + 1) (INT64_MAX pad)
    torch.sort          those rows -> the sorted head                    torch / CUB
    any other head (head == V, or a head past _HEAD_MAX given by hand):
    _order_keys_kernel  logits, temperature -> int64 sort keys in rows   Triton, element-wise
                        of key_row_stride(V) (INT64_MAX pad)
    torch.sort          keys -> sorted keys (the first head of them)     torch / CUB
    then
    _support_kernel     sorted keys -> token, lp, v0, log Z, last        Triton, one program per row
    _replay_bwd_kernel  d lp / d logits (the trainer's backward)         Triton, element-wise

Why the sorts are torch's: a 151936-wide per-row sort is a multi-pass radix
sort that Triton does not express well, and it needs no care here: the keys
of a row are distinct (``rules.order_keys``), so every correct sort returns
the one sorted permutation of the row, whatever algorithm, stability or batch
segmentation torch/CUB picks.

Why the head path has the full sort's bits (``op.sorted_head`` of every
key): s = fl(l / tau) is non-decreasing in l (tau > 0, 1 for greedy rows;
IEEE division is monotone), so with torch.topk's head + 1 largest logits,
t = fl(vals[head - 1] / tau) is the row's head-th largest s whichever equal
logits topk chose, and every token with s > t has l > vals[head - 1]: it is a
candidate.  If fl(vals[head] / tau) < t, the first head candidates are
exactly the tokens with s >= t and the last one sorts after them.  Otherwise
a tie straddles the cut (equal logits, -inf rows, or logits an ulp apart that
one division makes equal), topk's pick among the tied need not be the
keys' "smaller id first", and ``_head_keys_kernel`` scans the row in id order for the tied
tokens that make the head (``_head_keys_kernel``'s docstring).  Each key is
``_order_key`` of (logit, tau, id), the same function as the full keys', and
the replay computes its token's key the same way from the logit, so the head
path writes no (B, V) key buffer at all.  NaN logits are outside the
contract (``rules.order_keys``): topk ranks every NaN first while the keys
rank a negative-signed NaN last, so the two paths may differ on them.

Everything that rounds is in the Triton kernels, one program per row, with a
layout fixed by the constants below and by the sorted keys' row stride being
a multiple of ``KEY_ROW_ALIGN`` (16): both launchers pad to it, INT64_MAX in
the padding, which sorts last.  The JIT specializes integer arguments by
% 16 and Triton lays a loaded block out by what it knows of the addresses,
so a stride that reached the key loads as it was (head + 1 on the head
path, V on the full sort) gave the scan a batch-dependent layout: strides
1025 and 1040 gave different log Z bits on the H200.  The support kernel
takes the stride in units of 16, so its addresses are 16-key aligned for
every batch (``tests/test_sampling.py`` compiles it for sm_90 both ways).
``_support_kernel`` also folds the greedy / "off" parameters, hashes
(seed, step) into the uniform with the same int64 operations as
``rules.uniform01`` (same bits), and computes the token's log-prob with the
same two fp32 subtractions as ``rules.chosen_logprob``; the sampler
(DRAW=True) and the replay (DRAW=False) run the same kernel, so the replay
has the sampler's bits.

Reduction order and rounding points of ``_support_kernel`` (fp32, per row):
sorted positions are visited in chunks of BLOCK_V = 4096, chunk 0 first, each
chunk loaded whole;

    e[i] = exp(v[i] - v[0])            (tl.exp: ex2.approx(x * log2 e))
    cs   = tl.cumsum(e over the chunk) (Triton's scan tree for BLOCK_V = 4096,
                                        num_warps = 8; output i reads inputs <= i)
    S[i] = fl(carry + cs[i]),  carry <- S[chunk's last position]

Z_k = S[n_k - 1] and Z = S[n - 1] are read back exactly (a sum of one value
and zeros); log Z is one tl.log per row; lp = fl(fl(v_tok - v0) - log Z).
BLOCK_V and num_warps shape the scan: they are fixed constants, never chosen
from the number of rows.  The passes recompute e and S with the same code on
the same inputs (e is zeroed past the top-k cut n_k in every pass; the other
cuts are position tests), so a position's S has the same bits in every pass.
That is also why the top-p and draw passes may stop at the first chunk with
their "first i" (no later chunk can hold a smaller i), and why Z is taken
from the pass that already read S[n - 1] (Z_k when nothing was cut, the
top-p pass otherwise), with a pass of its own only after a min-p cut alone.
Scaling uses ``tl.div_rn`` (IEEE division, as torch's CPU and CUDA division),
and no kernel has an add that FP fusion could contract into an FMA
(``enable_fp_fusion=False`` anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2

BLOCK_V = 4096  # sorted positions per chunk in _support_kernel: shapes the scan
NUM_WARPS = 8  # shapes tl.cumsum's tree: fixed
ELEM_BLOCK = 1024  # element-wise kernels: no reduction, any value gives the same bits
TIE_BLOCK = 1024  # tokens per chunk of _head_keys_kernel's tie scan: integer ranks, any value gives the same bits
KEY_ROW_ALIGN = 16  # sorted keys' row stride is a multiple of this: one layout for the support kernel's loads
INT64_MAX = tl.constexpr(2**63 - 1)  # sorts after every non-NaN key: the largest, -inf's at id 2**31 - 1, is below 2**63 - 2**54


@triton.jit
def _order_key(b_l, b_tau, o_v):
    """rules.order_keys on a block: scaled value and id -> int64 key."""
    b_s = tl.div_rn(b_l, b_tau)
    b_bits = b_s.to(tl.int32, bitcast=True)
    b_bits = tl.where(b_s == 0.0, 0, b_bits)  # -0.0 -> +0.0
    b_ord = tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)
    return (-(b_ord.to(tl.int64))) * 4294967296 + o_v.to(tl.int64)


@triton.jit
def _key_value(b_key):
    """rules.key_values: int64 key -> its fp32 scaled logit."""
    b_ord = (-(b_key >> 32)).to(tl.int32)
    b_bits = tl.where(b_ord >= 0, b_ord, b_ord ^ 0x7FFFFFFF)
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit
def _order_keys_kernel(p_logits, p_temp, p_keys, V, W, BLOCK: tl.constexpr):
    """Keys of rows of W >= V columns: INT64_MAX past V (padding sorts last)."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_v = i_c * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_l = tl.load(p_logits + i_b.to(tl.int64) * V + o_v, mask=m_v, other=0.0)
    b_temp = tl.load(p_temp + i_b)
    b_key = _order_key(b_l, tl.where(b_temp == 0.0, 1.0, b_temp), o_v)  # greedy rows sort the raw logits
    tl.store(p_keys + i_b.to(tl.int64) * W + o_v, tl.where(m_v, b_key, INT64_MAX), mask=o_v < W)


@triton.jit
def _head_keys_kernel(p_logits, p_temp, p_vals, p_ids, p_cand, V, H, CS, BLOCK_H: tl.constexpr,
                      BLOCK: tl.constexpr):
    """One program per row: H + 1 keys whose H smallest are the keys of the
    row's first H sorted positions (rules.order_keys), from torch.topk's H + 1
    largest logits p_vals / ids p_ids (descending; rows of H + 1); p_cand rows
    are CS >= H + 1 wide, INT64_MAX past H (padding sorts last).

    t = fl(vals[H - 1] / tau).  The candidates' s are non-increasing, so those
    with s > t are a prefix, G of them, and hold every such token of the row.
    fl(vals[H] / tau) < t: the candidates' keys are the answer, the last key
    sorting after the rest.  Equal (a tie straddles the cut): the first G
    candidates' keys, then the first H - G ids of the row with s == t (chunks
    of BLOCK tokens in id order, ranks by an integer tl.cumsum: exact; the
    scan stops once it has them), then INT64_MAX.  == and > treat -0.0 as
    +0.0, as the keys do."""
    i_b = tl.program_id(0)
    o_row = i_b.to(tl.int64) * V
    o_crow = i_b.to(tl.int64) * (H + 1)
    p_crow = p_cand + i_b.to(tl.int64) * CS
    b_temp = tl.load(p_temp + i_b)
    b_tau = tl.where(b_temp == 0.0, 1.0, b_temp)  # greedy rows sort the raw logits
    o_h = tl.arange(0, BLOCK_H)
    m_h = o_h <= H
    b_l = tl.load(p_vals + o_crow + o_h, mask=m_h, other=0.0)
    b_key = _order_key(b_l, b_tau, tl.load(p_ids + o_crow + o_h, mask=m_h, other=0))
    b_t = tl.div_rn(tl.load(p_vals + o_crow + H - 1), b_tau)
    tie = tl.div_rn(tl.load(p_vals + o_crow + H), b_tau) == b_t
    n_gt = tl.sum((m_h & (tl.div_rn(b_l, b_tau) > b_t)).to(tl.int32), 0)
    n_kept = tl.where(tie, n_gt, H + 1)
    tl.store(p_crow + o_h, tl.where(o_h < n_kept, b_key, INT64_MAX), mask=(o_h < n_kept) | ((o_h > H) & (o_h < CS)))

    need = H - n_gt
    n_eq = tl.where(tie, 0, need)  # tied tokens seen so far; no scan without a tie
    i_c = 0
    while (n_eq < need) & (i_c * BLOCK < V):
        o_v = i_c * BLOCK + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_lv = tl.load(p_logits + o_row + o_v, mask=m_v, other=0.0)
        m_eq = m_v & (tl.div_rn(b_lv, b_tau) == b_t)
        b_rank = n_eq + tl.cumsum(m_eq.to(tl.int32), 0) - 1
        tl.store(p_crow + n_gt + b_rank, _order_key(b_lv, b_tau, o_v), mask=m_eq & (b_rank < need))
        n_eq += tl.sum(m_eq.to(tl.int32), 0)
        i_c += 1
    tl.store(p_crow + H, tl.full([], INT64_MAX, tl.int64), mask=tie)


@triton.jit
def _chunk(p_row, i_c, n_lim, b_v0, b_carry, BLOCK: tl.constexpr):
    """One chunk of sorted positions: (positions, mask, e, S, next carry)."""
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    m = o < n_lim
    b_key = tl.load(p_row + o, mask=m, other=0)
    b_e = tl.where(m, tl.exp(_key_value(b_key) - b_v0), 0.0)
    b_S = b_carry + tl.cumsum(b_e, 0)
    b_next = tl.sum(tl.where(o == i_c * BLOCK + BLOCK - 1, b_S, 0.0), 0)
    return o, m, b_e, b_S, b_next


@triton.jit
def _mul32(x, c_lo, c_hi):
    """rules._mul32: (x * c) mod 2**32 in int64, c = c_hi * 2**16 + c_lo."""
    return (x * c_lo + (((x * c_hi) & 0xFFFF) << 16)) & tl.full([], 4294967295, tl.int64)


@triton.jit
def _mix32(x):
    """rules._mix32 ('lowbias32'), the same int64 operations."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x352D, 0x7FEB)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xA68B, 0x846C)
    return x ^ (x >> 16)


@triton.jit
def _uniform01(b_seed, b_step):
    """rules.uniform01 on int64 scalars: same integer ops, same bits."""
    M32 = tl.full([], 4294967295, tl.int64)
    h = _mix32((b_seed & M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((b_seed >> 32) & M32))
    h = _mix32(h ^ (b_step & M32))
    h = _mix32(h ^ ((b_step >> 32) & M32))
    h = _mix32(h ^ 0x632BE5AB)
    return (h >> 8).to(tl.float32) * 5.9604644775390625e-08  # 2**-24


@triton.jit
def _support_kernel(p_skeys, p_logits, p_temp, p_topk, p_topp, p_minp, p_seed, p_step, p_tok_in,
                    p_tok, p_lp, p_v0, p_logz, p_last, V, SV16, BLOCK: tl.constexpr, DRAW: tl.constexpr):
    """One program per row: the per-row program of op.py after the sort.
    DRAW: draw a token from (seed, step); else score p_tok_in (the replay).
    p_skeys rows (row stride 16 * SV16: a multiple of 16 whatever the batch,
    so the key loads have one layout) start with the first k' sorted keys
    (the passes below read positions < k' only); the replay's token key is
    _order_key of its logit, the bits of the full keys'."""
    i_b = tl.program_id(0)
    o_row = i_b.to(tl.int64) * V
    p_row = p_skeys + i_b.to(tl.int64) * (SV16 * 16)
    b_temp = tl.load(p_temp + i_b)
    greedy = b_temp == 0.0
    b_k = tl.load(p_topk + i_b).to(tl.int64)
    n_k = tl.where(greedy, 1, tl.where((b_k > 0) & (b_k < V), b_k, V)).to(tl.int32)
    b_p = tl.where(greedy, 1.0, tl.load(p_topp + i_b))
    b_m = tl.where(greedy, 0.0, tl.load(p_minp + i_b))
    b_v0 = _key_value(tl.load(p_row))

    # pass 1: Z_k = S[n_k - 1]; min-p cut n = first i >= 1 with e[i] < min_p
    b_carry = tl.zeros([], dtype=tl.float32)
    b_zk = tl.zeros([], dtype=tl.float32)
    n = n_k
    for i_c in range(0, tl.cdiv(n_k, BLOCK)):
        o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK)
        b_zk += tl.sum(tl.where(o == n_k - 1, b_S, 0.0), 0)
        n = tl.minimum(n, tl.min(tl.where(m & (o >= 1) & (b_e < b_m), o, n_k), 0))

    # pass 2 (top_p < 1 only): n = min(n, 1 + first i < n with S[i] >= top_p * Z_k); it stops at
    # the first chunk with such an i, and keeps S[n - 1] (that S[i], or S[n_mk - 1] with no cut)
    n_mk = n
    b_t = b_p * b_zk
    b_carry = tl.zeros([], dtype=tl.float32)
    b_z = tl.zeros([], dtype=tl.float32)
    n_c = tl.where(b_p < 1.0, tl.cdiv(n_mk, BLOCK), 0)
    i_c = 0
    while i_c < n_c:
        o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK)
        first = tl.min(tl.where((o < n_mk) & (b_S >= b_t), o, n_mk), 0)
        n = tl.minimum(n, first + 1)
        b_z += tl.sum(tl.where(o == n - 1, b_S, 0.0), 0)  # S[n - 1] once it is in this chunk
        i_c = tl.where(first < n_mk, n_c, i_c + 1)

    # pass 3: Z = S[n - 1] -- already read where pass 2 ran (Z = S[n - 1] there) or nothing
    # was cut (n == n_k: Z = Z_k); else (a min-p cut alone) one more pass
    b_z = tl.where(n == n_k, b_zk, b_z)
    b_carry = tl.zeros([], dtype=tl.float32)
    for i_c in range(0, tl.where((n_c == 0) & (n < n_k), tl.cdiv(n, BLOCK), 0)):
        o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK)
        b_z += tl.sum(tl.where(o == n - 1, b_S, 0.0), 0)
    b_logz = tl.log(b_z)
    b_last = tl.load(p_row + n - 1)

    if DRAW:
        # pass 4: inverse CDF, first i < n with S[i] > u * Z (n - 1 if none)
        b_target = _uniform01(tl.load(p_seed + i_b), tl.load(p_step + i_b)) * b_z
        pick = n - 1
        b_carry = tl.zeros([], dtype=tl.float32)
        i_c = 0
        while i_c < tl.cdiv(n, BLOCK):  # stops at the first chunk with such an i
            o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK)
            first = tl.min(tl.where((o < n) & (b_S > b_target), o, n), 0)
            pick = tl.minimum(pick, first)
            i_c = tl.where(first < n, tl.cdiv(n, BLOCK), i_c + 1)
        b_key_tok = tl.load(p_row + pick)
    else:
        o_tok = tl.load(p_tok_in + i_b)
        b_key_tok = _order_key(tl.load(p_logits + o_row + o_tok), tl.where(greedy, 1.0, b_temp), o_tok)

    # rules.chosen_logprob: the same two fp32 subtractions, in the same order
    b_lp = (_key_value(b_key_tok) - b_v0) - b_logz
    b_lp = tl.where(greedy, 0.0, b_lp)
    b_lp = tl.where(b_key_tok <= b_last, b_lp, float("-inf"))
    tl.store(p_tok + i_b, b_key_tok & tl.full([], 4294967295, tl.int64))
    tl.store(p_lp + i_b, b_lp)
    tl.store(p_v0 + i_b, b_v0)
    tl.store(p_logz + i_b, b_logz)
    tl.store(p_last + i_b, b_last)


@triton.jit
def _uniform01_kernel(p_seed, p_step, p_u):
    i_b = tl.program_id(0)
    tl.store(p_u + i_b, _uniform01(tl.load(p_seed + i_b), tl.load(p_step + i_b)))


@triton.jit
def _replay_bwd_kernel(p_logits, p_tau, p_tok, p_v0, p_logz, p_last, p_coef, p_dl, V, BLOCK: tl.constexpr):
    """dl[j] = coef * ([j == tok] - [j in support] * exp((s[j] - v0) - log Z)),
    coef = dlp / tau (0 for greedy rows and tokens outside the support).
    Element-wise: each output is its own short expression, no reduction."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_v = i_c * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    o_row = i_b.to(tl.int64) * V
    b_l = tl.load(p_logits + o_row + o_v, mask=m_v, other=0.0)
    b_key = _order_key(b_l, tl.load(p_tau + i_b), o_v)
    b_prob = tl.exp((_key_value(b_key) - tl.load(p_v0 + i_b)) - tl.load(p_logz + i_b))
    b_prob = tl.where(b_key <= tl.load(p_last + i_b), b_prob, 0.0)
    b_hot = tl.where(o_v == tl.load(p_tok + i_b), 1.0, 0.0)
    b_dl = tl.load(p_coef + i_b) * (b_hot - b_prob)
    tl.store(p_dl + o_row + o_v, b_dl, mask=m_v)


def key_row_stride(n: int) -> int:
    """Row stride of a buffer of n sorted keys: n rounded up to ``KEY_ROW_ALIGN``."""
    return cdiv(n, KEY_ROW_ALIGN) * KEY_ROW_ALIGN


def order_keys_cuda(logits: torch.Tensor, temperature: torch.Tensor, *, padded: bool = False) -> torch.Tensor:
    """logits (B, V) fp32, temperature (B,) fp32 (0 = greedy) -> keys (B, V)
    int64; ``padded``: (B, key_row_stride(V)), INT64_MAX past V (sorts last)."""
    B, V = logits.shape
    W = key_row_stride(V) if padded else V
    logits, temperature = logits.contiguous(), temperature.contiguous()
    keys = torch.empty(B, W, dtype=torch.int64, device=logits.device)
    if B:
        grid = (B, cdiv(W, ELEM_BLOCK))
        _order_keys_kernel[grid](logits, temperature, keys, V, W, BLOCK=ELEM_BLOCK, num_warps=4,
                                 enable_fp_fusion=False)
    return keys


def sorted_head_cuda(logits: torch.Tensor, temperature: torch.Tensor, head: int) -> torch.Tensor:
    """logits (B, V) fp32, temperature (B,) fp32 (0 = greedy) ->
    (B, min(head, V)) int64: ``op.sorted_head`` of the rows' sort keys, the
    same bits, as a view whose row stride is a multiple of ``KEY_ROW_ALIGN``
    (what the support kernel reads).  ``op.partial_head`` (head < V, head <=
    ``op._HEAD_MAX``: what ``head_width`` gives): from torch.topk's head + 1
    largest logits and ``_head_keys_kernel`` (no (B, V) keys); else a sort of
    ``order_keys_cuda``'s padded keys (the candidates are one program's tile:
    at head = V - 1 it was 262144 wide)."""
    from .op import partial_head

    B, V = logits.shape
    if not partial_head(head, V):
        return torch.sort(order_keys_cuda(logits, temperature, padded=True), dim=-1).values[:, :min(head, V)]
    logits = logits.contiguous()  # _head_keys_kernel reads rows of stride V
    vals, ids = torch.topk(logits, head + 1, dim=-1, sorted=True)  # (B, head + 1)
    cs = key_row_stride(head + 1)
    cand = torch.empty(B, cs, dtype=torch.int64, device=logits.device)
    if B:
        _head_keys_kernel[(B,)](logits, temperature.contiguous(), vals, ids, cand, V, head, cs,
                                BLOCK_H=next_power_of_2(cs), BLOCK=TIE_BLOCK, num_warps=4,
                                enable_fp_fusion=False)
    return torch.sort(cand, dim=-1).values[:, :head]


def rows_cuda(logits, temperature, top_k, top_p, min_p, seed, step, tokens, head):
    """The per-row program on CUDA rows: the sorted head (``sorted_head_cuda``), support kernel.

    tokens None: draw (needs seed, step); else score the given tokens.  ``head``
    (``op.head_width``) bounds the sorted positions formed.
    Returns (tokens int64, lp fp32, v0 fp32, logz fp32, last_key int64), all (B,)."""
    B, V = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    skeys = sorted_head_cuda(logits, temperature, head)  # (B, min(head, V)): the sorted positions any row reads
    if skeys.stride(0) % KEY_ROW_ALIGN or skeys.stride(1) != 1 or skeys.data_ptr() % 16:
        raise AssertionError(f"sorted keys of row stride {skeys.stride(0)}: the support kernel needs a "
                             f"multiple of {KEY_ROW_ALIGN} (its layout, and so its bits, would change)")
    draw = tokens is None
    if draw:
        tokens = torch.zeros(B, dtype=torch.int64, device=dev)
    else:
        seed = step = tokens  # unused by the replay
    ins = [t.contiguous() for t in (temperature, top_k, top_p, min_p, seed, step, tokens)]
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    lp, v0, logz = (torch.empty(B, dtype=torch.float32, device=dev) for _ in range(3))
    last = torch.empty(B, dtype=torch.int64, device=dev)
    if B:
        _support_kernel[(B,)](skeys, logits, *ins, tok, lp, v0, logz, last, V, skeys.stride(0) // KEY_ROW_ALIGN,
                              BLOCK=BLOCK_V, DRAW=draw, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return (tok if draw else tokens), lp, v0, logz, last


def uniform01_cuda(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The kernel's own uniforms, exposed so tests can hold them to rules.uniform01."""
    u = torch.empty(seed.shape[0], dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        _uniform01_kernel[(seed.shape[0],)](seed.contiguous(), step.contiguous(), u, num_warps=1)
    return u


def replay_bwd_cuda(logits, tau, tokens, v0, logz, last_key, coef):
    B, V = logits.shape
    logits, tau, tokens, v0, logz, last_key, coef = (
        t.contiguous() for t in (logits, tau, tokens, v0, logz, last_key, coef))
    dl = torch.empty_like(logits)
    if B:
        grid = (B, cdiv(V, ELEM_BLOCK))
        _replay_bwd_kernel[grid](logits, tau, tokens, v0, logz, last_key, coef, dl, V,
                                 BLOCK=ELEM_BLOCK, num_warps=4, enable_fp_fusion=False)
    return dl
