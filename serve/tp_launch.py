"""``alignzoo serve --tp N``: one tensor-parallel engine over N processes behind the same HTTP API.

Every rank loads the same checkpoint (or preset) and seed, cuts its shards of the server weights by
the model's ``TPPlan`` (``models/<model>/parallelize.py``'s ``tp_plan``) through ``parallel.tp.tp_server``,
and builds the same engine.  Rank 0 runs the HTTP server as one process does (``server.serve``); the
others run no server and follow it (``follow``).  Lockstep: before each engine step, rank 0 broadcasts
what changed since the last (requests added with their token ids and SamplingParams, requests ended,
a retract) with ``broadcast_object_list``; every rank applies it and calls the same ``engine.step()``,
so the collectives inside the forward line up.  Every rank samples from the same gathered FP32 logits,
so every rank draws the same tokens and the batches stay the same.  While idle, rank 0 broadcasts an
empty change every 0.5 s, a heartbeat well inside the group's timeout.  Cost: one ``broadcast_object_list``
a step, 0.83 ms on a busy 2-core CPU (gloo, 2 ranks; the same with 8 requests added in it); at --tp 1 none
of this runs (``EngineLoop.lockstep`` is None).

A timeout, not a hang: the process group carries ``timeout_s`` (``--tp-timeout``) for every
collective.  A rank that dies or stops answering makes rank 0's next collective raise; rank 0 then
ends every request in flight with finish_reason abort and the error, shuts the HTTP server down and
exits 1; the other ranks' next collective raises likewise and they exit 1.  A forward that raises is
taken the same way (the ranks can no longer be known to be in step), not as one request's fault.

Started as ``alignzoo serve MODEL --tp N``, rank 0 is this process and it starts ranks 1..N-1 (fork
on the CPU; spawn on CUDA, where a forked child cannot use CUDA); under ``torchrun`` (RANK and
WORLD_SIZE set) nothing is started: each process joins as its rank.  Backend gloo on the CPU, nccl on
CUDA (one device a rank, ``cuda:LOCAL_RANK``; the nccl path is untested) with the lockstep's
broadcasts on a gloo group beside it.

Weight updates are refused under TP > 1 (a 400 saying why): a payload is the trainer's whole
tensors, and each rank holds shards of them.
"""
from __future__ import annotations

import datetime
import importlib
import logging
import os
import shutil
import signal
import sys
import tempfile

import torch
import torch.distributed as dist

log = logging.getLogger("alignzoo.serve")

SERVE_ONLY = ("log_level", "api_key", "admin_api_key", "allow_unauthenticated")  # rank 0's HTTP side alone


def tp_plan_of(model: str):
    """``model``'s ``tp_plan`` function; a ValueError naming the model (and those that have one) otherwise."""
    from .. import list_models
    from ..models import model_module

    def plan(name):
        try:
            mod = importlib.import_module(model_module(name).__name__ + ".parallelize")
        except ModuleNotFoundError:
            return None
        return getattr(mod, "tp_plan", None)

    found = plan(model)
    if found is None:
        takes = [m for m in list_models() if plan(m) is not None]
        raise ValueError(f"--tp: {model} declares no tensor-parallel plan (no tp_plan in its parallelize.py); "
                         f"models with a tp_plan: {', '.join(takes) or 'none'}")
    return found


def check_tp(model: str, tp: int, *, checkpoint=None, config=None, fp8: bool = False, **_) -> None:
    """Refuse a TP degree ``model`` cannot take, with its reason, before any process starts."""
    from ..models import model_module
    from ..models.loading import resolve_config
    from ..parallel.tp import check_layout

    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be an int >= 1, got {tp!r}")
    plan = tp_plan_of(model)
    if fp8:
        raise NotImplementedError("--fp8 with --tp > 1: FP8 codes and their scales are not sharded yet")
    cfg = resolve_config(model_module(model).SPEC, checkpoint, None if checkpoint else (config or "tiny"))
    try:
        check_layout(plan(cfg), cfg, tp)
    except ValueError as e:
        raise ValueError(f"--tp {tp} on {model}: {e}") from None


