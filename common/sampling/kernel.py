"""Triton kernels of the sampling transforms, and their CUDA launchers.

The GPU path of one block of rows (``rows_triton``) forms the sorted head the
rows read, then runs the support kernel:

    head < V and head <= ``op._HEAD_MAX`` (``op.partial_head``; ``op.head_width``
    gives such heads or V):
    torch.topk          fp32 logits -> head + 1 candidates (value, id)   torch, no keys
    _head_keys_kernel   candidates (the row, on a tie at the cut) ->
                        head + 1 int64 keys, the head's among them, in   Triton, one program per row
                        rows of key_row_stride(head + 1) (INT64_MAX pad)
    torch.sort          those rows -> the sorted head                    torch / CUB
    any other head (head == V, or a head past _HEAD_MAX given by hand), FULL_SORT "values":
    _scaled_kernel      logits, temperature -> s = fl(l / tau), -0.0 as  Triton, element-wise
                        +0.0, rows of key_row_stride(V) (-inf pad)
    torch.sort          s, descending, stable -> sorted values and ids   torch / CUB (fp32 keys)
    or FULL_SORT "keys" (today's reference, kept):
    _order_keys_kernel  logits, temperature -> int64 sort keys in rows   Triton, element-wise
                        of key_row_stride(V) (INT64_MAX pad)
    torch.sort          keys -> sorted keys (the first head of them)     torch / CUB (int64 keys)
    then, where a row's k' can span several chunks (a full sort wider than
    BLOCK_V; ``PREPASS``):
    _chunk_partials_kernel  sorted positions -> per (row, chunk): cs at  Triton, one program per
                        the chunk's end, its largest cs, its min-p cut   (row, chunk)
    and
    _support_kernel     sorted keys, or values and ids (and partials) -> Triton, one program per row
                        token, lp, v0, log Z, last key
    _replay_bwd_kernel  d lp / d logits (the trainer's backward)         Triton, element-wise
    _uncut_kernel       a row without a cut (``op.uncut_rows``) -> lp,   Triton, one program per row
                        v0, log Z_id: no sort (``op`` docstring)

Why the sorts are torch's: a 151936-wide per-row sort is a multi-pass radix
sort that Triton does not express well.  The keys of a row are distinct
(``rules.order_keys``), so every correct sort of them returns the one sorted
permutation of the row, whatever algorithm, stability or batch segmentation
torch/CUB picks.  The value sort reaches the same permutation with half the
key bits (4 radix passes over fp32 instead of 8 over int64): the key
is -ord(s) * 2**32 + id with ord monotone in s (-0.0 folded onto +0.0), so
ascending keys are "s descending, equal s by ascending id", which is a
stable descending sort of s -- torch.sort(stable=True) keeps equal values in
input (id) order on every route it takes (one CUB radix sort, a global sort
then a stable sort by row, CUB's segmented sort; stable CUB radix sorts all).
s is stored with the keys' exact bits (``_scaled_bits``, shared with
``_order_key``), -0.0 already +0.0 so no sort sees a signed zero, and -inf
tokens tie among themselves in id order as their keys do.  The padding past
V is -inf at ids >= V: it ties only the row's -inf tokens and stays after
them, so the first V sorted positions are the keys'.  NaN is outside the
contract (``rules.order_keys``).  The support kernel reads the values (4
bytes a position, not 8) and builds the key of a position it reports (the
last kept, the drawn) from the value's bits and id, the same int64.

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

Everything that rounds is in the Triton kernels, with a layout fixed by the
constants below and by the addresses of the sorted rows.  The JIT specializes
integer arguments by % 16 and Triton lays a loaded block out by what it knows
of the addresses, so a stride that reached the key loads as it was (head + 1
on the head path, V on the full sort) would give the scan a batch-dependent
layout (strides 1025 and 1040 give different log Z bits).  So sorted rows have
a stride that is a multiple of ``KEY_ROW_ALIGN`` (16; both key launchers pad
to it with INT64_MAX, which sorts last), and the kernels take it in units of
16 (keys: 16-key, 128-byte aligned rows, 16-byte loads, sizePerThread 2 for
every batch).  Sorted values take it in units of 2 with that argument never
specialized (do_not_specialize): 8-byte aligned rows for every batch, 8-byte
loads, sizePerThread 2 -- the keys' layout, so the same scan tree and the same
bits on both (specialized, 64-byte rows would give 16-byte loads,
sizePerThread 4).  ``tests/test_sampling.py`` compiles every variant for sm_90
with each integer aligned, not and == 1 and holds them all to today's layouts.
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

The partials (PRE) give the same S without the walk from chunk 0.  A
chunk's cs does not depend on the carry, so ``_chunk_partials_kernel`` runs
the same ``_chunk`` (same loads, e, scan, num_warps) with carry 0
(fl(0 + x) = x) for every chunk in parallel and stores per chunk c:
csum[c] = cs[min(last position, n_k - 1)], cmax[c] = max cs over its
positions < n_k, cfirst[c] = its first i >= 1 with e[i] < min_p.  The
support kernel folds them with the walk's scalar adds in the walk's order,
carry_c = fl(carry_{c-1} + csum[c]): the walk's carries bit for bit, and
Z_k is the last of them; the min-p cut is the min of cfirst (exact).  A pass
testing S[i] >= t (top-p) or > t (draw) over chunks c < C starts at the
first chunk c that is C - 1 or has fl(carry_{c-1} + cmax[c]) >= t (or > t),
with that carry (``_seek``): fl(carry + .) is monotone, so the largest S of
an earlier chunk (all of whose positions are below the pass's bound) is
fl(carry + cmax) < t and that chunk holds no hit, which is all the walk did
there (S[n - 1] lies in the pass's last chunk).  The min-p-alone Z pass runs
chunk (n - 1) // BLOCK_V only, with its folded carry.  So a row reads its
sorted positions once in parallel and then at most three chunks, instead of
up to three walks of ceil(n_k / 4096) chunks (38 at V = 151936).
Scaling uses ``tl.div_rn`` (IEEE division, as torch's CPU and CUDA division),
and no kernel has an add that FP fusion could contract into an FMA
(``enable_fp_fusion=False`` anyway).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior

BLOCK_V = 4096  # sorted positions per chunk in _support_kernel: shapes the scan
NUM_WARPS = 8  # shapes tl.cumsum's tree: fixed
ELEM_BLOCK = 1024  # element-wise kernels: no reduction, any value gives the same bits
TIE_BLOCK = 1024  # tokens per chunk of _head_keys_kernel's tie scan: integer ranks, any value gives the same bits
KEY_ROW_ALIGN = 16  # sorted keys' row stride is a multiple of this: one layout for the support kernel's loads
FOLD = 16  # chunk partials the support kernel's scalar loops load at once (latency only: each is added in turn)
FOLD_INTERPRETED = 2  # ... on CPU tensors (Triton's interpreter): 16 cost ~15 masked Python steps a group
FULL_SORT = "values"  # what a full sort sorts: "values" (fp32 scaled logits) or "keys" (int64); the same bits
PREPASS = True  # pass 1 of full-sort rows by _chunk_partials_kernel (parallel over chunks); the same bits
INT64_MAX = tl.constexpr(2**63 - 1)  # sorts after every non-NaN key: the largest, -inf's at id 2**31 - 1, is below 2**63 - 2**54


@triton.jit
def _scaled_bits(b_l, b_tau):
    """fp32 bits of s = fl(l / tau), -0.0 folded onto +0.0 (rules.order_keys)."""
    b_s = tl.div_rn(b_l, b_tau)
    b_bits = b_s.to(tl.int32, bitcast=True)
    return tl.where(b_s == 0.0, 0, b_bits)  # -0.0 -> +0.0


@triton.jit
def _bits_key(b_bits, o_v):
    """int64 key of a scaled value's bits (no -0.0) and its id."""
    b_ord = tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF)
    return (-(b_ord.to(tl.int64))) * 4294967296 + o_v.to(tl.int64)


