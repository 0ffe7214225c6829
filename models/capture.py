"""Capture points: named copies of every op's output, keyed by (sequence,
position), for ``alignzoo bisect``.

A model's trainer and server call ``self.tap(op, tensor, layer, rows)`` after
each op (``op`` like "attn.qkv", ``layer`` its layer or None); the class
default is ``no_tap``, which does nothing, so capture points cost one empty
call when off: no flag is read, nothing is copied, and a CUDA graph captures
no work for them.  So a capture point passes tensors the forward has anyway
(no cast, no arithmetic for the tap alone); the Recorder derives what it files.  ``Recorder.attached_trainer`` / ``attached_server`` replace ``tap`` on one trainer or
server (instance attributes: the class keeps ``no_tap``) and wraps the calls
that say which rows are which, so each captured row is filed under the
logical (sequence index, position) it belongs to, whether it came from a
packed trainer batch or a paged server step:

  rows="tokens"  a (T, ...) tensor, one row per new token
  rows="logits"  a (R, ...) tensor, one row per logit row
  rows="cache"   ``tap_cache``: the rows a step wrote into a paged cache,
                 read back at its slots (slot -1: none written)

Sequences are told apart by their tokens: the driver scores sequences it
registered with ``expect`` (distinct token lists).
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

import torch

from ..common.ladder import bitwise_equal


def no_tap(op, tensor, layer=None, rows="tokens") -> None:
    """The capture point when nothing records: does nothing."""


def no_tap_cache(op, cache, slot_mapping, layer=None) -> None:
    """The cache capture point when nothing records: does nothing."""


def no_tap_state(op, state, slots, starts, cu_seqlens, layer=None) -> None:
    """The recurrent-state capture point when nothing records: does nothing."""


def op_name(op: str, layer: int | None) -> str:
    return op if layer is None else f"layer.{layer}.{op}"


class Recorder:
    """Collects {op name: {(sequence, position): row}} from one side.  ``order``
    keeps the op names in the order the forward first reached them."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self._index = {tuple(s): i for i, s in enumerate(sequences)}
        if len(self._index) != len(sequences):
            raise ValueError("bisect needs distinct sequences: two are the same token list")
        self.rows: dict[str, dict[tuple[int, int], torch.Tensor]] = {}
        self.order: list[str] = []
        self.conflicts: dict[str, int] = {}  # rows recorded twice with other bits (a recompute that differs)
        self._token_keys: list[tuple[int, int] | None] = []
        self._logit_keys: list[tuple[int, int] | None] = []
        self._step: list[tuple[int | None, int, int]] = []  # (sequence, start, end) per chunk of the step
        self._chunk_seqs: list[int | None] = []

    # ---------------------------------------------------------------- the row layout of a forward
    def set_packed(self, positions: torch.Tensor, cu_seqlens: torch.Tensor, sequences: list[int],
                   logit_rows: torch.Tensor | None) -> None:
        """A packed batch: chunk i (rows cu[i]..cu[i+1]) is of sequence
        ``sequences[i]``; each row's position is in ``positions``."""
        pos, cu = positions.tolist(), cu_seqlens.tolist()
        keys: list[tuple[int, int] | None] = [None] * len(pos)
        for i, s in enumerate(sequences):
            for r in range(cu[i], cu[i + 1]):
                keys[r] = None if s is None else (s, pos[r])
        self._token_keys = keys
        self._logit_keys = [] if logit_rows is None else [keys[r] for r in logit_rows.tolist()]
        self._chunk_seqs = list(sequences)

    def sequence_of(self, tokens: Sequence[int]) -> int | None:
        return self._index.get(tuple(tokens))

    # ---------------------------------------------------------------- capture points
    def tap(self, op, tensor, layer=None, rows="tokens") -> None:
        keys = self._token_keys if rows == "tokens" else self._logit_keys
        self._file(op_name(op, layer), tensor, keys)

    def tap_cache(self, op, cache, slot_mapping, layer=None) -> None:
        flat = cache.flatten(0, 1)
        slots = slot_mapping.tolist()
        keys = [k if s >= 0 else None for k, s in zip(self._token_keys, slots)]
        self._file(op_name(op, layer), flat[slot_mapping.clamp(min=0)], keys)

    def tap_state(self, op, state, slots, starts, cu_seqlens, layer=None) -> None:
        """A recurrent state pool after a step: chunk b (its first position
        ``starts[b]``, its rows ``cu_seqlens[b]..cu_seqlens[b + 1]``) ends at
        end = starts[b] + its row count, and its slot holds its sequence's
        state at the last 64-aligned position before end, filed under
        (sequence, that boundary); none before position 64."""
        keys = []
        ends = (starts + cu_seqlens.diff()).tolist()
        for s, slot, end in zip(self._chunk_seqs, slots.tolist(), ends):
            b = end // 64 * 64
            keys.append(None if s is None or slot < 0 or b == 0 else (s, b))
        self._file(op_name(op, layer), state[slots.clamp(min=0)], keys)

    def _file(self, name: str, tensor: torch.Tensor, keys) -> None:
        if name not in self.rows:
            self.rows[name] = {}
            self.order.append(name)
        store = self.rows[name]
        data = tensor.detach().to("cpu", copy=True)
        for r, key in enumerate(keys[:data.shape[0]]):
            if key is None:
                continue
            old = store.get(key)
            if old is not None and not bitwise_equal(old, data[r]):
                self.conflicts[name] = self.conflicts.get(name, 0) + 1
            store[key] = data[r]

    # ---------------------------------------------------------------- attaching to one side
    @contextmanager
    def attached_trainer(self, trainer):
        """Record ``trainer``'s forwards (its ``logits`` calls) inside the block."""
        real, rec = trainer.logits, self

        def logits(tokens, positions, cu_seqlens, rows, *a, **kw):
            cu, toks = cu_seqlens.tolist(), tokens.tolist()
            rec.set_packed(positions, cu_seqlens, [rec.sequence_of(toks[cu[i]:cu[i + 1]]) for i in range(len(cu) - 1)],
                           rows)
            return real(tokens, positions, cu_seqlens, rows, *a, **kw)

        with _patched([(trainer, "logits", logits)] + _taps(trainer, self)):
            yield self

    @contextmanager
    def attached_server(self, engine):
        """Record an engine's model forwards inside the block (eager only: a
        replayed CUDA graph runs none of the capture points)."""
        if engine.runner.graphs is not None:
            raise ValueError("bisect records an eager server: build the engine with cuda_graphs=False "
                             "(a replayed graph runs none of the capture points)")
        model, runner, rec = engine.model, engine.runner, self
        real_launch, real_forward = runner.launch, model.forward

        def launch(chunks, cache, **kw):
            rec._step = [(rec.sequence_of(c.seq.prompt + c.seq.tokens), c.start, c.end) for c in chunks]
            return real_launch(chunks, cache, **kw)

        def forward(batch, caches):
            rec.set_packed(batch.positions, batch.cu_seqlens_q, [s for s, _, _ in rec._step], batch.logit_rows)
            return real_forward(batch, caches)

        with _patched([(runner, "launch", launch), (model, "forward", forward)] + _taps(model, self)):
            yield self


def _taps(obj, rec: Recorder) -> list:
    """(holder, attribute, recorder method) for every capture point of ``obj`` and its submodules."""
    holders = list(obj.modules()) if isinstance(obj, torch.nn.Module) else [obj]  # modules() starts with obj
    out = []
    for h in holders:
        if hasattr(h, "tap"):
            out.append((h, "tap", rec.tap))
        if hasattr(h, "tap_cache"):
            out.append((h, "tap_cache", rec.tap_cache))
        if hasattr(h, "tap_state"):
            out.append((h, "tap_state", rec.tap_state))
    return out


@contextmanager
def _patched(changes):
    """Set instance attributes for the block, then remove them (the class's
    methods, ``no_tap`` among them, show through again)."""
    had = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in changes]
    try:
        for obj, name, value in changes:
            setattr(obj, name, value)
        yield
    finally:
        for obj, name, old in reversed(had):
            if old is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, old)


_MISSING = object()