class Lockstep:
    """One rank's side of the lockstep: rank 0 records engine changes and ``sync``s them before each
    step (and as a heartbeat); the others ``receive`` them.  Also what ``server.build`` asks for the
    rank's model (``server_model``)."""

    def __init__(self, model: str, rank: int, world: int, group=None):
        from ..models import model_module

        self.model, self.rank, self.world, self.group = model, rank, world, group
        self.server_cls = model_module(model).SPEC.server_cls
        self.plan = tp_plan_of(model)
        self.cfg = None  # the served model's, once server_model built it
        self.failed: str | None = None  # why rank 0 stopped serving
        self.broken: str | None = None  # why a forward failed
        self._ops: list[tuple] = []

    def server_model(self, cfg, weights):
        from ..parallel.tp import tp_server

        self.cfg = cfg
        model = tp_server(self.server_cls, cfg, weights, self.plan(cfg), lora_scale=None)
        forward = model.forward

        def guarded(*args):
            # the engine retries a failed step's requests one by one: each would wait out the timeout again
            if self.broken is not None:
                raise RuntimeError(f"a TP collective failed before: {self.broken}")
            try:
                return forward(*args)
            except Exception as e:
                self.broken = f"{type(e).__name__}: {' '.join(str(e).split())}"
                raise

        model.forward = guarded
        return model

    def checked(self, done: list) -> list:
        """A step's completions; a RuntimeError if a forward failed in it: under TP a failed forward means
        a rank lost or out of step, never one request's fault."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        return done

    def shard(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """This rank's shards of the full server ``weights`` (what ``server_model`` holds)."""
        from ..parallel.tp import shard_weights

        return shard_weights(weights, self.plan(self.cfg), self.world, self.rank)

    def no_updates(self, path: str) -> str:
        return (f"{path} is not served under --tp {self.world}: each rank holds only its shards of the weights, "
                f"and a payload or checksum is the trainer's whole tensors; restart the server on the new "
                f"checkpoint, or serve with --tp 1")

    # ---------------------------------------------------------- rank 0
    def record(self, *op) -> None:
        self._ops.append(op)

    def sync(self, step: bool) -> None:
        """Send the changes recorded since the last sync, and whether a step follows."""
        msg, self._ops = [self._ops, step], []
        dist.broadcast_object_list(msg, src=0, group=self.group)

    def lost(self, message: str) -> None:
        """From the engine's thread after a failed collective: stop serving; the process exits 1."""
        log.error("alignzoo serve: TP rank 0: %s; shutting down", message)
        self.failed = message
        os.kill(os.getpid(), signal.SIGTERM)  # uvicorn's shutdown: the handlers answer what was ended

    def stop(self) -> None:
        self.record("stop")
        self.sync(step=False)

    # ---------------------------------------------------------- ranks 1..N-1
    def receive(self) -> tuple[list[tuple], bool]:
        msg = [None, None]
        dist.broadcast_object_list(msg, src=0, group=self.group)
        return msg[0], msg[1]


def follow(engine, lockstep: Lockstep) -> None:
    """Ranks 1..N-1: apply rank 0's changes and step with it until it says stop.  Rank 0's request ids
    are mapped to this engine's own, so a rank started afresh (torchrun) follows as well as a fork."""
    from .server import QUIESCED, end_requests, quiesce

    ids: dict[int, int] = {}  # rank 0's request id -> ours
    while True:
        ops, step = lockstep.receive()
        for name, *args in ops:
            if name == "stop":
                return
            if name == "add":
                eid, prompt, sampling, adapter = args
                ids[eid] = engine.add_request(prompt, sampling, adapter=adapter)
            elif name == "end_requests":
                rids, message = args
                quiesce(engine, end_requests, {ids[i] for i in rids if i in ids}, message)
            else:
                quiesce(engine, QUIESCED[name], *args)
        if step:
            done = {c.request_id for c in lockstep.checked(engine.step())}  # rank 0 answers them
            if done:
                ids = {e: i for e, i in ids.items() if i not in done}