@triton.jit
def _order_key(b_l, b_tau, o_v):
    """rules.order_keys on a block: scaled value and id -> int64 key."""
    return _bits_key(_scaled_bits(b_l, b_tau), o_v)


@triton.jit
def _key_value(b_key):
    """rules.key_values: int64 key -> its fp32 scaled logit."""
    b_ord = (-(b_key >> 32)).to(tl.int32)
    b_bits = tl.where(b_ord >= 0, b_ord, b_ord ^ 0x7FFFFFFF)
    return b_bits.to(tl.float32, bitcast=True)


@triton.jit
def _row_block(p_logits, p_temp, V, BLOCK: tl.constexpr):
    """This program's block of one row: (row offset in a buffer of row width
    1, positions, mask < V, logits, tau) -- tau 1 for greedy rows (they sort
    the raw logits)."""
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    o_v = i_c * BLOCK + tl.arange(0, BLOCK)
    m_v = o_v < V
    b_l = tl.load(p_logits + i_b.to(tl.int64) * V + o_v, mask=m_v, other=0.0)
    b_temp = tl.load(p_temp + i_b)
    return i_b.to(tl.int64), o_v, m_v, b_l, tl.where(b_temp == 0.0, 1.0, b_temp)


@triton.jit
def _order_keys_kernel(p_logits, p_temp, p_keys, V, W, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Keys of rows of W >= V columns: INT64_MAX past V (padding sorts last)."""
    wait_prior(PDL)
    o_b, o_v, m_v, b_l, b_tau = _row_block(p_logits, p_temp, V, BLOCK)
    b_key = _order_key(b_l, b_tau, o_v)
    tl.store(p_keys + o_b * W + o_v, tl.where(m_v, b_key, INT64_MAX), mask=o_v < W)


@triton.jit
def _scaled_kernel(p_logits, p_temp, p_s, V, W, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Scaled logits of rows of W >= V columns, the keys' values exactly
    (``_scaled_bits``: -0.0 stored as +0.0); -inf past V (padding: it ties
    only real -inf tokens, and a stable sort keeps it after them)."""
    wait_prior(PDL)
    o_b, o_v, m_v, b_l, b_tau = _row_block(p_logits, p_temp, V, BLOCK)
    b_s = _scaled_bits(b_l, b_tau).to(tl.float32, bitcast=True)
    tl.store(p_s + o_b * W + o_v, tl.where(m_v, b_s, float("-inf")), mask=o_v < W)


@triton.jit
def _head_keys_kernel(p_logits, p_temp, p_vals, p_ids, p_cand, V, H, CS, BLOCK_H: tl.constexpr,
                      BLOCK: tl.constexpr, PDL: tl.constexpr):
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
    wait_prior(PDL)
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
def _row_k(p_temp, p_topk, i_b, V):
    """A row's temperature, greedy flag and k' (op._effective_k)."""
    b_temp = tl.load(p_temp + i_b)
    greedy = b_temp == 0.0
    b_k = tl.load(p_topk + i_b).to(tl.int64)
    n_k = tl.where(greedy, 1, tl.where((b_k > 0) & (b_k < V), b_k, V)).to(tl.int32)
    return b_temp, greedy, n_k


@triton.jit
def _row_start(p_skeys, p_svals, i_b, SV16, SV2, VALUES: tl.constexpr):
    """A row's sorted positions (keys, or values when VALUES) and v0.
    Keys: row stride 16 * SV16.  Values: row stride 2 * SV2 with SV2 never
    specialized, so the JIT knows the row start to 2 values (8 bytes) for
    every batch: 8-byte vector loads, sizePerThread 2, the layout the keys'
    16-byte loads have (with SV2 specialized % 16 it would be 4)."""
    if VALUES:
        p_row = p_svals + i_b.to(tl.int64) * (SV2 * 2)
        b_v0 = tl.load(p_row)
    else:
        p_row = p_skeys + i_b.to(tl.int64) * (SV16 * 16)
        b_v0 = _key_value(tl.load(p_row))
    return p_row, b_v0


@triton.jit
def _chunk(p_row, i_c, n_lim, b_v0, b_carry, BLOCK: tl.constexpr, VALUES: tl.constexpr):
    """One chunk of sorted positions: (positions, mask, e, S, next carry)."""
    o = i_c * BLOCK + tl.arange(0, BLOCK)
    m = o < n_lim
    if VALUES:
        b_v = tl.load(p_row + o, mask=m, other=0.0)
    else:
        b_v = _key_value(tl.load(p_row + o, mask=m, other=0))
    b_e = tl.where(m, tl.exp(b_v - b_v0), 0.0)
    b_S = b_carry + tl.cumsum(b_e, 0)
    b_next = tl.sum(tl.where(o == i_c * BLOCK + BLOCK - 1, b_S, 0.0), 0)
    return o, m, b_e, b_S, b_next


@triton.jit
def _fold(p_csum, p_cfirst, n_c, n_init, G: tl.constexpr):
    """(carry after chunks 0..n_c-1, min(n_init, their min-p firsts)): the
    carry chain carry <- fl(carry + csum[c]), chunk 0 first, one scalar add
    per chunk as the chunk walk does.  G partials per step, loaded together."""
    b_carry = tl.zeros([], dtype=tl.float32)
    n = n_init
    i_g = 0
    while i_g < n_c:
        for j in tl.static_range(G):
            ok = i_g + j < n_c
            b_x = tl.load(p_csum + i_g + j, mask=ok, other=0.0)
            b_carry = tl.where(ok, b_carry + b_x, b_carry)
            n = tl.minimum(n, tl.load(p_cfirst + i_g + j, mask=ok, other=n_init))
        i_g += G
    return b_carry, n


@triton.jit
def _seek(p_csum, p_cmax, n_c, b_bound, STRICT: tl.constexpr, G: tl.constexpr):
    """(c, carry before chunk c) for the first chunk c < n_c that is the last
    one (n_c - 1) or whose largest S, fl(carry + cmax[c]), is > b_bound
    (STRICT) or >= b_bound: the first chunk a walk testing S[i] against
    b_bound would stop in (kernel docstring).  Same carry chain as _fold."""
    b_carry = tl.zeros([], dtype=tl.float32)
    b_carry_hit = tl.zeros([], dtype=tl.float32)
    i_hit = tl.maximum(n_c - 1, 0)  # n_c == 0: chunk 0, which a walk over no chunks never reads
    found = tl.zeros([], dtype=tl.int32)
    i_g = 0
    while (i_g < n_c) & (found == 0):
        for j in tl.static_range(G):
            i_c = i_g + j
            ok = i_c < n_c
            b_top = b_carry + tl.load(p_cmax + i_c, mask=ok, other=0.0)
            if STRICT:
                over = b_top > b_bound
            else:
                over = b_top >= b_bound
            hit = ok & (found == 0) & ((i_c == n_c - 1) | over)
            i_hit = tl.where(hit, i_c, i_hit)
            b_carry_hit = tl.where(hit, b_carry, b_carry_hit)
            found = found | hit.to(tl.int32)
            b_carry = b_carry + tl.load(p_csum + i_c, mask=ok, other=0.0)
        i_g += G
    return i_hit, b_carry_hit


@triton.jit(do_not_specialize=["SV2"])
def _chunk_partials_kernel(p_skeys, p_svals, p_temp, p_topk, p_minp, p_csum, p_cmax, p_cfirst, V, SV16, SV2, NC,
                           BLOCK: tl.constexpr, VALUES: tl.constexpr, PDL: tl.constexpr):
    """One program per (row, chunk c < cdiv(k', BLOCK)): the chunk's part of
    the support kernel's pass 1, which does not depend on the carry.  With
    carry 0 (fl(0 + x) = x), the same _chunk (same loads, e, scan layout)
    gives cs = tl.cumsum(e over the chunk); stored per (row, c) in rows of NC:
    csum = cs at min(chunk's last position, k' - 1) (the carry's increment;
    Z_k's in the last chunk), cmax = max of cs over the chunk's positions
    < k', cfirst = first i >= 1 of the chunk with e[i] < min_p (else k').
    The sum, max and min each pick one value: exact in any order."""
    wait_prior(PDL)
    i_b, i_c = tl.program_id(0), tl.program_id(1)
    b_temp, greedy, n_k = _row_k(p_temp, p_topk, i_b, V)
    if i_c * BLOCK < n_k:
        b_m = tl.where(greedy, 0.0, tl.load(p_minp + i_b))
        p_row, b_v0 = _row_start(p_skeys, p_svals, i_b, SV16, SV2, VALUES)
        o, m, b_e, b_S, b_next = _chunk(p_row, i_c, n_k, b_v0, tl.zeros([], dtype=tl.float32), BLOCK, VALUES)
        o_p = i_b.to(tl.int64) * NC + i_c
        o_end = tl.minimum(i_c * BLOCK + BLOCK - 1, n_k - 1)
        tl.store(p_csum + o_p, tl.sum(tl.where(o == o_end, b_S, 0.0), 0))
        tl.store(p_cmax + o_p, tl.max(tl.where(m, b_S, 0.0), 0))
        tl.store(p_cfirst + o_p, tl.min(tl.where(m & (o >= 1) & (b_e < b_m), o, n_k), 0))


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
def _key_at(p_row, p_irow, i, VALUES: tl.constexpr):
    """The int64 key at sorted position i: loaded, or built from the sorted
    value's bits (no -0.0: _scaled_kernel) and its id."""
    if VALUES:
        return _bits_key(tl.load(p_row + i).to(tl.int32, bitcast=True), tl.load(p_irow + i))
    else:
        return tl.load(p_row + i)


@triton.jit(do_not_specialize=["SV2"])
def _support_kernel(p_skeys, p_svals, p_sids, p_csum, p_cmax, p_cfirst, p_logits, p_temp, p_topk, p_topp, p_minp,
                    p_seed, p_step, p_tok_in, p_tok, p_lp, p_v0, p_logz, p_last, V, SV16, SV2, SI, NC,
                    BLOCK: tl.constexpr, DRAW: tl.constexpr, VALUES: tl.constexpr, PRE: tl.constexpr,
                    FOLD: tl.constexpr, PDL: tl.constexpr):
    """One program per row: the per-row program of op.py after the sort.
    DRAW: draw a token from (seed, step); else score p_tok_in (the replay).
    The row's first k' sorted positions (the passes read positions < k'
    only): VALUES=False, p_skeys rows of stride 16 * SV16 (a multiple of 16
    whatever the batch, so the key loads have one layout); VALUES=True, the
    sorted scaled values p_svals (row stride 2 * SV2, _row_start) and their
    ids p_sids (row stride SI), the same keys.  PRE: pass 1 and every walk
    up to the chunk a pass stops in come from _chunk_partials_kernel's
    partials p_csum / p_cmax / p_cfirst (rows of NC); else the chunks are
    walked from chunk 0.  The replay's token key is _order_key of its
    logit, the bits of the full keys'."""
    wait_prior(PDL)
    i_b = tl.program_id(0)
    o_row = i_b.to(tl.int64) * V
    p_row, b_v0 = _row_start(p_skeys, p_svals, i_b, SV16, SV2, VALUES)
    p_irow = p_sids + i_b.to(tl.int64) * SI
    p_crow = i_b.to(tl.int64) * NC
    b_temp, greedy, n_k = _row_k(p_temp, p_topk, i_b, V)
    b_p = tl.where(greedy, 1.0, tl.load(p_topp + i_b))
    b_m = tl.where(greedy, 0.0, tl.load(p_minp + i_b))

    # pass 1: Z_k = S[n_k - 1]; min-p cut n = first i >= 1 with e[i] < min_p
    b_carry = tl.zeros([], dtype=tl.float32)
    b_zk = tl.zeros([], dtype=tl.float32)
    n = n_k
    if PRE:
        b_zk, n = _fold(p_csum + p_crow, p_cfirst + p_crow, tl.cdiv(n_k, BLOCK), n_k, FOLD)
    else:
        for i_c in range(0, tl.cdiv(n_k, BLOCK)):
            o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK, VALUES)
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
    if PRE:  # straight to the chunk the walk stops in, with its carry
        i_c, b_carry = _seek(p_csum + p_crow, p_cmax + p_crow, n_c, b_t, False, FOLD)
    while i_c < n_c:
        o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK, VALUES)
        first = tl.min(tl.where((o < n_mk) & (b_S >= b_t), o, n_mk), 0)
        n = tl.minimum(n, first + 1)
        b_z += tl.sum(tl.where(o == n - 1, b_S, 0.0), 0)  # S[n - 1] once it is in this chunk
        i_c = tl.where(first < n_mk, n_c, i_c + 1)

    # pass 3: Z = S[n - 1] -- already read where pass 2 ran (Z = S[n - 1] there) or nothing
    # was cut (n == n_k: Z = Z_k); else (a min-p cut alone) one more pass
    b_z = tl.where(n == n_k, b_zk, b_z)
    b_carry = tl.zeros([], dtype=tl.float32)
    n_c3 = tl.where((n_c == 0) & (n < n_k), tl.cdiv(n, BLOCK), 0)
    i_c = 0
    if PRE:  # only chunk (n - 1) // BLOCK adds to b_z
        i_c = tl.maximum(n_c3 - 1, 0)
        b_carry, _ = _fold(p_csum + p_crow, p_cfirst + p_crow, i_c, n_k, FOLD)
    while i_c < n_c3:
        o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK, VALUES)
        b_z += tl.sum(tl.where(o == n - 1, b_S, 0.0), 0)
        i_c += 1
    b_logz = tl.log(b_z)
    b_last = _key_at(p_row, p_irow, n - 1, VALUES)

    if DRAW:
        # pass 4: inverse CDF, first i < n with S[i] > u * Z (n - 1 if none)
        b_target = _uniform01(tl.load(p_seed + i_b), tl.load(p_step + i_b)) * b_z
        pick = n - 1
        b_carry = tl.zeros([], dtype=tl.float32)
        i_c = 0
        if PRE:
            i_c, b_carry = _seek(p_csum + p_crow, p_cmax + p_crow, tl.cdiv(n, BLOCK), b_target, True, FOLD)
        while i_c < tl.cdiv(n, BLOCK):  # stops at the first chunk with such an i
            o, m, b_e, b_S, b_carry = _chunk(p_row, i_c, n_k, b_v0, b_carry, BLOCK, VALUES)
            first = tl.min(tl.where((o < n) & (b_S > b_target), o, n), 0)
            pick = tl.minimum(pick, first)
            i_c = tl.where(first < n, tl.cdiv(n, BLOCK), i_c + 1)
        b_key_tok = _key_at(p_row, p_irow, pick, VALUES)
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


