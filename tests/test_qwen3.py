"""The qwen3 pair's contract: trainer log-probs == server log-probs, bitwise.

Trainer (packed forward) == server prefill (score) == server decode (generate)
on completions sampled with temperature, top-k, top-p and min-p together;
mixed prompt lengths, batch order, fp32; sequences past 1024 tokens; bad
input.  Preemption, overlap, CUDA graphs, sync, checkpoints, the CLI check and
the misaligned server: tests/test_models.py, which every model runs.
"""
import pytest
import torch
from model_cases import assert_trainer_matches, make_pair, prompts_of

import alignzoo
from alignzoo import SamplingParams


SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, max_new_tokens=24, seed=11),
      SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0, max_new_tokens=40, seed=12),
      SamplingParams(temperature=0.6, top_k=7, top_p=1.0, min_p=0.1, max_new_tokens=9, seed=13),
      SamplingParams(temperature=0.0, max_new_tokens=17, seed=14)]


@pytest.fixture(scope="module")
def pair():
    return make_pair("qwen3")


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


def test_fp32_end_to_end():
    pair = make_pair("qwen3", dtype=torch.float32)
    prompts = prompts_of([150, 3], pair.config.vocab_size, seed=9)
    outs = pair.server.generate(prompts, SP[:2])
    assert_trainer_matches(pair, prompts, SP[:2], outs)


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
