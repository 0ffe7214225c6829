"""The engine over each cache-pool kind (``pool_toys.py``), bitwise against
the toys' no-cache references: a state pool through joins, preemption and
finishes mid-decode; a rate pool whose rows appear exactly at boundaries
under chunked prefill split at every offset; a window pool that gives pages
back under a long decode.  Per-token extras ride along on every path."""
from __future__ import annotations

import pytest
import torch
from pool_toys import PoolToy

from alignzoo.common.engine import Engine
from alignzoo.common.sampling import SamplingParams, params_to_tensors, sampling_logprobs


def _sp(i, n):
    return SamplingParams(temperature=0.8 + 0.1 * (i % 3), top_k=20 + i, top_p=0.9, min_p=0.02, seed=11 + i,
                          max_new_tokens=n)


def _prompts(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def assert_matches_reference(toy, prompt, tokens, logprobs, sp, extras=None):
    """The served log-probs (and extras) equal the reference's bits: the
    sampler's log-prob of a token is the replay of that token's logits row."""
    seq = prompt + tokens
    logits, ref_extras = toy.reference(seq)
    rows = logits[len(prompt) - 1:len(seq) - 1]
    t = params_to_tensors([sp] * len(tokens), [0] * len(tokens))
    want = sampling_logprobs(rows, torch.tensor(tokens), t["temperature"], t["top_k"], t["top_p"], t["min_p"])
    assert torch.equal(logprobs, want)
    if extras is not None:
        fed = len(seq) - 1
        assert set(extras) == set(ref_extras)
        for n, e in extras.items():
            assert torch.equal(e, ref_extras[n][:fed]), n


def test_state_pool_through_joins_preemption_and_finishes():
    toy = PoolToy("state")
    lens, news = [70, 60, 130, 1, 66], [90, 90, 55, 60, 33]
    prompts, sps = _prompts(lens, toy.vocab_size), [_sp(i, n) for i, n in enumerate(news)]
    eng = Engine(toy, num_pages=6, max_batch_size=3, max_batch_tokens=64, page_shuffle_seed=3, freeze_gc=False)
    outs = eng.generate(prompts, sps)
    assert eng.num_preemptions > 0  # 3 running sequences outgrow 6 pages: the newest is recomputed from position 0
    for p, o, sp in zip(prompts, outs, sps):
        assert o.error is None and len(o.tokens) == sp.max_new_tokens
        assert_matches_reference(toy, p, o.tokens, o.logprobs, sp, o.extras)
    assert eng.block_manager.idle and eng.block_manager.state.num_free == eng.pool_units["state"]
    # the same bits scored, prefilled whole and token by token
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    for chunk in (None, 1):
        lps, ext = eng.score(seqs, lens, sps, chunk_tokens=chunk, return_extras=True)
        for p, o, lp, e, sp in zip(prompts, outs, lps, ext, sps):
            assert torch.equal(lp, o.logprobs)
            assert_matches_reference(toy, p, o.tokens, lp, sp, e)


def test_a_broken_state_write_is_caught(monkeypatch):
    """A decode that reads the state of the last chunk boundary instead of its
    own slot (a stale state) parts from the reference."""
    toy = PoolToy("state")
    real = toy._serve_state

    def stale(x, batch, caches):
        if batch.max_seqlen_q == 1:
            caches["state"][0]["h"].mul_(1.0 + 2**-10)
        return real(x, batch, caches)

    monkeypatch.setattr(toy, "_serve_state", stale)
    prompt, sp = _prompts([20], toy.vocab_size)[0], _sp(0, 12)
    o = Engine(toy, num_pages=4, freeze_gc=False).generate([prompt], sp)[0]
    with pytest.raises(AssertionError):
        assert_matches_reference(toy, prompt, o.tokens, o.logprobs, sp)


@pytest.mark.parametrize("rate", [4, 7])
def test_rate_pool_rows_at_boundaries_under_every_split(rate):
    toy = PoolToy("rate", rate=rate)
    prompt = _prompts([150], toy.vocab_size, seed=rate)[0]
    sp = _sp(1, 30)
    eng = Engine(toy, num_pages=8, max_batch_tokens=64, freeze_gc=False)
    out = eng.generate([prompt], sp)[0]
    assert_matches_reference(toy, prompt, out.tokens, out.logprobs, sp, out.extras)
    seq = prompt + out.tokens
    for chunk in range(1, 2 * rate + 2):  # every offset of a split against the rate's boundaries
        lp, ext = eng.score([seq], [len(prompt)], sp, chunk_tokens=chunk, return_extras=True)
        assert torch.equal(lp[0], out.logprobs), chunk
        assert all(torch.equal(ext[0][n], out.extras[n]) for n in out.extras), chunk
    assert eng.block_manager.idle


def test_window_pool_gives_pages_back_under_a_long_decode():
    toy = PoolToy("window", window=100)
    eng = Engine(toy, num_pages=16, max_batch_size=1, max_batch_tokens=64, freeze_gc=False)
    win = eng.block_manager.ledgers["win"]
    assert win.num_pages * 64 < 430  # the window pool could not hold the sequence without giving pages back
    held = []
    prompt, sp = _prompts([30], toy.vocab_size, seed=5)[0], _sp(2, 400)
    rid = eng.add_request(prompt, sp)
    done = []
    while not done:
        done = eng.step()
        held.append(win.num_pages - win.num_free)
    (out,) = done
    assert out.request_id == rid and len(out.tokens) == 400 and eng.num_preemptions == 0
    assert max(held) <= 3  # the window's two pages and the one being filled
    assert_matches_reference(toy, prompt, out.tokens, out.logprobs, sp, out.extras)
    assert eng.block_manager.idle


def test_window_pool_admits_a_prompt_longer_than_its_pages():
    """A 700-token prompt into a 9-page window pool (576 rows): prefilled in 64-token chunks, it never holds more
    than the window and two chunks, so it is admitted and runs; the bits are the reference's."""
    toy = PoolToy("window", window=100)
    eng = Engine(toy, num_pages=16, max_batch_size=2, max_batch_tokens=64, freeze_gc=False)
    win = eng.block_manager.ledgers["win"]
    assert win.num_pages * 64 < 700
    prompts, sps = _prompts([700, 9], toy.vocab_size, seed=8), [_sp(0, 20), _sp(1, 30)]
    outs = eng.generate(prompts, sps)
    for p, o, sp in zip(prompts, outs, sps):
        assert o.error is None and len(o.tokens) == sp.max_new_tokens
        assert_matches_reference(toy, p, o.tokens, o.logprobs, sp, o.extras)
    assert eng.block_manager.idle


def test_runner_takes_the_engines_pools_in_the_models_order():
    """The runner allocates the specs the engine sized and reads which pools
    are paged (and whether one holds state) off the engine's cache manager,
    keeping the model's order of pools (the manager puts a window pool last)."""
    from alignzoo.common.kv_cache import StatePool

    for kind in ("state", "rate", "window"):
        toy = PoolToy(kind)
        eng = Engine(toy, num_pages=8, freeze_gc=False)
        pools = toy.cache_pools()
        assert eng.runner.pools == pools
        assert eng.runner.paged == [n for n, p in pools.items() if not isinstance(p, StatePool)]
        assert eng.runner.has_state == (kind == "state")
        assert {n: len(c) for n, c in eng.runner.caches.items()} == {n: p.layers for n, p in pools.items()}

    class WindowFirst(PoolToy):
        def cache_pools(self):
            return dict(reversed(super().cache_pools().items()))

    eng = Engine(WindowFirst("window"), num_pages=8, freeze_gc=False)
    assert eng.runner.paged == ["win", "kv"] and list(eng.block_manager.ledgers) == ["kv", "win"]
