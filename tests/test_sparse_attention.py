"""Sparse MLA attention in the absorbed form (``alignzoo.common.sparse_attention``): a query row attends to the
KV rows the DSA indexer selected, in one order, so a row has the same bits whether its history is contiguous
(trainer) or paged (server), alone or in any batch, and whether it is a decode step or a row of a prefill.
Accuracy and gradients against float64; parity with dense causal MQA attention when every position is selected."""
from __future__ import annotations

import math
import re

import pytest
import torch
from alignzoo.common.attention import attention_ref
from alignzoo.common.dsa import index_scores, index_topk
from alignzoo.common.kv_cache import PAGE_SIZE
from alignzoo.common.ladder import rel_err
from alignzoo.common.sparse_attention import (
    paged_sparse_attention,
    paged_sparse_attention_fwd,
    sparse_attention,
    sparse_attention_bwd,
    sparse_attention_fwd,
    sparse_attention_ref,
)


def _select(L, top_k, seed):
    """A sequence's (L, top_k) selection from the DSA indexer on random inputs (keys 0..p for token p)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(L, 4, 16, generator=g).to(torch.bfloat16)
    k = torch.randn(L, 16, generator=g).to(torch.bfloat16)
    w = torch.randn(L, 4, generator=g) * 0.5
    return index_topk(index_scores(q, k, w, 0.25), torch.arange(L), top_k)


def _case(lens, H, D, top_k, *, seed=0, dtype=torch.bfloat16):
    """Packed q (T, H, D), kv (T, D), cu_seqlens, and the indexer's selection (T, top_k), positions relative to
    each sequence's start."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(T, D, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    sel = torch.cat([_select(L, top_k, seed + 10 + b) for b, L in enumerate(lens)])
    return q, kv, cu, sel


