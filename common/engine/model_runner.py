"""Chunks -> one packed ``ForwardBatch`` -> the model -> sampled or scored rows.

Decode-shaped batches (one new token per sequence, a logit row each) replay a
CUDA graph captured for the next bucket size up; everything else runs eager.
Both give the same bits: the model's rows do not depend on the batch, so pad
rows and the wider fixed block table cannot change the real rows.  Small
decode buckets also replay their sampler (``SampleGraphs``): at batch 1 the
sampler's host work (a dozen torch ops, two Triton launches) took longer
than its kernels.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ..kv_cache import CacheManager
from ..matmul import graph_launches
from ..sampling import head_width, params_to_tensors, sample_fwd, sampling_logprobs_fwd
from ..sampling.op import uncut_rows
from .model_api import (ForwardBatch, HostLists, ServeModel, batch_tensors, field_spec, first_rows, from_tensors,
                        static_decode_batch)
from .scheduler import Chunk

GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SAMPLE_GRAPH_MAX_BATCH = 16  # buckets whose sampler is a graph too (above: the sort dominates; its buffers are big)
_SAMPLE_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed", "step")
log = logging.getLogger("alignzoo.engine")


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Buckets up to ``max_batch_size``, which is always the last one."""
    return [b for b in GRAPH_BATCH_SIZES if b < max_batch_size] + [max_batch_size]


@dataclass
class DecodeGraphs:
    """Captured decode forwards: ``graphs[bs]`` reads ``static`` sliced to bs
    rows and writes ``logits[bs]`` (bs, V) and ``extras[bs]`` ({name: (bs, ...)}).
    ``inputs[bs]``: {batch path: tensor} of those bs rows, views of ``static``
    made once (a replay copies a step's rows into them)."""

    static: ForwardBatch
    graphs: dict[int, torch.cuda.CUDAGraph]
    logits: dict[int, torch.Tensor]
    extras: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    inputs: dict[int, dict[str, torch.Tensor]] = field(init=False, default_factory=dict)

    def __post_init__(self):
        if self.static is not None:  # None: a stand-in holding only the logits (tests of SampleGraphs)
            self.inputs = {bs: batch_tensors(first_rows(self.static, bs)) for bs in self.graphs}

    def bucket(self, n: int) -> int | None:
        return next((b for b in self.graphs if b >= n), None)


def split_output(out) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A model's forward output -> (logits, extras)."""
    return (out[0], dict(out[1])) if isinstance(out, tuple) else (out, {})


