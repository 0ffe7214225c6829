"""Expert parallelism on gloo (CPU, forked ranks): an EP = 2 / EP = 4 MoE row is the one-device row.

Bitwise promises: per engine step the FP32 logits and routing extras, the scored log-probs (four
sampling transforms) and the sampled completions of the EP server (EP 4 with its positions permuted
across ranks) equal the one-device server's and the trainer's; the EP trainer's log-probs equal the
one-device trainer's, and so do its gradients (each rank's expert stacks: the one-device gradients'
slices).  The tiny presets' 7 (qwen3.5) and 9 (GLM-5) experts take neither EP 2 nor EP 4: the
cases use 8 and 12, and the tiny ones are the refused degrees.  Decode steps of a few tokens leave
some positions with no rows.  fp32 is where the routed sum's order shows in the logits (adding the
slots in reverse changes them; bf16 rounding hides it), so most cases run it."""
from __future__ import annotations

import copy

import pytest
import torch
from model_cases import make_pair, prompts_of
from test_parallel_dp import run_ranks
from test_parallel_tp import ENGINE, SP, scored

from alignzoo.common.engine.engine import Engine
from alignzoo.models.glm5_sparse_fp8.config import PRESETS as GLM5_PRESETS
from alignzoo.models.glm5_sparse_fp8.parallelize import ep_plan as glm5_plan
from alignzoo.models.glm5_sparse_fp8.serve import Glm5Server
from alignzoo.models.qwen35_gdn import Qwen35GdnServer
from alignzoo.models.qwen35_gdn.config import PRESETS as QWEN35_PRESETS
from alignzoo.models.qwen35_gdn.parallelize import ep_plan as qwen35_plan
from alignzoo.parallel.ep import check_layout, ep_server, ep_trainer, shard_experts

LENS = [63, 5, 129, 1]  # prompt lengths; each sequence scores 1..17 more tokens
QWEN35 = QWEN35_PRESETS["tiny"].replace(num_experts=8)  # top-3 of 8
GLM5 = GLM5_PRESETS["tiny"].replace(n_routed_experts=12)  # 3 groups of 4, top-2 groups, top-4 experts
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
        "target_parameters": ["experts.gate_up_proj", "mlp.experts.down_proj"]}
SERVERS = {"qwen35_gdn": (QWEN35, Qwen35GdnServer, qwen35_plan), "glm5_sparse_fp8": (GLM5, Glm5Server, glm5_plan)}


def run_engine(model, prompts):
    """Every forward's (FP32 logits, *extras), the scored log-probs and the sampled completions."""
    seen, forward = [], model.forward

    def record(batch, caches):
        out = forward(batch, caches)
        seen.append([out[0].clone(), *(v.clone() for v in out[1].values())])
        return out

    model.forward = record
    engine = Engine(model, **ENGINE)
    seqs, lens = scored(prompts)
    lp = engine.score(seqs, lens, SP)
    outs = engine.generate(prompts, SP)
    return {"steps": seen, "logprobs": lp, "tokens": [o.tokens for o in outs], "sampled": [o.logprobs for o in outs]}


def all_equal(xs, ys) -> bool:
    return len(xs) == len(ys) and all(torch.equal(a, b) for a, b in zip(xs, ys))


def _server_rank(rank, world, name, weights, prompts, positions, server_kw):
    torch.manual_seed(0)
    cfg, server_cls, plan = SERVERS[name]
    model = ep_server(server_cls, cfg, weights, plan(cfg), position=positions[rank], **server_kw)
    held = {n: w.shape[0] for n, w in model.weights.items() if n.endswith(("moe.gate_up.weight", "moe.down.weight"))}
    return run_engine(model, prompts) | {"held": held}


@pytest.mark.parametrize("name, dtype, kw, positions", [
    ("qwen35_gdn", torch.float32, {}, (3, 1, 0, 2)),
    ("qwen35_gdn", torch.bfloat16, {}, (1, 0)),
    ("glm5_sparse_fp8", torch.float32, {"fp8": True}, (1, 0)),
    ("glm5_sparse_fp8", torch.float32, {}, (2, 0, 3, 1)),
    ("qwen35_gdn", torch.float32, {"lora": LORA, "lora_mode": "separate"}, (1, 0)),
    ("qwen35_gdn", torch.bfloat16, {"lora": LORA, "lora_mode": "merged"}, (0, 1)),
], ids=["qwen35-fp32-EP4", "qwen35-bf16-EP2", "glm5-fp8-EP2", "glm5-fp32-EP4",
        "qwen35-fp32-lora-separate-EP2", "qwen35-bf16-lora-merged-EP2"])