def _page(kv, cu, *, seed, extra=3):
    """kv rows of each sequence placed in a (P, 64, 1, D) pool at random pages, not in order, with random
    bytes in every other slot -> (kv_cache, block_table, seq_idx (T,), positions (T,))."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.diff(cu).tolist()
    need = [-(-L // PAGE_SIZE) for L in lens]
    P = sum(need) + extra
    cache = torch.randn(P, PAGE_SIZE, 1, kv.shape[1], generator=g).to(kv.dtype)
    perm = torch.randperm(P, generator=g).tolist()
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for b, L in enumerate(lens):
        pages = [perm.pop() for _ in range(need[b])]
        table[b, : need[b]] = torch.tensor(pages, dtype=torch.int32)
        for p in range(L):
            cache[pages[p // PAGE_SIZE], p % PAGE_SIZE, 0] = kv[int(cu[b]) + p]
    seq_idx = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    positions = torch.cat([torch.arange(L) for L in lens])
    return cache, table, seq_idx, positions


def _equal(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


LONG = {"lens": [700, 333, 1], "H": 4, "D": 80, "top_k": 32}  # past 593, many 64-entry pages and blocks
SCALE = 0.07


# ------------------------------------------------------------------ bits
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_contiguous_equals_paged(dtype):
    q, kv, cu, sel = _case(**LONG, dtype=dtype)
    want = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=72)
    assert want[0].shape == (q.shape[0], 4, 72) and want[0].dtype == dtype and want[1].dtype == torch.float32
    for seed in (1, 2):
        cache, table, seq_idx, _ = _page(kv, cu, seed=seed)
        assert _equal(paged_sparse_attention_fwd(q, cache, sel, seq_idx, table, scale=SCALE, v_dim=72), want)


def test_rows_alone_batched_shuffled():
    q, kv, cu, sel = _case(**LONG)
    whole = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=72)
    # each sequence packed alone
    for b in range(3):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        alone = sparse_attention_fwd(q[s0:s1], kv[s0:s1], sel[s0:s1], torch.tensor([0, s1 - s0]), scale=SCALE, v_dim=72)
        assert _equal(alone, (whole[0][s0:s1], whole[1][s0:s1])), b
    cache, table, seq_idx, _ = _page(kv, cu, seed=3)
    # single rows, paged (decode-sized calls)
    for i in (0, 1, 31, 32, 63, 64, 65, 593, 699, 700, 701, 1032, 1033):
        one = paged_sparse_attention_fwd(q[i:i + 1], cache, sel[i:i + 1], seq_idx[i:i + 1], table,
                                         scale=SCALE, v_dim=72)
        assert _equal(one, (whole[0][i:i + 1], whole[1][i:i + 1])), i
    # the whole batch in a shuffled row order
    perm = torch.randperm(q.shape[0], generator=torch.Generator().manual_seed(4))
    shuf = paged_sparse_attention_fwd(q[perm], cache, sel[perm], seq_idx[perm], table, scale=SCALE, v_dim=72)
    assert _equal(shuf, (whole[0][perm], whole[1][perm]))


def test_decode_row_equals_prefill_row():
    """A decode step sees the cache up to its own token and the indexer's selection made from the keys up to it;
    its row equals the same token's row in the prefill of the whole sequence."""
    L, H, D, top_k = 700, 4, 80, 32
    q, kv, cu, _ = _case([L], H, D, top_k, seed=5)
    cache, table, seq_idx, _ = _page(kv, cu, seed=6)
    g = torch.Generator().manual_seed(7)
    iq = torch.randn(L, 4, 16, generator=g).to(torch.bfloat16)
    ik = torch.randn(L, 16, generator=g).to(torch.bfloat16)
    iw = torch.randn(L, 4, generator=g) * 0.5
    sel = index_topk(index_scores(iq, ik, iw, 0.25), torch.arange(L), top_k)
    prefill = paged_sparse_attention_fwd(q, cache, sel, seq_idx, table, scale=SCALE, v_dim=64)
    for t in (0, 31, 63, 64, 200, 593, 699):
        step_sel = index_topk(index_scores(iq[t:t + 1], ik[: t + 1], iw[t:t + 1], 0.25), torch.tensor([t]), top_k)
        grown = cache.clone()  # the cache as decode step t sees it: nothing written past t
        for p in range(t + 1, L):
            grown[table[0, p // PAGE_SIZE], p % PAGE_SIZE] = float("nan")
        one = paged_sparse_attention(q[t:t + 1], grown, step_sel, torch.tensor([0]), torch.tensor([t]), table,
                                     scale=SCALE, v_dim=64)
        assert torch.equal(one, prefill[0][t:t + 1]), t


def test_pad_entries_are_ignored():
    """-1 entries anywhere in a row, or a wider selection padded with -1, give the bits of the plain selection."""
    q, kv, cu, sel = _case([300, 90], 3, 40, 40, seed=8)
    want = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=40)
    g = torch.Generator().manual_seed(9)
    wide = torch.full((sel.shape[0], 150), -1, dtype=torch.int32)
    for i in range(sel.shape[0]):
        slots = torch.randperm(150, generator=g)[: sel.shape[1]].sort().values
        wide[i, slots] = sel[i]
    assert _equal(sparse_attention_fwd(q, kv, wide, cu, scale=SCALE, v_dim=40), want)
    cache, table, seq_idx, _ = _page(kv, cu, seed=10)
    assert _equal(paged_sparse_attention_fwd(q, cache, wide, seq_idx, table, scale=SCALE, v_dim=40), want)
    # rows past position 39 select exactly 40 positions: the unpadded selection
    full = sel[40:300]
    got = paged_sparse_attention_fwd(q[40:300], cache, full, seq_idx[40:300], table, scale=SCALE, v_dim=40)
    assert _equal(got, (want[0][40:300], want[1][40:300]))


def test_row_without_entries():
    """A row whose selection is all pads (a padding row) gives out = 0, lse = -inf and no gradient, and leaves
    the other rows' bits alone."""
    q, kv, cu, sel = _case([100], 2, 24, 16, seed=26, dtype=torch.float32)
    want = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=16)
    sel = sel.clone()
    sel[50] = -1
    o, lse = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=16)
    assert not o[50].any() and bool((lse[50] == float("-inf")).all())
    rest = torch.arange(100) != 50
    assert _equal((o[rest], lse[rest]), (want[0][rest], want[1][rest]))
    dq, dkv, _ = sparse_attention_bwd(q, kv, sel, cu, o, lse, torch.ones_like(o), scale=SCALE, v_dim=16)
    assert not dq[50].any() and bool(torch.isfinite(dkv).all())


