"""The serving engine: requests in, completions out (nano-vllm's ``LLMEngine``).

``step()`` is one scheduler decision, one model forward and one sampling
call.  Weights change only between steps (``between_steps``), and every token
records the weight version it was sampled under.

Overlap (``overlap=True``, the default; ``docs/DESIGN.md`` has the H200
figures): when a step is all decode rows that
continue (no prefill, no request waiting for a free slot in the batch, a page
for every next position), the engine launches the next step before it reads
this one's tokens: the next step's input ids are this step's sampled ids,
copied on the device.  The host's bookkeeping for step n (reading the ids,
appending, stop checks) then runs while the device computes step n + 1.  A
sequence that stops at step n rode along in step n + 1; that row is dropped,
and its cache slot, freed with the sequence, is written only before any later
step that could reuse the page (one stream orders them).  No bit changes: a
row's output does not depend on the batch, and the draw on (seed, step) only.
A step launched ahead completes under the weights it was launched with (its
tokens carry that version): ``between_steps`` functions, ``update_weights``
and ``score`` first wait for it and record its tokens.

A step that raises is run again one chunk at a time (same bits: the rows do
not depend on the batch, and a chunk rewrites the same cache slots); a
request whose chunk fails alone is dropped, its pages freed, and comes back
as a Completion with finish_reason "error".  One bad request never stops the
others, nor later steps.
"""
from __future__ import annotations

import atexit
import functools
import gc
import threading
from collections import deque
from collections.abc import Callable, Sequence as Seq

import torch
from tqdm.auto import tqdm

from .._host import cdiv
from .._validate import check_int
from ..kv_cache import PAGE_SIZE, CacheManager, PoolLimits
from ..kv_cache.pools import blocks_for_bytes, pool_bytes, pool_units
from ..sampling import SamplingParams
from .model_api import ServeModel
from .model_runner import Launched, ModelRunner
from .scheduler import Chunk, Scheduler
from .sequence import Completion, Sequence, Status, StopRule, adapter_position, check_token_ids, one_each

CPU_KV_CACHE_BYTES = 1 << 30
CUDA_KV_CACHE_FRACTION = 0.3  # of free memory after the model loaded; the rest: the trainer (it shares the GPU), activations, logits, graphs


@functools.cache
def _unfreeze_at_exit() -> None:
    atexit.register(gc.unfreeze)


