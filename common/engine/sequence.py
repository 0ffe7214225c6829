"""A request's state inside the engine, and what the engine hands back.

A ``Sequence`` is either generated (sample the next token after its last one)
or teacher-forced (score the given tokens after the prompt).  The engine only
ever asks it three things: which tokens to feed next, which of the fed rows
need logits, and what happens with the rows it gets back.
"""
from __future__ import annotations

import enum
import operator
import itertools
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Completion:
    """One finished request.

    tokens:          generated ids, the stop token included if one ended it (and every
                     token up to the one that completed a stop string)
    logprobs:        (len(tokens),) fp32 CPU: the log-prob the sampler returned
    finish_reason:   "stop" | "length" | "error" (then ``error`` says why; ``tokens`` holds
                     those sampled before a step of its own failed)
    matched:         what stopped it (finish_reason "stop"): the token id, or the stop string
    weight_version:  the version the last token was sampled under (-1: no token)
    weight_versions: the version of each token
    request_id:      what ``Engine.add_request`` returned
    adapter:         the LoRA adapter it was served with (None: the base model)
    extras:          the model's per-token extras ({name: (positions fed, ...)}:
                     prompt and generated tokens but the last; empty if the
                     model has none), e.g. the routed experts for router replay
    """

    prompt: list[int]
    tokens: list[int]
    logprobs: torch.Tensor
    finish_reason: str
    error: str | None = None
    weight_version: int = -1
    weight_versions: tuple[int, ...] = ()
    request_id: int = -1
    adapter: str | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    matched: int | str | None = None


class StopRule:
    """When a generated sequence ends before its length: at a token of ``token_ids``, or once the
    decoded tail of its tokens holds one of ``strings``.  As SGLang checks a stop string: after
    each token, ``decode`` (the tokenizer's, special tokens kept) of the last ``window`` tokens
    (the longest stop string's token count + 1), so a string is found at the token that completes
    it.  Checked on the host after a token is recorded: it never touches a logit or a draw."""

    __slots__ = ("token_ids", "strings", "decode", "window")

    def __init__(self, token_ids=(), strings: tuple[str, ...] = (), decode: Callable[[list[int]], str] | None = None,
                 window: int = 0):
        if strings and decode is None:
            raise ValueError("stop strings need a tokenizer to decode the completion")
        self.token_ids = frozenset(token_ids)
        self.strings, self.decode, self.window = tuple(strings), decode, window

    def check(self, tokens: list[int]) -> int | str | None:
        """What ``tokens`` (the completion so far) stop on now, if anything."""
        if tokens[-1] in self.token_ids:
            return tokens[-1]
        if self.strings:
            tail = self.decode(tokens[-self.window:])
            for s in self.strings:
                if s in tail:
                    return s
        return None



