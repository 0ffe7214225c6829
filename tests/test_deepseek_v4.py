"""deepseek_v4_mhc_mxfp4's contract on the CPU: trainer == sampled == prefill == chunked prefill, bitwise, on a
mixed batch whose longest prompt leaves the 40-token window ~27 times, crosses ~275 C4 and ~68 C16 groups and
picks 24 of up to ~280 C4 rows; decode creates compressed rows mid-batch at every offset of a group; the MXFP4
experts keep it too.  Parity with transformers' DeepseekV4ForCausalLM in fp32 is in test_deepseek_v4_parity.py."""
from __future__ import annotations

import pytest
import torch

from model_cases import sharpen_v4

from alignzoo import SamplingParams
from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4

TABLE = [(0.9, 40, 0.9, 0.05), (1.3, 0, 0.8, 0.0), (0.6, 7, 1.0, 0.1), (0.0, 0, 1.0, 0.0)]


def sharpen(trainer, seed: int) -> None:
    """``model_cases.sharpen_v4`` from a seed, on the trainer's device."""
    sharpen_v4(trainer, torch.Generator(device=trainer.device).manual_seed(seed))


def make_pair(config="tiny", seed=1, **kw):
    pair = V4.load(config=config, device="cpu", dtype=torch.bfloat16, seed=seed, **kw)
    sharpen(pair.trainer, seed + 1)
    pair.sync()
    return pair


def _run(pair, lens, new, seed):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    sps = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_new_tokens=new, seed=i, ignore_eos=True)
           for i, (t, k, p, m) in enumerate(TABLE[i % len(TABLE)] for i in range(len(lens)))]
    outs = pair.server.generate(prompts, sps)
    assert not [o.error for o in outs if o.error]
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    return prompts, sps, outs, seqs


def _same(got, outs, what):
    for i, (a, o) in enumerate(zip(got, outs)):
        assert torch.equal(a.cpu(), o.logprobs), f"{what}, request {i}: max |diff| {(a.cpu() - o.logprobs).abs().max()}"


@pytest.fixture(scope="module")
def pair():
    return make_pair()


def test_trainer_prefill_chunked_and_sampled_bits_are_one(pair):
    """1,100 / 333 / 65 / 1-token prompts, 24 new tokens each under the four sampling transforms: the trainer's
    FP32 log-probs, a fresh prefill and prefills in 37- and 17-token chunks (every offset of a C4 and of a C16
    group) equal the sampled ones bit for bit."""
    prompts, sps, outs, seqs = _run(pair, [1100, 333, 65, 1], 24, seed=3)
    plens = [len(p) for p in prompts]
    with torch.no_grad():
        _same(pair.trainer.logprobs(seqs, plens, sps), outs, "trainer")
    _same(pair.server.score(seqs, plens, sps), outs, "prefill")
    for chunk in (37, 17):
        _same(pair.server.score(seqs, plens, sps, chunk_tokens=chunk), outs, f"{chunk}-token chunks")


def test_a_request_alone_has_the_batch_bits(pair):
    """A sequence's bits do not depend on what shares its steps (continuous batching)."""
    prompts, sps, outs, seqs = _run(pair, [150, 40, 97], 12, seed=5)
    alone = pair.server.score(seqs[1:2], [len(prompts[1])], sps[1:2])
    _same(alone, outs[1:2], "alone")


def test_a_lone_one_token_request_decodes_through_its_first_groups(pair):
    """A step where no sequence has a compressed row yet (the rate pools' block tables 0 pages wide), then decode
    that completes the first C4 and C16 rows: the trainer's bits."""
    prompts, sps, outs, seqs = _run(pair, [1], 40, seed=13)
    with torch.no_grad():
        _same(pair.trainer.logprobs(seqs, [1], sps), outs, "trainer")


def test_mxfp4_experts_keep_the_contract():
    """The experts as frozen MXFP4 codes on both sides (computed packed): trainer == sampled."""
    p = make_pair("tiny-mxfp4", seed=7)
    assert p.trainer.layers[1].moe.gate_up.weight.dtype == torch.uint8
    prompts, sps, outs, seqs = _run(p, [260, 33], 10, seed=9)
    with torch.no_grad():
        _same(p.trainer.logprobs(seqs, [len(x) for x in prompts], sps), outs, "trainer")


