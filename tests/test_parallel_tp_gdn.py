"""Server tensor parallelism of qwen35_gdn (Gated DeltaNet + gated attention + MoE) on gloo (CPU, forked ranks).

Bitwise promises: per engine step the FP32 logits and routed experts, the scored log-probs (four sampling
transforms) and sampled completions of TP 1, TP 2 and TP 4 (shard positions permuted across ranks) equal the
one-device server's and the trainer's, over prompts of 63, 5, 129 and 1 tokens (GDN chunks of 64 crossed,
chunked continuation and decode from each rank's own state slots).  The tiny preset with 4 q heads and 2
k/v heads (its 3 q heads take no TP 2): at TP 4 a rank holds one value head and a replicated qk head and
k/v head.  A degree that does not divide the heads is refused before any process group is touched."""
from __future__ import annotations

import pytest
import test_parallel_ep
import torch
from model_cases import make_pair, prompts_of
from test_parallel_dp import run_ranks
from test_parallel_ep import all_equal, run_engine
from test_parallel_tp import ENGINE, LENS, SP, scored

from alignzoo.models.qwen35_gdn import Qwen35GdnServer
from alignzoo.models.qwen35_gdn.parallelize import tp_plan
from alignzoo.parallel.tp import check_layout, tp_server

HEADS = {"num_heads": 4, "num_kv_heads": 2}  # on tiny: Hk = 2, Hv = 4 GDN heads, Is = 48
CHUNKED = {**ENGINE, "max_batch_tokens": 50}  # prefill in pieces of <= 50 rows: GDN slots continue mid-chunk


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen35_gdn", config=HEADS, num_pages=24)


@pytest.fixture(autouse=True)
def chunked(monkeypatch):
    """test_parallel_ep's recorder (logits and routed experts per step) on an engine that prefills in pieces."""
    monkeypatch.setattr(test_parallel_ep, "ENGINE", CHUNKED)


def _tp_rank(rank, world, cfg, weights, prompts, positions):
    torch.manual_seed(0)
    return run_engine(tp_server(Qwen35GdnServer, cfg, weights, tp_plan(cfg), position=positions[rank]), prompts)


@pytest.mark.parametrize("positions", [(0,), (1, 0), (2, 0, 3, 1)], ids=lambda p: f"TP{len(p)}")
def test_tp_server_equals_one_device(pair, positions, tmp_path):
    prompts = prompts_of(LENS, pair.config.vocab_size, seed=2)
    ref = run_engine(pair.server.model, prompts)
    seqs, lens = scored(prompts)
    with torch.no_grad():
        trainer = pair.trainer.logprobs(seqs, lens, SP)
    assert all_equal(trainer, ref["logprobs"])
    cfg, weights = pair.server.model.cfg, pair.server.model.weights
    outs = run_ranks(len(positions), tmp_path, _tp_rank, cfg, weights, prompts, positions)
    for r, o in enumerate(outs):
        assert len(o["steps"]) == len(ref["steps"]) and all(map(all_equal, o["steps"], ref["steps"])), r
        assert all_equal(o["logprobs"], ref["logprobs"]) and all_equal(o["sampled"], ref["sampled"]), r
        assert o["tokens"] == ref["tokens"], r


def test_local_config_shrinks_the_state_pool(pair):
    """A TP 2 rank's GDN StatePool holds its heads only: half the value heads' state, half the conv channels."""
    cfg = pair.server.model.cfg
    local = tp_plan(cfg).local_config(cfg, 2)
    assert (local.num_heads, local.num_kv_heads, local.gdn_k_heads, local.gdn_v_heads) == (2, 1, 1, 2)
    assert (local.conv_dim, local.shared_intermediate_size, local.num_experts) == (cfg.conv_dim // 2, 24, 7)


@pytest.mark.parametrize("heads, tp, reason", [
    ({}, 2, "TP = 2 does not fit 3 q heads"),  # the tiny preset as it is
    (HEADS, 3, "TP = 3 does not fit 2 GDN qk heads"),
    (HEADS, 8, "TP = 8 does not divide 4 GDN value heads"),
    ({**HEADS, "gdn_k_heads": 3, "gdn_v_heads": 6}, 2, "TP = 2 does not fit 3 GDN qk heads"),
    ({**HEADS, "gdn_k_heads": 1, "gdn_v_heads": 3}, 2, "TP = 2 does not fit 3 GDN value heads"),
    ({**HEADS, "num_kv_heads": 4, "num_heads": 8, "shared_intermediate_size": 50}, 4,
     "TP = 4 does not fit 50 shared_intermediate_size"),
], ids=["q-heads-3", "tp3", "tp8", "qk-heads-3", "value-heads-3", "shared-width-50"])
def test_layouts_refused(pair, heads, tp, reason):
    cfg = pair.server.model.cfg.preset("tiny").replace(**heads)
    with pytest.raises(ValueError, match=reason):
        check_layout(tp_plan(cfg), cfg, tp)
