"""Weight sync from a trainer on one layout to a tensor-parallel server on another, all ranks or none.

Each rank of the server's TP group also holds a trainer rank (co-located, as the RL tests run them).
A ``source`` gives this rank the exact tensors its TP shard holds: ``replicated_source`` cuts them
with ``tp.shard_weights`` from the trainer's forward weights (one device, or DP-replicated after
``dp.step_gradients``); ``FSDPSource`` fetches, from an FSDP2-sharded trainer (``fully_shard``,
dim-0 shards), only the rows this TP position holds, cut by the same ``shard_weights``.
``LayoutSync.sync()`` then runs the one-device machinery per rank (``alignzoo.sync``): a
``Publisher`` diffs the shard against the last shipped one (changed blocks only, NaN/Inf refused)
and a ``Receiver`` over the TP server's tensors checks the payload, then writes it in place through
``engine.update_weights``, bumping the engine's weight version.

Checked before anything is written on any rank, in two agreements over the group:
1. before publishing, every rank's state: the version to publish (one number for all ranks, so every
   shard carries the same weight version) and whether any rank needs a full payload (a receiver
   that missed the last version or holds none, as ``Pair.sync`` decides);
2. after each rank has published and checked its payload — names, shapes, dtypes and block layout
   against the server's tensors, index ranges, sizes, checksums, NaN/Inf (publisher and receiver),
   the versions, and the end state (the server's shard as the payload would leave it hashes to the
   trainer's) — the verdict of every rank.  One refusal anywhere and every rank raises the same
   error, naming the ranks and their reasons; no rank writes, each keeps its weights and version, and
   the next ``sync()`` ships everything.  Only then does each rank write its changed blocks, through
   ``Receiver.apply`` (which runs its checks once more: the price of reusing it unchanged).  The write
   itself needs no collective: a rank that dies after the verdict leaves the others on the new version.

Bytes per sync, for P weight elements of b bytes over R TP ranks:
- on the wire, ``replicated_source``: none (the trainer rank beside each server rank holds the full
  weights).  ``FSDPSource``: a rank receives the rows of its shard that other ranks' FSDP shards hold
  (about P/R·b for the sharded weights where positions do not line up with FSDP shards, less where
  they do) plus (R-1)/R of each replicated weight (embedding, norms), against (R-1)/R·P·b for
  gathering every full tensor.  qwen3-8B at TP 2 in bf16, position = rank: 2.74 GB received per
  rank (a third of qkv's rows, half of gate_up's, half the embedding; o, down and the LM head line
  up), against 8.19 GB.  These rows move whole each sync (an Adam step changes nearly every element,
  so a diff before the exchange would ship nearly all of them anyway);
- written per rank: only the changed blocks of its shard (``sync/layout.py``: 64-row blocks), plus
  the two agreements' few hundred bytes of pickled state.  Memory: the publisher's shadow of the
  shard (one more copy of it) and, during a sync, the shard read from the source.
Every collective here times out with the process group's timeout instead of hanging.  Trainer and
server ranks in different processes would put a ``sync`` transport between each rank's publisher and
receiver; that split is not wired here.
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist

from ..sync import Publisher, Receiver, SyncError, SyncStats, apply_between_steps
from .collectives import _size_rank
from .tp import TPPlan, rank_of_positions, shard_weights


def replicated_source(trainer, plan: TPPlan, tp: int, position: int) -> Callable[[], dict[str, torch.Tensor]]:
    """TP position ``position``'s shard of a trainer that holds every full weight (one device, DP)."""
    return lambda: shard_weights(trainer.forward_weights(), plan, tp, position)


