"""Trainer pipeline parallelism on gloo (CPU, forked ranks): PP 2, 3 and 4 are the one-device trainer.

Bitwise promises: over a packed batch of 63, 5, 129 and 1 tokens under four sampling transforms, the
chosen-token FP32 log-probs on every rank, and after ``loss.backward()`` and ``reduce_gradients`` every
``.grad`` a stage holds (the others none), equal the one-device trainer's, trained in one microbatch and
in 2 to 4 (GPipe order and the whole-batch weight pass): PP 2 (qwen3 tiny, one layer a stage: bf16,
fp32, fp32 with separate LoRA; FP8 projections over 3 layers), PP 4 (5 layers, split 2/1/1/1, stages
permuted across ranks) and PP 3 (a tied LM head, an explicit 1/2/2 split, activation checkpointing,
other stages' parameters on the meta device); scored under ``no_grad`` in 1, 3 and 4 microbatches too.
PP 1 without a process group is the trainer.  A split the model cannot take is refused with its reason."""
from __future__ import annotations

import pytest
import torch
from test_parallel_cp import SP, batch, loss_of, trainer_of
from test_parallel_dp import run_ranks

from alignzoo.common.lora import LoRAConfig
from alignzoo.models.qwen3 import Qwen3Config, Qwen3Trainer
from alignzoo.models.qwen3.parallelize import pp_plan
from alignzoo.parallel.pp import PipelineParallel, stage_ranges


def _on_meta(trainer, keep) -> None:
    """Every parameter outside ``keep`` moved to the meta device: a stage must never read one."""
    for name, p in list(trainer.named_parameters()):
        if name not in keep:
            mod, _, leaf = name.rpartition(".")
            trainer.get_submodule(mod)._parameters[leaf] = torch.nn.Parameter(torch.empty_like(p, device="meta"))


def _one_device(trainer):
    """``test_parallel_cp.one_device`` where a frozen parameter (under LoRA) keeps a None ``.grad``."""
    seqs, lens = batch(trainer.cfg.vocab_size)
    trainer.zero_grad(set_to_none=True)
    lps = trainer.logprobs(seqs, lens, SP)
    loss_of(lps).backward()
    return [lp.detach() for lp in lps], {n: None if p.grad is None else p.grad.clone()
                                      for n, p in trainer.named_parameters()}


def _pp_rank(rank, world, trainer, positions, split, meta, microbatches):
    seqs, lens = batch(trainer.cfg.vocab_size)
    pp = PipelineParallel(trainer, pp_plan(trainer.cfg), position=positions[rank], split=split)
    if meta:
        _on_meta(trainer, pp.held_names)
    with torch.no_grad():  # scoring without a graph (the RL step's old log-probs), whole and microbatched
        scored = [pp.logprobs(seqs, lens, SP, microbatches=m) for m in (1, 3, 4)]
    lps = pp.logprobs(seqs, lens, SP, microbatches=microbatches)
    assert all(torch.equal(a, b.detach()) for s in scored for a, b in zip(s, lps, strict=True))
    loss_of(lps).backward()
    pp.reduce_gradients()
    return [lp.detach() for lp in lps], {n: p.grad for n, p in trainer.named_parameters()}, pp.held_names


B, F = torch.bfloat16, torch.float32
CASES = {  # id: stage of each rank, layers, dtype and what else the case turns on (``_case``)
    "PP2-bf16": dict(positions=(1, 0), dtype=B),
    "PP2-fp32": dict(positions=(0, 1)),
    "PP2-fp32-mb2": dict(positions=(1, 0), microbatches=2),
    "PP2-fp32-lora-separate-mb3": dict(positions=(1, 0), lora="separate", microbatches=3),
    "PP2-fp8-3layers-mb2": dict(positions=(1, 0), layers=3, dtype=B, fp8=True, microbatches=2),
    "PP4-fp32-5layers": dict(positions=(2, 0, 3, 1), layers=5),
    "PP4-fp32-5layers-mb3": dict(positions=(3, 1, 0, 2), layers=5, microbatches=3),
    "PP3-tied-split122-ckpt-meta-mb4": dict(positions=(2, 1, 0), layers=5, split=(1, 2, 2), dtype=B, tied=True,
                                            ckpt=True, microbatches=4),
}