def order_keys_triton(logits: torch.Tensor, temperature: torch.Tensor, *, padded: bool = False) -> torch.Tensor:
    """logits (B, V) fp32, temperature (B,) fp32 (0 = greedy) -> keys (B, V)
    int64; ``padded``: (B, key_row_stride(V)), INT64_MAX past V (sorts last)."""
    B, V = logits.shape
    W = key_row_stride(V) if padded else V
    logits, temperature = logits.contiguous(), temperature.contiguous()
    keys = torch.empty(B, W, dtype=torch.int64, device=logits.device)
    if B:
        grid = (B, cdiv(W, ELEM_BLOCK))
        _order_keys_kernel[grid](logits, temperature, keys, V, W, BLOCK=ELEM_BLOCK, num_warps=4,
                                 enable_fp_fusion=FP_FUSION, **pdl_options(logits.device, B))
    return keys


def sorted_head_triton(logits: torch.Tensor, temperature: torch.Tensor, head: int) -> torch.Tensor:
    """logits (B, V) fp32, temperature (B,) fp32 (0 = greedy) ->
    (B, min(head, V)) int64: ``op.sorted_head`` of the rows' sort keys, the
    same bits, as a view whose row stride is a multiple of ``KEY_ROW_ALIGN``
    (what the support kernel reads).  ``op.partial_head`` (head < V, head <=
    ``op._HEAD_MAX``: what ``head_width`` gives): from torch.topk's head + 1
    largest logits and ``_head_keys_kernel`` (no (B, V) keys); else a sort of
    ``order_keys_triton``'s padded keys (the candidates are one program's tile:
    at head = V - 1 it was 262144 wide)."""
    from .op import partial_head

    B, V = logits.shape
    if not partial_head(head, V):
        return torch.sort(order_keys_triton(logits, temperature, padded=True), dim=-1).values[:, :min(head, V)]
    logits = logits.contiguous()  # _head_keys_kernel reads rows of stride V
    vals, ids = torch.topk(logits, head + 1, dim=-1, sorted=True)  # (B, head + 1)
    cs = key_row_stride(head + 1)
    cand = torch.empty(B, cs, dtype=torch.int64, device=logits.device)
    if B:
        _head_keys_kernel[(B,)](logits, temperature.contiguous(), vals, ids, cand, V, head, cs,
                                BLOCK_H=next_power_of_2(cs), BLOCK=TIE_BLOCK, num_warps=4,
                                enable_fp_fusion=FP_FUSION, **pdl_options(logits.device, B))
    return torch.sort(cand, dim=-1).values[:, :head]