def test_fp8_dense_linears_beside_mxfp4_experts_keep_the_contract():
    """fp8=True on the release's layout: the attention's and shared expert's linears as FP8 codes, the routed
    experts MXFP4; trainer == sampled on a 310 / 33-token batch, and again after an Adam step's sync."""
    p = make_pair("tiny-mxfp4", seed=5, fp8=True)
    w = p.server.model.weights
    assert w["layers.1.attn.q_b.weight"].dtype == torch.float8_e4m3fn
    assert w["layers.1.moe.shared_down.weight"].dtype == torch.float8_e4m3fn
    assert w["layers.1.attn.o_a.weight"].dtype == torch.bfloat16 and w["layers.1.moe.down.weight"].dtype == torch.uint8
    t = p.trainer
    opt = torch.optim.Adam([x for x in t.parameters() if x.requires_grad], lr=3e-3)
    for step in range(2):
        codes = w["layers.1.attn.q_b.weight"].clone()
        prompts, sps, outs, seqs = _run(p, [310, 33], 6, seed=13 + step)
        plens = [len(x) for x in prompts]
        with torch.no_grad():
            _same(t.logprobs(seqs, plens, sps), outs, f"trainer, step {step}")
        (-sum(lp[torch.isfinite(lp)].sum() for lp in t.logprobs(seqs, plens, sps))).backward()
        opt.step()
        opt.zero_grad()
        p.sync()
        assert p.weights_match() and not torch.equal(w["layers.1.attn.q_b.weight"], codes)  # the step's codes shipped


def test_a_broken_server_is_caught(pair, monkeypatch):
    """The test's teeth: the server attending without its sinks no longer gives the trainer's bits."""
    from alignzoo.models.deepseek_v4_mhc_mxfp4 import serve

    real = serve.sparse_attention_fwd
    monkeypatch.setattr(serve, "sparse_attention_fwd", lambda *a, sinks=None, **k: real(*a, **k))
    prompts, sps, outs, seqs = _run(pair, [90], 4, seed=11)
    monkeypatch.undo()
    with torch.no_grad():
        got = pair.trainer.logprobs(seqs, [90], sps)
    assert not torch.equal(got[0], outs[0].logprobs)


def test_checkpoint_round_trip(pair, tmp_path):
    """save_pretrained writes what transformers' names expect (tid2eid an integer table) and load reads the same
    bytes back (MXFP4 saves: test_deepseek_v4_weights.py)."""
    V4.save_pretrained(pair.trainer, tmp_path / "ckpt")
    back = V4.load(checkpoint=tmp_path / "ckpt", device="cpu", dtype=torch.bfloat16)
    want = dict(pair.trainer.named_parameters())
    for n, p in back.trainer.named_parameters():
        assert torch.equal(p, want[n]), n


def test_router_and_index_replay_give_the_sampled_bits_and_bad_selections_are_named(pair):
    """The server's routing (every layer) and, on request, its C4 selections: the trainer scoring with them gives
    the sampled bits; a selection the indexer could not have made is refused, naming entry, layer and token."""
    from dataclasses import replace

    g = torch.Generator().manual_seed(17)
    prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in (260, 31)]
    sps = [SamplingParams(temperature=0.9, top_k=40, max_new_tokens=12, seed=i, ignore_eos=True,
                          extras=("index_selected",)) for i in range(2)]
    outs = pair.server.generate(prompts, sps)
    ex = [o.extras for o in outs]
    n_csa = len(pair.config.csa_layers)
    assert ex[0]["index_selected"].shape == (260 + 12 - 1, n_csa, pair.config.index_topk)
    seqs, plens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    with torch.no_grad():
        _same(pair.trainer.logprobs(seqs, plens, sps, replay=ex), outs, "replayed")
    other = {k: v.clone() for k, v in ex[0].items()}  # another selection the indexer could have made: rows 0..k-1
    k = pair.config.index_topk
    other["index_selected"][150:, :, :] = torch.arange(k, dtype=torch.int32)
    with torch.no_grad():
        moved = pair.trainer.logprobs(seqs[:1], plens[:1], sps[:1], replay=[other])[0]
    assert not torch.equal(moved, outs[0].logprobs)  # the replayed selection is what the trainer attends with
    bad = {k: v.clone() for k, v in ex[0].items()}
    bad["index_selected"][10, 1, 0] = 3  # token 10 sees C4 rows 0..1
    with pytest.raises(ValueError, match="CSA layer 1, token 10: entry 0 = 3 is not a complete row"):
        pair.trainer.logprobs(seqs, plens, [replace(sp, extras=()) for sp in sps], replay=[bad, ex[1]])
