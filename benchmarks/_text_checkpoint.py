"""A checkpoint directory that the OpenAI routes of ``alignzoo serve`` can serve, built on the spot (nothing
can be downloaded where the benchmarks run): a preset's seeded init saved with the model's
``save_pretrained``, and the tests' word-level tokenizer and chat template (``tests/text_toys.py``) sized to
the model's whole vocabulary, so that every id the model samples decodes to a word, as a real tokenizer's
does.  (The tokenizers library drops an id past the vocabulary without a word: sized to the ``tiny``
preset's 151 ids, a qwen3-0.6b answer would decode mostly to nothing and its text and token strings would
cost the server less than a real tokenizer's.)  151,936 words: built in 3 s, tokenizer.json 3.6 MB."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from text_toys import make_tokenizer  # noqa: E402


def write_checkpoint(directory, model: str, config: str, *, device="cpu", dtype=None, seed: int = 0) -> Path:
    """``directory`` holding ``model``'s ``config`` preset (weights seeded with ``seed``, in ``dtype``: the
    served bytes) and a tokenizer with a chat template and EOS id 2 (``</s>``)."""
    import torch

    from alignzoo.models import model_module
    from alignzoo.models.loading import build_trainer, resolve_config

    module = model_module(model)
    cfg = resolve_config(module.SPEC, None, config)
    trainer = build_trainer(module.SPEC, cfg, device=device, dtype=dtype or torch.bfloat16, seed=seed)
    directory = Path(directory)
    module.save_pretrained(trainer, directory)
    make_tokenizer(cfg.vocab_size).save_pretrained(directory)
    return directory


def chat_messages(tokenizer, n_words: int, generator) -> list[dict]:
    """One user message of ``n_words`` words drawn at random from the tokenizer's vocabulary, specials
    left out (each is one token of the word-level tokenizer)."""
    import torch

    first = max(tokenizer.all_special_ids) + 1
    ids = torch.randint(first, len(tokenizer), (n_words,), generator=generator).tolist()
    return [{"role": "user", "content": " ".join(tokenizer.convert_ids_to_tokens(ids))}]
