"""Continuous batching over a token budget (the model is nano-vllm's
``engine/scheduler.py``, with chunked prefill and one mixed batch per step).

Each step, running sequences go first, oldest first: a decoding one feeds its
last token, a half-prefilled one its next chunk.  Waiting sequences are then
admitted in FIFO order while the budget, the batch size and the free pages
allow, each feeding as much of its prompt as the budget leaves.  When a
running sequence needs a page and none is free, the newest running sequence
is preempted: its pages are freed and it goes back to the front of the
waiting queue, to be recomputed later by prefilling everything it has.

None of this can change a bit of a sequence's output: the model gives a row
the same bits whatever shares the batch or where a chunk starts, and the
sampler's draw depends only on (seed, tokens generated so far).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..kv_cache import CacheManager
from .sequence import Sequence, Status


@dataclass
class Chunk:
    """Positions [start, end) of ``seq`` fed this step, and their slots in
    each paged pool ({pool: one slot per position, -1 for none})."""

    seq: Sequence
    start: int
    end: int
    slots: dict[str, list[int]]


class Scheduler:
    def __init__(self, block_manager: CacheManager, max_batch_tokens: int, max_batch_size: int,
                 max_chunk: int | None = None):
        """``max_chunk`` caps one sequence's new tokens per step (None: only
        the step's ``max_batch_tokens`` does)."""
        self.block_manager = block_manager
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_chunk = max_chunk or max_batch_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.num_preemptions = 0

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def schedule(self) -> list[Chunk]:
        """Pick this step's chunks and give their positions pages."""
        bm, budget, chunks = self.block_manager, self.max_batch_tokens, []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_fed - seq.num_cached, budget, self.max_chunk)
            if n == 1:  # a decode row: one call when its page has room or one is free
                slot = bm.append_one(seq.id)
                if slot is not None:
                    chunks.append(Chunk(seq, seq.num_cached, seq.num_cached + 1, {p: [s] for p, s in slot.items()}))
                    budget -= 1
                    i += 1
                    continue
            fits = bm.can_append(seq.id, n)
            while not fits and self.running[-1] is not seq:
                self._preempt(self.running.pop())
                preempted = True
                fits = bm.can_append(seq.id, n)
            if not fits:  # seq is the newest: it waits itself
                self._preempt(self.running.pop())
                preempted = True
                break
            chunks.append(self._chunk(seq, n))
            budget -= n
            i += 1
        # Admitting right after a preemption would only preempt again.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            seq = self.waiting[0]
            if not bm.can_admit(seq.id, seq.num_fed, self.max_chunk):
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            n = min(seq.num_fed, budget, self.max_chunk)
            chunks.append(self._chunk(seq, n))
            budget -= n
        if not chunks and not self.idle:
            first = self.waiting[0]
            short = bm.shortfall(first.id, first.num_fed, self.max_chunk)
            raise RuntimeError(f"no request can run: the oldest waiting one needs {short} "
                               f"(other users of the cache hold the rest)")
        return chunks

    def retire(self, finished: list[Sequence]) -> None:
        """Free the pages of finished sequences and drop them from the batch."""
        for seq in finished:
            seq.status = Status.FINISHED
            self.block_manager.free(seq.id)
        self.running = [s for s in self.running if s.status is Status.RUNNING]

    def preempt_newest(self) -> bool:
        """Preempt the newest running sequence (recomputed later, same bits):
        how another user of the cache (``Engine.score``) makes room; False
        when nothing runs."""
        if not self.running:
            return False
        self._preempt(self.running.pop())
        return True

    def _chunk(self, seq: Sequence, n: int) -> Chunk:
        start = seq.num_cached
        return Chunk(seq, start, start + n, self.block_manager.append(seq.id, n))

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.id)
        seq.reset()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
