"""The qwen3 pair's contract: trainer log-probs == server log-probs, bitwise.

Trainer (packed forward) == server prefill (score) == server decode (generate,
eager) == CUDA-graph decode (GPU) on completions sampled with temperature,
top-k, top-p and min-p together; mixed prompt lengths, requests joining
mid-decode, preemption, batch order; sequences past 1024 tokens on the CPU.
"""
import pytest
import torch

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.metrics import mismatch


def make_pair(device="cpu", dtype=torch.bfloat16, seed=0, **kw):
    pair = alignzoo.load_pair("qwen3", config="tiny", device=device, dtype=dtype, seed=seed, **kw)
    with torch.no_grad():  # norms away from one, so a swapped norm weight shows
        g = torch.Generator(device=device).manual_seed(seed + 1)
        for n, p in pair.trainer.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.mul_(3.0)  # sharper distributions than the 0.02 init: top-p / min-p bite
    pair.sync()
    return pair


def prompts_of(lens, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, max_new_tokens=24, seed=11),
      SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0, max_new_tokens=40, seed=12),
      SamplingParams(temperature=0.6, top_k=7, top_p=1.0, min_p=0.1, max_new_tokens=9, seed=13),
      SamplingParams(temperature=0.0, max_new_tokens=17, seed=14)]


def assert_trainer_matches(pair, prompts, sps, outs):
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lens = [len(p) for p in prompts]
    with torch.no_grad():
        lp_t = pair.trainer.logprobs(seqs, lens, sps)
    lp_s = pair.server.score(seqs, lens, sps)
    for o, t, s in zip(outs, lp_t, lp_s):
        assert o.error is None, o.error
        t = t.cpu()
        assert torch.equal(t, o.logprobs), mismatch(t, o.logprobs)
        assert torch.equal(s, o.logprobs), mismatch(s, o.logprobs)


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def test_trainer_equals_server_long_mixed(pair):
    """A 1100-token prompt (past 1024 with its completion) beside short ones."""
    prompts = prompts_of([1100, 5, 233, 64], pair.config.vocab_size)
    outs = pair.server.generate(prompts, SP)
    assert [len(o.tokens) for o in outs] == [sp.max_new_tokens for sp in SP]
    assert_trainer_matches(pair, prompts, SP, outs)


def test_batch_composition_and_order(pair):
    prompts = prompts_of([300, 7, 129], pair.config.vocab_size, seed=3)
    sps = SP[:3]
    together = pair.server.generate(prompts, sps)
    rev = pair.server.generate(prompts[::-1], sps[::-1])[::-1]
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        alone = pair.server.generate([p], sp)[0]
        for other in (together[i], rev[i]):
            assert other.tokens == alone.tokens and torch.equal(other.logprobs, alone.logprobs)


def test_joining_mid_decode_and_preemption():
    """Requests join between engine steps, and a 9-page cache forces preemption."""
    pair = make_pair(num_pages=9)
    eng = pair.server
    prompts = prompts_of([200, 90, 130, 31], pair.config.vocab_size, seed=5)
    sps = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, max_new_tokens=70, seed=s)
           for s in range(4)]
    ids, done = [], {}
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        ids.append(eng.add_request(p, sp))
        for _ in range(3 + 5 * i):  # the next request joins mid-decode
            for c in eng.step():
                done[c.request_id] = c
    while eng.has_unfinished():
        for c in eng.step():
            done[c.request_id] = c
    assert eng.num_preemptions > 0
    outs = [done[i] for i in ids]
    assert_trainer_matches(pair, prompts, sps, outs)
    big = make_pair(num_pages=64).server
    for p, sp, o in zip(prompts, sps, outs):
        alone = big.generate([p], sp)[0]
        assert alone.tokens == o.tokens and torch.equal(alone.logprobs, o.logprobs)


def test_fp32_end_to_end():
    pair = make_pair(dtype=torch.float32)
    prompts = prompts_of([150, 3], pair.config.vocab_size, seed=9)
    outs = pair.server.generate(prompts, SP[:2])
    assert_trainer_matches(pair, prompts, SP[:2], outs)


def test_sync_after_a_training_step():
    pair = make_pair()
    prompts = prompts_of([60, 33], pair.config.vocab_size, seed=2)
    outs = pair.server.generate(prompts, SP[:2])
    v0 = outs[0].weight_version
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lps = pair.trainer.logprobs(seqs, [len(p) for p in prompts], SP[:2])
    opt = torch.optim.SGD(pair.trainer.parameters(), lr=0.5)
    (-sum(lp[torch.isfinite(lp)].sum() for lp in lps)).backward()
    opt.step()
    with torch.no_grad():
        stale = pair.trainer.logprobs(seqs, [len(p) for p in prompts], SP[:2])
    assert any(not torch.equal(a, o.logprobs) for a, o in zip(stale, outs))  # the step changed the trainer
    assert pair.sync() == v0 + 1
    outs2 = pair.server.generate(prompts, SP[:2])
    assert all(o.weight_version == v0 + 1 for o in outs2)
    assert_trainer_matches(pair, prompts, SP[:2], outs2)


