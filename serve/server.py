"""The aligned engine behind SGLang's RL HTTP API, on FastAPI + uvicorn.

One thread owns the engine (``EngineLoop``): it admits requests, steps the engine, streams tokens and
applies weight updates between steps.  HTTP handlers run on uvicorn's event loop and reach it only
through a thread-safe inbox and futures, so no handler ever touches the engine.

Weight updates (disk, tensor, distributed) all become one ``alignzoo.sync.Payload`` applied by one
``Receiver``: every check (versions, names, shapes, dtypes, checksums, NaN/Inf, the end state) runs
before a byte is written, so a refused update leaves the weights and the version as they were.  An
update closes admission, lets the requests in flight finish on the version they started with (or
aborts them: ``abort_all_requests``), applies, and opens admission again: every token of a
completion carries one weight version.

The process holds the model's trainer as well as the engine (one more copy of the weights): disk
updates are read through the model's name map into it and published from it, FP8 codes included.
They read only under the directories the operator allowed (``--weights-dir``).

With the checkpoint's tokenizer the server takes text (``/generate``'s ``text``) and speaks the
OpenAI-compatible API (``openai.py``); without one it serves token ids.  With an API key every
route needs ``Authorization: Bearer <key>`` (``ApiKeys``); an admin key, if given, is the only one
that opens the weight-update and control routes.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import hmac
import ipaddress
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from datetime import timedelta

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse as _JSONResponse
from fastapi.responses import Response, StreamingResponse

from ..common.engine.sequence import Completion, Status
from ..common.sampling import SamplingParams
from ..sync import (CorruptPayload, DistTransport, Publisher, Receiver, SyncError, VersionSkew, apply_between_steps,
                    weights_checksum)
from ..sync.payload import FORMAT
from . import ADMIN_ROUTES, api, jsonio, openai, wire
from .api import ApiError, Item

log = logging.getLogger("alignzoo.serve")


class JSONResponse(_JSONResponse):
    """Starlette's JSON answer written by ``jsonio`` (orjson where installed: the /generate hot path)."""

    def render(self, content) -> bytes:
        return jsonio.dumps(content)


# ------------------------------------------------------------------ the engine's thread
class Job:
    """One /generate call: its items and the asyncio queue its handler reads events from."""

    def __init__(self, items: list[Item], stream: bool, aloop: asyncio.AbstractEventLoop):
        self.items, self.stream, self.aloop = items, stream, aloop
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = time.perf_counter()

    def emit(self, event: tuple) -> None:
        """From the engine's thread: ("chunk", item, tokens, logprobs, version) or ("done", item, Completion, version)."""
        try:
            self.aloop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop closed (shutdown): nobody is waiting any more
            pass


@dataclasses.dataclass
class _Update:
    apply: object  # () -> new weight version, run in the engine's thread with nothing in flight
    abort_all: bool
    future: concurrent.futures.Future


