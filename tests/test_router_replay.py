"""Router replay on qwen35_gdn: the server's routed experts (per-token extras)
route the trainer's MoE layers; at the same weights it changes no bit, under
stale weights the trainer routes as the sampler did, and the two modes differ
only in whether the router gets a gradient."""
from __future__ import annotations

import pytest
import torch

import alignzoo
from alignzoo import SamplingParams
from alignzoo.models.capture import Recorder


@pytest.fixture(scope="module")
def sampled():
    pair = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", freeze_gc=False, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 151, (n,), generator=g).tolist() for n in (90, 7, 40)]
    sp = SamplingParams(temperature=0.9, top_k=30, max_new_tokens=40, seed=5)
    outs = pair.server.generate(prompts, sp)
    return pair, prompts, sp, outs


def test_extras_cover_every_fed_token(sampled):
    pair, prompts, sp, outs = sampled
    L, k = pair.config.num_layers, pair.config.experts_per_token
    for p, o in zip(prompts, outs):
        n = len(p) + len(o.tokens) - 1
        assert o.extras["routed_experts"].shape == (n, L, k) and o.extras["routed_experts"].dtype == torch.int32
        assert o.extras["routed_weights"].shape == (n, L, k) and o.extras["routed_weights"].dtype == torch.float32


@pytest.mark.parametrize("mode", ["frozen", "straight-through"])
def test_replay_at_the_same_weights_changes_no_bit(sampled, mode):
    pair, prompts, sp, outs = sampled
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    got = pair.trainer.logprobs(seqs, lens, sp, replay=[o.extras for o in outs], replay_mode=mode)
    assert all(torch.equal(a.detach(), o.logprobs) for a, o in zip(got, outs))


def _routed(trainer, seqs, lens, sp, **kw) -> list[torch.Tensor]:
    """Per MoE layer the experts the trainer routed each packed token to (T, k), read at its capture points."""
    rec = Recorder(seqs)
    with rec.attached_trainer(trainer):
        trainer.logprobs(seqs, lens, sp, **kw)
    return [torch.stack([rec.rows[f"layer.{j}.moe.router.ids"][i, t] for i, s in enumerate(seqs) for t in range(len(s))])
            for j in range(trainer.cfg.num_layers)]


def test_stale_weights_route_as_the_sampler_did(sampled):
    pair, prompts, sp, outs = sampled
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    saved = {n: p.detach().clone() for n, p in pair.trainer.named_parameters()}
    try:
        with torch.no_grad():
            for n, p in pair.trainer.named_parameters():
                if n.endswith("moe.gate.weight"):
                    p.add_(torch.randn_like(p) * 0.05)  # the trainer moved on: its routers disagree now
        own = _routed(pair.trainer, seqs, lens, sp)
        replayed = _routed(pair.trainer, seqs, lens, sp, replay=[o.extras for o in outs])
        served = torch.cat([torch.cat([o.extras["routed_experts"], o.extras["routed_experts"][-1:]]) for o in outs])
        last = torch.cumsum(torch.tensor([len(s) for s in seqs]), 0) - 1
        keep = torch.ones(served.shape[0], dtype=torch.bool)
        keep[last] = False  # a sequence's last token is never fed to the server
        assert any(not torch.equal(a[keep], served[keep, j].long()) for j, a in enumerate(own))
        assert all(torch.equal(a[keep], served[keep, j].long()) for j, a in enumerate(replayed))
    finally:
        with torch.no_grad():
            for n, p in pair.trainer.named_parameters():
                p.copy_(saved[n])


@pytest.mark.parametrize("mode,router_grad", [("frozen", False), ("straight-through", True)])
def test_only_straight_through_trains_the_router(sampled, mode, router_grad):
    pair, prompts, sp, outs = sampled
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    pair.trainer.zero_grad()
    lps = pair.trainer.logprobs(seqs, lens, sp, replay=[o.extras for o in outs], replay_mode=mode)
    sum(lp[torch.isfinite(lp)].sum() for lp in lps).backward()
    g = pair.trainer.layers[0].moe.gate.weight.grad
    reaches = g is not None and bool(g.abs().sum() > 0)
    assert reaches == router_grad  # frozen: the weights are the sampler's, nothing reaches the router
    assert torch.isfinite(pair.trainer.layers[1].moe.gate_up.weight.grad).all()
    pair.trainer.zero_grad()


def test_replay_entries_are_checked(sampled):
    pair, prompts, sp, outs = sampled
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    with pytest.raises(ValueError, match="one per sequence"):
        pair.trainer.logprobs(seqs, lens, sp, replay=[outs[0].extras])
    with pytest.raises(ValueError, match="no routed_experts"):
        pair.trainer.logprobs(seqs, lens, sp, replay=[{}, {}, {}])
    bad = dict(outs[0].extras, routed_experts=outs[0].extras["routed_experts"][:-1])
    with pytest.raises(ValueError, match="replay entry 0"):
        pair.trainer.logprobs(seqs, lens, sp, replay=[bad, outs[1].extras, outs[2].extras])