def test_ep_server_equals_one_device(name, dtype, kw, positions, tmp_path):
    cfg = SERVERS[name][0]
    pair = make_pair(name, config=cfg, dtype=dtype, num_pages=24, **kw)
    if "lora" in kw:  # B = 0 adds nothing: draw it, so each expert's adapter slice shows
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _, b in pair.trainer.lora_adapters().values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
        pair.sync()
    prompts = prompts_of(LENS, cfg.vocab_size, seed=2)
    ref = run_engine(pair.server.model, prompts)
    seqs, lens = scored(prompts)
    with torch.no_grad():
        assert all_equal(pair.trainer.logprobs(seqs, lens, SP), ref["logprobs"])
    outs = run_ranks(len(positions), tmp_path, _server_rank, name, pair.server.model.weights, prompts, positions,
                      {"lora_scale": pair.server.model.lora_scale})
    E = pair.server.model.moe_spec.num_experts
    for r, o in enumerate(outs):
        assert o["held"] and set(o["held"].values()) == {E // len(positions)}, r
        assert len(o["steps"]) == len(ref["steps"]), r
        assert all(all_equal(a, b) for a, b in zip(o["steps"], ref["steps"])), r
        assert all_equal(o["logprobs"], ref["logprobs"]), r
        assert o["tokens"] == ref["tokens"], r
        assert all_equal(o["sampled"], ref["sampled"]), r


def logprobs_and_grads(trainer, seqs, lens):
    """The log-probs and every parameter's gradient of a loss that weighs each log-prob differently."""
    lps = trainer.logprobs(seqs, lens, SP)
    g = torch.Generator().manual_seed(3)
    sum((lp * torch.randn(lp.shape, generator=g)).sum() for lp in lps).backward()
    return [lp.detach() for lp in lps], {n: p.grad for n, p in trainer.named_parameters() if p.grad is not None}


def _trainer_rank(rank, world, trainer, seqs, lens, positions):
    torch.manual_seed(0)
    return logprobs_and_grads(ep_trainer(trainer, qwen35_plan(QWEN35), position=positions[rank]), seqs, lens)


@pytest.fixture(scope="module")
def trainer_case():
    """dtype -> (trainer, sequences, prompt lengths, its one-device log-probs and gradients), built once a dtype."""
    built = {}

    def get(dtype):
        if dtype not in built:
            pair = make_pair("qwen35_gdn", config=QWEN35, dtype=dtype, num_pages=24)
            seqs, lens = scored(prompts_of(LENS, QWEN35.vocab_size, seed=2))
            built[dtype] = pair.trainer, seqs, lens, logprobs_and_grads(copy.deepcopy(pair.trainer), seqs, lens)
        return built[dtype]
    return get


@pytest.mark.parametrize("dtype, positions", [(torch.float32, (1, 0)), (torch.float32, (3, 1, 0, 2)),
                                              (torch.bfloat16, (0, 1))], ids=["fp32-EP2", "fp32-EP4", "bf16-EP2"])
def test_ep_trainer_equals_one_device(trainer_case, dtype, positions, tmp_path):
    trainer, seqs, lens, (ref_lp, ref_grads) = trainer_case(dtype)
    outs = run_ranks(len(positions), tmp_path, _trainer_rank, trainer, seqs, lens, positions)
    n = QWEN35.num_experts // len(positions)
    stacks = [name for name in ref_grads if name.endswith(("moe.gate_up.weight", "moe.down.weight"))]
    assert len(stacks) == 2 * QWEN35.num_layers
    for r, (lps, grads) in enumerate(outs):
        q = positions[r]
        assert all_equal(lps, ref_lp), r
        assert grads.keys() == ref_grads.keys(), r
        for name, want in ref_grads.items():
            assert torch.equal(grads[name], want[q * n:(q + 1) * n] if name in stacks else want), (r, name)


def test_degrees_refused():
    tiny = QWEN35_PRESETS["tiny"]  # 7 experts
    with pytest.raises(ValueError, match="EP = 2 does not divide 7 routed experts"):
        check_layout(qwen35_plan(tiny), 2)
    with pytest.raises(ValueError, match="EP = 2 does not divide 9 routed experts"):
        check_layout(glm5_plan(GLM5_PRESETS["tiny"]), 2)
    check_layout(glm5_plan(GLM5_PRESETS["tiny"]), 3)
    with pytest.raises(ValueError, match="EP must be an int >= 1"):
        check_layout(qwen35_plan(QWEN35), 0)
    weights = {"layers.0.moe.gate_up.weight": torch.zeros(8, 2, 3)}
    with pytest.raises(ValueError, match="EP position 2 outside 0..1"):
        shard_experts(weights, qwen35_plan(QWEN35), 2, 2)
    with pytest.raises(ValueError, match="layers.0.moe.gate_up.weight has 7 experts on dim 0; the plan has 8"):
        shard_experts({"layers.0.moe.gate_up.weight": torch.zeros(7, 2, 3)}, qwen35_plan(QWEN35), 2, 0)


def _refused_rank(rank, world, weights, position):
    ep_server(Qwen35GdnServer, QWEN35_PRESETS["tiny"] if position is None else QWEN35, weights,
              qwen35_plan(QWEN35_PRESETS["tiny"] if position is None else QWEN35), position=position)


def test_group_refusals(tmp_path):
    """A degree the model cannot take is refused on every rank before any collective; two ranks
    claiming one EP position are refused at setup."""
    pair = make_pair("qwen35_gdn", config=QWEN35, num_pages=24)
    with pytest.raises(Exception, match="EP = 2 does not divide 7 routed experts"):
        run_ranks(2, tmp_path / "degree", _refused_rank, {}, None)
    with pytest.raises(Exception, match=r"shard positions \[0, 0\] \(by rank\) are not a permutation of 0..1"):
        run_ranks(2, tmp_path / "positions", _refused_rank, pair.server.model.weights, 0)


def test_trainer_refusals():
    pair = make_pair("glm5_sparse_fp8", config=GLM5, num_pages=24, fp8=True)
    with pytest.raises(NotImplementedError, match="MoE block 1 has Fp8Experts"):
        ep_trainer(pair.trainer, glm5_plan(GLM5))
    trainer = make_pair("qwen35_gdn", config=QWEN35, num_pages=24).trainer
    ep_trainer(trainer, qwen35_plan(QWEN35))  # EP 1: one process, no group
    with pytest.raises(ValueError, match="MoE block 0 is sharded by ep_trainer already"):
        ep_trainer(trainer, qwen35_plan(QWEN35))