@pytest.mark.parametrize("top_k", [20, 130], ids=["k20_one_partial_block", "k130_three_blocks"])
def test_odd_sizes(top_k):
    """H = 5, Dqk = 72 + 8, Dv = 72; selections shorter than a 64-entry block and spanning three."""
    q, kv, cu, sel = _case([263, 65, 2], 5, 80, top_k, seed=11, dtype=torch.float32)
    want = sparse_attention_fwd(q, kv, sel, cu, scale=80 ** -0.5, v_dim=72)
    cache, table, seq_idx, _ = _page(kv, cu, seed=12)
    assert _equal(paged_sparse_attention_fwd(q, cache, sel, seq_idx, table, scale=80 ** -0.5, v_dim=72), want)
    for i in (0, 19, 20, 64, 129, 130, 262, 263, 327, 329):
        one = paged_sparse_attention_fwd(q[i:i + 1], cache, sel[i:i + 1], seq_idx[i:i + 1], table,
                                         scale=80 ** -0.5, v_dim=72)
        assert _equal(one, (want[0][i:i + 1], want[1][i:i + 1])), i
    o_ref, lse_ref = sparse_attention_ref(q, kv, sel, cu, scale=80 ** -0.5, v_dim=72, return_lse=True)
    assert rel_err(want[0], o_ref) < 1e-6 and rel_err(want[1], lse_ref) < 1e-6


def test_mla_head_dims():
    """GLM-5's absorbed head: Dqk = 512 + 64 = 576, Dv = 512, past the dense op's 256."""
    q, kv, cu, sel = _case([150], 2, 576, 70, seed=13)
    o, lse = sparse_attention_fwd(q, kv, sel, cu, scale=0.05, v_dim=512)
    cache, table, seq_idx, _ = _page(kv, cu, seed=14)
    assert _equal(paged_sparse_attention_fwd(q, cache, sel, seq_idx, table, scale=0.05, v_dim=512), (o, lse))
    o_ref, lse_ref = sparse_attention_ref(q, kv, sel, cu, scale=0.05, v_dim=512, return_lse=True)
    assert o.shape == (150, 2, 512)
    assert rel_err(o, o_ref) < 5e-3 and rel_err(lse, lse_ref) < 1e-6


# ------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-6), (torch.bfloat16, 4e-3)], ids=["fp32", "bf16"])
def test_forward_vs_float64(dtype, bound):
    q, kv, cu, sel = _case([400, 129], 4, 96, 100, seed=15, dtype=dtype)
    o, lse = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=64)
    o_ref, lse_ref = sparse_attention_ref(q, kv, sel, cu, scale=SCALE, v_dim=64, return_lse=True)
    assert rel_err(o, o_ref) < bound
    assert rel_err(lse, lse_ref) < 1e-6  # lse stays fp32 whatever the input dtype


def test_parity_with_dense_causal_mqa():
    """top_k >= T: every causal position is selected and the op is dense causal MQA attention (rows past
    position 1023 run two 1024-entry segments)."""
    lens = [1100, 200]
    q, kv, cu, sel = _case(lens, 2, 40, 1100, seed=16, dtype=torch.float32)
    assert bool(((sel >= 0).sum(1) == torch.cat([torch.arange(L) + 1 for L in lens])).all())
    o, lse = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=32)
    o_ref, lse_ref = attention_ref(q, kv[:, None], kv[:, None, :32], cu, scale=SCALE, return_lse=True)
    assert rel_err(o, o_ref) < 1e-6 and rel_err(lse, lse_ref) < 1e-6  # measured 8e-8


