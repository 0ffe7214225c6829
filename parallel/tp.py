"""Tensor-parallel serving whose rows equal one device's, bit for bit.

A model declares a ``TPPlan`` beside itself (``models/qwen3/parallelize.py``): which server weights
are column-, row- or vocabulary-sharded and the config one rank's forward sees.  ``tp_server`` applies
it: every rank holds its shards and runs the model's own ``forward`` unchanged, with the collectives
inside ``linear`` and ``_logits``.  The model file never mentions a rank.

Which split of ``y = x · Wᵀ`` is exact (``common/matmul``'s contract):

- **N (column) split: always.**  An output element is the K-chain of one row of x and one row of W;
  the rows of W beside it never enter (CPU: element-wise ops; CUDA: ``reduction_config`` depends on
  (N, K) but gives SEG_K = 1024 for every N, and no tile or schedule changes a bit).  q/k/v,
  gate/up and the LM head's vocabulary split by N; attention heads split likewise (each head's
  softmax is its own).  No reduction, only an all-gather in logical order where the width is needed.
- **K (row) split: only at the matmul's segment boundaries, partials merged left to right.**  The
  CUDA path cuts K into segments of SEG_K = 1024, each a chain of ``tl.dot`` steps from zero, and
  adds the fp32 partials left to right before one rounding: ranks that own whole segments and ship
  their fp32 partials (not a sum of them) to a left-to-right merge in segment order give its bits
  (``k_split_linear``).  The CPU path sums all of K in one chain from zero (``matmul/cpu.py``): its
  one segment is K itself, so no K split is exact there (rank 1's chain would restart at 0 instead of
  at rank 0's sum).  ``check_k_split`` refuses both cases with the reason.

The server's row-parallel layers (o, down) therefore run **gathered**: the K-sharded input (a rank's
heads, or its MLP columns) is all-gathered in logical order, which restores the one-device K layout,
and the weight is held N-sharded, so each rank computes whole K-chains of its output columns, then an
all-gather in logical order.  Exact on both paths, and fewer bytes than shipping segment partials.
Received per token row of a row-parallel layer: gathered, (R-1)/R·(K + N) values in the model's
dtype; a K split, (R-1)/R·(K/1024)·N fp32 partials; a ring all-reduce (not exact), 2·(R-1)/R·N.
qwen3-8B's down (K = 12288, N = 4096) at TP 2 in bf16: 16 KB, 96 KB, 8 KB.  So ``k_split_linear``
(tested on a CPU stand-in for the CUDA segment arithmetic) is not the server's path; it is the
recipe where a K split is wanted, once ``common/matmul`` exports its split kernel's fp32 partials.

Logical positions: rank r holds shard ``position`` (default r), a permutation of 0..R-1 settled once
(``rank_of_positions``); every gather concatenates by position, never by rank id.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .collectives import _all_gather, _size_rank, ordered_all_gather

Blocks = tuple[tuple[int, int, str], ...]  # fused blocks in order: (units, elements per unit, what the units are)


@dataclass(frozen=True)
class Column:
    """W's rows (N) are ``blocks`` of units (heads of D rows, single columns); each block splits over the
    ranks by whole units (a unit replicated where the ranks outnumber it); a rank's output stays local."""
    blocks: Blocks


@dataclass(frozen=True)
class Row:
    """W's columns (K) are ``blocks`` of units that arrive sharded as a column-parallel layer left them;
    the output (all N) is whole on every rank."""
    blocks: Blocks


@dataclass(frozen=True)
class Vocab:
    """An LM head: vocabulary rows in R contiguous slices (sizes differ by at most one); logits gathered."""


@dataclass(frozen=True)
class TPPlan:
    """weights: {name, "{}" for the layer index: Column | Row | Vocab}; unnamed weights are replicated.
    A name without "{}" is that one weight (a hybrid model names each layer's by its type).
    local_config(cfg, R): the config one rank's forward sees."""
    weights: dict[str, Column | Row | Vocab]
    num_layers: int
    local_config: Callable


def unit_range(units: int, tp: int, position: int, what: str = "units") -> tuple[int, int]:
    """[lo, hi) of the ``units`` held at TP position ``position``: units / tp each, or one replicated
    unit (units · position // tp) where tp is a multiple of units; other counts are refused."""
    if units % tp == 0:
        n = units // tp
        return position * n, (position + 1) * n
    if tp % units == 0:
        u = units * position // tp
        return u, u + 1
    raise ValueError(f"TP = {tp} does not fit {units} {what}: TP must divide them or be a multiple of them")


