"""A checkpoint's tokenizer, EOS ids and generation defaults on the pair (``models/text.py``), and the
engine's stop rules (the model's EOS ids, ``ignore_eos``, stop strings): a stop ends a completion and
changes none of its bits, so the tokens kept are a prefix of the run without it and their log-probs
are the trainer's, bit for bit."""
from __future__ import annotations

import json
import logging

import pytest
import torch
from text_toys import END, EOS, GENERATION_CONFIG, find_eos_seed, make_tokenizer, trainer_logprobs, write_checkpoint

import alignzoo
from alignzoo import SamplingParams
from alignzoo import cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("text") / "ckpt")


@pytest.fixture(scope="module")
def pair(ckpt):
    return alignzoo.load_pair("qwen3", checkpoint=ckpt)


def assert_trainer_bits(pair, prompt, c, sp):
    assert torch.equal(trainer_logprobs(pair, prompt, c.tokens, sp), c.logprobs)


def test_the_pair_reads_tokenizer_eos_defaults_and_template(pair):
    assert pair.eos_token_ids == (EOS, END)  # generation_config.json's, the tokenizer's eos_token among them
    assert pair.generation_defaults == {"temperature": 0.9, "top_k": 40, "top_p": 0.95}
    sp = pair.sampling_params(top_p=0.5)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.min_p) == (0.9, 40, 0.5, 0.0)
    tok = pair.tokenizer
    assert tok.eos_token_id == EOS and len(tok) == 151 and pair.text.chat_template is not None
    assert tok.encode("hello world") == [9, 10]


def test_eos_stops_unless_ignore_eos_and_the_bits_stay_the_trainers(pair):
    prompt = pair.tokenizer.encode("hello world the cat")
    seed, long, at = find_eos_seed(pair, prompt)
    sp_long = SamplingParams(max_new_tokens=24, seed=seed, ignore_eos=True)
    sp = SamplingParams(max_new_tokens=24, seed=seed)  # no stop_token_ids: the model's EOS ids stop it
    short = pair.server.generate([prompt], sp)[0]
    assert short.finish_reason == "stop" and short.matched == long.tokens[at] and short.tokens == long.tokens[:at + 1]
    assert torch.equal(short.logprobs, long.logprobs[:at + 1])  # a stop rule changes no bit
    assert long.finish_reason == "length" and len(long.tokens) == 24
    assert_trainer_bits(pair, prompt, short, sp)
    assert_trainer_bits(pair, prompt, long, sp_long)
    # stop_token_ids add to the EOS ids; ignore_eos turns every token stop off, as SGLang's does
    early = long.tokens[1]
    c = pair.server.generate([prompt], SamplingParams(max_new_tokens=24, seed=seed, stop_token_ids=(early,)))[0]
    assert c.tokens == long.tokens[:2] and c.matched == early
    c = pair.server.generate([prompt], SamplingParams(max_new_tokens=24, seed=seed, stop_token_ids=(early,),
                                                      ignore_eos=True))[0]
    assert c.tokens == long.tokens


def test_stop_string_ends_at_the_token_that_completes_it(pair):
    tok = pair.tokenizer
    prompt = tok.encode("reverse 1 2 3")
    sp_long = SamplingParams(max_new_tokens=20, seed=3, ignore_eos=True)
    long = pair.server.generate([prompt], sp_long)[0]
    words = tok.convert_ids_to_tokens(long.tokens)
    k = next(i for i in range(3, 15) if words[i] not in words[:i] and words[i + 1] not in words[:i + 1]
             and long.tokens[i] not in tok.all_special_ids and long.tokens[i + 1] not in tok.all_special_ids)
    stop = f"{words[k]} {words[k + 1]}"  # spans two tokens: found when the second one is sampled
    sp = SamplingParams(max_new_tokens=20, seed=3, ignore_eos=True, stop=("never there", stop))
    c = pair.server.generate([prompt], sp)[0]
    assert c.finish_reason == "stop" and c.matched == stop and c.tokens == long.tokens[:k + 2]
    assert torch.equal(c.logprobs, long.logprobs[:k + 2])
    assert_trainer_bits(pair, prompt, c, sp)