def test_absorbed_form_is_mla():
    """The absorbed form (q_abs = [q_nope @ W_UK | q_rope] against [latent | k_rope], then W_UV on the output)
    equals MLA with expanded per-head keys and values (transformers' kv_b_proj layout), in float64."""
    g = torch.Generator().manual_seed(17)
    L, H, dn, dr, r, dv = 90, 3, 24, 8, 40, 20
    q_nope, q_rope = torch.randn(L, H, dn, generator=g), torch.randn(L, H, dr, generator=g)
    latent, k_rope = torch.randn(L, r, generator=g), torch.randn(L, dr, generator=g)
    kv_b = torch.randn(H * (dn + dv), r, generator=g) * r ** -0.5  # kv_b_proj.weight
    w = kv_b.view(H, dn + dv, r).double()
    w_uk, w_uv = w[:, :dn], w[:, dn:]
    sel = _select(L, 30, 18)
    cu = torch.tensor([0, L])
    scale = (dn + dr) ** -0.5
    q_abs = torch.cat([torch.einsum("lhn,hnr->lhr", q_nope.double(), w_uk), q_rope.double()], -1)
    o_lat = sparse_attention_ref(q_abs, torch.cat([latent, k_rope], -1).double(), sel, cu, scale=scale, v_dim=r)
    o_abs = torch.einsum("lhr,hvr->lhv", o_lat, w_uv)
    k = torch.cat([torch.einsum("hnr,lr->lhn", w_uk, latent.double()), k_rope.double()[:, None].expand(L, H, dr)], -1)
    v = torch.einsum("hvr,lr->lhv", w_uv, latent.double())
    s = torch.einsum("ihd,jhd->hij", torch.cat([q_nope, q_rope], -1).double(), k) * scale
    keep = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        keep[i, sel[i][sel[i] >= 0].long()] = True
    o_exp = torch.einsum("hij,jhv->ihv", torch.softmax(s.masked_fill(~keep, -math.inf), -1), v)
    assert rel_err(o_abs, o_exp) < 1e-12


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.bfloat16, 4e-3)], ids=["fp32", "bf16"])
def test_gradients_vs_float64(dtype, bound):
    q, kv, cu, sel = _case([200, 70], 3, 48, 80, seed=19, dtype=dtype)
    q.requires_grad_(True)
    kv.requires_grad_(True)
    do = torch.randn(q.shape[0], 3, 40, generator=torch.Generator().manual_seed(20)).to(dtype)
    o = sparse_attention(q, kv, sel, cu, scale=SCALE, v_dim=40)
    dq, dkv = torch.autograd.grad(o, (q, kv), do)
    q64, kv64 = q.detach().double().requires_grad_(True), kv.detach().double().requires_grad_(True)
    o64 = sparse_attention_ref(q64, kv64, sel, cu, scale=SCALE, v_dim=40)
    dq64, dkv64 = torch.autograd.grad(o64, (q64, kv64), do.double())
    assert rel_err(o, o64) < (1e-6 if dtype == torch.float32 else 4e-3)
    assert rel_err(dq, dq64) < bound, rel_err(dq, dq64)
    assert rel_err(dkv, dkv64) < bound, rel_err(dkv, dkv64)
    assert rel_err(dkv[:, 40:], dkv64[:, 40:]) < bound  # the rope columns get the key gradient alone


def test_backward_is_deterministic_and_per_sequence():
    """Run to run the same bits; a sequence's gradients do not depend on what else is packed with it (its kv
    rows sum the contributions of its own query rows, in increasing position)."""
    q, kv, cu, sel = _case([300, 90, 5], 3, 40, 64, seed=21)
    o, lse = sparse_attention_fwd(q, kv, sel, cu, scale=SCALE, v_dim=32)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(22)).to(o.dtype)
    a = sparse_attention_bwd(q, kv, sel, cu, o, lse, do, scale=SCALE, v_dim=32)
    assert _equal(a[:2], sparse_attention_bwd(q, kv, sel, cu, o, lse, do, scale=SCALE, v_dim=32)[:2])
    for b in range(3):
        s0, s1 = int(cu[b]), int(cu[b + 1])
        one = sparse_attention_bwd(q[s0:s1], kv[s0:s1], sel[s0:s1], torch.tensor([0, s1 - s0]), o[s0:s1], lse[s0:s1],
                                   do[s0:s1], scale=SCALE, v_dim=32)
        assert _equal(one[:2], (a[0][s0:s1], a[1][s0:s1])) and one[2] is None, b


# ------------------------------------------------------------------ bad input
def _bad_packed(case):
    q, kv, cu, sel = _case([70, 30], 2, 24, 16, seed=23)
    kw = {"scale": SCALE, "v_dim": 16}
    if case == "q_dims":
        q = q[:, 0]
    elif case == "kv_width":
        kv = kv[:, :20].contiguous()
    elif case == "kv_dtype":
        kv = kv.float()
    elif case == "v_dim":
        kw["v_dim"] = 25
    elif case == "scale":
        kw["scale"] = float("nan")
    elif case == "sel_rows":
        sel = sel[:-1]
    elif case == "sel_dtype":
        sel = sel.float()
    elif case == "sel_below_pad":
        sel = sel.clone()
        sel[5, 0] = -2
    elif case == "sel_past_row":
        sel = sel.clone()
        sel[3, -1] = 4  # row 3 sees positions 0..3
    elif case == "sel_past_sequence":
        sel = sel.clone()
        sel[75, 0] = 40  # sequence 1 has 30 tokens
    elif case == "sel_not_ascending":
        sel = sel.clone()
        sel[50, :2] = sel[50, :2].flip(0)
    elif case == "sel_duplicate":
        sel = sel.clone()
        sel[50, 1] = sel[50, 0]
    elif case == "cu":
        cu = torch.tensor([0, 70, 99])
    return (q, kv, sel, cu), kw