class FSDPSource:
    """TP position ``position``'s shard of an FSDP2 trainer over the same ranks as the TP ``group``
    (group rank r holds FSDP shard r: rows [r·c, (r+1)·c) of each weight, c = ceil(N / R)).  Which rows a
    position needs comes from ``shard_weights`` applied to row numbers; one ``all_to_all`` moves exactly
    those rows, each from the rank whose FSDP shard holds it (no arithmetic: the bytes are the weights').
    ``received_bytes``: what the last call received from other ranks."""

    def __init__(self, trainer, plan: TPPlan, group=None, position: int | None = None):
        self.trainer, self.plan, self.group = trainer, plan, group
        self.R, self.rank = _size_rank(group)
        self.position = self.rank if position is None else position
        self.rank_of = rank_of_positions(self.position, group)
        self.received_bytes = 0

    def __call__(self) -> dict[str, torch.Tensor]:
        from torch.distributed.tensor import DTensor, Shard

        R, rank = self.R, self.rank
        weights = self.trainer.forward_weights()
        for n, w in weights.items():
            if isinstance(w, DTensor) and (w.placements != (Shard(0),) or w.device_mesh.get_local_rank() != rank):
                raise ValueError(f"{n!r}: FSDPSource takes dim-0 shards held by group rank = mesh rank, got "
                                 f"{w.placements} at mesh rank {w.device_mesh.get_local_rank()} (group rank {rank})")
        dev = next(iter(weights.values())).device
        need = [shard_weights({n: torch.arange(w.shape[0], device=dev)[:, None] for n, w in weights.items()},
                              self.plan, R, q) for q in range(R)]  # position q's row numbers of every weight, (n, 1)
        names = sorted(need[0])
        src = {n: weights.get(n, weights.get("embed.weight")) for n in names}  # a tied head reads the embedding
        local = {n: w.to_local() if isinstance(w, DTensor) else w for n, w in src.items()}
        row_bytes = {n: math.prod(w.shape[1:]) * local[n].element_size() for n, w in src.items()}

        def held(n: str, s: int, idx: torch.Tensor) -> torch.Tensor:
            """(n,) bool: which of the rows idx group rank s holds (all, on this rank, of an unsharded weight)."""
            if not isinstance(src[n], DTensor):
                return torch.full_like(idx, s == rank, dtype=torch.bool)
            c = -(-src[n].shape[0] // R)
            return (idx >= s * c) & (idx < (s + 1) * c)

        def offset(n: str) -> int:
            return rank * -(-src[n].shape[0] // R) if isinstance(src[n], DTensor) else 0

        sends = []  # to each group rank, the rows its position needs that this rank's shard holds
        for dst in range(R):
            rows = {n: need[self.rank_of.index(dst)][n][:, 0] for n in names}
            sends.append(torch.cat([torch.empty(0, dtype=torch.uint8, device=dev)] + [
                local[n][rows[n][held(n, rank, rows[n])] - offset(n)].contiguous().view(torch.uint8).reshape(-1)
                for n in names]))
        mine = {n: need[self.position][n][:, 0] for n in names}
        sizes = [sum(int(held(n, s, mine[n]).sum()) * row_bytes[n] for n in names) for s in range(R)]
        recv = sends[0]
        if R > 1:
            recv = torch.empty(sum(sizes), dtype=torch.uint8, device=dev)
            dist.all_to_all_single(recv, torch.cat(sends), sizes, [t.numel() for t in sends], group=self.group)
        self.received_bytes = sum(sizes) - sizes[rank]
        out, o = {n: local[n].new_empty(len(mine[n]), *local[n].shape[1:]) for n in names}, 0
        for s in range(R):
            for n in names:
                mask = held(n, s, mine[n])
                k = int(mask.sum()) * row_bytes[n]
                # a copy: a dtype view needs an offset aligned to its element size
                out[n][mask] = recv[o: o + k].clone().view(out[n].dtype).view(-1, *out[n].shape[1:])
                o += k
        return out


class LayoutSync:
    """``sync()`` makes every TP rank's server shard the bytes of the trainer's forward weights.

    trainer:  the trainer module of this rank (``invalidate_caches`` is called once per sync, as
              ``Pair.sync`` does, so derived weights are rebuilt from the masters)
    engine:   this rank's ``Engine`` over a ``tp_server`` model
    source:   () -> this position's shard, named as the server's weights (``replicated_source``,
              ``FSDPSource``)
    group:    the TP group (None: the default group)
    Construction runs the first sync (full), as a ``Pair`` does; every call is collective."""

    def __init__(self, trainer, engine, source: Callable[[], dict[str, torch.Tensor]], group=None, *,
                 rows_per_block: int = 64):
        self.trainer, self.engine, self.group = trainer, engine, group
        self.publisher = Publisher(source, rows_per_block=rows_per_block, check_finite=True)
        self.receiver = Receiver(engine.model.weights, version=engine.weight_version, check_finite=True)
        self.last_sync: SyncStats | None = None
        self.sync()

    def sync(self, *, full: bool = False) -> int:
        """Publish, check on every rank, then write on every rank; returns the new weight version (the
        same on every rank).  A refusal on any rank raises that rank's error type on every rank, with
        every refusing rank's reason; nothing is written anywhere."""
        invalidate = getattr(self.trainer, "invalidate_caches", None)
        if invalidate is not None:
            invalidate()
        served = self.engine.weight_version
        states = self._gather((max(self.publisher.version, served),
                               full or not self.publisher.version == self.receiver.version == served))
        self.publisher.version = max(v for v, _ in states)  # versions refused on some ranks are skipped
        full = any(f for _, f in states)
        refusal = None
        try:
            payload = self.publisher.publish(full=full)
            writes = self.receiver.check(payload)
        except Exception as e:  # noqa: BLE001 -- every failure is a refusal the other ranks must hear of
            refusal = (type(e) if type(e).__module__.startswith(("builtins", "alignzoo.sync")) else SyncError, str(e))
        verdicts = self._gather(refusal)
        refused = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if refused:
            cls = refused[0][1][0]
            reasons = "; ".join(f"rank {r}: {c.__name__}: {msg}" for r, (c, msg) in refused)
            raise cls(f"weight sync refused by {len(refused)} of {len(verdicts)} server ranks, nothing was written "
                      f"on any rank (each keeps its weights and weight version {self.engine.weight_version}; the "
                      f"next sync ships every block): {reasons}")
        version = apply_between_steps(self.engine, self.receiver, payload, writes)
        self.last_sync = payload.stats
        return version

    def _gather(self, obj) -> list:
        R, _ = _size_rank(self.group)
        if R == 1:
            return [obj]
        out = [None] * R
        dist.all_gather_object(out, obj, group=self.group)
        return out
