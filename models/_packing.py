"""Packing scored sequences for a trainer's forward (shared by every model).

A trainer scores ``sequence[prompt_len:]``: row ``prompt_len - 1 + j`` of the
packed forward predicts token ``prompt_len + j``.  Every model's
``Trainer.logprobs`` packs with ``pack_scored`` and reads its sampling
parameters with ``sampling_list``.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..common.engine.sequence import check_token_ids
from ..common.sampling import SamplingParams


@dataclass
class PackedScored:
    tokens: torch.Tensor      # (T,) int64, sequences back to back
    positions: torch.Tensor   # (T,) int64
    cu_seqlens: torch.Tensor  # (B + 1,) int32
    rows: torch.Tensor        # (R,) int64 rows whose next token is scored
    targets: torch.Tensor     # (R,) int64 the scored tokens
    counts: list[int]         # scored tokens per sequence (sum R)
    max_seqlen: int


def sampling_list(sampling, n: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per sequence from None (defaults), one, or a list."""
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    params = list(sampling)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} sequences: pass one, or one per sequence")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise TypeError(f"sampling[{i}] is a {type(p).__name__}, not an alignzoo.SamplingParams")
    return params


def pack_scored(sequences, prompt_lens: Sequence[int], vocab_size: int, max_position: int, device) -> PackedScored:
    if len(sequences) != len(prompt_lens):
        raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens")
    if not len(sequences):
        raise ValueError("no sequences to score")
    seqs = []
    for i, s in enumerate(sequences):
        try:
            seqs.append(check_token_ids(s, vocab_size, "sequence"))
        except (TypeError, ValueError) as e:
            raise type(e)(f"sequence {i}: {e}") from None
    tokens, positions, rows, targets, counts, cu = [], [], [], [], [], [0]
    for i, (s, p) in enumerate(zip(seqs, prompt_lens)):
        n = len(s)
        if not isinstance(p, int) or not 1 <= p <= n:
            raise ValueError(f"prompt_lens[{i}] = {p!r} must be an int in [1, {n}] (sequence {i} has {n} tokens)")
        if n > max_position:
            raise ValueError(f"sequence {i} has {n} tokens, past the model's maximum position {max_position}")
        off = cu[-1]
        tokens += s
        positions += range(n)
        rows += range(off + p - 1, off + n - 1)
        targets += s[p:]
        counts.append(n - p)
        cu.append(off + n)
    as_t = lambda x, dt: torch.tensor(x, dtype=dt).to(device)  # noqa: E731
    return PackedScored(
        tokens=as_t(tokens, torch.int64), positions=as_t(positions, torch.int64),
        cu_seqlens=as_t(cu, torch.int32), rows=as_t(rows, torch.int64), targets=as_t(targets, torch.int64),
        counts=counts, max_seqlen=max(len(s) for s in seqs),
    )