_PACKED_ERRORS = {
    "q_dims": "q must have 3 dimensions", "kv_width": "kv rows are 20 wide", "kv_dtype": "must share a dtype",
    "v_dim": "v_dim must be", "scale": "scale must be", "sel_rows": "sel has 99 rows", "sel_dtype": "sel has dtype",
    "sel_below_pad": "sel[5, 0] = -2", "sel_past_row": "sel[3, 15] = 4 is past the row's position 3",
    "sel_past_sequence": "sel[75, 0] = 40 is past the row's position 5", "sel_not_ascending": "sel[50] is not",
    "sel_duplicate": "sel[50] is not", "cu": "cu_seqlens ends at 99",
}


@pytest.mark.parametrize("case", list(_PACKED_ERRORS))
def test_bad_packed_input(case):
    args, kw = _bad_packed(case)
    with pytest.raises((ValueError, TypeError), match=re.escape(_PACKED_ERRORS[case])):
        sparse_attention(*args, **kw)


_PAGED_ERRORS = {
    "cache_dims": "kv_cache must be (pages, 64, 1, Dqk)", "seq_idx": "seq_idx[4] = 2",
    "positions": "positions has", "position_past_table": "positions[0] = 200 is past sequence 0's block table",
    "sel_past_row": "sel[1, 2] = 9 is past the row's position 5", "page": "block_table[1, 0] = 99",
}


@pytest.mark.parametrize("case", list(_PAGED_ERRORS))
def test_bad_paged_input(case):
    q, kv, cu, sel = _case([70, 30], 2, 24, 16, seed=24)
    cache, table, seq_idx, pos = _page(kv, cu, seed=25)
    if case == "cache_dims":
        cache = cache[:, :, 0]
    elif case == "seq_idx":
        seq_idx = seq_idx.clone()
        seq_idx[4] = 2
    elif case == "positions":
        pos = pos[:-1]
    elif case == "position_past_table":
        pos = pos.clone()
        pos[0] = 200
        sel = sel.clone()
        sel[0] = -1
    elif case == "sel_past_row":
        sel = sel.clone()
        sel[1, 2] = 9
        pos = pos.clone()
        pos[1] = 5
    elif case == "page":
        table = table.clone()
        table[1, 0] = 99
    with pytest.raises((ValueError, TypeError), match=re.escape(_PAGED_ERRORS[case])):
        paged_sparse_attention(q, cache, sel, seq_idx, pos, table, scale=SCALE, v_dim=16)


