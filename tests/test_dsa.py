"""The DSA indexer's scores and top-k selection (``alignzoo.common.dsa``): one reduction order and one tie rule.

Scores Σ_h w_h · ReLU(q_h · k) have exact 0.0 plateaus, so ties at the top-k boundary are the common case: the
selection must not depend on the batch, on how many keys are visible (prefill == decode), or on -0.0 vs +0.0.
"""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.dsa import index_scores, index_scores_ref, index_topk, index_topk_ref
from alignzoo.common.ladder import rel_err


def _inputs(n, H, D, L, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, H, D, generator=g).to(dtype)
    k = torch.randn(L, D, generator=g).to(dtype)
    w = torch.randn(n, H, generator=g) * H ** -0.5
    return q, k, w


@pytest.mark.parametrize("n,H,D,L", [(7, 5, 36, 63), (130, 3, 20, 700), (1, 32, 128, 65)],
                         ids=["7x5x36_L63", "130x3x20_L700", "1x32x128_L65"])
def test_scores_rows_do_not_depend_on_the_batch(n, H, D, L):
    q, k, w = _inputs(n, H, D, L)
    scale = D ** -0.5
    whole = index_scores(q, k, w, scale)
    assert whole.shape == (n, L) and whole.dtype == torch.float32
    alone = torch.cat([index_scores(q[i:i + 1], k, w[i:i + 1], scale) for i in range(n)])
    assert torch.equal(whole, alone)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    assert torch.equal(index_scores(q[perm], k, w[perm], scale), whole[perm])
    # a key's column does not depend on the other keys either (decode sees a prefix of the keys)
    assert torch.equal(index_scores(q, k[: L // 2 + 1], w, scale), whole[:, : L // 2 + 1])


def test_scores_match_float64():
    q, k, w = _inputs(50, 4, 64, 300, dtype=torch.float32)
    got, want = index_scores(q, k, w, 0.125), index_scores_ref(q, k, w, 0.125)
    assert rel_err(got, want) < 1e-6


def test_prefill_and_decode_select_the_same_positions():
    """A sequence of 1,000 tokens, top-k 32: each token's selection over the whole prefill equals the one a decode
    step makes with only the keys up to it."""
    L, H, D, top = 1000, 4, 32, 32
    q, k, w = _inputs(L, H, D, L, seed=3)
    pos = torch.arange(L)
    prefill = index_topk(index_scores(q, k, w, D ** -0.5), pos, top)
    for t in (0, 1, 31, 32, 33, 63, 64, 593, 999):
        step = index_topk(index_scores(q[t:t + 1], k[: t + 1], w[t:t + 1], D ** -0.5), pos[t:t + 1], top)
        assert torch.equal(step, prefill[t:t + 1]), t


def test_selection_ties_go_to_the_smaller_position_and_come_back_ascending():
    L, top = 300, 16
    scores = torch.zeros(3, L)
    scores[1, 100:110] = 1.0  # ten winners, then a plateau of zeros: the six smallest zero positions fill up
    scores[2] = -0.0  # signed zeros tie with +0.0
    scores[2, ::2] = 0.0
    pos = torch.tensor([299, 299, 200])
    sel = index_topk(scores, pos, top)
    assert sel.dtype == torch.int32 and sel.shape == (3, top)
    assert sel[0].tolist() == list(range(16))
    assert sel[1].tolist() == list(range(6)) + list(range(100, 110))
    assert sel[2].tolist() == list(range(16))
    assert torch.equal(sel, index_topk_ref(scores, pos, top))


def test_early_tokens_see_only_their_past_and_pad_with_minus_one():
    scores = torch.arange(10, dtype=torch.float32).repeat(4, 1)  # later positions score higher
    sel = index_topk(scores, torch.tensor([0, 2, 5, 9]), 4)
    assert sel.tolist() == [[0, -1, -1, -1], [0, 1, 2, -1], [2, 3, 4, 5], [6, 7, 8, 9]]


def test_selection_matches_the_reference_on_random_scores_with_plateaus():
    q, k, w = _inputs(200, 3, 16, 200, seed=5)
    w = w.abs()  # non-negative weights: every negative q.k is an exact 0 term, so many rows tie
    scores = index_scores(q, k, w, 0.25)
    pos = torch.arange(200)
    sel = index_topk(scores, pos, 24)
    assert torch.equal(sel, index_topk_ref(scores, pos, 24))
    assert (scores == 0).float().mean() > 0.01  # the plateaus the tie rule is for


def test_built_to_tie_every_score_is_zero():
    """Equal keys, queries opposite to them: every score is exactly 0, and the selection is the first k positions."""
    L, H, D = 257, 2, 8
    k = torch.ones(L, D, dtype=torch.bfloat16)
    q = -torch.ones(L, H, D, dtype=torch.bfloat16)
    w = torch.ones(L, H)
    scores = index_scores(q, k, w, 1.0)
    assert torch.equal(scores, torch.zeros(L, L))
    sel = index_topk(scores, torch.arange(L), 64)
    assert sel[256].tolist() == list(range(64)) and sel[10].tolist() == list(range(11)) + [-1] * 53


def test_bad_input_is_named():
    q, k, w = _inputs(4, 2, 8, 10)
    with pytest.raises(ValueError, match="k has head dim 7"):
        index_scores(q, k[:, :7].contiguous(), w, 1.0)
    with pytest.raises(ValueError, match="w has shape"):
        index_scores(q, k, w[:, :1].contiguous(), 1.0)
    with pytest.raises(ValueError, match="top_k"):
        index_topk(torch.zeros(2, 5), torch.tensor([1, 2]), 0)
    with pytest.raises(ValueError, match="positions"):
        index_topk(torch.zeros(2, 5), torch.tensor([1, 5]), 2)
    with pytest.raises(ValueError, match="NaN"):
        index_topk(torch.tensor([[0.0, float("nan")]]), torch.tensor([1]), 1)


_INTERPRETED_PAGED_SCORES = """
import torch
from alignzoo.common.dsa.cpu import gather_keys, index_scores_cpu
from alignzoo.common.dsa.kernel import paged_index_scores_triton
g = torch.Generator().manual_seed(0)
for n, H, D, P, W in ((37, 3, 24, 9, 4), (5, 4, 20, 6, 2)):
    q = torch.randn(n, H, D, generator=g)
    k_cache = torch.randn(P, 64, 1, D, generator=g)
    w = torch.randn(n, H, generator=g)
    block_table = torch.randperm(P, generator=g)[: 2 * W].view(2, W).int()
    block_table[1, -1] = -1  # a page given back: read as page 0, masked by the selection
    seq_idx = (torch.arange(n) % 2).long()
    got = paged_index_scores_triton(q, k_cache, w, seq_idx, block_table, 0.2)
    want = index_scores_cpu(q, gather_keys(k_cache, block_table, seq_idx), w, 0.2)
    assert got.shape == want.shape == (n, W * 64)
    assert torch.equal(got, want), (n, (got - want).abs().max())
    assert bool((got >= 0).logical_or(w.min() < 0).all())
"""


def test_paged_scores_kernel_adds_in_the_cpu_order_interpreted():
    """The Triton kernel the server runs on CUDA (``kernel.py``), run by Triton's interpreter on CPU tensors in
    fp32: every score has the element-wise CPU path's bits (d left to right, then the heads, no FMA), for rows
    of two sequences in shuffled pages, a given-back page included."""
    from interpreted import run_interpreted

    run_interpreted(_INTERPRETED_PAGED_SCORES)


@pytest.mark.gpu
@pytest.mark.parametrize("n,H,D,P,W", [(37, 3, 24, 9, 4), (300, 32, 128, 40, 17)])
def test_paged_scores_kernel_on_cuda_has_the_cpu_bits(n, H, D, P, W):
    """On the GPU the compiled kernel keeps the CPU path's bits: GLM-5's 32 × 128 indexer heads, keys read
    through a shuffled block table with a given-back page."""
    from alignzoo.common.dsa.cpu import gather_keys, index_scores_cpu
    from alignzoo.common.dsa.kernel import paged_index_scores_triton

    g = torch.Generator().manual_seed(n)
    q = torch.randn(n, H, D, generator=g)
    k_cache = torch.randn(P, 64, 1, D, generator=g)
    w = torch.randn(n, H, generator=g)
    block_table = torch.randperm(P, generator=g)[: 2 * W].view(2, W).int()
    block_table[1, -1] = -1
    seq_idx = (torch.arange(n) % 2).long()
    want = index_scores_cpu(q, gather_keys(k_cache, block_table, seq_idx), w, 0.2)
    got = paged_index_scores_triton(q.cuda(), k_cache.cuda(), w.cuda(), seq_idx.cuda(), block_table.cuda(), 0.2)
    assert torch.equal(got.cpu(), want), (got.cpu() - want).abs().max()
