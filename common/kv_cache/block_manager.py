"""Page bookkeeping for the paged KV cache (the model is nano-vllm's
``engine/block_manager.py``, without prefix caching yet).

A free list of pages, and per sequence a block table (page of each 64-token
block) and a length.  ``append`` grows a sequence by n tokens — a whole prompt,
a prefill chunk or one decode token — taking pages from the free list as block
boundaries are crossed, and returns the slots its new tokens go to; the one
writer (``write_kv``) then copies k/v there.  Which pages a sequence gets never
changes attention's bits: the kernels read block j from ``block_table[j]``.
"""
from __future__ import annotations

import random
from collections import deque
from collections.abc import Hashable, Sequence

import torch

from .op import PAGE_SIZE


class OutOfPages(RuntimeError):
    """Raised when a sequence needs more pages than are free."""


class BlockManager:
    def __init__(self, num_pages: int, *, page_size: int = PAGE_SIZE, shuffle_seed: int | None = None):
        """``shuffle_seed`` shuffles the initial free order (page placement
        must not matter; the tests use it)."""
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size != PAGE_SIZE:
            raise ValueError(f"page_size must be {PAGE_SIZE} (it is the attention kernels' KV block)")
        self.num_pages = num_pages
        self.page_size = page_size
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

    def _pages_needed(self, table, length: int) -> int:
        return -(-length // self.page_size) - len(table)

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        ps = self.page_size
        return [table[p // ps] * ps + p % ps for p in range(start, end)]

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
        """Grow ``seq_id`` by n positions (adding it if new); return their slots."""
        if n < 0:
            raise ValueError(f"cannot append {n} tokens")
        if seq_id not in self._tables:
            self.add(seq_id)
        table, start = self._tables[seq_id], self._lens[seq_id]
        need = self._pages_needed(table, start + n)
        if need > len(self._free):
            raise OutOfPages(f"sequence {seq_id!r} needs {need} more KV pages, {len(self._free)} are free")
        for _ in range(need):
            table.append(self._free.popleft())
        self._lens[seq_id] = start + n
        return self._slots(table, start, start + n)  # slots() without its bounds check: [start, start + n) is new

    def append_one(self, seq_id: Hashable) -> int | None:
        """``append(seq_id, 1)``'s slot for a sequence already here, or None
        (and nothing changed) when that needs a page and none is free, or the
        sequence is not here: a decode step's one call per sequence."""
        table = self._tables.get(seq_id)
        if table is None:
            return None
        n = self._lens[seq_id]
        off = n % self.page_size
        if not off:
            if not self._free:
                return None
            table.append(self._free.popleft())
        self._lens[seq_id] = n + 1
        return table[-1] * self.page_size + off

    def free(self, seq_id: Hashable) -> None:
        """Return a finished sequence's pages to the free list."""
        for page in self._tables.pop(self._known(seq_id)):
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