@pytest.mark.parametrize("T,K", [(2200, 1100), (700, 200)], ids=["two-segments", "one-segment"])
def test_the_static_path_reads_nothing_on_the_host_and_gives_the_same_bits(T, K):
    """The mode CUDA runs (a decode graph captures it): every row gathers all K entries and every block runs,
    a block past the row's entries masked.  It adds exactly nothing: the bits of the path that gathers only
    up to the longest row (rows with 1..K entries, one with none, a second 1024-entry segment empty for most)."""
    from alignzoo.common.sparse_attention import cpu

    g = torch.Generator().manual_seed(T)
    H, D, V = 2, 40, 24
    q = torch.randn(T, H, D, generator=g).bfloat16()
    kv = torch.randn(T, D, generator=g).bfloat16()
    sel = torch.full((T, K), -1, dtype=torch.int32)
    for t in range(T):
        n = min(t + 1, K)
        sel[t, :n] = torch.randperm(t + 1, generator=g)[:n].sort().values.int()
    sel[5] = -1
    ent, n_valid = cpu.compact(sel)
    rows = cpu.contiguous_rows(torch.tensor([0, T]), ent)
    a = cpu.sparse_attend(q, kv, rows, n_valid, 0.1, V, static=False)
    b = cpu.sparse_attend(q, kv, rows, n_valid, 0.1, V, static=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ------------------------------------------------------------------ the Triton kernel (kernel.py)
def _kernel_inputs(g, dtype, H, D, lens, rows, top_k, *, pages_extra=2):
    """A pool of two-plus sequences in shuffled pages with given-back (-1) table entries, and query rows
    ``rows`` = [(sequence, position)] each selecting up to top_k of 0..position, -1 pads anywhere (a third of
    the rows one fewer entry, the row at index 1 none) -> q, cache, sel, seq_idx, table, and the packed kv."""
    need = [-(-L // PAGE_SIZE) for L in lens]
    P = sum(need) + pages_extra
    cache = torch.randn(P, PAGE_SIZE, 1, D, generator=g).to(dtype)
    perm = torch.randperm(P, generator=g).tolist()
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for b in range(len(lens)):
        table[b, : need[b]] = torch.tensor([perm.pop() for _ in range(need[b])], dtype=torch.int32)
    kv = torch.cat([cache[table[b, : need[b]].long()].view(-1, D)[:L] for b, L in enumerate(lens)])
    sel = torch.full((len(rows), top_k), -1, dtype=torch.int64)
    for r, (b, p) in enumerate(rows):
        n = 0 if r == 1 else min(p + 1, top_k) - (r % 3 == 2)
        cols = torch.randperm(top_k, generator=g)[:n].sort().values
        sel[r, cols] = torch.randperm(p + 1, generator=g)[:n].sort().values
    q = torch.randn(len(rows), H, D, generator=g).to(dtype)
    seq_idx = torch.tensor([b for b, _ in rows])
    return q, cache, sel, seq_idx, table, kv


_INTERPRETED_SPARSE_FWD = r"""
import numpy as np
import torch
from triton.runtime import interpreter as _it
from alignzoo.common.sparse_attention import cpu
from alignzoo.common.sparse_attention.kernel import paged_sparse_attention_fwd_triton, sparse_attention_fwd_triton
from test_sparse_attention import _kernel_inputs

_it.InterpreterBuilder.create_log = lambda self, arg: self.unary_op(  # torch's log, as exp above
    arg, lambda a: torch.log(torch.from_numpy(np.array(a, copy=True))).numpy())

def same(got, want, what):
    assert got[0].dtype == want[0].dtype and got[0].shape == want[0].shape, what
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (what, (got[0] - want[0]).abs().max())

g = torch.Generator().manual_seed(0)
H, D, V, top = 3, 40, 32, 5  # D = 8 * 5: three halvings, then the odd tree over 5
# paged: two sequences in shuffled pages, rows on either side of a page boundary, a row with no entry
rows = [(0, 69), (0, 40), (1, 8), (0, 64), (1, 0), (0, 2)]
q, cache, sel, seq_idx, table, kv = _kernel_inputs(g, torch.bfloat16, H, D, [70, 9], rows, top)
got = paged_sparse_attention_fwd_triton(q, cache, sel, seq_idx, table, 0.17, V)
same(got, cpu.paged_sparse_attention_fwd_cpu(q, cache, sel, seq_idx, table, 0.17, V), "paged")
assert torch.equal(got[0][1], torch.zeros(H, V, dtype=q.dtype)) and bool((got[1][1] == float("-inf")).all())
# packed: every token of two short sequences
lens = [3, 8]
tokens = [(0, p) for p in range(3)] + [(1, p) for p in range(8)]
_, _, sel, _, _, kv = _kernel_inputs(g, torch.bfloat16, H, D, lens, tokens, top)
q = torch.randn(sum(lens), H, D, generator=g).bfloat16()
cu = torch.tensor([0, 3, 11])
same(sparse_attention_fwd_triton(q, kv, sel, cu, 0.17, V), cpu.sparse_attention_fwd_cpu(q, kv, sel, cu, 0.17, V),
     "packed")
# packed, DeepSeek-V4's layout: per-head sinks, and each sequence's kv rows elsewhere (cu_seqlens_kv), the row
# with no entry (index 1) getting lse = its sink
sinks = torch.randn(H, generator=g) * 2
cu_kv = torch.tensor([5, 12, 20])
other = torch.randn(9, D, generator=g).bfloat16()
kv2 = torch.cat([other[:5], kv[:3], other[5:], kv[3:]])
q, kv2 = q.float(), kv2.float()  # fp32 out: the sink's factor is seen to the last bit
got = sparse_attention_fwd_triton(q, kv2, sel, cu, 0.17, V, cu_kv, sinks)
same(got, cpu.sparse_attention_fwd_cpu(q, kv2, sel, cu, 0.17, V, cu_seqlens_kv=cu_kv, sinks=sinks), "sinks")
assert torch.equal(got[1][1], sinks)
# one row of 1,090 entries: two 1024-entry segments merged; D = 8 * 3, the value the whole row
q, cache, sel, seq_idx, table, _ = _kernel_inputs(g, torch.float32, 1, 24, [1200], [(0, 1199)], 1100)
same(paged_sparse_attention_fwd_triton(q, cache, sel, seq_idx, table, 0.3, 24),
     cpu.paged_sparse_attention_fwd_cpu(q, cache, sel, seq_idx, table, 0.3, 24), "two segments")
print("ok")
"""


def test_kernel_gives_the_cpu_bits_interpreted():
    """The Triton kernel CUDA runs (``kernel.py``), run by Triton's interpreter on CPU tensors with torch's exp and
    log: the CPU path's bits (out and lse) for paged rows of two sequences in shuffled pages with given-back
    entries, -1 pads anywhere and a row with none (bf16, 3 heads, D = 40, v_dim = 32, top-k 5), packed rows of
    two sequences (also with sinks and kv rows placed by ``cu_seqlens_kv``), and a row whose 1,090 entries span
    two merged segments."""
    from interpreted import TORCH_MATH, run_interpreted

    run_interpreted("import sys\nsys.path.insert(0, %r)\n" % str(_TESTS) + TORCH_MATH + _INTERPRETED_SPARSE_FWD,
                    expect="ok")


_TESTS = __import__("pathlib").Path(__file__).resolve().parent


@pytest.mark.gpu
def test_kernel_on_cuda_has_the_cpu_bits_at_glm5_shapes():
    """GLM-5's absorbed rows (Dqk = 512 + 64, v_dim 512, 64 heads), top-k 2048 over a 4,096-token context in
    shuffled pages: the compiled kernel (what the launchers run on CUDA) gives the bits of ``cpu.py`` run on the
    same CUDA tensors, and agrees with the CPU's run to within the last bits of exp/log; packed rows alike, with
    sinks and ``cu_seqlens_kv`` too."""
    from alignzoo.common.sparse_attention import cpu

    g = torch.Generator().manual_seed(0)
    H, D, V, top = 64, 576, 512, 2048
    scale = 0.0723
    rows = [(0, 4095), (1, 1500), (0, 2047), (1, 4000), (0, 0)]
    q, cache, sel, seq_idx, table, _ = _kernel_inputs(g, torch.bfloat16, H, D, [4096, 4096], rows, top)
    dev = [t.cuda() for t in (q, cache, sel, seq_idx, table)]
    got = paged_sparse_attention_fwd(*dev, scale=scale, v_dim=V)
    assert _equal(got, cpu.paged_sparse_attention_fwd_cpu(*dev, scale, V))
    want = cpu.paged_sparse_attention_fwd_cpu(q, cache, sel, seq_idx, table, scale, V)
    live = torch.isfinite(want[1])  # row 1 has no entry: -inf on both
    assert torch.equal(torch.isfinite(got[1].cpu()), live) and rel_err(got[1].cpu()[live], want[1][live]) < 1e-6
    assert rel_err(got[0].cpu().float(), want[0].float()) < 1e-3
    lens = [130, 170]
    _, _, sel, _, _, kv = _kernel_inputs(g, torch.bfloat16, H, D, lens,
                                         [(0, p) for p in range(130)] + [(1, p) for p in range(170)], top)
    q = torch.randn(sum(lens), H, D, generator=g).bfloat16()
    dev = [t.cuda() for t in (q, kv, sel, torch.tensor([0, 130, 300]))]
    assert _equal(sparse_attention_fwd(*dev, scale=scale, v_dim=V), cpu.sparse_attention_fwd_cpu(*dev, scale, V))
    # DeepSeek-V4's layout: sinks, and 20 other rows between the sequences' kv rows (cu_seqlens_kv)
    dev[1] = torch.cat([kv[:130], torch.randn(20, D, generator=g).bfloat16(), kv[130:]]).cuda()
    extra = dict(cu_seqlens_kv=torch.tensor([0, 150, 320], device="cuda"), sinks=torch.randn(H, device="cuda"))
    assert _equal(sparse_attention_fwd(*dev, scale=scale, v_dim=V, **extra),
                  cpu.sparse_attention_fwd_cpu(*dev, scale, V, **extra))


@pytest.mark.gpu
def test_kernel_decode_step_replays_in_a_cuda_graph():
    """The server's decode launch reads nothing on the host: captured once, replayed on new rows, selections and
    cache, it gives the eager bits (the compaction and the row loops run on the device)."""
    g = torch.Generator().manual_seed(1)
    H, D, V, top = 8, 576, 512, 300
    rows = [(0, 700), (1, 64), (0, 3)]
    q, cache, sel, seq_idx, table, _ = _kernel_inputs(g, torch.bfloat16, H, D, [800, 800], rows, top)
    static = [t.cuda() for t in (q, cache, sel, seq_idx, table)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        paged_sparse_attention_fwd(*static, scale=0.1, v_dim=V)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_sparse_attention_fwd(*static, scale=0.1, v_dim=V)
    q2, cache2, sel2, _, _, _ = _kernel_inputs(g, torch.bfloat16, H, D, [800, 800], [(0, 799), (1, 10), (0, 300)], top)
    for dst, src in zip(static, (q2, cache2, sel2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert _equal(out, paged_sparse_attention_fwd(*static, scale=0.1, v_dim=V))


# ------------------------------------------------------------------ DeepSeek-V4's layout: sinks, extra kv rows
def _v4_case(lens, extra, H, D, top_k, seed, dtype=torch.float32):
    """Sequences whose kv holds ``extra[b]`` rows before its tokens ([compressed | tokens]); each row selects
    from all of its sequence's rows."""
    g = torch.Generator().manual_seed(seed)
    T, R = sum(lens), sum(lens) + sum(extra)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    kv = torch.randn(R, D, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    cu_kv = torch.tensor([0, *torch.tensor([n + e for n, e in zip(lens, extra)]).cumsum(0).tolist()])
    sel = []
    for n, e in zip(lens, extra):
        for _ in range(n):
            k = min(top_k, n + e)
            pick = torch.sort(torch.randperm(n + e, generator=g)[: int(torch.randint(0, k + 1, (), generator=g))])[0]
            sel.append(torch.cat([pick, torch.full((top_k - pick.numel(),), -1)]))
    sinks = torch.randn(H, generator=g) * 2
    return q, kv, cu, cu_kv, torch.stack(sel).int(), sinks


def test_sinks_and_kv_layout_match_float64_and_stay_batch_invariant():
    """Extra kv rows per sequence and a per-head sink: float64 accuracy (rows with no entry give 0), a row's bits
    alone == in the batch, and gradients of q, kv and the sinks against float64 autograd."""
    q, kv, cu, cu_kv, sel, sinks = _v4_case([300, 90, 5], [75, 22, 1], 3, 40, 48, seed=31)
    o = sparse_attention(q, kv, sel, cu, scale=SCALE, v_dim=40, cu_seqlens_kv=cu_kv, sinks=sinks)
    ref = sparse_attention_ref(q, kv, sel, cu, scale=SCALE, v_dim=40, cu_seqlens_kv=cu_kv, sinks=sinks)
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-6
    assert bool((o[(sel < 0).all(1)] == 0).all())
    for b, t in ((0, 0), (0, 299), (1, 50), (2, 4)):
        i = int(cu[b]) + t
        one = sparse_attention(q[i:i + 1], kv[int(cu_kv[b]):int(cu_kv[b + 1])], sel[i:i + 1], torch.tensor([0, 1]),
                               scale=SCALE, v_dim=40, cu_seqlens_kv=torch.tensor([0, int(cu_kv[b + 1] - cu_kv[b])]),
                               sinks=sinks)
        assert torch.equal(one, o[i:i + 1]), (b, t)
    xs = [t.clone().requires_grad_() for t in (q, kv, sinks)]
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(32))
    sparse_attention(xs[0], xs[1], sel, cu, scale=SCALE, v_dim=40, cu_seqlens_kv=cu_kv, sinks=xs[2]).backward(do)
    x64 = [t.detach().double().requires_grad_() for t in (q, kv, sinks)]
    sparse_attention_ref(x64[0], x64[1], sel, cu, scale=SCALE, v_dim=40, cu_seqlens_kv=cu_kv, sinks=x64[2]).backward(
        do.double())
    for name, a, b in zip(("dq", "dkv", "dsinks"), xs, x64):
        assert ((a.grad.double() - b.grad).norm() / b.grad.norm()).item() < 1e-5, name


def test_kv_layout_input_is_checked():
    q, kv, cu, cu_kv, sel, sinks = _v4_case([30, 9], [7, 2], 2, 24, 8, seed=33)
    kw = {"scale": SCALE, "v_dim": 24}
    with pytest.raises(ValueError, match="sinks has 3 entries for q's 2 heads"):
        sparse_attention(q, kv, sel, cu, cu_seqlens_kv=cu_kv, sinks=torch.zeros(3), **kw)
    with pytest.raises(ValueError, match="one row per token"):
        sparse_attention(q, kv, sel, cu, **kw)
    bad = sel.clone()
    bad[35, 0] = 11  # sequence 1 has 9 + 2 rows: 0..10
    with pytest.raises(ValueError, match=r"sel\[35, 0\] = 11 is past"):
        sparse_attention(q, kv, bad, cu, cu_seqlens_kv=cu_kv, **kw)