class EngineLoop:
    """Owns ``engine`` in one thread.  Thread-safe entry points: ``submit``, ``call``, ``update``,
    ``reserve``, ``stop``; everything else runs in the engine's thread."""

    def __init__(self, engine, lockstep=None):
        self.engine = engine
        # --tp > 1: every engine change is recorded and sent to the other ranks before the step that
        # needs it, so they run the same steps and the collectives inside the forward line up (tp_launch.py)
        self.lockstep = lockstep
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._pending: deque[tuple[Job, Item]] = deque()  # accepted, not yet added to the engine
        self._inflight: dict[int, tuple[Job, Item]] = {}  # engine request id ->
        self._streams: dict[int, tuple[Job, Item]] = {}
        self._by_rid: dict[str, tuple[Job, Item]] = {}  # pending and in flight
        self._updates: deque[_Update] = deque()
        self._rids: set[str] = set()
        self._rid_lock = threading.Lock()
        self.paused: str | None = None  # the pause mode, None when generating
        self._stopping = False
        self.thread = threading.Thread(target=self._run, name="alignzoo-engine", daemon=True)

    # ---------------------------------------------------------- any thread
    def start(self) -> None:
        self.thread.start()

    def reserve(self, rids: list[str]) -> str | None:
        """Claim request ids; the first one already in flight if any (nothing is claimed then)."""
        with self._rid_lock:
            taken = next((r for r in rids if r in self._rids), None)
            if taken is None:
                self._rids.update(rids)
            return taken

    def submit(self, job: Job) -> None:
        self._inbox.put(("submit", job))

    def call(self, fn) -> concurrent.futures.Future:
        """Run ``fn()`` in the engine's thread between two steps; its result or exception on the future."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("call", fn, fut))
        return fut

    def update(self, apply, abort_all: bool) -> concurrent.futures.Future:
        """Queue a weight update: ``apply()`` runs once no request is in flight (after aborting them all
        with ``abort_all``); new requests wait until it ran.  The future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(("update", _Update(apply, abort_all, fut)))
        return fut

    def stop(self, timeout: float = 30.0) -> None:
        self._inbox.put(("stop",))
        self.thread.join(timeout)

    # ---------------------------------------------------------- the engine's thread
    def _run(self) -> None:
        while True:
            try:
                self._take(block=not self._busy())
                if self._stopping:
                    break
                self._apply_update()
                self._admit()
                if self.paused is None and self.engine.has_unfinished():
                    self._dispatch(self._step())
                    self._progress()
                elif self.lockstep is not None:
                    self.lockstep.sync(step=False)  # a heartbeat within the group's timeout while idle
            except Exception as e:  # the engine isolates bad requests; this is a bug: fail what is in flight
                log.exception("the engine loop failed")
                message = f"the engine failed: {type(e).__name__}: {e}"
                if self.lockstep is not None:  # a rank lost or out of step: no collective can run again
                    message = (f"the tensor-parallel engine stopped (a rank died, hung past --tp-timeout or fell "
                               f"out of step); the server exits: {type(e).__name__}: {e}")
                    self._take(block=False)  # what arrived while the collective waited ends here too
                    for job, item in list(self._by_rid.values()):
                        self._finish(job, item, Completion(item.prompt, [], torch.empty(0), "abort", message))
                    self.lockstep.lost(message)
                    break
                self._abort(None, message)
        self._abort(None, "the server is shutting down")
        for upd in self._updates:
            upd.future.set_exception(ApiError(503, "the server is shutting down"))
        self._updates.clear()

    def _step(self) -> list[Completion]:
        if self.lockstep is None:
            return self.engine.step()
        self.lockstep.sync(step=True)
        return self.lockstep.checked(self.engine.step())

    def _busy(self) -> bool:
        if self._updates:
            return True
        return self.paused is None and (self.engine.has_unfinished() or bool(self._pending))

    def _take(self, block: bool) -> None:
        try:
            cmd = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "submit":
            job = cmd[1]
            for item in job.items:
                self._pending.append((job, item))
                self._by_rid[item.rid] = (job, item)
        elif kind == "call":
            _, fn, fut = cmd
            try:
                fut.set_result(fn())
            except Exception as e:
                fut.set_exception(e)
        elif kind == "update":
            upd = cmd[1]
            if upd.abort_all:  # at arrival, as SGLang: requests sent after it wait and run on the new version
                self._abort(None, "aborted for a weight update (abort_all_requests)")
            self._updates.append(upd)
        elif kind == "stop":
            self._stopping = True

    def _admit(self) -> None:
        if self.paused is not None or self._updates:
            return
        waiting = self.engine.scheduler.waiting
        while self._pending:
            job, item = self._pending.popleft()
            eid = self.engine.add_request(item.prompt, item.sampling, adapter=item.adapter)
            if self.lockstep is not None:
                self.lockstep.record("add", eid, item.prompt, item.sampling, item.adapter)
            item.engine_id = eid
            item.seq = waiting[-1] if waiting and waiting[-1].id == eid else None  # None: refused, out in the next step
            self._inflight[eid] = (job, item)
            if job.stream:
                self._streams[eid] = (job, item)

    def _finish(self, job: Job, item: Item, c: Completion) -> None:
        self._by_rid.pop(item.rid, None)
        with self._rid_lock:
            self._rids.discard(item.rid)
        version = c.weight_version if c.weight_version >= 0 else self.engine.weight_version
        job.emit(("done", item, c, version))

    def _dispatch(self, done: list[Completion]) -> None:
        for c in done:
            entry = self._inflight.pop(c.request_id, None)
            self._streams.pop(c.request_id, None)
            if entry is not None:
                self._finish(*entry, c)

    def _progress(self) -> None:
        for job, item in self._streams.values():
            seq = item.seq
            if seq is not None and len(seq.tokens) > item.sent:  # only the new rows: the stream keeps the rest
                a, item.sent = item.sent, len(seq.tokens)
                job.emit(("chunk", item, seq.tokens[a:item.sent], seq.logprobs[a:item.sent], seq.versions[-1]))

    def _quiesce(self, op, *args):
        """``op(engine, *args)`` (one of ``QUIESCED``) with no step in flight, recorded for the other TP ranks."""
        if self.lockstep is not None:
            self.lockstep.record(op.__name__, *args)
        return quiesce(self.engine, op, *args)

    def _abort(self, rids: set[str] | None, message: str) -> int:
        """End the matching requests (None: all) with finish_reason abort; returns how many."""
        if rids is None:
            targets = list(self._by_rid.values())
        else:
            targets = [e for r, e in self._by_rid.items() if r in rids or any(r.startswith(x + "_") for x in rids)]
        if not targets:
            return 0
        queued = {id(item) for _, item in targets if item.engine_id < 0}
        if queued:
            self._pending = deque(e for e in self._pending if id(e[1]) not in queued)
        for job, item in targets:
            if item.engine_id < 0:
                self._finish(job, item, Completion(item.prompt, [], torch.empty(0), "abort", message))
        ids = {item.engine_id for _, item in targets if item.engine_id >= 0}
        if ids:
            aborted = self._quiesce(end_requests, ids, message)
            self._dispatch([s.completion() for s in aborted])
            if self.paused is not None and self.engine.scheduler.idle:
                self._dispatch(self._step())  # what the waited-for step finished; steps nothing more
        return len(targets)

    def _apply_update(self) -> None:
        if not self._updates:
            return
        upd = self._updates[0]
        if self._inflight:
            if self.paused is None:
                return  # they finish on the version they started with
            self._updates.popleft()
            upd.future.set_exception(ApiError(409, (
                f"{len(self._inflight)} request(s) are paused mid-generation ({self.paused}) and would finish on two "
                f"weight versions: abort them (abort_all_requests: true, /abort_request, or /pause_generation with "
                f"mode abort) or /continue_generation first")))
            return
        self._updates.popleft()
        try:
            upd.future.set_result(upd.apply())
        except Exception as e:
            upd.future.set_exception(e)

    # ---------------------------------------------------------- control, run through call()
    def pause(self, mode: str) -> str:
        if mode == "abort":
            n = self._abort(None, "aborted by /pause_generation")
            self.paused = mode
            return f"generation paused; {n} request(s) aborted"
        if mode == "retract":
            self._quiesce(retract_all)
        self.paused = mode
        return f"generation paused ({mode}); {len(self._inflight)} request(s) in flight"

    def resume(self) -> str:
        was, self.paused = self.paused, None
        return "generation continued" if was else "generation was not paused"

    def counts(self) -> dict:
        sched = self.engine.scheduler
        return {"num_running_reqs": len(sched.running), "num_waiting_reqs": len(sched.waiting) + len(self._pending),
                "num_in_flight": len(self._inflight), "num_queued": len(self._pending),
                "paused": self.paused, "weight_version": self.engine.weight_version,
                "num_preemptions": self.engine.num_preemptions}

    def flush(self) -> None:
        busy = len(self._inflight) + len(self._pending)
        if busy:
            raise ApiError(400, f"cache not flushed: {busy} request(s) are running or waiting")


