"""An RL step across layouts on gloo (CPU, 2 forked ranks): trainer DP 2 or FSDP 2, server TP 2.

Bitwise promises: completions sampled on the TP 2 server (all four sampling transforms) score
K3 == 0 on the trainer (its log-probs torch.equal the sampled ones), before and after an Adam step
synced through ``parallel.layout_sync``; the step gives the one-device pair's weights, the synced
server shards are ``shard_weights`` of them, and the second round's tokens and log-probs equal a
one-device server synced from the one-device trainer.  A sync one rank refuses (NaN in its trainer
shard, or its server shard changed out of band) writes nothing on any rank."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from model_cases import make_pair, prompts_of
from test_parallel_dp import run_ranks
from test_parallel_tp import ENGINE, SP

from alignzoo.common.engine.engine import Engine
from alignzoo.models.qwen3 import Qwen3Server
from alignzoo.models.qwen3.parallelize import tp_plan
from alignzoo.parallel.dp import step_gradients
from alignzoo.parallel.layout_sync import FSDPSource, LayoutSync, replicated_source
from alignzoo.parallel.tp import shard_weights, tp_server
from alignzoo.sync import EndStateMismatch, NonFiniteWeights

LENS = [63, 5, 29, 1]  # prompt lengths: one leaf a completion, 2 slots a DP rank
LR = 3e-3


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen3", num_pages=24)


def k3(trainer, prompts, outs):
    """Per completion: the trainer's log-probs under the request's transforms equal the sampled ones
    (K3 = exp(r) - r - 1 of r = trainer - sampled is 0 exactly where they do)."""
    with torch.no_grad():
        lp = trainer.logprobs([p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts], SP)
    r = [a - o.logprobs for a, o in zip(lp, outs)]
    return [torch.equal(a, o.logprobs) and float((x.exp() - x - 1).abs().max()) == 0.0 for a, o, x in zip(lp, outs, r)]


def leaves_of(prompts, outs):
    """(sequence, prompt length, advantage) per completion; reward: the share of even tokens, centred."""
    rewards = [sum(t % 2 == 0 for t in o.tokens) / len(o.tokens) for o in outs]
    mean = sum(rewards) / len(rewards)
    return [(p + o.tokens, len(p), r - mean) for p, o, r in zip(prompts, outs, rewards)]


def rl_round(trainer, engine, sync, prompts, step):
    """Generate, check K3, step (``step(loss_fn, leaves)`` sets every .grad), sync, generate, check K3."""
    first = engine.generate(prompts, SP)
    k3_first = k3(trainer, prompts, first)
    leaves = leaves_of(prompts, first)
    tokens = sum(len(s) - n for s, n, _ in leaves)  # the batch's normaliser: a constant on every rank

    def loss_fn(leaf):
        seq, n, adv = leaf
        return -adv * trainer.logprobs([seq], [n])[0].sum() / tokens

    step(loss_fn, leaves)
    torch.optim.Adam(trainer.parameters(), lr=LR).step()
    version = sync()
    second = engine.generate(prompts, SP)
    return {"k3_first": k3_first, "k3_second": k3(trainer, prompts, second),
            "first": [(o.tokens, o.logprobs) for o in first], "second": [(o.tokens, o.logprobs) for o in second],
            "version": version, "sampled_under": [o.weight_version for o in second]}


def full_weights(trainer):
    return {n: (w.full_tensor() if hasattr(w, "full_tensor") else w).detach().clone()
            for n, w in trainer.forward_weights().items()}


def _one_device(rank, world, pair, prompts):
    params = list(pair.trainer.parameters())
    out = rl_round(pair.trainer, pair.server, pair.sync, prompts,
                   lambda loss_fn, leaves: step_gradients(loss_fn, params, leaves))
    return {**out, "weights": full_weights(pair.trainer)}


def _fsdp_step(trainer, world, position):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from alignzoo.parallel.fsdp import shard_ordered

    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = init_device_mesh("cpu", (world,))
    for layer in trainer.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    register_fsdp_forward_method(trainer, "logprobs")
    shard_ordered(trainer, len(LENS), position=position)

    def step(loss_fn, leaves):
        for j in range(position, len(leaves), world):
            loss_fn(leaves[j]).backward()

    return step


def tp_engine(pair, position):
    cfg = pair.server.model.cfg
    weights = {n: w.clone() for n, w in pair.server.model.weights.items()}  # replicated tensors are shared, not copied
    return Engine(tp_server(Qwen3Server, cfg, weights, tp_plan(cfg), position=position), **ENGINE)


def _layouts(rank, world, pair, prompts, trainer_layout):
    torch.manual_seed(0)
    trainer, plan = pair.trainer, tp_plan(pair.config)
    tp_pos, dp_pos = (rank + 1) % world, rank  # TP positions off the rank ids; DP positions on them
    engine = tp_engine(pair, tp_pos)
    if trainer_layout == "DP2":
        params = list(trainer.parameters())
        step = lambda loss_fn, leaves: step_gradients(loss_fn, params, leaves, dist.group.WORLD, dp_pos)  # noqa: E731
        source = replicated_source(trainer, plan, world, tp_pos)
    else:
        step = _fsdp_step(trainer, world, dp_pos)
        source = FSDPSource(trainer, plan, position=tp_pos)
    sync = LayoutSync(trainer, engine, source)
    out = rl_round(trainer, engine, sync.sync, prompts, step)
    return {**out, "weights": full_weights(trainer), "position": tp_pos, "server": dict(engine.model.weights),
            "blocks": (sync.last_sync.blocks_changed, sync.last_sync.blocks_total),
            "received": getattr(source, "received_bytes", 0)}


@pytest.fixture(scope="module")
def cases(pair, tmp_path_factory):
    """tied -> (pair, prompts, the one-device round), each built once."""
    built = {}

    def case(tied: bool):
        if tied not in built:
            p = make_pair("qwen3", num_pages=24, config=pair.config.replace(tie_word_embeddings=True)) if tied else pair
            prompts = prompts_of(LENS, p.config.vocab_size, seed=3)
            (ref,) = run_ranks(1, tmp_path_factory.mktemp("one_device"), _one_device, p, prompts)
            assert all(ref["k3_first"]) and all(ref["k3_second"])
            assert ref["second"] != ref["first"]  # the step moved the sampler (tokens or log-probs)
            built[tied] = p, prompts, ref
        return built[tied]

    return case


@pytest.mark.parametrize("trainer_layout,tied", [("DP2", False), ("FSDP2", False), ("FSDP2", True)],
                         ids=["DP2", "FSDP2", "FSDP2-tied"])
def test_rl_step_across_layouts(cases, trainer_layout, tied, tmp_path):
    """Trainer DP 2 / FSDP 2 and server TP 2 (positions swapped against the ranks): K3 == 0 on both rounds,
    the one-device step's weights, shards synced exactly, the one-device synced server's completions.
    Tied: the TP 2 LM head's vocabulary rows come from the FSDP-sharded embedding."""
    pair, prompts, ref = cases(tied)
    plan = tp_plan(pair.config)
    for r, o in enumerate(run_ranks(2, tmp_path, _layouts, pair, prompts, trainer_layout)):
        assert all(o["k3_first"]) and all(o["k3_second"]), (r, o["k3_first"], o["k3_second"])
        bad = [n for n in ref["weights"] if not torch.equal(o["weights"][n], ref["weights"][n])]
        assert not bad, (r, bad[:4])
        want = shard_weights(ref["weights"], plan, 2, o["position"])
        assert sorted(o["server"]) == sorted(want)
        assert all(torch.equal(o["server"][n], want[n]) for n in want), r
        for got, exp in zip(o["first"] + o["second"], ref["first"] + ref["second"]):
            assert got[0] == exp[0] and torch.equal(got[1], exp[1]), r
        assert o["version"] == 2 and o["sampled_under"] == [2] * len(LENS)
        changed, total = o["blocks"]
        assert 0 < changed <= total
        full = sum(w.numel() * w.element_size() for w in ref["weights"].values())
        if trainer_layout == "FSDP2":  # position 1 - r's rows, mostly in the other rank's FSDP half: fewer than half
            assert 0 < o["received"] < full / 2, (r, o["received"], full)


