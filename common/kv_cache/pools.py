"""Cache pools: what a model keeps for a sequence between engine steps, and
the one manager the scheduler talks to.

A model declares its pools (``ServeModel.cache_pools()``, name -> spec); each
kind is its own class:

  PagedPool   a row per position, in 64-row pages (K/V, an MLA latent row)
  RatePool    a row per ``rate`` positions (compressed caches, e.g. C4, C128)
  WindowPool  a row per position; pages behind ``window`` go back to the pool
  StatePool   fixed-size tensors per running sequence (recurrent state)

A spec knows how many units it has for the engine's limits (``units``:
pages, or slots for a state pool) and the bytes of one (``unit_bytes``),
allocates its tensors (per layer, a dict of named tensors: the model's
forward reads ``caches[pool][layer][name]``) and makes its ledger
(``block_manager.py``).  ``CacheManager`` runs every ledger behind one API
(``append``, ``append_one``, ``can_append``, ``free``): a sequence is
admitted, grown or preempted only when every pool it uses has room, and an
append that one pool cannot serve changes none.

Shapes: P pages of PAGE_SIZE rows, S state slots.
"""
from __future__ import annotations

import math
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

import torch

from .._host import cdiv
from .._validate import check_int
from .block_manager import BlockManager, OutOfPages, StateSlots, WindowManager
from .op import PAGE_SIZE