def quiesce(engine, op, *args):
    """``op(engine, *args)`` with no step in flight, scheduling nothing; its result.  ``score`` of no
    sequences waits for a step launched ahead (overlap) and runs the between-steps hooks, and steps
    nothing itself."""
    out = []
    engine.between_steps(lambda: out.append(op(engine, *args)))
    engine.score([], [], SamplingParams())
    return out[0]


def end_requests(engine, ids: set[int], message: str) -> list:
    """End the engine's requests ``ids`` (waiting or running) with finish_reason abort; their Sequences."""
    sched, aborted = engine.scheduler, []
    for seq in [s for s in sched.waiting if s.id in ids]:
        sched.waiting.remove(seq)
        seq.status = Status.FINISHED  # a waiting request holds no pages (new, or preempted)
        aborted.append(seq)
    running = [s for s in sched.running if s.id in ids]
    sched.retire(running)
    for seq in aborted + running:
        seq.finish_reason, seq.error = "abort", message
    return aborted + running


def retract_all(engine) -> None:
    while engine.scheduler.preempt_newest():  # pages freed; recomputed on continue, same bits
        pass


QUIESCED = {f.__name__: f for f in (end_requests, retract_all)}  # what a TP rank replays by name


# ------------------------------------------------------------------ the HTTP side
def _status(e: BaseException) -> int:
    if isinstance(e, ApiError):
        return e.status
    if isinstance(e, VersionSkew):
        return 409
    if isinstance(e, (SyncError, ValueError, TypeError, FileNotFoundError, NotADirectoryError, NotImplementedError)):
        return 400
    return 500


def _message(e: BaseException) -> str:
    msg = e.message if isinstance(e, ApiError) else f"{type(e).__name__}: {e}"
    return " ".join(msg.split())


def _under(path: str, dirs) -> bool:
    return any(os.path.commonpath([path, d]) == d for d in dirs)


def allowed_weights_dirs(weights_dirs, checkpoint) -> tuple[str, ...]:
    """The directories ``/update_weights_from_disk`` may read under (real paths): ``weights_dirs`` as
    given; by default the served checkpoint's parent directory (where an RL run writes the checkpoints
    that follow its first), none for a preset."""
    if weights_dirs is None:
        weights_dirs = [os.path.dirname(os.path.realpath(checkpoint))] if checkpoint else []
    out = []
    for d in weights_dirs:
        real = os.path.realpath(d)
        if not os.path.isdir(real):
            raise ValueError(f"--weights-dir {os.fspath(d)!r} is not a directory")
        out.append(real)
    return tuple(dict.fromkeys(out))


def check_key(key: str | None, name: str) -> str | None:
    if key is None:
        return None
    if not key or not key.isascii() or not key.isprintable() or any(c.isspace() for c in key):
        raise ValueError(f"{name} must be a non-empty string of printable ASCII without spaces (it travels in an "
                         f"HTTP header)")
    return key


@dataclasses.dataclass(frozen=True)
class ApiKeys:
    """Who may call which route: with ``api_key``, every route needs ``Authorization: Bearer <key>``
    (the admin key opens them too); with ``admin_api_key``, the ADMIN_ROUTES need it and no other.
    Keys are compared in constant time (``hmac.compare_digest``), against every accepted key."""
    api_key: str | None = None
    admin_api_key: str | None = None

    def accepted(self, path: str) -> tuple[bytes, ...]:
        """The keys that open ``path``; () when it is open to all."""
        if path.rstrip("/") in ADMIN_ROUTES and self.admin_api_key:
            return (self.admin_api_key.encode(),)
        if not self.api_key:
            return ()
        return tuple(k.encode() for k in (self.api_key, self.admin_api_key) if k)

    def refusal(self, path: str, authorization: bytes | None) -> str | None:
        """Why a request for ``path`` with that Authorization header is refused; None: let in."""
        keys = self.accepted(path)
        if not keys:
            return None
        scheme, _, got = (authorization or b"").partition(b" ")
        if not authorization or scheme.lower() != b"bearer":
            return "missing API key: send Authorization: Bearer <key>"
        ok = False
        for k in keys:  # every key compared, each in constant time
            ok |= hmac.compare_digest(got.strip(), k)
        if ok:
            return None
        admin = path.rstrip("/") in ADMIN_ROUTES and self.admin_api_key
        return "wrong API key" + (" (this route needs the admin API key)" if admin else "")