def _case(positions, layers=2, split=None, dtype=F, tied=False, ckpt=False, lora=None, fp8=False, microbatches=1):
    """ckpt: activation checkpointing, and other stages' parameters on the meta device."""
    cfg = Qwen3Config.preset("tiny").replace(num_layers=layers, tie_word_embeddings=tied)
    trainer = trainer_of(cfg, dtype)
    if fp8:  # the same weights, the projections read through their FP8 quantization
        fp8_trainer = Qwen3Trainer(cfg, dtype=dtype, fp8=True)
        fp8_trainer.load_state_dict(trainer.state_dict())
        trainer = fp8_trainer
    if lora:  # base weights frozen, adapters trained: B drawn too, so A's gradient is not 0
        trainer.add_lora(LoRAConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]), lora)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in trainer.adapter_parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return trainer, positions, split, ckpt, microbatches


# fp32 weights: a gradient's summation order shows in its bits far more often than after a bf16 rounding
@pytest.mark.parametrize("case", CASES)
def test_pp_trainer_equals_one_device(case, tmp_path):
    trainer, positions, split, ckpt, microbatches = _case(**CASES[case])
    ref_lp, ref_grad = _one_device(trainer)
    trainer.zero_grad(set_to_none=True)
    trainer.activation_checkpointing = ckpt
    held_by_all = set()
    for r, (lps, grads, held) in enumerate(run_ranks(len(positions), tmp_path, _pp_rank, trainer, positions, split,
                                                     ckpt, microbatches)):
        assert len(lps) == len(ref_lp) and all(torch.equal(a, b) for a, b in zip(lps, ref_lp)), r
        assert grads.keys() == ref_grad.keys(), r
        bad = [n for n in held if (grads[n] is None) != (ref_grad[n] is None)
               or grads[n] is not None and not torch.equal(grads[n], ref_grad[n])]
        assert not bad, (r, bad)
        assert all(grads[n] is None for n in grads.keys() - set(held)), r
        held_by_all |= set(held)
    assert held_by_all == ref_grad.keys()


def test_pp_splits_refused():
    plan = pp_plan(Qwen3Config.preset("tiny"))
    assert stage_ranges(plan, 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="PP = 3 stages over 2 layers: every stage needs at least one layer"):
        stage_ranges(plan, 3)
    with pytest.raises(ValueError, match=r"split \[2, 0\] leaves a stage without layers"):
        stage_ranges(plan, 2, (2, 0))
    with pytest.raises(ValueError, match=r"split \[1, 2\] holds 3 layers, the model has 2"):
        stage_ranges(plan, 2, (1, 2))
    with pytest.raises(ValueError, match="a split of 3 stages for PP = 2"):
        stage_ranges(plan, 2, (1, 1, 0))
    with pytest.raises(ValueError, match="PP must be an int >= 1"):
        stage_ranges(plan, 0)


def test_pp1_is_the_trainer():
    """One stage, no process group: the same code path (what runs on one GPU) gives the trainer's bits."""
    trainer = trainer_of(Qwen3Config.preset("tiny"), torch.float32)
    ref_lp, ref_grad = _one_device(trainer)
    trainer.zero_grad(set_to_none=True)
    pp = PipelineParallel(trainer, pp_plan(trainer.cfg))
    seqs, lens = batch(trainer.cfg.vocab_size)
    lps = pp.logprobs(seqs, lens, SP)
    loss_of(lps).backward()
    pp.reduce_gradients()
    assert all(torch.equal(a.detach(), b) for a, b in zip(lps, ref_lp))
    assert all(torch.equal(p.grad, ref_grad[n]) for n, p in trainer.named_parameters())
    assert set(pp.held_names) == ref_grad.keys()
    trainer.zero_grad(set_to_none=True)
    lps = pp.logprobs(seqs, lens, SP, microbatches=3)  # the weight pass alone, no pipeline around it
    loss_of(lps).backward()
    assert all(torch.equal(a.detach(), b) for a, b in zip(lps, ref_lp))
    assert all(torch.equal(p.grad, ref_grad[n]) for n, p in trainer.named_parameters())
    with pytest.raises(ValueError, match="PP stage 1 of 1: stages are 0..0"):
        PipelineParallel(trainer, pp_plan(trainer.cfg), position=1)
    with pytest.raises(ValueError, match=r"microbatches must be an int in \[1, 4\]"):
        pp.logprobs(seqs, lens, SP, microbatches=5)
