"""The serving engine's contract on a toy model built from the real kernels:
a request's tokens and FP32 log-probs are the same bits alone, in any batch,
in any order, joining mid-decode, after preemption, with any prefill chunking,
and when teacher-forced through ``score``; and with per-request LoRA adapters
sharing a batch (``adapter_ids``, a static input of the decode graphs)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from engine_toy import ToyServeModel
from model_cases import assert_same

from alignzoo.common.engine import Completion, Engine, ForwardBatch, PagedRows, ServeModel, graph_batch_sizes
from alignzoo.common.engine.model_api import batch_tensors, first_rows, static_decode_batch
from alignzoo.common.engine.model_runner import DecodeGraphs
from alignzoo.common.engine.scheduler import Scheduler
from alignzoo.common.sampling import SamplingParams

RICH = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, min_p=0.02, max_new_tokens=24, seed=11)


@pytest.fixture(scope="module")
def model():
    return ToyServeModel()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def solo(model, p, sp) -> Completion:
    """The reference: the request alone in a fresh engine, prefilled in one piece."""
    return Engine(model, num_pages=64, max_batch_tokens=4096).generate([p], sp)[0]


# Different lengths straddling page boundaries; per-request seeds and transforms.
PROMPTS = [prompt(n, i) for i, n in enumerate((5, 63, 64, 130, 1))]
PARAMS = [
    SamplingParams(max_new_tokens=24, seed=1),
    RICH,
    SamplingParams(temperature=0.0, max_new_tokens=17),
    SamplingParams(temperature=1.3, top_k=5, max_new_tokens=30, seed=7),
    SamplingParams(top_p=0.7, max_new_tokens=20, seed=2**40),
]


@pytest.fixture(scope="module")
def alone(model):
    return [solo(model, p, sp) for p, sp in zip(PROMPTS, PARAMS)]


def test_toy_is_a_serve_model_and_default_cache_size(model):
    assert isinstance(model, ServeModel)
    # 1 GiB on the CPU, capped at max_batch_size sequences of max_position (2048 = 32 pages)
    assert Engine(model, max_batch_size=4).num_pages == 4 * 32
    with pytest.raises(ValueError, match="cuda_graphs=True needs a model on CUDA"):
        Engine(model, cuda_graphs=True)


def test_batch_and_order_do_not_change_bits(model, alone):
    eng = Engine(model, num_pages=64, max_batch_tokens=4096, page_shuffle_seed=3)
    outs = eng.generate(PROMPTS, PARAMS)
    for got, want in zip(outs, alone):
        assert_same(got, want)
        assert got.weight_version == 0 and got.weight_versions == (0,) * len(got.tokens)
    rev = Engine(model, num_pages=64, max_batch_tokens=4096, page_shuffle_seed=4).generate(PROMPTS[::-1], PARAMS[::-1])
    for got, want in zip(rev, alone[::-1]):
        assert_same(got, want)


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_join_and_finish_mid_decode(model, alone, overlap):
    # A small budget also mixes prefill chunks and decode rows in one step.
    eng = Engine(model, num_pages=64, max_batch_tokens=48, page_shuffle_seed=5, overlap=overlap)
    ids, done = {}, {}
    for i in range(len(PROMPTS)):
        ids[eng.add_request(PROMPTS[i], PARAMS[i])] = i
        for _ in range(3 + 2 * i):
            done.update({c.request_id: c for c in eng.step()})
    while eng.has_unfinished():
        done.update({c.request_id: c for c in eng.step()})
    assert sorted(ids) == sorted(done)
    for rid, i in ids.items():
        assert_same(done[rid], alone[i])


def test_preemption_recomputes_the_same_bits(model, alone):
    # 4 pages: the three first admitted outgrow them while decoding.
    eng = Engine(model, num_pages=4, max_batch_tokens=96, page_shuffle_seed=6)
    outs = eng.generate(PROMPTS, PARAMS)
    assert eng.num_preemptions > 0
    for got, want in zip(outs, alone):
        assert_same(got, want)
    assert eng.block_manager.num_free == 4


def test_joins_chunks_and_preemption_together(model, alone, monkeypatch):
    # This order preempts the 130-token prompt halfway through its prefill.
    preempted = []
    real = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq: (preempted.append(seq.num_cached < seq.num_fed - 1),
                                                                   real(self, seq)))
    eng = Engine(model, num_pages=4, max_batch_tokens=40, page_shuffle_seed=8)
    ids, done = {}, {}
    for i in (1, 3, 2, 0, 4):
        ids[eng.add_request(PROMPTS[i], PARAMS[i])] = i
        done.update({c.request_id: c for c in eng.step()})
    while eng.has_unfinished():
        done.update({c.request_id: c for c in eng.step()})
    assert any(preempted) and eng.num_preemptions == len(preempted)
    for rid, i in ids.items():
        assert_same(done[rid], alone[i])


@pytest.mark.parametrize("budget", [64, 700])
def test_chunked_long_prompt(model, budget):
    long = prompt(1100, 99)  # past 593 positions and many pages
    sp = SamplingParams(temperature=0.8, top_k=30, max_new_tokens=6, seed=5)
    want = solo(model, long, sp)
    eng = Engine(model, num_pages=64, max_batch_tokens=budget, page_shuffle_seed=budget)
    outs = eng.generate([PROMPTS[0], long, PROMPTS[3]], [PARAMS[0], sp, PARAMS[3]])
    assert_same(outs[1], want)


def test_score_equals_generate(model, alone):
    long = prompt(700, 42)
    long_out = solo(model, long, RICH)
    outs = alone + [long_out]
    seqs = [o.prompt + o.tokens for o in outs]
    lens = [len(o.prompt) for o in outs]
    params = PARAMS + [RICH]
    for budget, chunk in ((4096, None), (100, None), (4096, 97)):  # whole, budget-chunked, 97-token chunks
        eng = Engine(model, num_pages=64, max_batch_tokens=budget)
        scored = eng.score(seqs, lens, params, chunk_tokens=chunk)
        for lp, o in zip(scored, outs):
            assert lp.dtype == torch.float32 and torch.equal(lp, o.logprobs)
        assert eng.block_manager.num_free == 64
    # one token per sequence and step: decode-shaped, like the decode that sampled them
    short = [0, 4]
    scored = Engine(model, num_pages=64).score([seqs[i] for i in short], [lens[i] for i in short],
                                               [params[i] for i in short], chunk_tokens=1)
    for lp, i in zip(scored, short):
        assert torch.equal(lp, outs[i].logprobs)
    # The transforms matter: plain temperature-1 scores differ.
    plain = Engine(model, num_pages=64).score(seqs[1:2], lens[1:2], SamplingParams())[0]
    assert not torch.equal(plain, outs[1].logprobs)
    assert Engine(model, num_pages=64).score([[3, 4]], [2], RICH)[0].shape == (0,)


def test_score_in_a_small_cache_beside_running_requests(model, alone):
    # Scored sequences wait for pages (a teacher-forced one never grows, so
    # admission alone keeps them from preempting each other).
    eng = Engine(model, num_pages=6, max_batch_tokens=64)
    rid = eng.add_request(PROMPTS[0], PARAMS[0])
    eng.step()
    scored = eng.score([o.prompt + o.tokens for o in alone], [len(o.prompt) for o in alone], PARAMS)
    for lp, o in zip(scored, alone):
        assert torch.equal(lp, o.logprobs)
    done = []
    while eng.has_unfinished():
        done += eng.step()
    assert [c.request_id for c in done] == [rid]
    assert_same(done[0], alone[0])
    small = Engine(model, num_pages=4)
    small.add_request(PROMPTS[3], PARAMS[3])
    small.step()  # holds 3 pages: the score preempts it (recomputed later, tests/test_robustness.py)
    small.score([PROMPTS[0], PROMPTS[3]], [1, 1], PARAMS[3])
    assert small.block_manager.num_free == 4 and small.num_preemptions == 1


def test_sampling_transforms_together(model):
    # Same prompt, every transform on: the seed alone separates the draws, and
    # each is its own request's bits whatever its neighbours' parameters.
    p = prompt(40, 7)
    sps = [SamplingParams(temperature=t, top_k=k, top_p=tp, min_p=mp, max_new_tokens=16, seed=s)
           for t, k, tp, mp, s in ((0.7, 10, 0.8, 0.05, 0), (0.7, 10, 0.8, 0.05, 1), (1.5, 3, 0.95, 0.1, 2))]
    outs = Engine(model, num_pages=64).generate([p] * 3, sps)
    assert outs[0].tokens != outs[1].tokens
    for o, sp in zip(outs, sps):
        assert_same(o, solo(model, p, sp))
        assert bool((o.logprobs <= 0).all()) and bool(torch.isfinite(o.logprobs).all())


def test_stop_tokens(model, alone):
    ref = alone[0]
    stop = ref.tokens[6]
    first = ref.tokens.index(stop)
    sp = SamplingParams(max_new_tokens=24, seed=1, stop_token_ids=(stop, 96))
    out = Engine(model, num_pages=64).generate([PROMPTS[0], PROMPTS[1]], [sp, RICH])
    assert out[0].finish_reason == "stop" and out[0].tokens == ref.tokens[: first + 1]
    assert torch.equal(out[0].logprobs, ref.logprobs[: first + 1])
    assert_same(out[1], alone[1])
    assert alone[1].finish_reason == "length" and len(alone[1].tokens) == RICH.max_new_tokens


def test_greedy_is_argmax_with_logprob_zero(model, alone):
    out = alone[2]
    assert torch.equal(out.logprobs, torch.zeros(len(out.tokens)))
    seq = out.prompt + out.tokens
    T, P = len(seq) - 1, len(out.prompt)
    caches = {n: p.allocate(2, "cpu") for n, p in model.cache_pools().items()}
    batch = ForwardBatch(
        tokens=torch.tensor(seq[:-1]), positions=torch.arange(T), cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32),
        seq_lens=torch.tensor([T], dtype=torch.int32), logit_rows=torch.arange(P - 1, T),
        adapter_ids=torch.full((T,), -1), state_slots=torch.full((1,), -1),
        pools={"kv": PagedRows(torch.tensor([[0, 1]], dtype=torch.int32), torch.arange(T))}, max_seqlen_q=T)
    logits = model.forward(batch, caches)
    assert logits.argmax(-1).tolist() == out.tokens


def test_bad_requests_fail_alone(model, alone):
    eng = Engine(model, num_pages=8)
    ok = SamplingParams(max_new_tokens=4)
    bad = [
        ([], ok, "empty"),
        ([3, -1, 4], ok, "token id -1 at index 1"),
        ([3, 97], ok, "token id 97 at index 1 is outside the vocabulary [0, 97)"),
        ([1.5], ok, "token 0 is a float"),
        (prompt(2040, 1), SamplingParams(max_new_tokens=9), "exceeds the model's max_position 2048"),
        (prompt(600, 1), SamplingParams(max_new_tokens=1), "could never run, even alone"),
        ([1, 2], "greedy", "sampling must be a SamplingParams"),
    ]
    prompts = [PROMPTS[1]] + [b[0] for b in bad] + [PROMPTS[3]]
    outs = eng.generate(prompts, [PARAMS[1]] + [b[1] for b in bad] + [PARAMS[3]])
    assert_same(outs[0], alone[1])
    assert_same(outs[-1], alone[3])
    for o, (p, _, msg) in zip(outs[1:-1], bad):
        assert o.finish_reason == "error" and msg in o.error, (o.error, msg)
        assert o.tokens == [] and o.logprobs.shape == (0,)
    with pytest.raises(ValueError, match="3 prompts but 2 SamplingParams"):
        eng.generate([[1], [2], [3]], [ok, ok])
    with pytest.raises(TypeError, match="flat list of ints"):
        eng.generate([1, 2, 3], ok)
    with pytest.raises(ValueError, match="sequence 1: prompt_len 5"):
        eng.score([[1, 2, 3], [1, 2, 3]], [1, 5], ok)
    with pytest.raises(ValueError, match="sequence 0: token id 99"):
        eng.score([[1, 99]], [1], ok)
    with pytest.raises(ValueError, match="chunk_tokens must be an int >= 1"):
        eng.score([[1, 2]], [1], ok, chunk_tokens=0)
    assert eng.block_manager.num_free == 8 and not eng.has_unfinished()


def test_weight_version_changes_only_between_steps(model):
    eng = Engine(model, num_pages=16)
    sp = SamplingParams(max_new_tokens=6, seed=3)
    rid = eng.add_request(PROMPTS[0], sp)
    eng.step()  # prefill + first token under version 0
    eng.between_steps(lambda: eng.set_weight_version(7))
    assert eng.weight_version == 0
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    (c,) = outs
    assert c.request_id == rid and c.weight_versions == (0, 7, 7, 7, 7, 7) and c.weight_version == 7
    # update_weights: applied between steps, bumps the version it returns
    rid = eng.add_request(PROMPTS[0], sp)
    eng.step()
    applied = []
    assert eng.update_weights(lambda: applied.append(eng.weight_version)) == 8 and applied == [7]
    while eng.has_unfinished():
        outs += eng.step()
    assert outs[-1].weight_versions == (7, 8, 8, 8, 8, 8)


def _spy_launches(eng) -> list:
    """Record the runner's launches: (launched ahead?, [(seq id, start)] of its chunks)."""
    seen, real = [], eng.runner.launch

    def spy(chunks, bm, **kw):
        seen.append((kw.get("tokens") is not None, [(c.seq.id, c.start) for c in chunks]))
        return real(chunks, bm, **kw)
    eng.runner.launch = spy
    return seen