def unit_count(units: int, tp: int, what: str = "units") -> int:
    """How many of the ``units`` one TP position holds (``unit_range``'s width): what a ``local_config`` sets."""
    lo, hi = unit_range(units, tp, 0, what)
    return hi - lo


def even_range(n: int, tp: int, position: int) -> tuple[int, int]:
    """[lo, hi) of slice ``position`` of n rows cut into tp contiguous slices, the first n % tp one longer."""
    q, r = divmod(n, tp)
    lo = position * q + min(position, r)
    return lo, lo + q + (position < r)


def _block_index(blocks: Blocks, tp: int, position: int, *, replicate: bool) -> torch.Tensor:
    idx, o = [], 0
    for units, size, what in blocks:
        if not replicate and units % tp:
            raise ValueError(f"TP = {tp} does not divide {units} {what}: a row-parallel input splits by whole units")
        lo, hi = unit_range(units, tp, position, what)
        idx.append(torch.arange(o + lo * size, o + hi * size))
        o += units * size
    return torch.cat(idx)


def check_layout(plan: TPPlan, cfg, tp: int) -> None:
    """Refuse a TP degree the plan cannot take, with its reason, before any process group is touched."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"TP must be an int >= 1, got {tp!r}")
    for name, kind in plan.weights.items():
        if isinstance(kind, (Column, Row)):
            _block_index(kind.blocks, tp, 0, replicate=isinstance(kind, Column))
    plan.local_config(cfg, tp)


def shard_weights(weights: dict[str, torch.Tensor], plan: TPPlan, tp: int, position: int) -> dict[str, torch.Tensor]:
    """This position's server weights: Column rows by unit, Row rows as an even N slice (the gathered
    form: whole K), Vocab rows as an even slice; the rest shared.  A tied LM head shards the embedding."""
    if any(".lora_" in n or n.endswith("weight_scale_inv") for n in weights):
        raise NotImplementedError("TP serves bf16/fp32 weights without separate LoRA adapters: FP8 codes and "
                                  "lora_A/lora_B branches are not sharded yet (merge the adapter first)")
    if not 0 <= position < tp:
        raise ValueError(f"TP position {position} outside 0..{tp - 1}")
    kinds = {n.replace("{}", str(i)): k for n, k in plan.weights.items() for i in range(plan.num_layers)}
    out = dict(weights)
    if "lm_head.weight" in kinds and "lm_head.weight" not in out:
        out["lm_head.weight"] = weights["embed.weight"]
    for name, kind in kinds.items():
        w = out[name]
        if isinstance(kind, Column):
            w = w[_block_index(kind.blocks, tp, position, replicate=True)]
        else:
            w = w[slice(*even_range(w.shape[0], tp, position))]
        out[name] = w.contiguous()
    return out


class TensorParallel:
    """Mixed in before a model's server class: ``linear`` gathers around row-parallel layers and
    ``_logits`` gathers the vocabulary shards, both in logical order; the rest is the model's.

    Who holds which position and every shard's width are settled once by ``tp_server``, so a gather
    is one ``all_gather`` and static slicing: no label exchange and no host read per call (what a
    CUDA-graph capture needs)."""

    tp_group = None
    tp_rank_of: tuple[int, ...] = (0,)  # the rank holding each position, by position
    tp_rows: dict[str, tuple[int, ...]] = {}  # row-parallel layer prefix -> its output widths by position
    tp_vocab: tuple[int, ...] = ()  # the LM head's vocabulary widths by position

    def tp_gather(self, x: torch.Tensor, widths: tuple[int, ...]) -> torch.Tensor:
        """(T, widths[p]) at each position p -> (T, sum(widths)), shards concatenated by position."""
        R = len(self.tp_rank_of)
        if R == 1:
            return x
        w = max(widths)
        padded = torch.nn.functional.pad(x, (0, w - x.shape[-1])).contiguous()
        out = padded.new_empty(R, *padded.shape)
        _all_gather(out, padded, self.tp_group)
        return torch.cat([out[r, :, : widths[p]] for p, r in enumerate(self.tp_rank_of)], -1)

    def linear(self, x, prefix, adapter_ids):
        widths = self.tp_rows.get(prefix)
        if widths is None:
            return super().linear(x, prefix, adapter_ids)
        x = self.tp_gather(x, (x.shape[-1],) * len(widths))  # (T, K): the one-device K layout
        y = super().linear(x, prefix, adapter_ids)  # (T, N_p): whole K-chains of this rank's columns
        return self.tp_gather(y, widths)

    def _logits(self, x, residual, batch):
        return self.tp_gather(super()._logits(x, residual, batch), self.tp_vocab)


@functools.cache
def _tp_class(server_cls: type) -> type:
    return type(f"TP{server_cls.__name__}", (TensorParallel, server_cls), {})


def rank_of_positions(position: int, group=None, device=None) -> tuple[int, ...]:
    """The rank holding each TP position (one all-gather at setup); positions must be a permutation."""
    R, _ = _size_rank(group)
    if R == 1:
        if position != 0:
            raise ValueError(f"one rank holds TP position {position}: positions must be 0..R-1")
        return (0,)
    mine = torch.tensor([position], dtype=torch.int64, device=device)
    table = mine.new_empty(R)
    _all_gather(table, mine, group=group)
    by_rank = table.tolist()
    if sorted(by_rank) != list(range(R)):
        raise ValueError(f"TP positions {by_rank} (by rank) are not a permutation of 0..{R - 1}")
    return tuple(by_rank.index(p) for p in range(R))


def tp_server(server_cls: type, cfg, weights: dict[str, torch.Tensor], plan: TPPlan, group=None,
              position: int | None = None, **server_kw):
    """``server_cls`` (a ``ServeModel``) over this rank's shards of the full ``weights``: the engine runs
    it as any model, the same requests on every rank of ``group``.  Returns full FP32 logits (R, V) on
    every rank, bitwise the one-device server's.  position: this rank's TP position (default its rank)."""
    R, rank = _size_rank(group)
    check_layout(plan, cfg, R)
    p = rank if position is None else position
    model = _tp_class(server_cls)(plan.local_config(cfg, R), shard_weights(weights, plan, R, p), **server_kw)
    model.tp_group = group
    model.tp_rank_of = rank_of_positions(p, group, model.device)
    rows = {n.replace("{}", str(i)): k for n, k in plan.weights.items() if isinstance(k, Row)
            for i in range(plan.num_layers)}
    model.tp_rows = {n.removesuffix("weight"): tuple(hi - lo for lo, hi in (even_range(weights[n].shape[0], R, q)
                                                                             for q in range(R))) for n in rows}
    V = weights.get("lm_head.weight", weights["embed.weight"]).shape[0]
    model.tp_vocab = tuple(hi - lo for lo, hi in (even_range(V, R, q) for q in range(R)))
    return model


# --- K split at segment boundaries (the CUDA contract) ------------------------------------------------


def check_k_split(K: int, tp: int, seg_k: int | None) -> None:
    """A K split is exact only where each of the tp ranks owns whole segments of the matmul's chain."""
    if seg_k is None:
        raise ValueError("this matmul path sums K in one chain from zero (the CPU path): no K split is exact; "
                         "gather the input and split N instead")
    if K % tp or (K // tp) % seg_k:
        raise ValueError(f"K = {K} over TP = {tp} is not whole segments of SEG_K = {seg_k} per rank: a rank's "
                         f"partial would cut a segment's chain")


def merge_segment_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """parts (S, M, N) fp32 in segment order -> ((0 + p_0) + p_1) + ... + p_{S-1}, rounded once to dtype:
    the CUDA matmul's merge (``matmul/kernel.py``)."""
    total = torch.zeros(parts.shape[1:], dtype=torch.float32, device=parts.device)
    for p in parts:
        total = total + p
    return total.to(dtype)


def k_split_linear(x: torch.Tensor, w: torch.Tensor, seg_k: int | None, partials: Callable, position: int,
                   group=None) -> torch.Tensor:
    """Row-parallel ``x · Wᵀ`` with K split at segment boundaries.  x (M, K_p), w (N, K_p): this rank's
    K slice, slice ``position`` of R equal ones; partials(x, w, seg_k) -> (K_p / seg_k, M, N) fp32,
    each segment's chain from zero.  -> (M, N) in x.dtype on every rank: the partials of all ranks
    concatenated by position (segment order), merged left to right."""
    R, _ = _size_rank(group)
    check_k_split(x.shape[1] * R, R, seg_k)
    parts = ordered_all_gather(partials(x, w, seg_k), position, group, dim=0)  # (S, M, N)
    return merge_segment_partials(parts, x.dtype)