def _device(device, local_rank: int) -> torch.device:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return torch.device("cuda", local_rank) if device.type == "cuda" else device


def run_rank(model: str, rank: int, world: int, local_rank: int, init_method: str, timeout_s: float,
             kw: dict) -> int:
    """Join the group as ``rank`` and serve (rank 0) or follow (the others); the exit status."""
    device = _device(kw.get("device"), local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    group = None if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    lockstep = Lockstep(model, rank, world, group)
    kw = {**kw, "device": device, "lockstep": lockstep}
    try:
        if rank == 0:
            from .server import serve

            code = serve(model, **kw)
            if lockstep.failed is not None:
                return 1
            try:
                lockstep.stop()
            except RuntimeError as e:  # a rank lost while rank 0 shut down
                log.error("alignzoo serve: TP rank 0: telling the other ranks to stop: %s", " ".join(str(e).split()))
                return 1
            return code
        from .server import build

        server = build(model, **{k: v for k, v in kw.items() if k not in SERVE_ONLY})
        follow(server.engine, lockstep)
        return 0
    except Exception as e:
        if rank == 0:
            raise
        log.error("alignzoo serve: TP rank %d of %d: %s: %s", rank, world, type(e).__name__, " ".join(str(e).split()))
        return 1
    finally:
        dist.destroy_process_group()


def _child(rank: int, world: int, init_method: str, timeout_s: float, threads: int, model: str, kw: dict) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: rank 0 stops us
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    torch.set_num_threads(threads)
    sys.exit(run_rank(model, rank, world, rank, init_method, timeout_s, kw))


def launch(model: str, tp: int, *, timeout_s: float = 60.0, **kw) -> int:
    """``alignzoo serve MODEL --tp tp``: check the layout, then start ranks 1..tp-1 and serve as rank 0
    (or, under torchrun, join as RANK of WORLD_SIZE); the exit status: 0 after a clean shutdown, 1 when
    a rank was lost.  ``kw``: ``server.serve``'s keywords."""
    from .server import _check_listen, access

    check_tp(model, tp, **kw)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        world = int(os.environ["WORLD_SIZE"])
        if world != tp:
            raise ValueError(f"--tp {tp} but torchrun started WORLD_SIZE={world} processes")
        rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        return run_rank(model, rank, world, local, "env://", timeout_s, kw)
    # what rank 0 would refuse, refused before any process starts
    host, port = kw.get("host", "127.0.0.1"), kw.get("port", 30000)
    access(host, kw.get("api_key"), kw.get("admin_api_key"), kw.get("allow_unauthenticated", False))
    _check_listen(host, port)
    store = tempfile.mkdtemp(prefix="alignzoo-tp-")
    init = f"file://{store}/rendezvous"
    cuda = _device(kw.get("device"), 0).type == "cuda"
    ctx = torch.multiprocessing.get_context("spawn" if cuda else "fork")
    procs = [ctx.Process(target=_child, args=(r, tp, init, timeout_s, torch.get_num_threads(), model, kw),
                         name=f"alignzoo-tp{r}", daemon=True) for r in range(1, tp)]
    for p in procs:
        p.start()
    code = 1
    try:
        code = run_rank(model, 0, tp, 0, init, timeout_s, kw)
    finally:
        for p in procs:
            p.join(10 if code == 0 else 0)  # told to stop, they exit; otherwise they wait on a collective
            if p.is_alive():
                p.kill()
                p.join()
        shutil.rmtree(store, ignore_errors=True)
    lost = [p.name for p in procs if p.exitcode]
    if lost and code == 0:
        log.error("alignzoo serve: %s exited with an error", ", ".join(lost))
        return 1
    return code