class Sequence:
    _ids = itertools.count()

    def __init__(self, prompt: list[int], sampling: SamplingParams, *, score_tokens: list[int] | None = None,
                 adapter: tuple[str, int] | None = None, stop: StopRule | None = None):
        """``score_tokens`` makes it teacher-forced: it feeds prompt + all but
        the last scored token and wants logits from position len(prompt) - 1.
        ``adapter``: (name, index into the model's ``adapter_names``) of the
        LoRA adapter to serve it with; None: the base model.  ``stop``: its
        stop rule (the engine's, from ``sampling`` and the model's EOS ids);
        None: ``sampling.stop_token_ids`` alone (none with ``ignore_eos``)."""
        self.id = next(Sequence._ids)
        self.prompt = prompt
        self.sampling = sampling
        self.adapter_name, self.adapter_id = adapter if adapter is not None else (None, -1)
        self.teacher_forced = score_tokens is not None
        self.tokens: list[int] = list(score_tokens) if self.teacher_forced else []
        self.logprobs: list[float] = []  # fp32 values; a Python float holds them exactly
        self.versions: list[int] = []
        self.num_cached = 0  # positions whose k/v are in the cache
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.matched: int | str | None = None
        self.extras: dict[str, list[torch.Tensor]] = {}  # per-token model outputs, chunk by chunk from position 0
        self._stop = stop if stop is not None else StopRule(() if sampling.ignore_eos else sampling.stop_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.tokens)

    @property
    def num_fed(self) -> int:
        """Positions that go through the model: every known token, except that
        teacher forcing never feeds the last one (nothing follows it)."""
        return self.num_tokens - 1 if self.teacher_forced else self.num_tokens

    @property
    def step(self) -> int:
        """The sampler's step: tokens generated so far (seeds the draw)."""
        return len(self.tokens)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt)
        if end <= p:
            return self.prompt[start:end]
        return (self.prompt + self.tokens)[start:end] if start < p else self.tokens[start - p : end - p]

    def logit_positions(self, start: int, end: int) -> range:
        """Positions in [start, end) whose next-token logits are wanted."""
        if self.teacher_forced:
            return range(max(start, len(self.prompt) - 1), end)
        return range(end - 1, end) if end == self.num_tokens else range(0)

    def append(self, token: int, logprob: float, version: int) -> None:
        self.tokens.append(token)
        self.logprobs.append(logprob)
        self.versions.append(version)
        matched = self._stop.check(self.tokens)
        if matched is not None:
            self.finish_reason, self.matched = "stop", matched
        elif len(self.tokens) >= self.sampling.max_new_tokens:
            self.finish_reason = "length"

    def add_extras(self, rows: dict[str, torch.Tensor]) -> None:
        """The model's extras of the positions just fed (in order)."""
        for n, t in rows.items():
            self.extras.setdefault(n, []).append(t)

    def gathered_extras(self) -> dict[str, torch.Tensor]:
        return {n: torch.cat(ts) for n, ts in self.extras.items()}

    def reset(self) -> None:
        """Preempted: its pages are gone; it will prefill everything again
        (a teacher-forced one rescores from the prompt)."""
        self.num_cached = 0
        self.extras.clear()
        self.status = Status.WAITING
        if self.teacher_forced:
            self.logprobs.clear()

    def completion(self) -> Completion:
        return Completion(
            prompt=self.prompt,
            tokens=list(self.tokens),
            logprobs=torch.tensor(self.logprobs, dtype=torch.float32),
            finish_reason=self.finish_reason,
            error=self.error,
            weight_version=self.versions[-1] if self.versions else -1,
            weight_versions=tuple(self.versions),
            request_id=self.id,
            adapter=self.adapter_name,
            extras=self.gathered_extras(),
            matched=self.matched,
        )


def one_each(value, n: int, what: str, kind: str) -> list:
    """``value`` for each of n ``what`` (a plural noun), or ``value`` itself
    when it is a list or tuple of n (a clear error for another length)."""
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{n} {what} but {len(value)} {kind}: give one, or one per {what[:-1]}")
        return list(value)
    return [value] * n


def adapter_position(name, names: Seq, holder: str) -> int:
    """The index of LoRA adapter ``name`` among ``names``: a TypeError for a
    non-str, a ValueError naming the adapters ``holder`` ("the model serves")
    has.  The engine's requests and the trainer's multi-mode calls."""
    if not isinstance(name, str):
        raise TypeError(f"adapter must be an adapter name (str) or None, got {type(name).__name__}")
    if name not in names:
        have = ", ".join(map(repr, names)) if names else "none"
        raise ValueError(f"unknown adapter {name!r}: {holder} adapters {have}")
    return list(names).index(name)


def check_token_ids(ids, vocab_size: int, what: str = "prompt") -> list[int]:
    """A list of ints from a 1-D integer tensor or a sequence of ints, each
    in [0, vocab_size); a clear TypeError / ValueError otherwise.  Used for
    the engine's prompts and scored sequences and the trainers' sequences
    (``what`` names the input in the empty-input message)."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex:
            raise TypeError(f"token ids must be a 1-D integer tensor, got {ids.dtype} of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Seq):
        raise TypeError(f"token ids must be a list of ints, got {type(ids).__name__}")
    if not ids:
        raise ValueError(f"the {what} is empty: give at least one token id")
    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool):
            raise TypeError(f"token {i} is a bool ({t}), not a token id")
        try:
            t = operator.index(t)
        except TypeError:
            raise TypeError(f"token {i} is a {type(t).__name__} ({t!r}), not an int token id") from None
        if not 0 <= t < vocab_size:
            raise ValueError(f"token id {t} at index {i} is outside the vocabulary [0, {vocab_size})")
        out.append(t)
    return out
