"""What a checkpoint ships beside its weights: the tokenizer (transformers' ``AutoTokenizer``, read from
the directory's own files, never downloaded), its chat template, and ``generation_config.json`` (EOS ids,
default sampling parameters).

The model's EOS ids are those SGLang stops on: ``config.json``'s and ``generation_config.json``'s
``eos_token_id`` (an int or a list) and the tokenizer's ``eos_token_id``.  The default sampling
parameters are the ``generation_config.json`` fields the aligned sampler has (temperature, top_k,
top_p, min_p); ``do_sample`` is not read (SGLang does not read it either), and a field the sampler
cannot apply (a repetition penalty) is named in a warning and not applied.
"""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("alignzoo.models")

GENERATION_CONFIG = "generation_config.json"
# A directory with one of these holds a tokenizer AutoTokenizer can read (fast: tokenizer.json; slow: the others).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
# generation_config.json field -> SamplingParams field, and the value that means "off" in each
SAMPLING_FIELDS = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p"}
UNAPPLIED = {"repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
             "no_repeat_ngram_size": 0, "min_new_tokens": 0, "min_length": 0}


@dataclass(frozen=True)
class CheckpointText:
    """tokenizer:            a transformers tokenizer, or None (token ids only)
    eos_token_ids:        the model's EOS ids, in the order first seen
    generation_defaults:  ``SamplingParams`` fields from generation_config.json
    generation_config:    the file's JSON (written back by ``Pair.save_pretrained``), or None
    """
    tokenizer: Any = None
    eos_token_ids: tuple[int, ...] = ()
    generation_defaults: dict = field(default_factory=dict)
    generation_config: dict | None = None

    @property
    def chat_template(self) -> str | None:
        return getattr(self.tokenizer, "chat_template", None)


def has_tokenizer(directory) -> bool:
    return directory is not None and any(os.path.isfile(os.path.join(directory, f)) for f in TOKENIZER_FILES)


def _ids(value, where: str, vocab_size: int) -> list[int]:
    if value is None:
        return []
    ids = value if isinstance(value, list) else [value]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise ValueError(f"{where}: eos_token_id must be an int or a list of ints, got {value!r}")
        if not 0 <= i < vocab_size:
            raise ValueError(f"{where}: eos_token_id {i} is outside the model's vocabulary [0, {vocab_size})")
    return ids


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            out = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON object ({type(e).__name__}: {e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: not a JSON object")
    return out


def load_tokenizer(directory, vocab_size: int):
    """The checkpoint's tokenizer (local files only), checked against the model's vocabulary."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(os.fspath(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many kinds (OSError, ValueError, its own) for one bad file
        raise ValueError(f"{os.fspath(directory)}: cannot load its tokenizer ({type(e).__name__}: "
                         f"{' '.join(str(e).split())})") from None
    if len(tok) > vocab_size:
        raise ValueError(f"{os.fspath(directory)}: the tokenizer's vocabulary ({len(tok)} tokens, added tokens "
                         f"included) exceeds the model's vocab_size {vocab_size}: ids past {vocab_size - 1} "
                         f"have no embedding")
    return tok


def read_checkpoint_text(checkpoint, vocab_size: int) -> CheckpointText:
    """The tokenizer, EOS ids and generation defaults of a checkpoint directory (None: a preset, none)."""
    if checkpoint is None:
        return CheckpointText()
    directory = os.fspath(checkpoint)
    tokenizer = None
    if has_tokenizer(directory):
        tokenizer = load_tokenizer(directory, vocab_size)
    else:
        log.warning("%s has no tokenizer: serving token ids only (text prompts, stop strings and chat are refused)",
                    directory)
    eos: list[int] = []
    config_path = os.path.join(directory, "config.json")
    if os.path.isfile(config_path):
        eos += _ids(_read_json(config_path).get("eos_token_id"), config_path, vocab_size)
    gen, defaults = None, {}
    gen_path = os.path.join(directory, GENERATION_CONFIG)
    if os.path.isfile(gen_path):
        gen = _read_json(gen_path)
        eos += _ids(gen.get("eos_token_id"), gen_path, vocab_size)
        defaults = _sampling_defaults(gen, gen_path)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos += _ids(tokenizer.eos_token_id, f"{directory} (the tokenizer's eos_token)", vocab_size)
    return CheckpointText(tokenizer, tuple(dict.fromkeys(eos)), defaults, gen)


def _sampling_defaults(gen: dict, where: str) -> dict:
    from ..common.sampling import SamplingParams

    out = {}
    for name, ours in SAMPLING_FIELDS.items():
        v = gen.get(name)
        if v is None:
            continue
        if name == "top_k" and isinstance(v, int) and not isinstance(v, bool) and v < 0:
            v = 0  # off, as transformers and SGLang read a negative top_k
        out[ours] = v
    try:
        SamplingParams(**out)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    skipped = {k: gen[k] for k, off in UNAPPLIED.items() if gen.get(k) not in (None, off)}
    if skipped:
        log.warning("%s: %s not applied: the aligned sampler applies temperature, top_k, top_p and min_p only",
                    where, ", ".join(f"{k}={v}" for k, v in skipped.items()))
    return out