def _freeze_gc() -> None:
    """``gc.freeze`` what the process holds now; unfrozen at exit, so the
    shutdown collection still frees it (native bindings count leaks)."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


class Engine:
    def __init__(
        self,
        model: ServeModel,
        *,
        num_pages: int | None = None,
        max_batch_tokens: int = 8192,
        max_batch_size: int = 256,
        cuda_graphs: bool | None = None,
        page_shuffle_seed: int | None = None,
        progress: bool = False,
        kv_cache_bytes: int | None = None,
        freeze_gc: bool = True,
        overlap: bool = True,
        eos_token_ids: Seq[int] = (),
        tokenizer=None,
    ):
        """``num_pages`` None sizes the KV cache from ``kv_cache_bytes`` (default:
        30% of free GPU memory, 1 GiB on the CPU), capped at what
        ``max_batch_size`` sequences of ``model.max_position`` tokens can use.
        ``cuda_graphs`` None captures decode graphs when the model is on CUDA.

        ``freeze_gc``: once built, move every object the process holds into
        Python's permanent GC generation (``gc.freeze``), so the collector's
        full passes stop walking the framework's ~170k objects.  Measured on
        this CPU at batch 256 (a stub forward, the engine's host work alone):
        a full pass every ~50 steps took ~63 ms, 1.3 of the 5.6 ms of host
        work per step; frozen, 4.4 ms.  Process-wide: cyclic garbage among
        objects alive now is never collected (reference counting still frees
        the rest).

        ``overlap``: launch a decode step before reading the previous one's
        tokens (the module docstring); False reads every step before the next.

        ``kv_cache_bytes``: an int of at least one page's bytes (a smaller
        cache could hold no request).

        ``eos_token_ids``: the model's EOS ids; every generated request stops
        at one of them (and at its own ``stop_token_ids``) unless its
        ``SamplingParams.ignore_eos``.  ``tokenizer``: what decodes a
        completion's tail for ``SamplingParams.stop`` strings (an object with
        ``decode(ids)`` and ``encode(text, add_special_tokens=False)``; a
        transformers tokenizer); None refuses stop strings.  ``load_pair``
        passes both from the checkpoint.  Stop rules end a completion; they
        never change a bit of it."""
        if not isinstance(model, ServeModel):
            raise TypeError(f"model must implement ServeModel (vocab_size, max_position, device, weights, "
                            f"cache_pools, forward); got {type(model).__name__}")
        for name, v in (("max_batch_tokens", max_batch_tokens), ("max_batch_size", max_batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        device = torch.device(model.device)
        if cuda_graphs is None:
            cuda_graphs = device.type == "cuda"
        if cuda_graphs and device.type != "cuda":
            raise ValueError(f"cuda_graphs=True needs a model on CUDA; this one is on {device}")
        self.model = model
        self.adapter_names = tuple(getattr(model, "adapter_names", ()))
        try:
            self.eos_token_ids = tuple(check_token_ids(eos_token_ids, model.vocab_size) if len(eos_token_ids) else ())
        except (TypeError, ValueError) as e:
            raise type(e)(f"eos_token_ids: {e}") from None
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.progress = progress
        pools = model.cache_pools()
        limits = PoolLimits(max_batch_size, max_batch_tokens)
        self.num_pages = self._num_pages(pools, limits, num_pages, kv_cache_bytes, device)
        self.pool_units = pool_units(pools, self.num_pages, limits)  # pages (slots) of each pool
        self.block_manager = CacheManager({n: p.ledger(self.pool_units[n], name=n, shuffle_seed=page_shuffle_seed)
                                           for n, p in pools.items()})
        self.scheduler = Scheduler(self.block_manager, max_batch_tokens, max_batch_size)
        self.runner = ModelRunner(model, pools, self.pool_units, self.block_manager, max_batch_size=max_batch_size,
                                  cuda_graphs=cuda_graphs)
        self.weight_version = 0
        self._score_preemptions = 0
        self._hooks: deque[Callable[[], None]] = deque()
        self._lock = threading.RLock()  # held through each step and score: weights never change inside one
        self._rejected: list[Completion] = []  # bad requests, handed out by the next step()
        self._unclaimed: list[Completion] = []  # finished inside generate() but added by add_request()
        self.overlap = overlap
        self._ahead: Launched | None = None  # a step launched before the previous one was read
        self._drained: list[Completion] = []  # finished when a step launched ahead was waited for outside step()
        if freeze_gc:
            _freeze_gc()

    # ------------------------------------------------------------ public
    @property
    def num_preemptions(self) -> int:
        """Requests (generated or scored) preempted for lack of pages so far."""
        return self.scheduler.num_preemptions + self._score_preemptions

    def set_weight_version(self, version: int) -> None:
        """Tokens sampled from now on carry ``version``.  Call it between steps."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise TypeError(f"weight version must be an int, got {type(version).__name__}")
        self.weight_version = version

    def between_steps(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once, before the next step (or score) touches the model,
        and return at once: the place to swap weights (in place: captured
        graphs keep their pointers) and call ``set_weight_version``.  Safe to
        call from another thread.  A step already launched ahead (overlap)
        is waited for first and keeps the version it was launched under."""
        self._hooks.append(fn)

    def update_weights(self, fn: Callable[[], None]) -> int:
        """Run ``fn`` (it writes the new weights into the model's tensors, in
        place) between two steps and bump the weight version; return the new
        version.  From another thread it waits for the running step to end,
        and for a step launched ahead (overlap)."""
        with self._lock:
            self._drain()
            fn()
            self.weight_version += 1
            return self.weight_version

    def add_request(self, prompt_token_ids, sampling: SamplingParams, adapter: str | None = None) -> int:
        """Queue a request; return its id.  ``adapter``: the name of a LoRA
        adapter of the model's ``adapter_names`` to serve it with (None: the
        base model).  A bad request is not queued: the next ``step()`` returns
        it as a Completion with finish_reason "error"."""
        try:
            prompt = self._check_request(prompt_token_ids, sampling)
            lora = self._adapter(adapter)
            stop = self.stop_rule(sampling)
        except (TypeError, ValueError) as e:
            rid = next(Sequence._ids)
            self._rejected.append(Completion(_as_list(prompt_token_ids), [], torch.empty(0), "error", str(e),
                                             request_id=rid, adapter=adapter if isinstance(adapter, str) else None))
            return rid
        seq = Sequence(prompt, sampling, adapter=lora, stop=stop)
        self.scheduler.add(seq)
        return seq.id

    def stop_rule(self, sampling: SamplingParams) -> StopRule:
        """Where a request with ``sampling`` stops besides its length: its
        ``stop_token_ids`` and the model's EOS ids (none with ``ignore_eos``),
        and its ``stop`` strings (ValueError without a tokenizer)."""
        ids = () if sampling.ignore_eos else (*sampling.stop_token_ids, *self.eos_token_ids)
        if not sampling.stop:
            return StopRule(ids)
        if self.tokenizer is None:
            raise ValueError("stop strings need the checkpoint's tokenizer; this engine has none "
                             "(stop on token ids with stop_token_ids)")
        tok = self.tokenizer
        window = max(len(tok.encode(s, add_special_tokens=False)) for s in sampling.stop) + 1
        return StopRule(ids, sampling.stop, tok.decode, window)

    def has_unfinished(self) -> bool:
        return not self.scheduler.idle or bool(self._rejected or self._unclaimed or self._drained)

    def step(self) -> list[Completion]:
        """One engine step; returns the requests that finished in it."""
        done, self._unclaimed = self._unclaimed, []
        return done + self._step()

    def generate(self, prompts: Seq[Seq[int]], sampling: SamplingParams | Seq[SamplingParams],
                 adapters: str | None | Seq[str | None] = None) -> list[Completion]:
        """Complete every prompt; Completions in prompt order.  ``sampling`` is
        one SamplingParams for all or a list with one per prompt; ``adapters``
        likewise one LoRA adapter name (None: the base model) or one per
        prompt, all served in the same batches."""
        sps = self._per_prompt(prompts, sampling, "prompts")
        loras = one_each(adapters, len(prompts), "prompts", "adapters")
        ids = [self.add_request(p, sp, a) for p, sp, a in zip(prompts, sps, loras)]
        index = {rid: i for i, rid in enumerate(ids)}
        out: list[Completion | None] = [None] * len(ids)
        with tqdm(total=len(ids), disable=not self.progress, desc="generate") as bar:
            todo = len(ids)
            while todo:
                for c in self._step():
                    i = index.get(c.request_id)
                    if i is None:
                        self._unclaimed.append(c)
                        continue
                    out[i] = c
                    todo -= 1
                    bar.update(1)
        return out

    def score(self, sequences: Seq[Seq[int]], prompt_lens: Seq[int],
              sampling: SamplingParams | Seq[SamplingParams], *, adapters: str | None | Seq[str | None] = None,
              chunk_tokens: int | None = None, return_extras: bool = False):
        """Teacher-forced log-probs: for each sequence, (len - prompt_len,) fp32
        CPU, the log-prob of ``sequence[prompt_len:]`` under the sampling
        transforms (and LoRA adapter: as ``generate``), bitwise what
        ``generate`` returned for the same tokens.

        The sequences prefill through the same forward, at most
        ``chunk_tokens`` new tokens per sequence and step (default: as the
        token budget allows; 1 makes every step decode-shaped), in the pages
        left free by running requests, and free them after; when none are
        free, running requests are preempted (recomputed later, same bits).
        Raises ValueError on bad input, naming the sequence (and one that needs
        more pages than the whole cache), and holds no pages after a failure.
        ``return_extras``: (log-probs, per sequence the model's per-token
        extras {name: (len - 1, ...)}) instead."""
        seqs = self._score_sequences(sequences, prompt_lens, sampling, adapters, chunk_tokens)
        with self._lock:
            self._drain()
            self._run_hooks()
            try:
                self._score(seqs, chunk_tokens)
            except Exception as e:
                i, err = self._score_culprit(seqs, chunk_tokens) if len(seqs) > 1 else (0, e)
                where, err = (f"sequence {i}: ", err) if i is not None else ("", e)
                raise ValueError(f"{where}scoring failed: {type(err).__name__}: {err}") from e
        lps = [torch.tensor(seq.logprobs, dtype=torch.float32) for seq in seqs]
        return (lps, [seq.gathered_extras() for seq in seqs]) if return_extras else lps

    # ------------------------------------------------------------ internals
    def _score(self, seqs: list[Sequence], chunk_tokens: int | None) -> None:
        sched = Scheduler(self.block_manager, self.max_batch_tokens, self.max_batch_size, chunk_tokens)
        for seq in seqs:
            if seq.tokens:
                sched.add(seq)
        try:
            while not sched.idle:
                if not sched.running:  # the oldest waits for pages only while generated requests hold them
                    first = sched.waiting[0]
                    while (not self.block_manager.can_admit(first.id, first.num_fed, sched.max_chunk)
                           and self.scheduler.preempt_newest()):
                        pass
                chunks = sched.schedule()
                with torch.inference_mode():
                    launched = self.runner.launch(chunks, self.block_manager)
                    results = launched.read()
                for i, (c, res) in enumerate(zip(chunks, results)):
                    c.seq.num_cached = c.end
                    c.seq.logprobs += [lp for _, lp in res]
                    if launched.extras:
                        c.seq.add_extras(launched.chunk_extras(i))
                sched.retire([c.seq for c in chunks if c.seq.num_cached == c.seq.num_fed])
        finally:  # a failed call must not keep pages
            for seq in sched.running:
                self.block_manager.free(seq.id)
            self._score_preemptions += sched.num_preemptions

    def _score_culprit(self, seqs: list[Sequence], chunk_tokens: int | None) -> tuple[int | None, Exception | None]:
        """(index, error) of the first sequence whose scoring fails alone; (None, None) if none does."""
        for i, s in enumerate(seqs):
            alone = Sequence(s.prompt, s.sampling, score_tokens=s.tokens,
                             adapter=None if s.adapter_name is None else (s.adapter_name, s.adapter_id))
            try:
                self._score([alone], chunk_tokens)
            except Exception as e:
                return i, e
        return None, None

    def _step(self) -> list[Completion]:
        with self._lock:
            if self._hooks:
                self._drain()
                self._run_hooks()
            done, self._rejected, self._drained = self._rejected + self._drained, [], []
            launched, self._ahead = self._ahead, None
            with torch.inference_mode():
                if launched is None:
                    if self.scheduler.idle:
                        return done
                    chunks = self.scheduler.schedule()
                    try:
                        launched = self.runner.launch(chunks, self.block_manager, version=self.weight_version)
                    except Exception as e:
                        return done + self._run_alone(chunks, e, self.weight_version)
                ahead = self._plan_ahead(launched)
                if ahead is not None:
                    nxt, ids, steps = ahead
                    try:
                        self._ahead = self.runner.launch(nxt, self.block_manager, tokens=ids, steps=steps,
                                                         version=self.weight_version)
                    except Exception as e:
                        # its chunks hold their slots: run them alone once this step's tokens are known
                        return done + self._finish(launched) + self._run_alone(nxt, e, self.weight_version)
                return done + self._finish(launched)

    def _finish(self, launched: Launched) -> list[Completion]:
        """Wait for a launched step and record its tokens; retire what
        finished.  A step whose read fails runs again chunk by chunk."""
        try:
            results = launched.read()
        except Exception as e:
            ahead, self._ahead = self._ahead, None  # launched from this step's device tokens: run it again too
            done = self._run_alone(launched.chunks, e, launched.version)
            return done + (self._run_alone(ahead.chunks, None, ahead.version) if ahead is not None else [])
        return self._record(launched, results)

    def _record(self, launched: Launched, results) -> list[Completion]:
        finished, version = [], launched.version
        for i, (c, res) in enumerate(zip(launched.chunks, results)):
            seq = c.seq
            if seq.status is Status.FINISHED:  # it stopped at the step before: this row rode along
                continue
            seq.num_cached = c.end
            if launched.extras:
                seq.add_extras(launched.chunk_extras(i))
            for tok, lp in res:
                seq.append(tok, lp, version)
            if seq.finish_reason is not None:
                finished.append(seq)
        self.scheduler.retire(finished)
        return [s.completion() for s in finished]

    def _run_alone(self, chunks: list[Chunk], error: Exception | None, version: int) -> list[Completion]:
        """A step (under weight ``version``) that raised ``error`` (None: its
        inputs were lost), its chunks holding their slots: run each chunk by
        itself, from the host's token ids, and drop the requests whose chunk
        fails alone.  The others' bits are those of the batched step."""
        chunks = [c for c in chunks if c.seq.status is Status.RUNNING]
        if len(chunks) == 1 and error is not None:  # alone already
            return [self._drop(chunks[0].seq, error)]
        done = []
        for c in chunks:
            try:
                alone = self.runner.launch([c], self.block_manager, version=version)
                results = alone.read()
            except Exception as e:
                done.append(self._drop(c.seq, e))
                continue
            done += self._record(alone, results)
        return done

    def _drop(self, seq: Sequence, error: Exception) -> Completion:
        """End a request whose step failed by itself: free its pages, report why."""
        seq.finish_reason = "error"
        seq.error = f"the request's step failed: {type(error).__name__}: {error}"
        self.scheduler.retire([seq])
        return seq.completion()

    def _drain(self) -> None:
        """Wait for a step launched ahead and record it (its finished requests
        are handed out by the next step)."""
        if self._ahead is not None:
            launched, self._ahead = self._ahead, None
            self._drained += self._finish(launched)

    def _plan_ahead(self, launched: Launched):
        """The step after ``launched``, to launch before it is read, when that
        step is fixed already: every chunk a drawn decode row of a running
        sequence, the whole batch (no request waiting for a free batch slot), a
        page for each next position.  Sequences whose token of ``launched`` is
        their last by length are left out; ones that stop on a stop token ride
        along.  -> (chunks, device token ids, sampler steps) or None."""
        sched, bm, chunks = self.scheduler, self.block_manager, launched.chunks
        if not self.overlap or self._hooks or not chunks or launched.tokens is None:
            return None
        if len(chunks) != len(sched.running) or (sched.waiting and len(sched.running) < sched.max_batch_size):
            return None
        if any(c.end - c.start != 1 or c.seq.teacher_forced or c.end != c.seq.num_tokens for c in chunks):
            return None
        keep = [i for i, c in enumerate(chunks) if len(c.seq.tokens) + 1 < c.seq.sampling.max_new_tokens]
        if not keep or not bm.fits((chunks[i].seq.id, 1) for i in keep):
            return None
        nxt = [Chunk(chunks[i].seq, chunks[i].end, chunks[i].end + 1, bm.append(chunks[i].seq.id, 1)) for i in keep]
        ids = launched.tokens if len(keep) == len(chunks) else \
            launched.tokens[torch.tensor(keep, dtype=torch.int64).to(launched.tokens.device, non_blocking=True)]
        return nxt, ids, [len(chunks[i].seq.tokens) + 1 for i in keep]

    def _score_sequences(self, sequences, prompt_lens, sampling, adapters, chunk_tokens) -> list[Sequence]:
        if chunk_tokens is not None and (not isinstance(chunk_tokens, int) or chunk_tokens < 1):
            raise ValueError(f"chunk_tokens must be an int >= 1 or None, got {chunk_tokens!r}")
        sps = self._per_prompt(sequences, sampling, "sequences")
        if len(prompt_lens) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(prompt_lens)} prompt_lens: give one per sequence")
        seqs = []
        loras = one_each(adapters, len(sequences), "sequences", "adapters")
        for i, (s, pl, sp, a) in enumerate(zip(sequences, prompt_lens, sps, loras)):
            try:
                s = check_token_ids(s, self.model.vocab_size, "sequence")
                if not isinstance(sp, SamplingParams):
                    raise TypeError(f"sampling must be a SamplingParams, got {type(sp).__name__}")
                if isinstance(pl, bool) or not isinstance(pl, int) or not 1 <= pl <= len(s):
                    raise ValueError(f"prompt_len {pl!r} must be an int in [1, {len(s)}] (the sequence length)")
                if len(s) > self.model.max_position:
                    raise ValueError(f"{len(s)} tokens exceed the model's max_position {self.model.max_position}")
                self._check_fits(len(s) - 1)
                lora = self._adapter(a)
            except (TypeError, ValueError) as e:
                raise type(e)(f"sequence {i}: {e}") from None
            seqs.append(Sequence(s[:pl], sp, score_tokens=s[pl:], adapter=lora))
        return seqs

    def _run_hooks(self) -> None:
        while self._hooks:
            self._hooks.popleft()()

    def _per_prompt(self, prompts, sampling, what: str) -> list:
        if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Seq):
            raise TypeError(f"{what} must be a list of token-id lists, got {type(prompts).__name__}")
        if prompts and all(isinstance(p, int) for p in prompts):
            raise TypeError(f"{what} must be a list of token-id lists; got a flat list of ints (wrap one prompt in a list)")
        return one_each(sampling, len(prompts), what, "SamplingParams")

    def _adapter(self, name) -> tuple[str, int] | None:
        """(name, index into ``adapter_names``) of a requested LoRA adapter; None: the base model."""
        if name is None:
            return None
        return name, adapter_position(name, self.adapter_names, "the model serves")

    def _check_request(self, prompt, sampling) -> list[int]:
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = check_token_ids(prompt, self.model.vocab_size)
        unknown = [x for x in sampling.extras if x not in self.runner.on_request_extras]
        if unknown:
            have = ", ".join(sorted(self.runner.on_request_extras)) or "none"
            raise ValueError(f"extras {unknown}: not an on-request extra of this model (it has: {have})")
        total = len(prompt) + sampling.max_new_tokens
        if total > self.model.max_position:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
                             f"exceeds the model's max_position {self.model.max_position}")
        self._check_fits(total - 1)  # the last sampled token is never fed back
        return prompt

    def _check_fits(self, positions: int) -> None:
        short = self.block_manager.fits_alone(positions)
        if short is not None:
            raise ValueError(f"the request needs {short}: it could never run, even alone")

    def _num_pages(self, pools, limits: PoolLimits, num_pages, kv_cache_bytes, device) -> int:
        """64-position blocks the pools hold (``num_pages``, else what
        ``kv_cache_bytes`` buys), capped at what max_batch_size sequences of
        max_position positions could use."""
        if num_pages is not None:
            check_int("num_pages", num_pages)
            return num_pages
        least = pool_bytes(pools, pool_units(pools, 1, limits))
        if kv_cache_bytes is None:
            if device.type == "cuda":
                kv_cache_bytes = max(least, int(torch.cuda.mem_get_info(device)[0] * CUDA_KV_CACHE_FRACTION))
            else:
                kv_cache_bytes = CPU_KV_CACHE_BYTES
        else:
            check_int("kv_cache_bytes", kv_cache_bytes, least,
                      bound=f"of at least one page of every cache pool ({least} bytes for this model)")
        most = self.max_batch_size * cdiv(self.model.max_position, PAGE_SIZE)
        return blocks_for_bytes(pools, kv_cache_bytes, limits, most)


def _as_list(ids) -> list:
    try:
        return list(ids.tolist() if isinstance(ids, torch.Tensor) else ids)
    except TypeError:
        return []
