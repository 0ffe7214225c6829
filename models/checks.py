"""Ladder rungs 1-4 for any aligned pair: ``alignzoo check <model>``
(docs/DESIGN.md, "The verification ladder").

1. repeat: the same batch twice, on the trainer and on the server;
2. batch: each sequence alone, in a mixed batch, in reversed order, with a
   different prefill chunking;
3. trainer == server on the same sequences: prefill scoring, and decode
   (the server feeds the tokens one step at a time);
4. online: the server samples (temperature, top-k, top-p, min-p together,
   mixed prompt lengths, requests joining mid-decode) and the trainer scores
   the samples at the same weight version.

Every row reports tokens compared, tokens whose FP32 bits differ, max |Δ| and
K3; a rung passes only when no bit differs.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..common.ladder import RungResult
from ..common.metrics import Mismatch, mismatch
from ..common.sampling import SamplingParams


def logprob_mismatch(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> tuple[Mismatch, float]:
    """The mismatch of two sides' FP32 log-probs of the same tokens (concatenated),
    its K3 max over the tokens finite on both sides, and their max |Δ|."""
    la = torch.cat([t.detach().float().cpu().reshape(-1) for t in a])
    lb = torch.cat([t.detach().float().cpu().reshape(-1) for t in b])
    m = mismatch(la, lb)
    finite = torch.isfinite(la) & torch.isfinite(lb)  # -inf: a token outside the top-k/p support on both sides
    d = (la[finite].double() - lb[finite].double()).abs()
    m.k3_max = float(mismatch(la[finite], lb[finite]).k3_max)
    return m, float(d.max()) if d.numel() else 0.0


def _row(name: str, rung: int, check: str, a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> RungResult:
    m, max_abs = logprob_mismatch(a, b)
    return RungResult(name, rung, check, m.exact and m.tokens > 0, m.tokens, m.differing,
                      f"max|d| {max_abs:.3g}  K3 max {m.k3_max:.3g}",
                      extra={"max_abs": max_abs, "scored_lengths": [int(t.numel()) for t in a], **m.as_dict()})


def make_sequences(vocab: int, length: int, batch: int, seed: int) -> list[list[int]]:
    """``batch`` sequences of odd, mixed lengths up to ``length``."""
    g = torch.Generator().manual_seed(seed)
    lens = [length] + [max(2, (length * (2 * i + 1)) // (2 * batch + 1) + i) for i in range(1, batch)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def scoring_batch(vocab: int, length: int, batch: int, seed: int):
    """(sequences, prompt lengths, per-sequence ``SamplingParams``) that the
    ladder and bisect score: ``make_sequences``, a third of each as prompt,
    temperatures only, so every token has a finite log-prob."""
    seqs = make_sequences(vocab, length, batch, seed)
    plens = [max(1, len(s) // 3) for s in seqs]
    sp = [SamplingParams(temperature=0.7 + 0.1 * i, seed=seed + i) for i in range(batch)]
    return seqs, plens, sp


def decode_prefixes(seqs, plens, n: int):
    """The first ``n`` tokens of each sequence and their prompt lengths (a third at most), for the decode path."""
    short = [s[:n] for s in seqs]
    return short, [max(1, min(p, len(s) // 3)) for p, s in zip(plens, short)]


DECODE_RUNG_TOKENS = 384


def run_ladder(pair, *, length: int = 1024, batch: int = 4, seed: int = 0, new_tokens: int = 192,
               progress: Callable[[str], None] | None = None) -> list[RungResult]:
    name, trainer, server = pair.name, pair.trainer, pair.server
    vocab = pair.config.vocab_size
    say = progress or (lambda s: None)
    seqs, plens, sp = scoring_batch(vocab, length, batch, seed)
    rows: list[RungResult] = []
    with torch.no_grad():
        say("rung 1: repeat")
        t1 = trainer.logprobs(seqs, plens, sp)
        rows.append(_row(name, 1, "trainer, same batch twice", t1, trainer.logprobs(seqs, plens, sp)))
        s1 = server.score(seqs, plens, sp)
        rows.append(_row(name, 1, "server prefill, same batch twice", s1, server.score(seqs, plens, sp)))

        say("rung 2: batch composition")
        alone = [trainer.logprobs([s], [p], [q])[0] for s, p, q in zip(seqs, plens, sp)]
        rows.append(_row(name, 2, "trainer: alone vs mixed batch", alone, t1))
        rev = trainer.logprobs(seqs[::-1], plens[::-1], sp[::-1])[::-1]
        rows.append(_row(name, 2, "trainer: reversed batch order", rev, t1))
        s_alone = [server.score([s], [p], [q])[0] for s, p, q in zip(seqs, plens, sp)]
        rows.append(_row(name, 2, "server: alone vs mixed batch", s_alone, s1))
        s_chunk = server.score(seqs, plens, sp, chunk_tokens=97)
        rows.append(_row(name, 2, "server: prefill in 97-token chunks", s_chunk, s1))

        say("rung 3: trainer == server")
        rows.append(_row(name, 3, "trainer == server prefill", t1, s1))
        n_dec = min(length, DECODE_RUNG_TOKENS)  # one engine step per token: keep it short
        short, p_short = decode_prefixes(seqs, plens, n_dec)
        t_short = trainer.logprobs(short, p_short, sp)
        s_dec = server.score(short, p_short, sp, chunk_tokens=1)
        rows.append(_row(name, 3, f"trainer == server decode (1 token/step, first {n_dec})", t_short, s_dec))

        say("rung 4: online sampling")
        # long prompts (prefill) then decode: sequences still reach `length` tokens (past the model's EOS ids
        # too: a checkpoint's EOS would end them early, and a receipt's token counts with them)
        prompts = [s[:max(1, len(s) - new_tokens)] for s in seqs]
        gen_sp = [SamplingParams(temperature=0.7 + 0.1 * i, top_k=vocab // 3 + i, top_p=0.9, min_p=0.02,
                                 seed=seed + i, max_new_tokens=len(s) - len(p), ignore_eos=True)
                  for i, (s, p) in enumerate(zip(seqs, prompts))]
        outs = server.generate(prompts, gen_sp)
        bad = [o.error for o in outs if o.error]
        if bad:
            raise RuntimeError(f"generation failed: {bad[0]}")
        lp_t = trainer.logprobs([p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts], gen_sp)
        rows.append(_row(name, 4, "server samples == trainer scores", lp_t, [o.logprobs for o in outs]))
    return rows