def test_ladder_catches_a_misaligned_server(monkeypatch):
    """The checks can fail: a server whose projections land one ULP off the
    trainer's.  (torch's ``F.linear`` differs from the fixed-order matmul on
    most hosts, but on some BLAS builds it happens to give the same bits at
    these shapes, so the test plants a difference no host can hide.)"""
    from alignzoo.models import base, checks

    pair = make_pair()
    aligned = base.matmul_fwd
    monkeypatch.setattr(base, "matmul_fwd", lambda x, w: torch.nextafter(aligned(x, w), x.new_tensor(float("inf"))))
    rows = {r.check: r for r in checks.run_ladder(pair, length=300, batch=3, new_tokens=20)}
    assert not rows["trainer == server prefill"].passed
    assert rows["trainer == server prefill"].differing > 0
    assert rows["trainer, same batch twice"].passed


@pytest.mark.parametrize("extra", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_cli_check_qwen3(capsys, extra):
    from alignzoo.cli import main

    assert main(["check", "qwen3", "--length", "260", "--batch", "3", *extra]) == 0
    out = capsys.readouterr().out
    assert "9/9 checks passed" in out and "FAIL" not in out


def test_load_pair_from_checkpoint(tmp_path, pair):
    pair.save_pretrained(tmp_path)
    again = alignzoo.load_pair("qwen3", checkpoint=tmp_path, device="cpu")
    for (n, a), (_, b) in zip(pair.trainer.named_parameters(), again.trainer.named_parameters()):
        assert torch.equal(a, b), n
    prompts = prompts_of([40], pair.config.vocab_size)
    a, b = pair.server.generate(prompts, SP[0])[0], again.server.generate(prompts, SP[0])[0]
    assert a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)


def test_bad_input(pair):
    V, P = pair.config.vocab_size, pair.config.max_position
    with pytest.raises(ValueError, match="unknown model 'qwen9'.*qwen3"):
        alignzoo.load_pair("qwen9")
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    good = prompts_of([20], V)[0]
    outs = pair.server.generate([good, [1, V, 2], good, []],
                                [SP[0], SP[0], SamplingParams(max_new_tokens=P), SP[0]])
    assert outs[0].error is None and outs[0].finish_reason in ("length", "stop")
    assert "outside the vocabulary" in outs[1].error and outs[1].finish_reason == "error"
    assert "max_position" in outs[2].error
    assert "the prompt is empty" in outs[3].error
    with pytest.raises(ValueError, match="outside the vocabulary"):
        pair.trainer.logprobs([[1, V]], [1])
    with pytest.raises(ValueError, match="prompt_lens"):
        pair.trainer.logprobs([[1, 2]], [3])
    with pytest.raises(ValueError, match="sequence 1: the sequence is empty"):
        pair.trainer.logprobs([[1, 2], []], [1, 1])
    with pytest.raises(ValueError, match="not both"):
        alignzoo.load_pair("qwen3", checkpoint="/nonexistent", config="tiny")


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_graph_decode_long_0p6b_shapes(overlap):
    """qwen3-0.6b shapes, random weights, a 4100-token sequence: trainer ==
    server prefill == eager decode == CUDA-graph decode, with decode steps
    launched ahead (``overlap``) or not; the eager server reads every step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pair = alignzoo.load_pair("qwen3", config="qwen3-0.6b", device="cuda", max_batch_size=8, kv_cache_bytes=8 << 30,
                              overlap=overlap)
    eager = alignzoo.load_pair("qwen3", config="qwen3-0.6b", device="cuda", max_batch_size=8, kv_cache_bytes=8 << 30,
                               cuda_graphs=False)
    prompts = prompts_of([4000, 333, 17], pair.config.vocab_size, seed=4)
    sps = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.01, max_new_tokens=n, seed=n)
           for n in (100, 60, 30)]
    outs = pair.server.generate(prompts, sps)
    for o, e in zip(outs, eager.server.generate(prompts, sps)):
        assert o.tokens == e.tokens and torch.equal(o.logprobs, e.logprobs)
    assert_trainer_matches(pair, prompts, sps, outs)


def test_sync_ships_only_changed_blocks():
    pair = make_pair()
    assert pair.weights_match()
    v = pair.server.weight_version
    with torch.no_grad():
        pair.trainer.layers[1].o.weight[70, :5] += 1.0  # one 64-row block of one tensor
    assert not pair.weights_match()
    assert pair.sync() == v + 1
    s = pair.last_sync
    assert (s.blocks_changed, s.tensors_changed) == (1, 1) and s.bytes_shipped < s.bytes_full / 20
    assert pair.weights_match()
    assert pair.sync() == v + 2 and pair.last_sync.blocks_changed == 0