class RequireKey:
    """ASGI middleware: a request ``ApiKeys`` refuses gets a 401 before any route runs (nothing changes)."""

    def __init__(self, app, keys: ApiKeys):
        self.app, self.keys = app, keys

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), None)
            why = self.keys.refusal(scope["path"], auth)
            if why is not None:
                body = jsonio.dumps({"error": {"message": why, "type": "authentication_error", "code": 401}})
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def is_loopback(host: str) -> bool:
    """Every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError):
        return False
    addrs = {info[4][0].split("%")[0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a).is_loopback for a in addrs)


class AlignedServer:
    """The state behind the routes: the engine's loop, the receiver every update goes through, the
    trainer that disk updates are read into, and the torch.distributed group of distributed updates."""

    def __init__(self, spec, cfg, trainer, engine, *, model: str, checkpoint, preset, device, dtype, fp8: bool,
                 host: str, port: int, text=None, weights_dirs=None, served_model_name: str | None = None,
                 lockstep=None):
        from ..models.text import CheckpointText

        self.spec, self.cfg, self.trainer, self.engine = spec, cfg, trainer, engine
        self.text = text if text is not None else CheckpointText()
        self.info = {"model": model, "checkpoint": checkpoint, "preset": preset, "device": str(device),
                     "dtype": str(dtype).removeprefix("torch."), "fp8": fp8, "host": host, "port": port}
        self.model_name = served_model_name or (os.fspath(checkpoint) if checkpoint else model)
        self.weights_dirs = allowed_weights_dirs(weights_dirs, checkpoint)
        self.created = int(time.time())
        self.dtype, self.fp8, self.device = dtype, fp8, torch.device(device)
        # Version 0 and a first full payload: the receiver then knows the checksum of what it holds,
        # so a damaged delta later leaves it on its version instead of on none.
        self.rx = Receiver(engine.model.weights, version=0, check_finite=True)
        source = trainer.forward_weights if lockstep is None else lambda: lockstep.shard(trainer.forward_weights())
        apply_between_steps(engine, self.rx, Publisher(source, check_finite=True).publish())
        if lockstep is not None:
            self.info["tp"] = lockstep.world
        _, extras = engine.score([[0, 0]], [1], SamplingParams(), return_extras=True)
        self.limits = api.ModelLimits(model, engine.model.vocab_size, engine.model.max_position,
                                      engine.block_manager.fits_alone, tuple(engine.adapter_names),
                                      tuple(sorted(extras[0])), self.text.tokenizer,
                                      on_request=tuple(sorted(engine.runner.on_request_extras)))
        self.loop = EngineLoop(engine, lockstep)
        self._update_lock = threading.Lock()  # one weight update at a time, read to apply
        self._group: dict | None = None

    # ---------------------------------------------------------- updates (worker threads)
    def _apply(self, payload, asked_version, abort_all: bool, what: str) -> dict:
        want = api.parse_weight_version(asked_version)
        if want is not None and want != payload.version:
            raise ApiError(400, f"weight_version {want} but the payload is v{payload.version}")
        t0 = time.perf_counter()
        version = self.loop.update(lambda: apply_between_steps(self.engine, self.rx, payload), abort_all).result()
        stats = payload.stats
        log.info("weights v%d from %s (%s) in %.2fs", version, what, stats if stats else "full", time.perf_counter() - t0)
        return {"success": True, "message": f"weights updated to v{version} from {what}", "weight_version": version,
                "num_paused_requests": 0}

    def check_weights_path(self, path: str) -> None:
        """``path`` and the files a disk update reads from it lie under an allowed directory (symbolic
        links resolved: a link out of it is refused too); a 403 naming the directories otherwise."""
        if not self.weights_dirs:
            raise ApiError(403, "model_path: disk updates are off: this server allows no weights directory (start "
                                "it with --weights-dir DIR)")
        allowed = ", ".join(self.weights_dirs)
        real = os.path.realpath(path)
        if not _under(real, self.weights_dirs):
            raise ApiError(403, f"model_path {path!r} is outside the allowed weights directories ({allowed})")
        if os.path.isdir(real):
            for name in sorted(os.listdir(real)):
                if name.endswith((".json", ".safetensors")) and not _under(os.path.realpath(os.path.join(real, name)),
                                                                          self.weights_dirs):
                    raise ApiError(403, f"model_path {path!r}: {name} links outside the allowed weights directories "
                                        f"({allowed})")

    def update_from_disk(self, req: api.UpdateFromDiskIn) -> dict:
        from ..weights import HFCheckpoint, read_hf_config
        from ..weights.fp8 import DequantizedSource, is_fp8_checkpoint

        want = api.parse_weight_version(req.weight_version)
        path = req.model_path
        self.check_weights_path(path)
        if not os.path.isdir(path):
            raise ApiError(400, f"model_path {path!r} is not a directory")
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ApiError(400, f"model_path {path!r} has no config.json: not a Hugging Face checkpoint directory")
        with self._update_lock:
            current = self.engine.weight_version
            target = current + 1 if want is None else want
            if target <= current:
                raise ApiError(409, f"weight_version {target} is stale: the server holds v{current}; an update "
                                    f"must be newer")
            cfg = self.spec.config_cls.from_hf(path)
            if cfg != self.cfg:
                diff = [f"{f.name} {getattr(cfg, f.name)!r} (served: {getattr(self.cfg, f.name)!r})"
                        for f in dataclasses.fields(cfg) if getattr(cfg, f.name) != getattr(self.cfg, f.name)]
                raise ApiError(400, f"{path}: its config differs from the served model's: {', '.join(diff)}")
            fp8_ckpt = is_fp8_checkpoint(read_hf_config(path))
            with HFCheckpoint(path) as ckpt:  # names, shapes and NaN/Inf are checked before any tensor is used
                tensors = self.spec.from_hf(DequantizedSource(ckpt) if fp8_ckpt else ckpt, self.cfg,
                                            dtype=torch.float32 if self.fp8 else self.dtype, device=self.device)
            with torch.no_grad():
                for name, p in self.trainer.named_parameters():
                    p.copy_(tensors.pop(name))
            self.trainer.invalidate_caches()
            pub = Publisher(self.trainer.forward_weights, check_finite=True)
            pub.version = target - 1
            payload = pub.publish(full=True)
            del pub
            return self._apply(payload, None, req.abort_all_requests, path)

    def update_from_tensor(self, req: api.UpdateFromTensorIn) -> dict:
        if len(req.serialized_named_tensors) != 1:
            raise ApiError(400, f"serialized_named_tensors must hold one payload ({FORMAT}: "
                                f"alignzoo.serve.wire.encode_payload_b64), got {len(req.serialized_named_tensors)}")
        payload = wire.decode_payload_b64(req.serialized_named_tensors[0])
        with self._update_lock:
            return self._apply(payload, req.weight_version, req.abort_all_requests, "a tensor payload")

    def init_group(self, req: api.InitGroupIn) -> dict:
        import torch.distributed as dist

        if self._group is not None or dist.is_initialized():
            name = self._group["group_name"] if self._group else "another"
            raise ApiError(400, f"a weight update group ({name!r}) is open: /destroy_weights_update_group first")
        if req.rank_offset < 1 or req.world_size != req.rank_offset + 1:
            raise ApiError(400, f"this server is one rank after the trainer's: rank_offset >= 1 and world_size = "
                                f"rank_offset + 1, got rank_offset {req.rank_offset}, world_size {req.world_size}")
        if req.backend == "nccl" and self.device.type != "cuda":
            raise ApiError(400, f"backend nccl needs a CUDA server; this one runs on {self.device}: use gloo")
        try:
            dist.init_process_group(req.backend, init_method=f"tcp://{req.master_address}:{req.master_port}",
                                    world_size=req.world_size, rank=req.rank_offset,
                                    timeout=timedelta(seconds=req.timeout_s))
        except Exception as e:
            raise ApiError(400, f"could not join the weight update group at {req.master_address}:{req.master_port}: "
                                f"{type(e).__name__}: {e}") from None
        self._group = req.model_dump()
        return {"success": True, "message": f"joined {req.group_name!r} ({req.backend}) as rank {req.rank_offset} "
                                            f"of {req.world_size}"}

    def update_from_distributed(self, req: api.UpdateFromDistributedIn) -> dict:
        if req.names is not None or req.dtypes is not None or req.shapes is not None:
            raise ApiError(400, f"names/dtypes/shapes (SGLang's raw per-tensor broadcast) are not taken: this server "
                                f"receives one checked payload ({FORMAT}) from rank 0 over the group "
                                f"(alignzoo.client.Client.update_weights_from_distributed)")
        if self._group is None:
            raise ApiError(400, "no weight update group: /init_weights_update_group first")
        if req.group_name != self._group["group_name"]:
            raise ApiError(400, f"group_name {req.group_name!r}: the open group is {self._group['group_name']!r}")
        with self._update_lock:
            try:
                # the device explicitly: CUDA's current device is per thread, and this is a worker thread
                device = self.device if self._group["backend"] == "nccl" else torch.device("cpu")
                payload = DistTransport(0, device=device).recv()
            except CorruptPayload:
                raise
            except Exception as e:
                raise ApiError(400, f"receiving the payload from rank 0 failed: {type(e).__name__}: {e}") from None
            return self._apply(payload, req.weight_version, req.abort_all_requests, f"group {req.group_name!r}")

    def destroy_group(self, req: api.DestroyGroupIn) -> dict:
        import torch.distributed as dist

        if self._group is None:
            raise ApiError(400, "no weight update group is open")
        if req.group_name != self._group["group_name"]:
            raise ApiError(400, f"group_name {req.group_name!r}: the open group is {self._group['group_name']!r}")
        dist.destroy_process_group()
        self._group = None
        return {"success": True, "message": f"destroyed {req.group_name!r}"}

    def close(self) -> None:
        self.loop.stop()
        if self._group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self._group = None

    # ---------------------------------------------------------- info
    def model_info(self) -> dict:
        c = self.info
        return {"model_path": c["checkpoint"] or f"preset:{c['preset']}",
                "tokenizer_path": c["checkpoint"] if self.text.tokenizer is not None else None,
                "served_model_name": self.model_name, "eos_token_ids": list(self.engine.eos_token_ids),
                "generation_defaults": dict(self.text.generation_defaults),
                "chat_template": self.text.chat_template is not None,
                "is_generation": True, "model_type": c["model"], "architectures": self.cfg.to_hf().get("architectures"),
                "weight_version": self.engine.weight_version, "vocab_size": self.limits.vocab_size,
                "max_position": self.limits.max_position, "extras": list(self.limits.extras),
                "routed_experts": api.ROUTED_EXPERTS in self.limits.extras,
                "index_selected": api.INDEX_SELECTED in self.limits.on_request,
                "adapters": list(self.limits.adapter_names)}

    def server_info(self) -> dict:
        from .. import __version__

        e = self.engine
        return {**self.info, "alignzoo": __version__, "torch": torch.__version__,
                "max_batch_size": e.max_batch_size, "max_batch_tokens": e.max_batch_tokens, "num_pages": e.num_pages,
                "overlap": e.overlap,
                "weight_update_group": self._group, **self.loop.counts()}


def create_app(server: AlignedServer, keys: ApiKeys | None = None) -> FastAPI:
    srv, loop = server, server.loop
    tok = srv.text.tokenizer

    def error(e: BaseException, update: bool = False) -> JSONResponse:
        status, msg = _status(e), _message(e)
        if status >= 500:
            log.error("request failed: %s", msg)
        kind = "invalid_request_error" if status < 500 else "server_error"
        body = {"success": False, "message": msg} if update else {"error": {"message": msg, "type": kind,
                                                                             "code": status}}
        return JSONResponse(body, status_code=status)

    async def body_of(request: Request, model):
        return api.validated(model, api.parse_json(await request.body()))

    app = FastAPI(title="alignzoo serve", default_response_class=JSONResponse, docs_url=None, redoc_url=None,
                  openapi_url=None)
    if keys is not None and (keys.api_key or keys.admin_api_key):
        app.add_middleware(RequireKey, keys=keys)

    # ---------------------------------------------------------- generate
    def _start(spec) -> Job:
        """Reserve the request ids and queue the job on the engine's thread; a 400 if an id is in flight."""
        taken = loop.reserve([it.rid for it in spec.items])
        if taken is not None:
            raise ApiError(400, f"rid {taken!r} is already in flight")
        job = Job(spec.items, spec.stream, asyncio.get_running_loop())
        loop.submit(job)
        return job

    @app.post("/generate")
    async def generate(request: Request):
        try:
            spec = api.build_generate(api.parse_json(await request.body()), srv.limits)
            job = _start(spec)
        except ApiError as e:
            return error(e)
        if spec.stream:
            return StreamingResponse(_sse(job, api.Stream(spec, tok, job.started)), media_type="text/event-stream")
        out: list = [None] * len(spec.items)
        for _ in spec.items:
            _, item, c, version = await _next_done(job)
            out[item.index] = api.item_response(item, c.tokens, c.logprobs.tolist(), version, c,
                                                latency=time.perf_counter() - job.started, tokenizer=tok)
        return JSONResponse(out[0] if spec.single else out)

    async def _next_done(job: Job):
        while True:
            ev = await job.events.get()
            if ev[0] == "done":
                return ev

    async def _sse(job: Job, stream):
        """A streamed job's server-sent events, each chunk as ``stream`` writes it (``api.Stream``,
        ``openai.Stream``): ``running`` from a sample's tokens and log-probs so far, ``final`` from its
        Completion, ``closing`` after the last; then ``data: [DONE]``.  A client that goes away aborts the
        samples still running."""
        left = {it.rid for it in job.items}
        so_far: dict[str, tuple[list, list]] = {it.rid: ([], []) for it in job.items}  # the engine sends new rows only
        try:
            while left:
                ev = await job.events.get()
                item = ev[1]
                if ev[0] == "chunk":
                    _, _, new_tokens, new_lps, version = ev
                    tokens, lps = so_far[item.rid]
                    tokens += new_tokens
                    lps += new_lps
                    chunk = stream.running(item, tokens, lps, version)
                else:
                    _, _, c, version = ev
                    left.discard(item.rid)
                    chunk = stream.final(item, c, version)
                yield b"data: " + jsonio.dumps(chunk) + b"\n\n"
            for chunk in stream.closing():
                yield b"data: " + jsonio.dumps(chunk) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            if left:  # the client went away
                loop.call(lambda: loop._abort(set(left), "the client disconnected"))

    # ---------------------------------------------------------- the OpenAI-compatible API
    @app.get("/v1/models")
    async def v1_models():
        return openai.models(srv.model_name, srv.limits, srv.created, srv.info["checkpoint"])

    async def openai_route(request: Request, chat: bool):
        try:
            spec = openai.build(api.parse_json(await request.body()), srv.limits, srv.text.generation_defaults,
                                srv.model_name, chat)
            job = _start(spec)
        except ApiError as e:
            return error(e)
        if spec.stream:
            return StreamingResponse(_sse(job, openai.Stream(spec, tok)), media_type="text/event-stream")
        done: list = [None] * len(spec.items)
        for _ in spec.items:
            _, item, c, version = await _next_done(job)
            done[item.index] = (item, c, version)
        try:
            return JSONResponse(openai.response(spec, tok, done))
        except ValueError as e:  # a non-finite log-prob: JSON cannot carry it
            return error(ApiError(500, str(e)))

    @app.post("/v1/completions")
    async def v1_completions(request: Request):
        return await openai_route(request, chat=False)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request):
        return await openai_route(request, chat=True)

    # ---------------------------------------------------------- health and info
    @app.get("/health")
    async def health():
        if not loop.thread.is_alive():
            return JSONResponse({"error": {"message": "the engine thread is not running"}}, status_code=503)
        return Response(status_code=200)

    @app.get("/health_generate")
    async def health_generate():
        if not loop.thread.is_alive():
            return JSONResponse({"error": {"message": "the engine thread is not running"}}, status_code=503)
        if loop.paused is not None:
            return JSONResponse({"status": "paused"})
        rid = f"health-{time.monotonic_ns()}"
        item = Item(rid, 0, [0], SamplingParams(temperature=0.0, max_new_tokens=1), None, False, None)
        loop.reserve([rid])
        job = Job([item], False, asyncio.get_running_loop())
        loop.submit(job)
        try:
            _, _, c, _ = await asyncio.wait_for(_next_done(job), timeout=60)
        except asyncio.TimeoutError:
            loop.call(lambda: loop._abort({rid}, "health check timed out"))
            return JSONResponse({"error": {"message": "no token within 60 s"}}, status_code=503)
        if c.finish_reason not in ("stop", "length"):
            return JSONResponse({"error": {"message": c.error or c.finish_reason}}, status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def get_model_info():
        return srv.model_info()

    @app.get("/get_server_info")
    async def get_server_info():
        return await asyncio.wrap_future(loop.call(srv.server_info))

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": srv.engine.weight_version}

    @app.get("/get_weights_checksum")
    async def get_weights_checksum():
        if loop.lockstep is not None:
            return error(ApiError(400, loop.lockstep.no_updates("/get_weights_checksum")))
        fn = lambda: {"weight_version": srv.engine.weight_version,  # noqa: E731
                      "checksum": weights_checksum(srv.engine.model.weights)}
        return await asyncio.wrap_future(loop.call(fn))

    # ---------------------------------------------------------- weight updates
    def update_route(path: str, model, fn):
        async def route(request: Request):
            try:
                if loop.lockstep is not None:
                    raise ApiError(400, loop.lockstep.no_updates(path))
                req = await body_of(request, model)
                return await asyncio.to_thread(fn, req)
            except Exception as e:
                return error(e, update=True)
        route.__name__ = path.strip("/")
        app.post(path)(route)

    update_route("/update_weights_from_disk", api.UpdateFromDiskIn, srv.update_from_disk)
    update_route("/update_weights_from_tensor", api.UpdateFromTensorIn, srv.update_from_tensor)
    update_route("/init_weights_update_group", api.InitGroupIn, srv.init_group)
    update_route("/update_weights_from_distributed", api.UpdateFromDistributedIn, srv.update_from_distributed)
    update_route("/destroy_weights_update_group", api.DestroyGroupIn, srv.destroy_group)

    # ---------------------------------------------------------- control
    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        try:
            req = await body_of(request, api.PauseIn)
            msg = await asyncio.wrap_future(loop.call(lambda: loop.pause(req.mode)))
        except Exception as e:
            return error(e, update=True)
        return {"success": True, "message": msg}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        try:
            await body_of(request, api._Strict)
            msg = await asyncio.wrap_future(loop.call(loop.resume))
        except Exception as e:
            return error(e, update=True)
        return {"success": True, "message": msg}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            req = await body_of(request, api.AbortIn)
            if not req.abort_all and not req.rid:
                raise ApiError(400, "give rid (a request id, or the prefix of a batch's ids) or abort_all: true")
            rids = None if req.abort_all else {req.rid}
            n = await asyncio.wrap_future(loop.call(
                lambda: loop._abort(rids, req.abort_message or "aborted by /abort_request")))
        except Exception as e:
            return error(e, update=True)
        return {"success": True, "message": f"{n} request(s) aborted", "num_aborted": n}

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        try:
            await asyncio.wrap_future(loop.call(loop.flush))
        except Exception as e:
            return error(e, update=True)
        return {"success": True, "message": "no prefix cache to flush: every request prefills its own pages"}

    return app


# ------------------------------------------------------------------ the process
def _check_listen(host: str, port: int) -> None:
    """Fail before the model loads if the address cannot be bound."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"cannot resolve host {host!r}: {e}") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def build(model: str, *, checkpoint=None, config=None, device=None, dtype=torch.bfloat16, fp8: bool = False,
          seed: int = 0, host: str = "127.0.0.1", port: int = 30000, weights_dirs=None,
          served_model_name: str | None = None, lockstep=None, **engine_kwargs) -> AlignedServer:
    """The model's trainer and engine (as ``load_pair`` builds them, without LoRA) behind an ``AlignedServer``,
    with the checkpoint's tokenizer, EOS ids and generation defaults (``models/text.py``).  ``lockstep``
    (``tp_launch.Lockstep``): the engine serves this rank's tensor-parallel shards, stepped with the others."""
    from ..common.engine import Engine
    from ..models import model_module
    from ..models.loading import build_trainer, resolve_config, server_weights
    from ..models.text import read_checkpoint_text

    spec = model_module(model).SPEC
    cfg = resolve_config(spec, checkpoint, None if checkpoint else (config or "tiny"))
    text = read_checkpoint_text(checkpoint, cfg.vocab_size)
    weights_dirs = allowed_weights_dirs(weights_dirs, checkpoint)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    trainer = build_trainer(spec, cfg, checkpoint, device=device, dtype=dtype, seed=seed, fp8=fp8)
    # The engine's thread decodes stop strings with a tokenizer of its own: the handlers' stays theirs.
    stops = {"eos_token_ids": text.eos_token_ids, "tokenizer": copy.deepcopy(text.tokenizer)}
    weights = server_weights(trainer)
    served = spec.server_cls(cfg, weights, lora_scale=None) if lockstep is None else lockstep.server_model(cfg, weights)
    engine = Engine(served, **{**stops, **engine_kwargs})
    return AlignedServer(spec, cfg, trainer, engine, model=model, checkpoint=checkpoint,
                         preset=None if checkpoint else (config or "tiny"), device=device, dtype=dtype, fp8=fp8,
                         host=host, port=port, text=text, weights_dirs=weights_dirs,
                         served_model_name=served_model_name, lockstep=lockstep)


def access(host: str, api_key: str | None, admin_api_key: str | None,
           allow_unauthenticated: bool) -> ApiKeys:
    """The keys to require (ALIGNZOO_API_KEY / ALIGNZOO_ADMIN_API_KEY when not given); a ValueError for
    a bind beyond loopback without an API key unless ``allow_unauthenticated``."""
    api_key = check_key(api_key if api_key is not None else os.environ.get("ALIGNZOO_API_KEY") or None,
                        "--api-key (ALIGNZOO_API_KEY)")
    admin = check_key(admin_api_key if admin_api_key is not None else
                      os.environ.get("ALIGNZOO_ADMIN_API_KEY") or None, "--admin-api-key (ALIGNZOO_ADMIN_API_KEY)")
    if api_key is None and not is_loopback(host):
        if not allow_unauthenticated:
            raise ValueError(f"--host {host} is reachable from other machines and no API key is set: anyone who "
                             f"reaches the port could sample, pause generation and replace the weights. Set "
                             f"--api-key (or ALIGNZOO_API_KEY), or pass --allow-unauthenticated to serve it open")
        log.warning("alignzoo serve: WARNING: %s is reachable from other machines and no API key is set "
                    "(--allow-unauthenticated): anyone who reaches the port may %s", host,
                    "sample" + ("" if admin else ", pause generation and replace the weights"))
    return ApiKeys(api_key, admin)


def _one_malloc_arena() -> None:
    """glibc gives each new thread a malloc arena of its own, and in its own arena the engine's thread
    ran the same generate 7% slower than the main thread does (CPU, batch 64; MALLOC_ARENA_MAX=1 took
    the gap away): every thread shares the main arena instead.  A no-op off glibc."""
    try:
        import ctypes

        ctypes.CDLL(None).mallopt(-8, 1)  # M_ARENA_MAX
    except (OSError, AttributeError):
        pass


def serve(model: str, *, host: str = "127.0.0.1", port: int = 30000, log_level: str = "info",
          api_key: str | None = None, admin_api_key: str | None = None, allow_unauthenticated: bool = False,
          **kw) -> int:
    """Build the server and run it until SIGINT or SIGTERM; returns 0 after a clean shutdown.  ``api_key``
    / ``admin_api_key`` (default: ALIGNZOO_API_KEY / ALIGNZOO_ADMIN_API_KEY): see ``ApiKeys``."""
    import uvicorn

    _one_malloc_arena()  # before any thread of ours allocates
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    keys = access(host, api_key, admin_api_key, allow_unauthenticated)
    _check_listen(host, port)
    t0 = time.perf_counter()
    server = build(model, host=host, port=port, **kw)
    app = create_app(server, keys)
    dirs = server.weights_dirs
    log.info("alignzoo serve: %s; %s; disk updates %s; %s",
             "API key required on every route" if keys.api_key else "no API key",
             "admin key required for weight updates and control" if keys.admin_api_key else "no admin key",
             f"under {', '.join(dirs)}" if dirs else "off (no --weights-dir)",
             "tokenizer and chat template from the checkpoint" if server.text.chat_template is not None else
             "tokenizer from the checkpoint (no chat template)" if server.text.tokenizer is not None else
             "no tokenizer: token ids only")

    class _Uvicorn(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                where = f"[{host}]" if ":" in host else host
                log.info("alignzoo serve: %s (%s) on %s, weight version %d, at http://%s:%d (ready in %.1fs)",
                         model, kw.get("checkpoint") or kw.get("config") or "tiny", server.info["device"],
                         server.engine.weight_version, where, port, time.perf_counter() - t0)

        def handle_exit(self, sig, frame):
            # uvicorn re-raises a captured signal after its shutdown, which would make a requested stop
            # exit 128 + signal; a signal here means "stop", so shut down and return 0.
            if self.should_exit and sig == 2:
                self.force_exit = True
            self.should_exit = True
            server.loop.call(lambda: server.loop._abort(None, "the server is shutting down"))

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            access_log=False, lifespan="off")
    server.loop.start()
    try:
        _Uvicorn(config).run()
    finally:
        server.close()
        log.info("alignzoo serve: stopped")
    return 0
