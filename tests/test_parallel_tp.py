"""Server tensor parallelism on gloo (CPU, forked ranks): a TP = 2 / TP = 4 qwen3 row is the TP = 1 row.

Bitwise promises: per engine step the FP32 logits, the scored log-probs (four sampling transforms) and
sampled completions of TP 2 and TP 4 (shard positions permuted across ranks) equal the one-device
server's and the trainer's; a K split at segment boundaries, partials merged in segment order, equals
the unsplit segmented sum.  qwen3 tiny as it is: Hkv = 2 < TP = 4 replicates a k/v head per rank."""
from __future__ import annotations

import pytest
import torch
from model_cases import make_pair, prompts_of
from test_parallel_dp import run_ranks

from alignzoo import SamplingParams
from alignzoo.common.engine.engine import Engine
from alignzoo.common.matmul import fixed_order_dot, matmul_fwd
from alignzoo.models.qwen3 import Qwen3Server
from alignzoo.models.qwen3.parallelize import tp_plan
from alignzoo.parallel.tp import (
    check_k_split,
    check_layout,
    k_split_linear,
    merge_segment_partials,
    shard_weights,
    tp_server,
)

SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, max_new_tokens=5, seed=1),
      SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=3, seed=2),
      SamplingParams(temperature=0.6, top_k=7, min_p=0.1, max_new_tokens=4, seed=3),
      SamplingParams(temperature=0.0, max_new_tokens=2, seed=4)]
LENS = [63, 5, 129, 1]  # prompt lengths; each sequence scores 1..17 more tokens
ENGINE = dict(num_pages=24, cuda_graphs=False, overlap=False, freeze_gc=False)
SEG, K, M, N = 8, 96, 37, 29  # the K-split check: TP 2 -> 6 segments a rank, TP 4 -> 3


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen3", num_pages=24)


def scored(prompts):
    g = torch.Generator().manual_seed(5)
    tails = [torch.randint(0, 151, (1 + 4 * i,), generator=g).tolist() for i in range(len(prompts))]
    return [p + t for p, t in zip(prompts, tails)], [len(p) for p in prompts]


def recorded(model) -> list[torch.Tensor]:
    """Every forward's FP32 logits, in step order."""
    seen, forward = [], model.forward

    def record(batch, caches):
        out = forward(batch, caches)
        seen.append(out.clone())
        return out

    model.forward = record
    return seen


def run_engine(model, prompts):
    seen = recorded(model)
    engine = Engine(model, **ENGINE)
    seqs, lens = scored(prompts)
    lp = engine.score(seqs, lens, SP)
    outs = engine.generate(prompts, SP)
    return {"logits": seen, "logprobs": lp, "tokens": [o.tokens for o in outs], "sampled": [o.logprobs for o in outs]}


def segment_partials(x, w, seg):
    """The CUDA matmul's arithmetic shape on the CPU: each K segment's chain from zero, (S, M, N) fp32."""
    return torch.stack([fixed_order_dot(a, b) for a, b in zip(x.split(seg, 1), w.split(seg, 1))])


def segmented_sum(x, w, seg):
    """The contract spelled out: one running fp32 total, segment 0 first."""
    total = torch.zeros(x.shape[0], w.shape[0])
    for k in range(0, x.shape[1], seg):
        total = total + fixed_order_dot(x[:, k: k + seg], w[:, k: k + seg])
    return total


def k_split_case():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g) * torch.exp2(torch.randint(-12, 12, (M, K), generator=g).float())
    return x, torch.randn(N, K, generator=g)  # fp32: a bf16 output's rounding would hide the merge's order


def _tp_rank(rank, world, cfg, weights, prompts, positions):
    torch.manual_seed(0)
    p = positions[rank]
    out = run_engine(tp_server(Qwen3Server, cfg, weights, tp_plan(cfg), position=p), prompts)
    x, w = k_split_case()
    lo, hi = p * K // world, (p + 1) * K // world
    out["k_split"] = k_split_linear(x[:, lo:hi].contiguous(), w[:, lo:hi].contiguous(), SEG, segment_partials, p)
    return out