def _refusals(rank, world, pair, prompts):
    trainer, plan = pair.trainer, tp_plan(pair.config)
    engine = tp_engine(pair, rank)
    engine.set_weight_version(5)  # a server that served other versions before: the first sync goes above them
    sync = LayoutSync(trainer, engine, replicated_source(trainer, plan, world, rank))
    out = {"first": engine.weight_version}
    w = dict(trainer.named_parameters())
    with torch.no_grad():  # rows 3 and 40 of o's 72, one in each position's half: one 64-row block a rank ships
        w["layers.1.o.weight"][[3, 40]] += 1
    out["small"] = (sync.sync(), sync.last_sync.blocks_changed)
    out["small_ok"] = all(torch.equal(engine.model.weights[n], t)
                          for n, t in shard_weights(trainer.forward_weights(), plan, world, rank).items())
    before = {n: t.clone() for n, t in engine.model.weights.items()}

    def refused(exc):
        with torch.no_grad():
            w["layers.0.gate_up.weight"][7] -= 1  # a valid change on every rank, which rank 0 alone would write
        try:
            sync.sync()
        except exc as e:
            msg = str(e)
        else:
            msg = None
        kept = all(torch.equal(engine.model.weights[n], t) for n, t in before.items())
        return msg, kept, engine.weight_version

    if rank == 0:  # the server shard changed behind the receiver's back: a delta's end state cannot match
        with torch.no_grad():
            engine.model.weights["layers.1.qkv.weight"][2, 2] += 1
        before["layers.1.qkv.weight"] = engine.model.weights["layers.1.qkv.weight"].clone()
    out["out_of_band"] = refused(EndStateMismatch)
    kept_value = w["layers.0.down.weight"][40, 5].item()
    if rank == 1:
        with torch.no_grad():
            w["layers.0.down.weight"][40, 5] = float("nan")  # row 40: position 1's half of the 72 rows
    out["nan"] = refused(NonFiniteWeights)
    if rank == 1:
        with torch.no_grad():
            w["layers.0.down.weight"][40, 5] = kept_value  # the ranks' trainers agree again
    out["resync"] = (sync.sync(), sync.last_sync.blocks_changed == sync.last_sync.blocks_total)
    out["resync_ok"] = all(torch.equal(engine.model.weights[n], t)
                           for n, t in shard_weights(trainer.forward_weights(), plan, world, rank).items())
    prompts_out = engine.generate(prompts, SP)
    out["k3"] = k3(trainer, prompts, prompts_out)
    out["sampled_under"] = [o.weight_version for o in prompts_out]
    return out