def _item(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedPool:
    """A row per position: ``rows`` = {name: row shape} (K/V: {"k": (Hkv, D),
    "v": (Hkv, D)}), one set per layer, in pages of PAGE_SIZE rows."""

    rows: Mapping[str, tuple[int, ...]]
    dtype: torch.dtype
    layers: int

    rate = 1  # positions per row

    def __post_init__(self):
        if not self.rows or any(not all(isinstance(d, int) and d >= 1 for d in s) for s in self.rows.values()):
            raise ValueError(f"a pool's rows must map names to shapes of positive ints, got {dict(self.rows)!r}")
        check_int("a pool's layers", self.layers)

    def page_bytes(self) -> int:
        return PAGE_SIZE * self.layers * _item(self.dtype) * sum(math.prod(s) for s in self.rows.values())

    def unit_bytes(self) -> int:
        return self.page_bytes()

    def graph_width(self, max_position: int) -> int:
        """Block-table columns that cover ``max_position`` positions."""
        return cdiv(cdiv(max_position, self.rate), PAGE_SIZE)

    def ledger(self, num_pages: int, *, name: str, shuffle_seed: int | None = None) -> BlockManager:
        return BlockManager(num_pages, rate=self.rate, name=name, shuffle_seed=shuffle_seed)

    def units(self, blocks: int, engine_limits: "PoolLimits") -> int:
        """This pool's pages when the engine holds ``blocks`` 64-position blocks."""
        return max(1, cdiv(blocks, self.rate))

    def allocate(self, num_pages: int, device) -> list[dict[str, torch.Tensor]]:
        return [{n: torch.zeros(num_pages, PAGE_SIZE, *s, dtype=self.dtype, device=device)
                 for n, s in self.rows.items()} for _ in range(self.layers)]


@dataclass(frozen=True)
class RatePool(PagedPool):
    """A row per ``rate`` positions: position p completes row (p + 1) / rate - 1
    when rate divides p + 1 (its slot; the others get -1)."""

    rate: int = 1

    def __post_init__(self):
        super().__post_init__()
        check_int("a rate pool's rate", self.rate)

    def units(self, blocks: int, engine_limits: "PoolLimits") -> int:
        # a sequence of n positions holds n / (64 rate) pages plus its open one: blocks / rate in all, plus one
        # per sequence holding pages (at most state_slots), never more than the blocks themselves
        return max(1, min(blocks, cdiv(blocks, self.rate) + engine_limits.state_slots))


@dataclass(frozen=True)
class WindowPool(PagedPool):
    """A row per position, of which only the last ``window`` are ever read:
    pages wholly behind it go back to the pool.

    ``ring``: the block table the model reads is a ring, block b of a sequence
    in column ``b % width`` (``ring_table``), so its width follows the window
    and a step's chunks, not the context: a decode graph's is
    ``cdiv(window - 1, 64) + 2`` columns at any ``max_position``.  The model
    reads ``block_table[seq, (pos // 64) % block_table.shape[1]]``; a model
    whose kernels read the table in order keeps ``ring=False``."""

    window: int = 1
    ring: bool = False

    def __post_init__(self):
        super().__post_init__()
        check_int("a window pool's window", self.window)

    def graph_width(self, max_position: int) -> int:
        if not self.ring:
            return super().graph_width(max_position)
        return min(super().graph_width(max_position), self.ring_width(1))

    def ring_width(self, chunk: int) -> int:
        """Ring columns for a step whose longest chunk is ``chunk`` tokens: its queries read positions from
        (first - window + 1) to (first + chunk - 1), at most this many 64-position blocks."""
        return cdiv(self.window - 1 + chunk - 1, PAGE_SIZE) + 1

    def ledger(self, num_pages: int, *, name: str, shuffle_seed: int | None = None) -> WindowManager:
        return WindowManager(num_pages, self.window, name=name, shuffle_seed=shuffle_seed)

    def units(self, blocks: int, engine_limits: "PoolLimits") -> int:
        # every sequence's window and its open page, and one chunk's worth of pages beyond them
        lim = engine_limits
        per_seq = cdiv(self.window - 1, PAGE_SIZE) + 2
        return max(1, min(blocks, lim.max_batch_size * per_seq + cdiv(lim.max_batch_tokens, PAGE_SIZE)))


@dataclass(frozen=True)
class StatePool:
    """Fixed-size tensors per running sequence: ``fields`` = {name: (shape,
    dtype)}, one set per layer, in S slots (a slot's tensors are
    ``caches[pool][layer][name][slot]``)."""

    fields: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
    layers: int

    def __post_init__(self):
        if not self.fields:
            raise ValueError("a state pool needs at least one field")
        check_int("a pool's layers", self.layers)

    def slot_bytes(self) -> int:
        return self.layers * sum(math.prod(s) * _item(d) for s, d in self.fields.values())

    def unit_bytes(self) -> int:
        return self.slot_bytes()

    def units(self, blocks: int, engine_limits: "PoolLimits") -> int:
        """This pool's slots: the engine's ``state_slots``, whatever its blocks."""
        return engine_limits.state_slots

    def ledger(self, num_slots: int, *, name: str, shuffle_seed: int | None = None) -> StateSlots:
        return StateSlots(num_slots, name=name)

    def allocate(self, num_slots: int, device) -> list[dict[str, torch.Tensor]]:
        return [{n: torch.zeros(num_slots, *s, dtype=d, device=device) for n, (s, d) in self.fields.items()}
                for _ in range(self.layers)]


@dataclass(frozen=True)
class PoolLimits:
    """What sizes the pools beside the byte budget: the engine's batch limits."""

    max_batch_size: int
    max_batch_tokens: int

    @property
    def state_slots(self) -> int:
        # the running batch plus as many sequences as one score() runs beside it
        return 2 * self.max_batch_size


def pool_units(pools: Mapping[str, object], blocks: int, limits: PoolLimits) -> dict[str, int]:
    """Pages (slots for a state pool) of each pool when the engine holds
    ``blocks`` 64-position blocks."""
    return {n: p.units(blocks, limits) for n, p in pools.items()}


def pool_bytes(pools: Mapping[str, object], units: Mapping[str, int]) -> int:
    return sum(units[n] * p.unit_bytes() for n, p in pools.items())


def blocks_for_bytes(pools: Mapping[str, object], budget: int, limits: PoolLimits, most: int) -> int:
    """The most 64-position blocks (<= ``most``, >= 1) whose pools fit ``budget`` bytes."""
    lo, hi = 1, max(1, most)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if pool_bytes(pools, pool_units(pools, mid, limits)) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


class CacheManager:
    """Every pool's ledger behind the one API the scheduler uses.  A window
    pool goes last, so that ``append_one`` never has to undo its step (which
    may have given pages back) when a later pool has no room."""

    def __init__(self, ledgers: Mapping[str, object]):
        if not ledgers:
            raise ValueError("a cache manager needs at least one pool")
        if not any(isinstance(l, BlockManager) for l in ledgers.values()):
            raise ValueError("a model needs at least one paged pool (its K/V or latent rows)")
        order = sorted(ledgers, key=lambda n: isinstance(ledgers[n], WindowManager))
        if sum(isinstance(ledgers[n], WindowManager) for n in order) > 1:
            raise ValueError("at most one window pool per model: a second could not undo a failed decode step")
        self.ledgers = {n: ledgers[n] for n in order}
        self.paged = {n: l for n, l in self.ledgers.items() if isinstance(l, BlockManager)}
        self.state = next((l for l in self.ledgers.values() if isinstance(l, StateSlots)), None)
        self._only = next(iter(self.paged.items())) if len(self.ledgers) == 1 and self.paged else None

    # -- queries --------------------------------------------------------
    @property
    def main(self) -> BlockManager:
        """The first paged pool the model declares (its K/V): the one whose
        pages ``num_free`` and ``num_pages`` count."""
        return next(iter(self.paged.values()))

    @property
    def num_free(self) -> int:
        return self.main.num_free

    @property
    def num_pages(self) -> int:
        return self.main.num_pages

    @property
    def idle(self) -> bool:
        """Nothing is held in any pool."""
        return all(l.num_free == l.num_pages for l in self.ledgers.values())

    def __contains__(self, seq_id: Hashable) -> bool:
        return any(seq_id in l for l in self.ledgers.values())

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        return all(l.pages_needed(seq_id, n) <= l.num_free for l in self.ledgers.values())

    def can_admit(self, seq_id: Hashable, n: int, chunk: int) -> bool:
        """Whether a waiting sequence's ``n`` positions, prefilled in chunks of at most ``chunk``, fit what is
        free: every position in most pools, the window and two chunks in a window pool."""
        return all(l.admit_pages(seq_id, n, chunk) <= l.num_free for l in self.ledgers.values())

    def fits(self, wants) -> bool:
        """Whether every (seq_id, n) of ``wants`` can be appended together."""
        wants = list(wants)
        return all(sum(l.pages_needed(s, n) for s, n in wants) <= l.num_free for l in self.ledgers.values())

    def shortfall(self, seq_id: Hashable, n: int, chunk: int | None = None) -> str:
        """Which pool keeps ``append(seq_id, n)`` (with ``chunk``: its admission) from running, in words."""
        for name, l in self.ledgers.items():
            need = l.pages_needed(seq_id, n) if chunk is None else l.admit_pages(seq_id, n, chunk)
            if need > l.num_free:
                return f"{need} pages of the {name!r} cache and {l.num_free} of {l.num_pages} are free"
        return "nothing: it fits"

    def fits_alone(self, positions: int) -> str | None:
        """None if a sequence of ``positions`` cached positions fits the empty
        pools; else which pool it could never fit."""
        for name, l in self.ledgers.items():
            need = l.pages_for(positions)
            if need > l.num_pages:
                return f"{need} pages of the {name!r} cache ({positions} cached positions), which has {l.num_pages}"
        return None

    def table_view(self, pool: str, seq_id: Hashable) -> list[int]:
        return self.paged[pool].table_view(seq_id)

    def state_slot(self, seq_id: Hashable) -> int:
        return self.state.slot(seq_id)

    # -- updates --------------------------------------------------------
    def append(self, seq_id: Hashable, n: int) -> dict[str, list[int]]:
        """Grow ``seq_id`` by n positions in every pool (none if one has no
        room: OutOfPages) -> {paged pool: slots of the new positions}."""
        for name, l in self.ledgers.items():
            need = l.pages_needed(seq_id, n)
            if need > l.num_free:
                raise OutOfPages(f"sequence {seq_id!r} needs {need} more pages of the {name!r} cache, "
                                 f"{l.num_free} are free")
        out = {}
        for name, l in self.ledgers.items():
            slots = l.append(seq_id, n)
            if name in self.paged:
                out[name] = slots
        return out

    def append_one(self, seq_id: Hashable) -> dict[str, int] | None:
        """``append(seq_id, 1)`` for a sequence already here -> {paged pool:
        slot}, or None with nothing changed when a pool has no room."""
        if self._only is not None:
            name, l = self._only
            slot = l.append_one(seq_id)
            return None if slot is None else {name: slot}
        out, done = {}, []
        for name, l in self.ledgers.items():
            slot = l.append_one(seq_id)
            if slot is None:
                for d in reversed(done):
                    d.undo_one(seq_id)
                return None
            done.append(l)
            if name in self.paged:
                out[name] = slot
        return out

    def free(self, seq_id: Hashable) -> None:
        """Give back everything ``seq_id`` holds (a KeyError if it holds nothing)."""
        held = [l for l in self.ledgers.values() if seq_id in l]
        if not held:
            raise KeyError(f"sequence {seq_id!r} is not in the cache")
        for l in held:
            l.free(seq_id)
