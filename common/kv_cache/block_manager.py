"""Page bookkeeping for the paged caches (the model is nano-vllm's
``engine/block_manager.py``, without prefix caching yet).

A free list of pages, and per sequence a block table (page of each block of
64 rows) and a length in positions.  ``append`` grows a sequence by n
positions — a whole prompt, a prefill chunk or one decode token — taking pages
from the free list as block boundaries are crossed, and returns the slots its
new tokens' rows go to; the one writer (``write_kv``) then copies them there.
Which pages a sequence gets never changes a kernel's bits: block j is read
from ``block_table[j]``.

``BlockManager(rate=1)`` keeps a row per position (KV, latent caches);
``rate=r`` a row per r positions (compressed caches: position p completes row
(p + 1) / r - 1 when r divides p + 1, and the other positions get slot -1).
``WindowManager`` gives back the pages that slid out of an attention window.
``StateSlots`` hands out one fixed slot per running sequence (recurrent state).
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable, Sequence

import torch

from .._validate import check_int
from .op import PAGE_SIZE


class OutOfPages(RuntimeError):
    """Raised when a sequence needs more pages than are free."""


class BlockManager:
    def __init__(self, num_pages: int, *, page_size: int = PAGE_SIZE, shuffle_seed: int | None = None,
                 rate: int = 1, name: str = "kv"):
        """``shuffle_seed`` shuffles the initial free order (page placement
        must not matter; the tests use it); ``rate``: positions per row;
        ``name`` names the pool in errors."""
        check_int("num_pages", num_pages)
        if page_size != PAGE_SIZE:
            raise ValueError(f"page_size must be {PAGE_SIZE} (it is the attention kernels' KV block)")
        check_int("rate", rate, bound=">= 1 (positions per row)")
        self.num_pages = num_pages
        self.page_size = page_size
        self.rate = rate
        self.name = name
        pages = list(range(num_pages))
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(pages)
        self._free: deque[int] = deque(pages)
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # -- queries --------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._tables

    def length(self, seq_id: Hashable) -> int:
        return self._lens[self._known(seq_id)]

    def block_table(self, seq_id: Hashable) -> list[int]:
        return list(self._tables[self._known(seq_id)])

    def table_view(self, seq_id: Hashable) -> list[int]:
        """``block_table`` without the copy: the live list, to read before the next update."""
        return self._tables[self._known(seq_id)]

    def pages_needed(self, seq_id: Hashable, n: int) -> int:
        """Pages that ``append(seq_id, n)`` would take from the free list."""
        return self._pages_needed(self._tables.get(seq_id, ()), self._lens.get(seq_id, 0) + n)

    def pages_for(self, positions: int) -> int:
        """Pages a sequence of ``positions`` positions holds (at most)."""
        return -(-(positions // self.rate) // self.page_size)

    def _pages_needed(self, table, length: int) -> int:
        return -(-(length // self.rate) // self.page_size) - len(table)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        ps, r = self.page_size, self.rate
        if r == 1:
            return [table[p // ps] * ps + p % ps for p in range(start, end)]
        out = []
        for p in range(start, end):  # position p completes row (p + 1) / r - 1 when r divides p + 1
            row = (p + 1) // r - 1
            out.append(table[row // ps] * ps + row % ps if (p + 1) % r == 0 else -1)
        return out

    def admit_pages(self, seq_id: Hashable, n: int, chunk: int) -> int:
        """Pages a sequence takes to prefill ``n`` positions in chunks of at most ``chunk``: all of them."""
        return self.pages_needed(seq_id, n)

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        return self.pages_needed(seq_id, n) <= len(self._free)

    def slots(self, seq_id: Hashable, start: int, end: int) -> list[int]:
        """Slots (page * PAGE_SIZE + offset) of positions [start, end)."""
        table, n = self._tables[self._known(seq_id)], self._lens[seq_id]
        if not 0 <= start <= end <= n:
            raise ValueError(f"positions [{start}, {end}) are outside sequence {seq_id!r} of length {n}")
        return self._slots(table, start, end)

    # -- updates --------------------------------------------------------
    def add(self, seq_id: Hashable) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        self._tables[seq_id] = []
        self._lens[seq_id] = 0

    def append(self, seq_id: Hashable, n: int) -> list[int]:
        """Grow ``seq_id`` by n positions (adding it if new); return their
        slots (-1 for a position that completes no row)."""
        if n < 0:
            raise ValueError(f"cannot append {n} tokens")
        if seq_id not in self._tables:
            self.add(seq_id)
        table, start = self._tables[seq_id], self._lens[seq_id]
        need = self._pages_needed(table, start + n)
        if need > len(self._free):
            raise OutOfPages(f"sequence {seq_id!r} needs {need} more pages of the {self.name!r} cache, {len(self._free)} are free")
        for _ in range(need):
            table.append(self._free.popleft())
        self._lens[seq_id] = start + n
        slots = self._slots(table, start, start + n)  # slots() without its bounds check: [start, start + n) is new
        self._appended(seq_id, table, start)
        return slots

    def append_one(self, seq_id: Hashable) -> int | None:
        """``append(seq_id, 1)``'s slot for a sequence already here, or None
        (and nothing changed) when that needs a page and none is free, or the
        sequence is not here: a decode step's one call per sequence."""
        table = self._tables.get(seq_id)
        if table is None:
            return None
        n = self._lens[seq_id]
        if self.rate == 1:
            row = n
        elif (n + 1) % self.rate:
            self._lens[seq_id] = n + 1
            self._appended(seq_id, table, n)
            return -1
        else:
            row = n // self.rate
        off = row % self.page_size
        if not off:
            if not self._free:
                return None
            table.append(self._free.popleft())
        self._lens[seq_id] = n + 1
        self._appended(seq_id, table, n)
        return table[-1] * self.page_size + off

    def undo_one(self, seq_id: Hashable) -> None:
        """Take back the last ``append_one`` (its page, if it took one, goes
        back to the front of the free list): a manager over several pools
        undoes the pools that had room when a later one has none.  Every
        entry of the table is a page: only ``WindowManager`` writes -1, and
        it cannot undo."""
        table, n = self._tables[seq_id], self._lens[seq_id] - 1
        self._lens[seq_id] = n
        if len(table) > self._pages_needed((), n):
            self._free.appendleft(table.pop())

    def _appended(self, seq_id: Hashable, table: list[int], start: int) -> None:
        """After positions from ``start`` were appended (``WindowManager`` frees here)."""

    def free(self, seq_id: Hashable) -> None:
        """Return a finished sequence's pages to the free list."""
        for page in self._tables.pop(self._known(seq_id)):
            if page >= 0:
                self._free.append(page)
        del self._lens[seq_id]

    # -- tensors for the kernels ---------------------------------------
    def block_tables(self, seq_ids: Sequence[Hashable], *, width: int | None = None, device="cpu") -> torch.Tensor:
        """``(B, width)`` int32 block tables, rows padded with -1 (never read:
        the kernels visit only blocks below ``ceil(seq_len / PAGE_SIZE)``)."""
        tables = [self._tables[self._known(s)] for s in seq_ids]
        w = max((len(t) for t in tables), default=0) if width is None else width
        if any(len(t) > w for t in tables):
            raise ValueError(f"width {w} is smaller than a block table ({max(len(t) for t in tables)} pages)")
        out = torch.full((len(tables), max(w, 1)), -1, dtype=torch.int32)
        for i, t in enumerate(tables):
            out[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return out.to(device)

    def seq_lens(self, seq_ids: Sequence[Hashable], *, device="cpu") -> torch.Tensor:
        return torch.tensor([self._lens[self._known(s)] for s in seq_ids], dtype=torch.int32, device=device)

    def _known(self, seq_id: Hashable) -> Hashable:
        if seq_id not in self._tables:
            raise KeyError(f"sequence {seq_id!r} is not in the cache")
        return seq_id


class WindowManager(BlockManager):
    """Pages of a sliding-window cache: once a chunk starting at position s
    is appended, the pages wholly before s - window + 1 (the first key its
    first query reads) go back to the free list and their table entries
    become -1 (the attention kernels never read blocks before the window)."""

    def __init__(self, num_pages: int, window: int, **kw):
        check_int("window", window)
        super().__init__(num_pages, **kw)
        self.window = window
        self._released: dict[Hashable, int] = {}

    def pages_for(self, positions: int) -> int:
        """Pages a sequence holds after a decode step at ``positions`` (its
        window's blocks and the one being filled)."""
        return min(super().pages_for(positions), -(-(self.window - 1) // self.page_size) + 1)

    def admit_pages(self, seq_id: Hashable, n: int, chunk: int) -> int:
        """At most the pages of the window, the previous chunk (given back only after the next is appended)
        and the chunk being appended, and one for a page boundary: a prompt longer than the pool still runs."""
        most = -(-(self.window - 1 + 2 * chunk) // self.page_size) + 1
        return min(self.pages_needed(seq_id, n), most)

    def _appended(self, seq_id: Hashable, table: list[int], start: int) -> None:
        first = self._released.get(seq_id, 0)
        upto = max(0, (start - self.window + 1) // (self.page_size * self.rate))
        for b in range(first, upto):
            self._free.append(table[b])
            table[b] = -1
        if upto > first:
            self._released[seq_id] = upto

    def undo_one(self, seq_id: Hashable) -> None:
        raise NotImplementedError("a window pool cannot take back a step that gave pages back (the manager "
                                  "puts it last, so it never has to)")

    def free(self, seq_id: Hashable) -> None:
        self._released.pop(seq_id, None)
        super().free(seq_id)


class StateSlots:
    """One fixed slot per running sequence: taken on its first append, kept
    until it finishes or is preempted.  A sequence restarts from position 0
    after a preemption, whose prefill writes its state without reading it."""

    def __init__(self, num_slots: int, *, name: str = "state"):
        check_int("num_slots", num_slots)
        self.num_pages = num_slots  # the manager counts slots as a pool's pages
        self.name = name
        self._free: deque[int] = deque(range(num_slots))
        self._slot: dict[Hashable, int] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._slot

    def slot(self, seq_id: Hashable) -> int:
        if seq_id not in self._slot:
            raise KeyError(f"sequence {seq_id!r} holds no {self.name} slot")
        return self._slot[seq_id]

    def pages_needed(self, seq_id: Hashable, n: int) -> int:
        return 0 if seq_id in self._slot else 1

    def admit_pages(self, seq_id: Hashable, n: int, chunk: int) -> int:
        return self.pages_needed(seq_id, n)

    def pages_for(self, positions: int) -> int:
        return 1

    def can_append(self, seq_id: Hashable, n: int) -> bool:
        return seq_id in self._slot or bool(self._free)

    def append(self, seq_id: Hashable, n: int) -> list[int]:
        if seq_id not in self._slot:
            if not self._free:
                raise OutOfPages(f"sequence {seq_id!r} needs a {self.name} slot, none is free")
            self._slot[seq_id] = self._free.popleft()
        return []

    def append_one(self, seq_id: Hashable) -> int | None:
        return self._slot.get(seq_id)

    def undo_one(self, seq_id: Hashable) -> None:
        pass

    def free(self, seq_id: Hashable) -> None:
        self._free.append(self._slot.pop(seq_id))