def sorted_values_triton(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (B, V) fp32, temperature (B,) fp32 (0 = greedy) -> (values
    (B, W) fp32, ids (B, W) int64), W = key_row_stride(V): the rows' full
    sort as the sorted keys' values and ids (``key_values`` / ``key_ids`` of
    ``op.sorted_head(keys, V)`` in the first V columns), from a stable
    descending torch.sort of the scaled logits (``_scaled_kernel``; -inf
    padding, which sorts after the row's own -inf tokens).  Why it is the
    keys' permutation: the module docstring."""
    B, V = logits.shape
    W = key_row_stride(V)
    s = torch.empty(B, W, dtype=torch.float32, device=logits.device)
    if B:
        _scaled_kernel[(B, cdiv(W, ELEM_BLOCK))](logits.contiguous(), temperature.contiguous(), s, V, W,
                                                 BLOCK=ELEM_BLOCK, num_warps=4, enable_fp_fusion=FP_FUSION,
                                                 **pdl_options(logits.device, B))
    vals, ids = torch.sort(s, dim=-1, descending=True, stable=True)
    return vals, ids


def _check_rows(t: torch.Tensor, what: str) -> None:
    if t.stride(0) % KEY_ROW_ALIGN or t.stride(1) != 1 or t.data_ptr() % 16:
        raise AssertionError(f"sorted {what} of row stride {t.stride(0)}: the support kernel needs a multiple of "
                             f"{KEY_ROW_ALIGN} and 16-byte rows (its layout, and so its bits, would change)")


def rows_triton(logits, temperature, top_k, top_p, min_p, seed, step, tokens, head, *, sort: str | None = None,
              prepass: bool | None = None):
    """The per-row program on CUDA rows: the sorted head, (partials), support kernel.

    tokens None: draw (needs seed, step); else score the given tokens.  ``head``
    (``op.head_width``) bounds the sorted positions formed: a partial head
    (``op.partial_head``) is ``sorted_head_triton``'s keys; a full sort is
    ``sorted_values_triton`` (``sort`` "values", the default ``FULL_SORT``) or
    ``sorted_head_triton``'s int64 keys ("keys").  ``prepass``: pass 1 by
    ``_chunk_partials_kernel``; default (None) where a row's k' can span
    several chunks (more than BLOCK_V sorted positions).  Every choice gives
    the same bits (module docstring); the arguments are there to compare them.
    Returns (tokens int64, lp fp32, v0 fp32, logz fp32, last_key int64), all (B,)."""
    from .op import partial_head

    B, V = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    draw = tokens is None
    if draw:
        tokens = torch.zeros(B, dtype=torch.int64, device=dev)
    else:
        seed = step = tokens  # unused by the replay
    ins = [t.contiguous() for t in (temperature, top_k, top_p, min_p, seed, step, tokens)]
    tok = torch.empty(B, dtype=torch.int64, device=dev)
    lp, v0, logz = (torch.empty(B, dtype=torch.float32, device=dev) for _ in range(3))
    last = torch.empty(B, dtype=torch.int64, device=dev)
    values = not partial_head(head, V) and (sort or FULL_SORT) == "values"
    if values:
        svals, sids = sorted_values_triton(logits, temperature)  # (B, key_row_stride(V)) each
        _check_rows(svals, "values")
        skeys, width = tok, svals.shape[1]  # skeys: unused
    else:
        skeys = sorted_head_triton(logits, temperature, head)  # (B, min(head, V)): the sorted positions any row reads
        _check_rows(skeys, "keys")
        svals, sids, width = lp, tok, skeys.shape[1]  # svals, sids: unused
    pre = PREPASS and width > BLOCK_V if prepass is None else prepass
    if not B:
        return (tok if draw else tokens), lp, v0, logz, last
    pdl = pdl_options(dev, B)
    sv16, sv2 = skeys.stride(0) // KEY_ROW_ALIGN, svals.stride(0) // 2
    nc = cdiv(width, BLOCK_V)
    if pre:
        parts = torch.empty(2, B, nc, dtype=torch.float32, device=dev)  # csum, cmax
        cfirst = torch.empty(B, nc, dtype=torch.int32, device=dev)
        _chunk_partials_kernel[(B, nc)](skeys, svals, ins[0], ins[1], ins[3], parts[0], parts[1], cfirst, V, sv16,
                                        sv2, nc, BLOCK=BLOCK_V, VALUES=values, num_warps=NUM_WARPS,
                                        enable_fp_fusion=FP_FUSION, **pdl)
    else:
        parts, cfirst = v0.expand(2, B), tok.view(torch.int32)  # unused
    _support_kernel[(B,)](skeys, svals, sids, parts[0], parts[1], cfirst, logits, *ins, tok, lp, v0, logz, last, V,
                          sv16, sv2, sids.stride(0), nc, BLOCK=BLOCK_V, DRAW=draw, VALUES=values, PRE=pre,
                          FOLD=FOLD if logits.is_cuda else FOLD_INTERPRETED, num_warps=NUM_WARPS,
                          enable_fp_fusion=FP_FUSION, **pdl)
    return (tok if draw else tokens), lp, v0, logz, last


def uniform01_triton(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """The kernel's own uniforms, exposed so tests can hold them to rules.uniform01."""
    u = torch.empty(seed.shape[0], dtype=torch.float32, device=seed.device)
    if seed.shape[0]:
        _uniform01_kernel[(seed.shape[0],)](seed.contiguous(), step.contiguous(), u, num_warps=1,
            enable_fp_fusion=FP_FUSION)
    return u


def replay_bwd_triton(logits, tau, tokens, v0, logz, last_key, coef):
    B, V = logits.shape
    logits, tau, tokens, v0, logz, last_key, coef = (
        t.contiguous() for t in (logits, tau, tokens, v0, logz, last_key, coef))
    dl = torch.empty_like(logits)
    if B:
        grid = (B, cdiv(V, ELEM_BLOCK))
        _replay_bwd_kernel[grid](logits, tau, tokens, v0, logz, last_key, coef, dl, V,
                                 BLOCK=ELEM_BLOCK, num_warps=4, enable_fp_fusion=FP_FUSION)
    return dl


@triton.jit
def _uncut_kernel(p_logits, p_temp, p_tok, p_lp, p_v0, p_logz, V, BLOCK: tl.constexpr, LOG2_BLOCK: tl.constexpr):
    """One row without a cut: v0 = max s (exact), Z_id = the chunks' pairwise trees (reshape/split:
    the pairs are logical, whatever the layout) added left to right, lp = fl(fl(s_tok - v0) - log Z_id)."""
    i_b = tl.program_id(0)
    o_row = i_b.to(tl.int64) * V
    b_tau = tl.load(p_temp + i_b)
    b_tau = tl.where(b_tau == 0.0, 1.0, b_tau)
    b_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    for c in range(0, tl.cdiv(V, BLOCK)):
        o_v = c * BLOCK + tl.arange(0, BLOCK)
        b_l = tl.load(p_logits + o_row + o_v, mask=o_v < V, other=float("-inf"))
        b_max = tl.maximum(b_max, _scaled_bits(b_l, b_tau).to(tl.float32, bitcast=True))
    v0 = tl.max(b_max, axis=0)
    acc = tl.zeros((1,), tl.float32)
    for c in range(0, tl.cdiv(V, BLOCK)):
        o_v = c * BLOCK + tl.arange(0, BLOCK)
        m_v = o_v < V
        b_l = tl.load(p_logits + o_row + o_v, mask=m_v, other=0.0)
        b_s = _scaled_bits(b_l, b_tau).to(tl.float32, bitcast=True)
        b_x = tl.where(m_v, tl.exp(b_s - v0), 0.0)
        for i in tl.static_range(LOG2_BLOCK):
            b_a, b_c = tl.split(tl.reshape(b_x, (BLOCK >> (i + 1), 2)))
            b_x = b_a + b_c
        acc = acc + b_x
    logz = tl.log(acc)
    b_tok = tl.load(p_tok + i_b)
    s_tok = _scaled_bits(tl.load(p_logits + o_row + b_tok), b_tau).to(tl.float32, bitcast=True)
    o1 = tl.arange(0, 1)
    tl.store(p_lp + i_b + o1, (s_tok - v0) - logz)
    tl.store(p_v0 + i_b + o1, tl.zeros((1,), tl.float32) + v0)
    tl.store(p_logz + i_b + o1, logz)


def uncut_logprobs_triton(logits, temperature, tokens):
    """``op.uncut_logprobs`` on CUDA rows: -> (lp, v0, logz, last_key), (B,) each."""
    from .op import INT64_MAX, UNCUT_CHUNK

    B, V = logits.shape
    logits, temperature, tokens = logits.contiguous(), temperature.contiguous(), tokens.to(torch.int64).contiguous()
    lp, v0, logz = (torch.empty(B, dtype=torch.float32, device=logits.device) for _ in range(3))
    if B:
        _uncut_kernel[(B,)](logits, temperature, tokens, lp, v0, logz, V, BLOCK=UNCUT_CHUNK,
                            LOG2_BLOCK=UNCUT_CHUNK.bit_length() - 1, num_warps=8, enable_fp_fusion=FP_FUSION)
    return lp, v0, logz, torch.full((B,), INT64_MAX, dtype=torch.int64, device=logits.device)