@pytest.mark.parametrize("pages,budget", [(64, 4096), (4, 96)], ids=["roomy", "preempting"])
def test_overlap_gives_the_bits_of_reading_every_step(model, alone, pages, budget):
    """Decode steps launched before the previous step's tokens are read
    (``overlap=True``) give the bits of an engine that reads every step first, with
    requests that finish by length and by stop token at different steps (a
    stopped one rides along in the step launched ahead, whose row is
    dropped), and in a cache small enough to preempt."""
    params = [replace(sp, stop_token_ids=(a.tokens[len(a.tokens) // 2],)) if i % 2 else sp
              for i, (sp, a) in enumerate(zip(PARAMS, alone))]
    outs, seen = {}, {}
    for overlap in (False, True):
        eng = Engine(model, num_pages=pages, max_batch_tokens=budget, page_shuffle_seed=2, overlap=overlap)
        seen[overlap] = _spy_launches(eng)
        outs[overlap] = eng.generate(PROMPTS, params)
        assert eng.block_manager.num_free == pages and not eng.has_unfinished()
    assert not any(ahead for ahead, _ in seen[False]) and sum(ahead for ahead, _ in seen[True]) > 10
    for got, want in zip(outs[True], outs[False]):
        assert_same(got, want)
    for i in (0, 2, 4):
        assert_same(outs[True][i], alone[i])
    stopped = [o for o in outs[True] if o.finish_reason == "stop"]
    assert stopped
    if pages == 64:  # the roomy run: a stopped request rode along past its stop token in a step launched ahead
        rode = {(sid, start) for ahead, chunks in seen[True] if ahead for sid, start in chunks}
        assert any((o.request_id, len(o.prompt) + len(o.tokens) - 1) in rode for o in stopped)


def test_overlap_hooks_and_score_wait_for_the_step_launched_ahead(model):
    """A step launched ahead completes under the weights it was launched
    with: a ``between_steps`` version change lands after it, ``score`` and
    ``update_weights`` wait for it, and the tokens are the bits of an engine
    reading every step first."""
    sp = SamplingParams(max_new_tokens=6, seed=3)
    ref = Engine(model, num_pages=16, overlap=False).generate([PROMPTS[0]], sp)[0]
    eng = Engine(model, num_pages=16, overlap=True)
    eng.add_request(PROMPTS[0], sp)
    eng.step()  # prefill + token 0: nothing launched ahead of a prefill
    assert eng._ahead is None
    eng.step()  # token 1, and token 2's step launched ahead under version 0
    assert eng._ahead is not None
    eng.between_steps(lambda: eng.set_weight_version(7))
    outs = eng.step()  # waits for token 2 (version 0), then the hook, then token 3 (version 7)
    assert eng.weight_version == 7 and eng._ahead is not None
    scored = eng.score([PROMPTS[1] + [3, 4]], [len(PROMPTS[1])], sp)  # waits for token 4's step first
    assert eng._ahead is None and len(scored[0]) == 2
    assert eng.update_weights(lambda: None) == 8
    while eng.has_unfinished():
        outs += eng.step()
    (c,) = outs
    assert c.weight_versions == (0, 0, 0, 7, 7, 8)
    assert_same(c, ref)


def test_block_table_rows_are_the_tables_zero_padded(model):
    """The runner's (rows, width) block table: each sequence's pages, zeros
    past them and in pad rows (empty tables, ragged lengths, a full row), at
    a graph's full width; Python pads only to the longest table (at width
    640, max_position 40960, and 256 rows, padding every row took 28 ms a
    step on the CPU machine)."""
    runner = Engine(model, num_pages=8).runner
    g = torch.Generator().manual_seed(0)
    width = 640
    tables = [torch.randint(1, 10**6, (n,), generator=g).tolist() for n in (0, 3, width, 1, 17)]
    for rows in (len(tables), len(tables) + 3):
        want = torch.zeros(rows, width, dtype=torch.int32)
        for i, t in enumerate(tables):
            want[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
        got = runner._block_table(tables, rows, width)
        assert got.dtype == torch.int32 and torch.equal(got, want)
    assert torch.equal(runner._block_table([[]], 1, 4), torch.zeros(1, 4, dtype=torch.int32))


class EagerReplay:
    """Stands in for a captured CUDA graph on the CPU: a replay runs the
    forward on the static inputs and writes the static output."""

    def __init__(self, model, caches, batch, out):
        self.args, self.out = (model, caches, batch), out

    def replay(self):
        model, caches, batch = self.args
        self.out.copy_(model.forward(batch, caches))


def test_padded_decode_path_on_cpu(model, alone):
    # Everything the graph path does but the capture: buckets, pad rows, the
    # fixed-width block table, copies into the static inputs, sliced logits.
    eng = Engine(model, num_pages=64, max_batch_size=6, page_shuffle_seed=9)
    runner = eng.runner
    sizes = graph_batch_sizes(6)
    assert sizes == [1, 2, 4, 6]
    static = static_decode_batch(6, runner.graph_widths, "cpu")
    logits = {bs: torch.empty(bs, model.vocab_size) for bs in sizes}
    runner.graphs = DecodeGraphs(static, {bs: EagerReplay(model, runner.caches, first_rows(static, bs), logits[bs])
                                          for bs in sizes}, logits)
    replays = []
    real = runner._replay
    runner._replay = lambda bs, *a: (replays.append(bs), real(bs, *a))[1]
    for got, want in zip(eng.generate(PROMPTS, PARAMS), alone):
        assert_same(got, want)
    assert {6, 4, 1} <= set(replays)  # 5 rows in bucket 6, then 3 in bucket 4: pad rows ride along


def test_decode_graph_inputs_are_views_of_the_static_batch(model):
    """``DecodeGraphs.inputs[bs]``, made once, are the first bs rows of the
    static batch in place (what a captured graph reads): a replay's copies
    land in ``static``, and every path of the batch is there."""
    runner = Engine(model, num_pages=8, max_batch_size=6).runner
    static = static_decode_batch(6, runner.graph_widths, "cpu")
    graphs = DecodeGraphs(static, {bs: None for bs in graph_batch_sizes(6)}, {})
    whole = batch_tensors(static)
    for bs, inputs in graphs.inputs.items():
        want = batch_tensors(first_rows(static, bs))
        assert list(inputs) == list(want) == list(whole)
        for path, t in inputs.items():
            assert t.data_ptr() == whole[path].data_ptr() and t.shape == want[path].shape
    graphs.inputs[4]["tokens"].fill_(7)
    assert static.tokens.tolist() == [7] * 4 + [0] * 2
    assert DecodeGraphs(None, {4: None}, {}).inputs == {}


def test_engine_integer_arguments_refuse_bools(model):
    with pytest.raises(ValueError, match="num_pages must be an int >= 1, got True"):
        Engine(model, num_pages=True)
    with pytest.raises(ValueError, match="kv_cache_bytes must be an int of at least one page of every cache pool"):
        Engine(model, kv_cache_bytes=False)


# LoRA adapters named per request, served in one batch (the toy adapts its qkv projection)
ADAPTERS = ("x", "y", "z")
LORA_PICK = [None, "x", "y", "x", "z"]
LORA_PARAMS = [replace(sp, max_new_tokens=n) for sp, n in zip(PARAMS, (9, 12, 7, 10, 8))]


@pytest.fixture(scope="module")
def lora_model():
    return ToyServeModel(adapters=ADAPTERS)


def test_adapters_share_a_batch(lora_model):
    m = lora_model
    alone = [Engine(m, num_pages=64).generate([p], sp, adapters=a)[0]
             for p, sp, a in zip(PROMPTS, LORA_PARAMS, LORA_PICK)]
    assert [o.adapter for o in alone] == LORA_PICK
    plain = solo(m, PROMPTS[1], LORA_PARAMS[1])  # the base model: another draw
    assert plain.adapter is None and not torch.equal(plain.logprobs, alone[1].logprobs)
    # one batch, chunked prefill beside decode rows, then reversed order with preemption
    eng = Engine(m, num_pages=64, max_batch_tokens=48, page_shuffle_seed=2, overlap=True)  # LoRA ids ride ahead too
    for got, want in zip(eng.generate(PROMPTS, LORA_PARAMS, adapters=LORA_PICK), alone):
        assert_same(got, want)
        assert got.adapter == want.adapter
    eng = Engine(m, num_pages=4, max_batch_tokens=96, page_shuffle_seed=6)
    for got, want in zip(eng.generate(PROMPTS[::-1], LORA_PARAMS[::-1], adapters=LORA_PICK[::-1]), alone[::-1]):
        assert_same(got, want)
    assert eng.num_preemptions > 0
    # teacher-forced: prefilled, and token by token (the short ones)
    seqs, lens = [o.prompt + o.tokens for o in alone], [len(p) for p in PROMPTS]
    for lp, o in zip(Engine(m, num_pages=64).score(seqs, lens, LORA_PARAMS, adapters=LORA_PICK), alone):
        assert torch.equal(lp, o.logprobs)
    short = [1, 4]
    for i, lp in zip(short, Engine(m, num_pages=64).score([seqs[i] for i in short], [lens[i] for i in short],
                                                          [LORA_PARAMS[i] for i in short],
                                                          adapters=[LORA_PICK[i] for i in short], chunk_tokens=1)):
        assert torch.equal(lp, alone[i].logprobs)
    # the padded graph path: adapter ids copied into the static batch, pad rows -1
    eng = Engine(m, num_pages=64, max_batch_size=6)
    runner, sizes = eng.runner, graph_batch_sizes(6)
    static = static_decode_batch(6, runner.graph_widths, "cpu")
    logits = {bs: torch.empty(bs, m.vocab_size) for bs in sizes}
    runner.graphs = DecodeGraphs(static, {bs: EagerReplay(m, runner.caches, first_rows(static, bs), logits[bs])
                                          for bs in sizes}, logits)
    replays, real = [], runner._replay
    runner._replay = lambda bs, host: (replays.append(host["adapter_ids"] + [-1] * (bs - len(host["adapter_ids"]))), real(bs, host))[1]
    for got, want in zip(eng.generate(PROMPTS, LORA_PARAMS, adapters=LORA_PICK), alone):
        assert_same(got, want)
    assert [-1, 0, 1, 0, 2, -1] in replays  # five decode rows and a pad row in bucket 6


def test_unknown_adapter_fails_alone(model, lora_model, alone):
    eng = Engine(lora_model, num_pages=16)
    outs = eng.generate(PROMPTS[:3], LORA_PARAMS[:3], adapters=["x", "nope", None])
    assert outs[1].finish_reason == "error" and outs[1].adapter == "nope"
    assert "unknown adapter 'nope': the model serves adapters 'x', 'y', 'z'" in outs[1].error
    assert outs[0].error is None and outs[2].error is None and len(outs[2].tokens) == LORA_PARAMS[2].max_new_tokens
    bad = eng.generate([PROMPTS[0]], LORA_PARAMS[0], adapters=3)[0]
    assert bad.finish_reason == "error" and "adapter must be an adapter name (str) or None, got int" in bad.error
    with pytest.raises(ValueError, match="3 prompts but 2 adapters"):
        eng.generate(PROMPTS[:3], LORA_PARAMS[0], adapters=["x", "y"])
    with pytest.raises(ValueError, match="sequence 1: unknown adapter 'w'"):
        eng.score([[1, 2, 3], [1, 2, 3]], [1, 1], LORA_PARAMS[0], adapters=["x", "w"])
    # a model without adapters serves the base model and refuses any name
    out = Engine(model, num_pages=16).generate(PROMPTS[:2], PARAMS[:2], adapters=[None, "x"])
    assert_same(out[0], alone[0])
    assert "unknown adapter 'x': the model serves adapters none" in out[1].error
    assert eng.block_manager.num_free == 16 and not eng.has_unfinished()


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graph_decode_matches_eager(overlap):
    model = ToyServeModel(device="cuda")
    prompts = PROMPTS + [prompt(700, 3), prompt(9, 4)]
    params = PARAMS + [RICH, SamplingParams(max_new_tokens=40, seed=9)]
    eager = Engine(model, num_pages=64, max_batch_size=8, cuda_graphs=False).generate(prompts, params)
    graph_eng = Engine(model, num_pages=64, max_batch_size=8, cuda_graphs=True, page_shuffle_seed=1, overlap=overlap)
    assert sorted(graph_eng.runner.graphs.graphs) == [1, 2, 4, 8]
    replays = []
    real = graph_eng.runner._replay
    graph_eng.runner._replay = lambda bs, *a: (replays.append(bs), real(bs, *a))[1]
    graphed = graph_eng.generate(prompts, params)
    assert 8 in replays and 1 in replays  # 7 rows padded to 8, down to the last request alone
    assert {bs for bs, _ in graph_eng.runner.sample_graphs.graphs} >= {1, 8}  # the sampler replayed too
    for g, e in zip(graphed, eager):
        assert_same(g, e)
    # and against each request alone (batch of one: bucket 1)
    for p, sp, e in zip(prompts[:2], params[:2], eager[:2]):
        assert_same(Engine(model, num_pages=64, max_batch_size=8).generate([p], sp)[0], e)
    scored = graph_eng.score([o.prompt + o.tokens for o in graphed], [len(p) for p in prompts], params)
    for lp, o in zip(scored, graphed):
        assert torch.equal(lp.cpu(), o.logprobs)


@pytest.mark.gpu
def test_cuda_graph_sampler_narrow_head_after_wide_rows():
    """A wide row (top_k 0: k' = V) finishes first and leaves three narrow
    ones in bucket 4, whose pad row last held the wide row: the sampler graph
    of the narrow head class (64 < V) runs with that pad row reset to greedy
    (before the reset it read past the head), and the tokens and bits equal
    the eager engine's."""
    model = ToyServeModel(device="cuda")
    prompts = [prompt(40, 1), prompt(300, 2), prompt(9, 3), prompt(120, 4)]
    params = [SamplingParams(max_new_tokens=4, seed=1),
              SamplingParams(temperature=0.8, top_k=5, max_new_tokens=30, seed=2),
              SamplingParams(temperature=0.0, max_new_tokens=30),
              SamplingParams(temperature=1.1, top_k=3, top_p=0.9, max_new_tokens=30, seed=4)]
    eager = Engine(model, num_pages=64, max_batch_size=4, cuda_graphs=False).generate(prompts, params)
    graph_eng = Engine(model, num_pages=64, max_batch_size=4, cuda_graphs=True)
    for g, e in zip(graph_eng.generate(prompts, params), eager):
        assert_same(g, e)
    V = graph_eng.runner.graphs.logits[1].shape[1]
    classes = {h for _, h in graph_eng.runner.sample_graphs.graphs}
    assert V in classes and min(classes) < V


@pytest.mark.gpu
def test_cuda_graph_decode_with_adapters():
    """Adapter ids are a static input of the captured graphs: graphed ==
    eager == alone for mixed adapters, pad rows included."""
    m = ToyServeModel(device="cuda", adapters=ADAPTERS)
    prompts, pick = PROMPTS + [prompt(700, 3)], LORA_PICK + ["y"]
    params = LORA_PARAMS + [RICH]
    eager = Engine(m, num_pages=64, max_batch_size=8, cuda_graphs=False).generate(prompts, params, adapters=pick)
    graph_eng = Engine(m, num_pages=64, max_batch_size=8, cuda_graphs=True, page_shuffle_seed=1)
    replays, real = [], graph_eng.runner._replay
    graph_eng.runner._replay = lambda bs, *a: (replays.append(bs), real(bs, *a))[1]
    for g, e in zip(graph_eng.generate(prompts, params, adapters=pick), eager):
        assert_same(g, e)
    assert 8 in replays and 1 in replays  # 6 rows padded to 8, down to the last request alone
    for i in (1, 5):
        assert_same(Engine(m, num_pages=64, max_batch_size=8).generate([prompts[i]], params[i], adapters=pick[i])[0],
                    eager[i])


def test_sampler_graph_pad_rows_are_greedy_every_step():
    """``SampleGraphs.stage`` (CPU tensors stand in for a decode graph's): pad
    rows past the step's B are reset to greedy (k' = 1) every step, so a head
    class computed from the real rows covers them.  A pad row left with an
    earlier step's top_k = 0 (k' = V) read past a narrow head's key buffer."""
    from alignzoo import SamplingParams
    from alignzoo.common.engine.model_runner import DecodeGraphs, SampleGraphs
    from alignzoo.common.sampling import head_width, params_to_tensors

    V = 5000
    graphs = SampleGraphs(DecodeGraphs(static=None, graphs={4: None}, logits={4: torch.zeros(4, V)}), 16)
    wide = params_to_tensors([SamplingParams(seed=1)] * 3, [0, 1, 2])  # top_k 0: k' = V
    assert graphs.stage(4, wide, head_width(wide["temperature"], wide["top_k"], V)) == (4, V)
    narrow = params_to_tensors([SamplingParams(temperature=0.0)], [0])  # greedy: head 1
    key = graphs.stage(4, narrow, head_width(narrow["temperature"], narrow["top_k"], V))
    p = graphs.params[4]
    k_eff = torch.where(p["temperature"] == 0, 1, torch.where(p["top_k"] > 0, p["top_k"], V))
    assert int(k_eff.max()) <= key[1] < V
    assert torch.equal(p["temperature"], torch.zeros(4)) and torch.equal(p["top_p"], torch.ones(4))


def test_engine_freezes_the_gc_once_built():
    """``freeze_gc`` (default): the objects alive once the engine is built go
    to the permanent generation, out of the collector's full passes."""
    import gc

    model = ToyServeModel()
    gc.unfreeze()
    Engine(model, num_pages=8, freeze_gc=False)
    assert gc.get_freeze_count() == 0
    Engine(model, num_pages=8)
    assert gc.get_freeze_count() > 0
