"""What the engine needs from a model's serving module, and what it hands it.

The engine is model-agnostic: it schedules requests, owns the cache pools the
model declares and samples, and asks the model for one thing — FP32 logits
of chosen rows of a packed batch of new tokens (and, if it has them, per-token
extras such as the routed experts of every MoE layer).  A model's ``serve.py``
implements ``ServeModel``; the same batch layout serves prefill, chunked
prefill, decode and teacher-forced scoring, so the model has one forward.

Shapes: T new tokens of B sequences, packed sequence after sequence; W pages
per block-table row; R logit rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class PagedRows:
    """One paged pool's view of a batch.

    block_table:  (B, W) int32  page of each 64-row block (unused entries 0;
                                -1 for a page a window pool gave back);
                                W >= 1 even before a rate pool has a row
    slot_mapping: (T,) int64    slot page * 64 + offset of each new token's
                                row, -1 where it writes none (a padding
                                token; a position that completes no row of a
                                rate pool)
    """

    block_table: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class HostLists:
    """The host's copy of a step's layout, where the runner has it: an eager step's, never a graph
    bucket's (its values change under the captured graph).  A model reads these instead of the
    device tensors, so its forward never waits on the GPU; they hold the tensors' values.

    cu_seqlens_q: B + 1 offsets; starts: each sequence's first new position (its
    ``positions`` at ``cu_seqlens_q[b]``); state_slots: B slots."""

    cu_seqlens_q: list[int]
    starts: list[int]
    state_slots: list[int]


@dataclass
class ForwardBatch:
    """One engine step's packed batch (all tensors on the model's device).

    tokens:       (T,) int64   new token ids
    positions:    (T,) int64   their positions in their sequences
    cu_seqlens_q: (B + 1,) int32  offsets of each sequence's new tokens
    seq_lens:     (B,) int32   cached + new tokens per sequence (>= its new tokens)
    logit_rows:   (R,) int64   rows of ``tokens`` whose next-token logits are wanted
    adapter_ids:  (T,) int64   LoRA adapter of each token's request: an index
                               into the model's ``adapter_names``, -1 for none
                               (the base model; padding rows too)
    state_slots:  (B,) int64   each sequence's slot in the model's state pool,
                               -1 for padding rows (and models without one)
    pools:        {paged pool name: PagedRows}
    max_seqlen_q: int          max new tokens of one sequence (1 for decode)
    host:         HostLists or None: the layout as host lists (eager steps)
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    logit_rows: torch.Tensor
    adapter_ids: torch.Tensor
    state_slots: torch.Tensor
    pools: dict[str, PagedRows]
    max_seqlen_q: int
    host: HostLists | None = None
    want_extras: frozenset[str] = frozenset()  # on-request extras a sequence of this (eager) step asked for


# Every tensor of a batch, by path: its dtype, what a padding row holds, and whether it has B + 1 rows.
# A decode batch has T == B == R, so a graph bucket's static buffers are these with n rows each.
FIELDS = {
    "tokens": (torch.int64, 0, False),
    "positions": (torch.int64, 0, False),
    "cu_seqlens_q": (torch.int32, "arange", True),
    "seq_lens": (torch.int32, 1, False),
    "logit_rows": (torch.int64, "arange", False),
    "adapter_ids": (torch.int64, -1, False),
    "state_slots": (torch.int64, -1, False),
}
POOL_FIELDS = {"block_table": (torch.int32, 0, False), "slot_mapping": (torch.int64, -1, False)}


def batch_tensors(b: ForwardBatch) -> dict[str, torch.Tensor]:
    """{path: tensor} of every tensor in ``b`` ("tokens", "pools.kv.block_table", ...)."""
    out = {f: getattr(b, f) for f in FIELDS}
    for name, rows in b.pools.items():
        out |= {f"pools.{name}.{f}": getattr(rows, f) for f in POOL_FIELDS}
    return out