@pytest.mark.parametrize("positions", [(0,), (0, 1), (2, 0, 3, 1)], ids=lambda p: f"TP{len(p)}")
def test_tp_server_equals_one_device(pair, positions, tmp_path):
    prompts = prompts_of(LENS, pair.config.vocab_size, seed=2)
    ref = run_engine(pair.server.model, prompts)
    seqs, lens = scored(prompts)
    with torch.no_grad():
        trainer = pair.trainer.logprobs(seqs, lens, SP)
    assert all(torch.equal(t, s) for t, s in zip(trainer, ref["logprobs"]))
    cfg, weights = pair.server.model.cfg, pair.server.model.weights
    outs = run_ranks(len(positions), tmp_path, _tp_rank, cfg, weights, prompts, positions)
    x, w = k_split_case()
    one_device = segmented_sum(x, w, SEG)
    for r, o in enumerate(outs):
        assert len(o["logits"]) == len(ref["logits"]), r
        assert all(torch.equal(a, b) for a, b in zip(o["logits"], ref["logits"])), r
        assert all(torch.equal(a, b) for a, b in zip(o["logprobs"], ref["logprobs"])), r
        assert o["tokens"] == ref["tokens"], r
        assert all(torch.equal(a, b) for a, b in zip(o["sampled"], ref["sampled"])), r
        assert torch.equal(o["k_split"], one_device), r


def test_k_split_needs_whole_segments_in_order():
    """The merge's order shows in these data, and the CPU matmul's single chain is not a segmented sum:
    why the CPU path gathers instead of splitting K."""
    x, w = k_split_case()
    parts = segment_partials(x, w, SEG)
    merged = merge_segment_partials(parts, torch.float32)
    assert torch.equal(merged, segmented_sum(x, w, SEG))
    assert not torch.equal(merge_segment_partials(parts.flip(0), torch.float32), merged)
    assert not torch.equal(merged, matmul_fwd(x, w))
    check_k_split(4096, 4, 1024)
    with pytest.raises(ValueError, match="one chain"):
        check_k_split(K, 2, None)
    with pytest.raises(ValueError, match="K = 3072 over TP = 4 is not whole segments of SEG_K = 1024"):
        check_k_split(3072, 4, 1024)


def test_layouts_refused(pair):
    cfg = pair.server.model.cfg  # Hq = 4, Hkv = 2, I = 200
    with pytest.raises(ValueError, match="TP = 3 does not fit 4 q heads"):
        check_layout(tp_plan(cfg), cfg, 3)
    with pytest.raises(ValueError, match="TP = 8 does not divide 4 q heads"):
        check_layout(tp_plan(cfg), cfg, 8)
    with pytest.raises(ValueError, match="TP must be an int >= 1"):
        check_layout(tp_plan(cfg), cfg, 0)
    weights = pair.server.model.weights
    with pytest.raises(NotImplementedError, match="lora_A/lora_B"):
        shard_weights({**weights, "layers.0.qkv.lora_A.q_proj": torch.zeros(2, 72)}, tp_plan(cfg), 2, 0)
    with pytest.raises(ValueError, match="TP position 2 outside 0..1"):
        shard_weights(weights, tp_plan(cfg), 2, 2)


def _positions_rank(rank, world, cfg, weights):
    tp_server(Qwen3Server, cfg, weights, tp_plan(cfg), position=0)


def test_positions_must_be_a_permutation(pair, tmp_path):
    with pytest.raises(Exception, match=r"TP positions \[0, 0\] \(by rank\) are not a permutation of 0..1"):
        run_ranks(2, tmp_path, _positions_rank, pair.server.model.cfg, pair.server.model.weights)