def capture_decode_graphs(model: ServeModel, caches, batch_sizes: list[int], widths: dict[str, int]) -> DecodeGraphs:
    """Capture ``model.forward`` for decode batches of each size, reading the
    static pad rows until a replay copies real rows in.  Largest first, so the
    memory pool the first capture sizes serves the smaller ones; replays run
    one at a time, which makes sharing it safe."""
    static = static_decode_batch(max(batch_sizes), widths, model.device)
    graphs, logits, extras, pool = {}, {}, {}, None
    for bs in sorted(batch_sizes, reverse=True):
        t0 = time.perf_counter()
        batch = first_rows(static, bs)
        with graph_launches():  # the matmuls may run the Gluon kernel: only device time replays
            model.forward(batch, caches)  # warm-up: Triton compiles and picks configs outside the capture
            torch.cuda.synchronize(model.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits[bs], extras[bs] = split_output(model.forward(batch, caches))
        pool = graph.pool() if pool is None else pool
        graphs[bs] = graph
        log.info("captured the decode graph for batch %d in %.1fs", bs, time.perf_counter() - t0)
    torch.cuda.synchronize(model.device)
    return DecodeGraphs(static, dict(sorted(graphs.items())), logits, extras)


def _draw_params(seqs: list, V: int, steps: list[int] | None = None) -> tuple[dict, int]:
    """Host tensors of the draw's parameters (``params_to_tensors``: each
    sequence's sampling and step, or ``steps`` for a step launched before the
    previous one's tokens were appended) and their ``head_width`` (host: no sync)."""
    params = params_to_tensors([s.sampling for s in seqs], [s.step for s in seqs] if steps is None else steps)
    return params, head_width(params["temperature"], params["top_k"], V)


@dataclass
class Launched:
    """A step whose forward and sampling are enqueued on the device.

    ``tokens`` (R,) int64 on the device: each logit row's token (drawn, or
    the given one of a scored row), in row order; it may be a sampler graph's
    output, so it is valid as an input only until the next step's sampler
    runs (a copy enqueued before that reads it in stream order).  ``read``
    waits for the step's host copies and returns, per chunk, the (token,
    log-prob) of each of its logit rows."""

    chunks: list[Chunk]
    rows: list[int]  # the chunk of each logit row
    tokens: torch.Tensor | None
    version: int
    host: tuple[torch.Tensor, torch.Tensor] | None
    event: torch.cuda.Event | None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # host copies, (T, ...) each
    cu: list[int] = field(default_factory=list)  # each chunk's first token row, then T
    on_request: frozenset[str] = frozenset()  # the model's on-request extras (``ServeModel.on_request_extras``)

    def read(self) -> list[list[tuple[int, float]]]:
        if self.event is not None:
            self.event.synchronize()
        results: list[list[tuple[int, float]]] = [[] for _ in self.chunks]
        if self.rows:
            for i, tok, lp in zip(self.rows, self.host[0].tolist(), self.host[1].tolist()):
                results[i].append((tok, lp))
        return results

    def chunk_extras(self, i: int) -> dict[str, torch.Tensor]:
        """Chunk i's rows of the per-token extras (after ``read``): the model's always-on ones, and the
        on-request ones its sequence asked for (another sequence of the step may have)."""
        asked = self.chunks[i].seq.sampling.extras
        return {n: t[self.cu[i]:self.cu[i + 1]] for n, t in self.extras.items()
                if n not in self.on_request or n in asked}


class SampleGraphs:
    """``sample_fwd`` on a decode graph's logits, captured per (bucket, head
    class) on first use and replayed right after the decode graph.

    ``stage`` copies a step's parameters in (pinned host buffers, async)
    before the decode graph is launched, and ``replay`` runs the sampler
    right after it: no host work and no pageable copy (which would wait for
    the forward) sits between the two graphs.  The head class is the batch's
    ``head_width`` rounded up to 64, 1024 or V (``HEAD_CLASSES``: at most
    three captures per bucket): bit-neutral, since ``head`` only bounds the
    sorted positions formed and every row reads positions < its own k' (the
    head path equals the full sort, ``tests/test_sampling.py``).  Pad rows
    are reset to greedy (k' = 1) at every step, so the class computed from
    the real rows covers them too (a pad row left with an earlier step's
    top_k = 0 would read past a narrow head); their tokens are dropped.  One
    memory pool serves every sampler graph: they replay one at a time, and
    their outputs are read before the next replay."""

    def __init__(self, decode: DecodeGraphs, max_batch: int):
        self.decode = decode
        self.buckets = [b for b in decode.graphs if b <= max_batch]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.params: dict[int, dict[str, torch.Tensor]] = {}
        self._pool = None

    HEAD_CLASSES = (64, 1024)  # then V
    _PAD = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 0, "step": 0}  # greedy: k' = 1

    @classmethod
    def head_class(cls, head: int, V: int) -> int:
        """The sorted-head width a batch of head width ``head`` (>= 1) is sampled with."""
        if head < 1:
            raise ValueError(f"head must be >= 1, got {head}")
        return min(next((c for c in cls.HEAD_CLASSES if head <= c), V), V)

    def stage(self, bs: int, host: dict, head: int) -> tuple[int, int]:
        """Copy ``params_to_tensors`` of the step's B <= bs rows (CPU) into
        bucket bs's sampler inputs; -> the key ``replay`` takes."""
        logits = self.decode.logits[bs]
        if bs not in self.params:
            self.params[bs] = {k: torch.full((bs,), v, dtype=host[k].dtype, device=logits.device)
                               for k, v in self._PAD.items()}
        B = host["temperature"].shape[0]
        for k in _SAMPLE_KEYS:
            # a fresh pinned buffer per step: with overlap, the previous step's copy may still be queued
            # behind its forward, and refilling a buffer it reads from would hand it this step's params
            staging = torch.full((bs,), self._PAD[k], dtype=host[k].dtype, pin_memory=logits.is_cuda)
            staging[:B].copy_(host[k])
            self.params[bs][k].copy_(staging, non_blocking=True)
        return bs, self.head_class(head, logits.shape[1])

    def replay(self, key: tuple[int, int], B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (tokens, logprobs) of the staged step's B rows, device tensors."""
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, tok, lp = self.graphs[key]
        graph.replay()
        return tok[:B], lp[:B]

    def run(self, bs: int, host: dict, head: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.replay(self.stage(bs, host, head), host["temperature"].shape[0])

    def _capture(self, bs: int, head: int):
        t0 = time.perf_counter()
        logits, params = self.decode.logits[bs], self.params[bs]
        sample_fwd(logits, **params, head=head)  # warm-up: Triton compiles outside the capture
        torch.cuda.synchronize(logits.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            tok, lp = sample_fwd(logits, **params, head=head)
        self._pool = graph.pool() if self._pool is None else self._pool
        log.info("captured the sampler for batch %d, head %d in %.1fs", bs, head, time.perf_counter() - t0)
        return graph, tok, lp


class ModelRunner:
    """Allocates the model's cache pools (``pools``: its ``cache_pools()``;
    ``units``: pages or slots of each; ``cache``: the engine's manager of
    them, which knows the paged ones and the state pool) and runs steps: one
    packed batch per step, eager or replayed from the decode graph of the
    next bucket up."""

    def __init__(self, model: ServeModel, pools: dict, units: dict[str, int], cache: CacheManager, *,
                 max_batch_size: int, cuda_graphs: bool):
        self.model = model
        self.on_request_extras = frozenset(getattr(model, "on_request_extras", ()))
        self.device = torch.device(model.device)
        self.pools = pools
        self.caches = {n: p.allocate(units[n], self.device) for n, p in pools.items()}
        self.paged = [n for n in pools if n in cache.paged]  # in the model's order (the manager puts a window last)
        self.has_state = cache.state is not None
        self._pin = self.device.type == "cuda"
        self.graph_widths = {n: self.pools[n].graph_width(model.max_position) for n in self.paged}
        self.graphs: DecodeGraphs | None = None
        self.sample_graphs: SampleGraphs | None = None
        if cuda_graphs:
            with torch.inference_mode():
                self.graphs = capture_decode_graphs(model, self.caches, graph_batch_sizes(max_batch_size),
                                                    self.graph_widths)
            self.sample_graphs = SampleGraphs(self.graphs, SAMPLE_GRAPH_MAX_BATCH)

    def run(self, chunks: list[Chunk], cache: CacheManager) -> list[list[tuple[int, float]]]:
        """Forward the chunks as one batch; per chunk, the (token, log-prob)
        of each logit row: the sampled token of a generated sequence, or the
        given next token of a teacher-forced one."""
        return self.launch(chunks, cache).read()

    def launch(self, chunks: list[Chunk], cache: CacheManager, *, tokens: torch.Tensor | None = None,
               steps: list[int] | None = None, version: int = 0) -> Launched:
        """``run`` without the wait: enqueue the forward, the sampling and the
        copies of the sampled rows (and per-token extras) to the host.
        ``tokens`` (one per chunk, on the device) and ``steps`` (the sampler
        step of each chunk's sequence) stand in for a decode step's inputs
        that the host does not know yet: the tokens the previous step is still
        drawing (``Launched.tokens``)."""
        toks, positions, seq_lens, cu, rows, wanted, adapters, states = [], [], [], [0], [], [], [], []
        slots = {n: [] for n in self.paged}
        for i, c in enumerate(chunks):
            seq = c.seq
            if tokens is None:
                toks += seq.token_ids(c.start, c.end)
            positions += range(c.start, c.end)
            for n in self.paged:
                slots[n] += c.slots[n]
            adapters += [seq.adapter_id] * (c.end - c.start)
            states.append(cache.state_slot(seq.id) if self.has_state else -1)
            # a chunk ahead of its own last token (device ids) wants its one row: the host does not know that token yet
            for p in (seq.logit_positions(c.start, c.end) if tokens is None else (c.end - 1,)):
                rows.append(cu[-1] + p - c.start)
                wanted.append((i, p))
            cu.append(cu[-1] + c.end - c.start)
            seq_lens.append(c.end)
        if tokens is not None and not (len(tokens) == len(positions) == len(chunks)):
            raise ValueError(f"device tokens stand in for one token per chunk: {len(tokens)} tokens, "
                             f"{len(positions)} positions, {len(chunks)} chunks")
        tables = {n: [cache.table_view(n, c.seq.id) for c in chunks] for n in self.paged}
        host = {"tokens": toks if tokens is None else tokens, "positions": positions, "seq_lens": seq_lens,
                "adapter_ids": adapters, "state_slots": states}
        for n in self.paged:
            host[f"pools.{n}.slot_mapping"] = slots[n]
        B = len(chunks)
        want = frozenset(x for c in chunks for x in c.seq.sampling.extras)  # on-request extras: an eager step
        bucket = (self.graphs.bucket(B) if self.graphs is not None and len(positions) == len(rows) == B and not want
                  else None)
        staged = None
        if bucket is not None:
            staged = self._stage_sampler(bucket, [c.seq for c in chunks], steps)  # before the forward is launched
            for n in self.paged:
                host[f"pools.{n}.block_table"] = self._table(n, tables[n], bucket, self.graph_widths[n])
            logits, extras = self._replay(bucket, host)
            logits, extras = logits[:B], {k: v[:B] for k, v in extras.items()}
        else:
            # a step of prefill chunks only still asks for one row: no model meets R = 0
            host |= {"cu_seqlens_q": cu, "logit_rows": rows or [len(positions) - 1]}
            longest_chunk = max(c.end - c.start for c in chunks)
            for n in self.paged:  # at least one page wide: a rate pool's tables are empty until a row completes
                width = max([1, *map(len, tables[n])])
                if getattr(self.pools[n], "ring", False):
                    width = min(width, self.pools[n].ring_width(longest_chunk))
                host[f"pools.{n}.block_table"] = self._table(n, tables[n], B, width)
            batch = from_tensors({p: self._to_device(v, field_spec(p)[0]) for p, v in host.items()},
                                 max(b - a for a, b in zip(cu, cu[1:])))
            batch.host = HostLists(cu, [c.start for c in chunks], states)
            batch.want_extras = want
            logits, extras = split_output(self.model.forward(batch, self.caches))  # (R, V) fp32
        extras_host = {k: self._to_host(v) for k, v in extras.items()}
        if not rows:
            return Launched(chunks, [], None, version, None, self._event(), extras_host, cu, self.on_request_extras)
        tok, lp = self._sample(logits, [(chunks[i].seq, p, i) for i, p in wanted], staged, steps)
        return Launched(chunks, [i for i, _ in wanted], tok, version, (self._to_host(tok), self._to_host(lp)),
                        self._event(), extras_host, cu, self.on_request_extras)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=self._pin)
        out.copy_(t, non_blocking=self._pin)
        return out

    def _event(self) -> torch.cuda.Event | None:
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _stage_sampler(self, bucket: int, seqs: list, steps: list[int] | None = None) -> tuple[int, int] | None:
        """A decode step whose rows are all drawn, in a bucket with a sampler
        graph: stage its parameters (before the decode graph is launched, so
        nothing but the sampler graph follows it)."""
        if self.sample_graphs is None or bucket not in self.sample_graphs.buckets or \
                any(s.teacher_forced for s in seqs):
            return None
        return self.sample_graphs.stage(bucket, *_draw_params(seqs, self.graphs.logits[bucket].shape[1], steps))

    def _sample(self, logits: torch.Tensor, wanted: list, staged: tuple | None = None,
                steps: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per logit row (its sequence, its position, its chunk): draw a
        generated sequence's next token, or replay a teacher-forced one's given
        next token (the same program, so the same bits for the same row).
        ``staged``: the rows' sampler graph, parameters already in.  ->
        (tokens int64, log-probs fp32), (R,) each, on the device."""
        R = len(wanted)
        gen = [r for r, (s, _, _) in enumerate(wanted) if not s.teacher_forced]
        forced = [r for r, (s, _, _) in enumerate(wanted) if s.teacher_forced]
        tok = lp = None
        if gen:
            if staged is not None:  # every row is drawn
                tok, lp = self.sample_graphs.replay(staged, R)
            else:
                params, head = _draw_params([wanted[r][0] for r in gen], logits.shape[1],
                                            None if steps is None else [steps[wanted[r][2]] for r in gen])
                params = {k: v.to(self.device, non_blocking=True) for k, v in params.items()}
                lg = logits if len(gen) == R else logits[self._to_device(gen, torch.int64)]
                tok, lp = sample_fwd(lg, **params, head=head)
            if not forced:
                return tok, lp
        tok_all = torch.empty(R, dtype=torch.int64, device=logits.device)
        lp_all = torch.empty(R, dtype=torch.float32, device=logits.device)
        if gen:
            at = self._to_device(gen, torch.int64)
            tok_all[at], lp_all[at] = tok, lp
        targets = [s.token_ids(p + 1, p + 2)[0] for s, p, _ in (wanted[r] for r in forced)]
        params = params_to_tensors([wanted[r][0].sampling for r in forced], [0] * len(forced))
        head = head_width(params["temperature"], params["top_k"], logits.shape[1])  # host tensors: no sync
        uncut = uncut_rows(params["temperature"], params["top_k"], params["top_p"], params["min_p"], logits.shape[1])
        params = {k: params[k].to(self.device, non_blocking=True) for k in ("temperature", "top_k", "top_p", "min_p")}
        lg = logits if len(forced) == R else logits[self._to_device(forced, torch.int64)]
        at, given = self._to_device(forced, torch.int64), self._to_device(targets, torch.int64)
        tok_all[at] = given
        lp_all[at] = sampling_logprobs_fwd(lg, given, **params, head=head, uncut=uncut)[0]
        return tok_all, lp_all

    def _to_device(self, data, dtype: torch.dtype) -> torch.Tensor:
        """A host list or tensor (or a device tensor, as is) on the model's device."""
        if isinstance(data, torch.Tensor):
            return data.to(self.device, non_blocking=True)
        return torch.tensor(data, dtype=dtype, pin_memory=self._pin).to(self.device, non_blocking=True)

    def _table(self, pool: str, tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
        return (ring_table if getattr(self.pools[pool], "ring", False) else self._block_table)(tables, rows, width)

    def _block_table(self, tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
        """(rows, width) int32 host tensor, zero past each table and in pad rows.
        Python pads the tables only to the longest one and the rest of the width
        (a graph's is max_position / 64: 640 at 40960 positions) is one fill:
        padding each row in Python cost 25x more at 256 rows of 10 pages."""
        out = torch.empty(rows, width, dtype=torch.int32, pin_memory=self._pin).fill_(0)  # torch.zeros: 5 ms at 256 x 640 here
        longest = max(map(len, tables), default=0)
        if longest:
            flat, zeros = [], [0] * longest
            for t in tables:
                flat += t
                flat += zeros[len(t):]
            out[:len(tables), :longest] = torch.tensor(flat, dtype=torch.int32).view(len(tables), longest)
        return out

    def _replay(self, bs: int, host: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Copy a decode step's rows (``host``: {batch path: host list or
        (bs, W) table; "tokens" may be the real rows' ids on the device}) into
        bucket bs's static inputs, pad rows with each field's pad value, and
        replay.  -> (logits, extras) of the bucket's bs rows."""
        static = self.graphs.inputs[bs]
        for path, data in host.items():
            dst = static[path]
            if isinstance(data, torch.Tensor) and data.device.type != "cpu":  # device ids of the real rows
                dst[:len(data)].copy_(data)
                dst[len(data):].fill_(field_spec(path)[1])
                continue
            if not isinstance(data, torch.Tensor):
                data = torch.tensor(data + [field_spec(path)[1]] * (bs - len(data)), dtype=dst.dtype,
                                    pin_memory=self._pin)
            dst.copy_(data, non_blocking=True)
        self.graphs.graphs[bs].replay()
        return self.graphs.logits[bs], self.graphs.extras.get(bs, {})


def ring_table(tables: list[list[int]], rows: int, width: int) -> torch.Tensor:
    """A window pool's ring block table (``WindowPool.ring``): (rows, width) int32, block b of a sequence in
    column b % width.  Only a sequence's last ``width`` blocks are placed (a step reads no older one), so an
    older block never overwrites a live one; given-back blocks (-1) and pad rows read page 0, masked by the
    model as past its window."""
    out = torch.zeros(rows, width, dtype=torch.int32)
    for i, t in enumerate(tables):
        for b in range(max(0, len(t) - width), len(t)):
            if t[b] >= 0:
                out[i, b % width] = t[b]
    return out