def test_refused_sync_writes_nothing_anywhere(pair, tmp_path):
    """A changed row ships one block a rank; rank 0's server shard changed out of band, then NaN in rank 1's
    trainer shard: every rank raises the refusing rank's error and keeps its weights and version; a full resync
    then repairs both ranks (the same version on each) and K3 == 0 again."""
    prompts = prompts_of(LENS, pair.config.vocab_size, seed=4)
    outs = run_ranks(2, tmp_path, _refusals, pair, prompts)
    for r, o in enumerate(outs):
        assert o["first"] == 6 and o["small"] == (7, 1) and o["small_ok"], (r, o["first"], o["small"])
        msg, kept, version = o["out_of_band"]
        assert msg is not None and kept and version == 7, (r, o["out_of_band"])
        assert "refused by 1 of 2 server ranks" in msg and "rank 0: EndStateMismatch" in msg and "rank 1" not in msg
        msg, kept, version = o["nan"]
        assert msg is not None and kept and version == 7, (r, o["nan"])
        assert "rank 1: NonFiniteWeights" in msg and "rank 0" not in msg
        assert "'layers.0.down.weight'" in msg and "weight version 7" in msg
        assert o["resync"][1] and o["resync_ok"] and all(o["k3"]), r
    # v8 and v9 were published and refused: the resync skips them, one version on both ranks
    assert outs[0]["resync"][0] == outs[1]["resync"][0] == 10 and outs[0]["sampled_under"] == [10] * len(LENS)