def test_a_checkpoint_without_tokenizer_says_so_once_and_serves_ids(tmp_path, caplog):
    d = write_checkpoint(tmp_path, tokenizer=False, generation_config={"eos_token_id": 5})
    with caplog.at_level(logging.WARNING, logger="alignzoo.models"):
        p = alignzoo.load_pair("qwen3", checkpoint=d, num_pages=64)
    said = [r.getMessage() for r in caplog.records if "no tokenizer" in r.getMessage()]
    assert len(said) == 1 and "token ids only" in said[0]
    assert p.tokenizer is None and p.eos_token_ids == (5,) and p.generation_defaults == {}
    c = p.server.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4, stop=("x",)))[0]
    assert c.finish_reason == "error" and "stop strings need the checkpoint's tokenizer" in c.error
    assert p.server.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("case, message", [
    ("vocab", "the tokenizer's vocabulary (160 tokens, added tokens included) exceeds the model's vocab_size 151"),
    ("eos", "generation_config.json: eos_token_id 500 is outside the model's vocabulary [0, 151)"),
    ("temperature", "generation_config.json: temperature must be 0 (greedy) or a finite value"),
    ("tokenizer-json", "cannot load its tokenizer"),
], ids=str)
def test_bad_checkpoint_text_is_a_load_error_naming_it(tmp_path, case, message):
    gen = {"eos": {"eos_token_id": [2, 500]}, "temperature": {"temperature": -1.0}}.get(case, GENERATION_CONFIG)
    d = write_checkpoint(tmp_path, generation_config=gen, tokenizer=case != "vocab")
    if case == "vocab":
        make_tokenizer(160).save_pretrained(d)
    if case == "tokenizer-json":
        (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError) as e:
        alignzoo.load_pair("qwen3", checkpoint=d, num_pages=64)
    assert message in str(e.value), str(e.value)


def test_save_pretrained_keeps_the_tokenizer_and_generation_config(pair, tmp_path):
    pair.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text()) == GENERATION_CONFIG
    again = alignzoo.load_pair("qwen3", checkpoint=tmp_path, num_pages=64)
    assert again.eos_token_ids == pair.eos_token_ids and again.tokenizer.get_vocab() == pair.tokenizer.get_vocab()
    assert again.text.chat_template == pair.text.chat_template


@pytest.mark.parametrize("kw, error, message", [
    ({"stop": ("",)}, ValueError, "stop[0] is empty"),
    ({"stop": ("x" * 513,)}, ValueError, "at most 512"),
    ({"stop": ("a",) * 33}, ValueError, "at most 32"),
    ({"stop": (1,)}, TypeError, "stop[0] must be a string"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos must be a bool"),
], ids=["empty", "long", "many", "not-str", "ignore_eos-int"])
def test_sampling_params_refuse_bad_stops(kw, error, message):
    with pytest.raises(error) as e:
        SamplingParams(**kw)
    assert message in str(e.value)
    assert SamplingParams(stop="ab").stop == ("ab",)


def test_cli_generate_takes_text_with_a_tokenizer(ckpt, capsys):
    rc = cli.main(["generate", "qwen3", "--checkpoint", str(ckpt), "--prompt", "hello world", "--prompt", "9 10",
                   "--max-new-tokens", "3", "--temperature", "1.0"])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert rc == 0 and lines[0].startswith("prompt [9, 10] -> ") and lines[1].startswith("  text '")
    assert lines[3].split(" -> ")[1] == lines[0].split(" -> ")[1]  # the same prompt as text and as ids
    rc = cli.main(["generate", "qwen3", "--prompt", "hello world"])  # a preset has no tokenizer
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and err.count("\n") == 1 and "'hello' is not a token id" in err
