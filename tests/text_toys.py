"""A tiny checkpoint that ships what a real one does: a tokenizer (built here with the ``tokenizers``
library, one word per id, covering all 151 ids of the ``tiny`` preset so that every sampled id has
text), a chat template, and a generation_config.json with two EOS ids and sampling defaults."""
from __future__ import annotations

import json
from pathlib import Path

import torch

import alignzoo
from alignzoo import SamplingParams

SPECIAL = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "<unk>"]
WORDS = ("hello world the a cat dog sat on mat is good bad yes no reverse digits again please and what how why who "
         "you me it , . ! ? : 0 1 2 3 4 5 6 7 8 9").split()
VOCAB = 151
EOS, END = 2, 7  # "</s>" (the tokenizer's eos_token) and "<|end|>" (a turn's end), both in generation_config.json
GENERATION_CONFIG = {"eos_token_id": [EOS, END], "temperature": 0.9, "top_k": 40, "top_p": 0.95}

# Tools and an assistant's tool calls as GLM's template writes them: the arguments iterated as a dict
# (a message without them renders as it did before they were added).
CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'assistant' -%}"
    "{{ raise_exception('the conversation must start with a system or user message') }}"
    "{%- endif -%}"
    "{%- if tools -%}<|system|> {% for t in tools %}{{ t['function']['name'] }} {% endfor %}<|end|> {% endif -%}"
    "{%- for m in messages -%}<|{{ m['role'] }}|> {{ m['content'] if m['content'] is not none else '' }}"
    "{%- for tc in m.get('tool_calls') or [] %} <tool_call> {{ tc['function']['name'] }}"
    "{%- for k, v in tc['function']['arguments'].items() %} {{ k }} {{ v }}{% endfor %} </tool_call>{% endfor %}"
    " <|end|> {% endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)


def words(n: int = VOCAB) -> list[str]:
    out = SPECIAL + WORDS
    return out + [f"w{i}" for i in range(len(out), n)]


def make_tokenizer(n: int = VOCAB, chat_template: str | None = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words(n))}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tk.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                  unk_token="<unk>", additional_special_tokens=SPECIAL[3:8])
    tok.chat_template = chat_template
    return tok


def write_checkpoint(directory, *, tokenizer: bool = True, generation_config: dict | None = GENERATION_CONFIG,
                     vocab: int = VOCAB) -> Path:
    """The ``tiny`` qwen3 preset (seed 0) saved with the tokenizer and generation_config.json."""
    directory = Path(directory)
    alignzoo.load_pair("qwen3", config="tiny", num_pages=64).save_pretrained(directory)
    if tokenizer:
        make_tokenizer(vocab).save_pretrained(directory)
    if generation_config is not None:
        (directory / "generation_config.json").write_text(json.dumps(generation_config))
    return directory


def find_eos_seed(pair, prompt: list[int], *, max_new: int = 24, eos=(EOS, END), first: int = 2, **sp):
    """(seed, ignore_eos completion, index of its first EOS): the first seed whose completion, EOS ignored,
    meets one of ``eos`` at index ``first`` or later but before its last token (8 seeds a batch)."""
    for base in range(0, 96, 8):
        seeds = range(base, base + 8)
        outs = pair.server.generate([prompt] * 8, [SamplingParams(max_new_tokens=max_new, seed=s, ignore_eos=True,
                                                                  **sp) for s in seeds])
        for s, o in zip(seeds, outs):
            at = next((i for i, t in enumerate(o.tokens) if t in eos), None)
            if at is not None and first <= at < max_new - 1:
                return s, o, at
    raise AssertionError("no seed in 0..95 samples an EOS id: widen the search")


def trainer_logprobs(pair, prompt: list[int], tokens: list[int], sp: SamplingParams) -> torch.Tensor:
    return pair.trainer.logprobs([prompt + tokens], [len(prompt)], sp)[0].detach()