def field_spec(path: str) -> tuple[torch.dtype, Any, bool]:
    """(dtype, pad value, has B + 1 rows) of a batch tensor's path."""
    return POOL_FIELDS[path.rsplit(".", 1)[1]] if path.startswith("pools.") else FIELDS[path]


def from_tensors(tensors: dict[str, torch.Tensor], max_seqlen_q: int) -> ForwardBatch:
    """The inverse of ``batch_tensors``."""
    pools: dict[str, dict[str, torch.Tensor]] = {}
    for path, t in tensors.items():
        if path.startswith("pools."):
            _, name, f = path.split(".")
            pools.setdefault(name, {})[f] = t
    return ForwardBatch(**{f: tensors[f] for f in FIELDS}, max_seqlen_q=max_seqlen_q,
                        pools={n: PagedRows(**p) for n, p in pools.items()})


def first_rows(b: ForwardBatch, n: int) -> ForwardBatch:
    """The first n rows of a decode batch (views: a graph reads them in place)."""
    return from_tensors({p: t[: n + 1 if field_spec(p)[2] else n] for p, t in batch_tensors(b).items()},
                        b.max_seqlen_q)


def static_decode_batch(n: int, widths: dict[str, int], device) -> ForwardBatch:
    """n pad rows: token 0, position 0, seq_len 1, slots -1 (nothing
    written), no adapter, no state slot, a zero block-table row of each paged
    pool's fixed width ``widths[pool]``."""
    paths = list(FIELDS) + [f"pools.{p}.{f}" for p in widths for f in POOL_FIELDS]
    out = {}
    for path in paths:
        dtype, pad, plus_one = field_spec(path)
        rows = n + 1 if plus_one else n
        shape = (rows, widths[path.split(".")[1]]) if path.endswith("block_table") else (rows,)
        out[path] = torch.arange(rows, dtype=dtype, device=device) if pad == "arange" else \
            torch.full(shape, pad, dtype=dtype, device=device)
    return from_tensors(out, 1)


@runtime_checkable
class ServeModel(Protocol):
    """A model's serving module as the engine sees it.

    ``forward`` must not read the batch's values on the host (no ``.item()``,
    no ``.tolist()``): decode steps are captured into CUDA graphs and replayed
    with new values written into the same input tensors, and an eager step
    that needs its layout on the host has ``batch.host``.  It must give row r
    of its output the same bits whatever else is in the batch (the contract).

    ``weights``: the dict of tensors the forward reads, which weight sync
    writes into (in place: captured graphs keep their pointers).

    ``cache_pools()``: {name: pool spec} (``common.kv_cache``: ``PagedPool``,
    ``RatePool``, ``WindowPool``, ``StatePool``); the engine sizes and
    allocates them and hands ``forward`` ``caches``: {name: [per layer:
    {tensor name: tensor}]}.  Paged pools: (pages, 64, *row shape) tensors,
    rows at ``batch.pools[name]``'s slots; a state pool: (slots, *shape),
    each sequence at ``batch.state_slots``.  A state slot is written by a
    prefill from position 0, which must not read it (a new or preempted
    sequence's slot holds another sequence's old state).

    ``forward`` returns the (R, V) fp32 logits, or (logits, extras): extras
    a {name: (T, ...) tensor} of per-token outputs (e.g. router replay's
    expert ids and weights), handed back on each ``Completion.extras`` and
    by ``Engine.score(..., return_extras=True)``.  A model may also have
    ``on_request_extras: tuple[str, ...]``: extras it computes only when
    ``batch.want_extras`` names them (a request asked, ``SamplingParams.extras``;
    such a step is eager), and only those requests get them back.

    A model that serves several LoRA adapters in one batch also has
    ``adapter_names: tuple[str, ...]``: the names requests may ask for, in the
    order ``ForwardBatch.adapter_ids`` indexes them (absent: none).
    """

    vocab_size: int
    max_position: int
    device: torch.device
    weights: dict[str, torch.Tensor]

    def cache_pools(self) -> dict[str, Any]: ...

    def forward(self, batch: ForwardBatch, caches: dict[str, list[dict[str, torch.Tensor]]]) -> Any:
        ...
