"""Trainer context parallelism on gloo (CPU, forked ranks): CP 2 and CP 4 are the one-device trainer.

Bitwise promises: over a packed batch of 63, 5, 129 and 1 tokens (the slices cut sequences, the 1-token one
scores nothing), under four sampling transforms, the chosen-token FP32 log-probs of CP 2 (qwen3 tiny,
Hkv = 2) and CP 4 (Hkv = 4), positions permuted across ranks, equal the one-device trainer's, and after
``loss.backward()`` and ``reduce_gradients`` every parameter's ``.grad`` on every rank equals the
one-device trainer's ``.grad``.  A CP degree that splits a head or a GQA group, activation checkpointing
and a tied LM head's gradient are refused with their reason."""
from __future__ import annotations

import pytest
import torch
from model_cases import make_pair, prompts_of, sharpen
from test_parallel_dp import run_ranks

from alignzoo import SamplingParams
from alignzoo.common.matmul import matmul_bwd
from alignzoo.models.qwen3 import Qwen3Trainer
from alignzoo.models.qwen3.parallelize import cp_plan
from alignzoo.parallel.cp import ContextParallel, check_cp

SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05),
      SamplingParams(temperature=1.3, top_p=0.8),
      SamplingParams(temperature=0.6, top_k=7, min_p=0.1),
      SamplingParams()]
LENS = [63, 5, 129, 1]  # sequence lengths; each scores its last len // 2 tokens


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen3")


def trainer_of(cfg, dtype=torch.bfloat16, seed: int = 3) -> Qwen3Trainer:
    """A sharpened random qwen3 trainer of ``cfg``: the tiny preset with other head counts or dtype."""
    g = torch.Generator().manual_seed(seed)
    t = Qwen3Trainer(cfg, dtype=dtype)
    with torch.no_grad():
        for p in t.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    sharpen(t, g)
    return t


def batch(vocab: int):
    seqs = prompts_of(LENS, vocab, seed=4)
    return seqs, [max(1, n - n // 2) for n in LENS]


def loss_of(lps) -> torch.Tensor:
    """A loss with a distinct weight per scored token, so every row's gradient differs."""
    g = torch.Generator().manual_seed(9)
    return sum((lp * torch.randn(lp.shape, generator=g)).sum() for lp in lps)


def one_device(trainer):
    seqs, lens = batch(trainer.cfg.vocab_size)
    trainer.zero_grad(set_to_none=True)
    lps = trainer.logprobs(seqs, lens, SP)
    loss_of(lps).backward()
    return [lp.detach() for lp in lps], {n: p.grad.clone() for n, p in trainer.named_parameters()}


def _cp_rank(rank, world, trainer, positions):
    seqs, lens = batch(trainer.cfg.vocab_size)
    cp = ContextParallel(trainer, cp_plan(trainer.cfg), position=positions[rank])
    lps = cp.logprobs(seqs, lens, SP)
    loss_of(lps).backward()
    cp.reduce_gradients()
    return [lp.detach() for lp in lps], {n: p.grad for n, p in trainer.named_parameters()}


# fp32 weights: a gradient's summation order shows in its bits far more often than after a bf16 rounding
@pytest.mark.parametrize("positions,kv,dtype", [((1, 0), 2, torch.bfloat16), ((1, 0), 2, torch.float32),
                                                ((2, 0, 3, 1), 4, torch.float32)],
                         ids=["CP2-bf16", "CP2-fp32", "CP4-fp32"])
def test_cp_trainer_equals_one_device(pair, positions, kv, dtype, tmp_path):
    cfg = pair.config.replace(num_kv_heads=kv)
    trainer = pair.trainer if (kv, dtype) == (2, torch.bfloat16) else trainer_of(cfg, dtype)
    ref_lp, ref_grad = one_device(trainer)
    trainer.zero_grad(set_to_none=True)
    for r, (lps, grads) in enumerate(run_ranks(len(positions), tmp_path, _cp_rank, trainer, positions)):
        assert len(lps) == len(ref_lp) and all(torch.equal(a, b) for a, b in zip(lps, ref_lp)), r
        assert grads.keys() == ref_grad.keys(), r
        bad = [n for n, g in grads.items() if g is None or not torch.equal(g, ref_grad[n])]
        assert not bad, (r, bad)


def test_cp_layouts_refused(pair):
    cfg = pair.config  # Hq = 4, Hkv = 2
    check_cp(cp_plan(cfg), 2)
    with pytest.raises(ValueError, match="CP = 4 does not divide the 2 k/v heads"):
        check_cp(cp_plan(cfg), 4)
    with pytest.raises(ValueError, match="CP = 3 does not divide the 4 q heads"):
        check_cp(cp_plan(cfg), 3)
    with pytest.raises(ValueError, match="CP must be an int >= 1"):
        check_cp(cp_plan(cfg), 0)
    t = trainer_of(cfg)
    t.activation_checkpointing = True
    with pytest.raises(NotImplementedError, match="activation checkpointing"):
        ContextParallel(t, cp_plan(cfg))
    tied = trainer_of(cfg.replace(tie_word_embeddings=True))
    seqs, lens = batch(cfg.vocab_size)
    with pytest.raises(NotImplementedError, match="tied LM head"):
        ContextParallel(tied, cp_plan(cfg)).logprobs(seqs, lens)


def test_token_split_weight_gradient_is_not_one_device():
    """Why the owner replays dW on all rows: the CPU matmul's dW is one fp32 chain over all tokens, so the
    sum of two slices' chains (or their float64 tree) is not the one-device dW (the 99-token cut of CP 2)."""
    g = torch.Generator().manual_seed(11)
    x, w, dy = torch.randn(198, 72, generator=g), torch.randn(29, 72, generator=g), torch.randn(198, 29, generator=g)
    whole = matmul_bwd(x, w, dy, need_dx=False)[1]
    halves = [matmul_bwd(x[s], w, dy[s], need_dx=False)[1] for s in (slice(0, 99), slice(99, None))]
    assert not torch.equal(halves[0] + halves[1], whole)
    assert not torch.equal((halves[0].double() + halves[1].double()).float(), whole)
