"""``alignzoo bisect``: feed the trainer and another path the same sequences,
record every capture point on both (``models/capture.py``) and find the
first op where their bytes part.

Paths (``against``):
  server        the pair's engine: prefill scoring, and decode (1 token/step)
  vendor        the model's vendor server (torch's kernels) on the same weights
  trainer-fp32  the same trainer and weights in fp32 (where precision goes)

For each path the report names the first op in forward order with a
differing row, the first (sequence, position) there, the element, both
values and the max |Δ| of that op, then every later op that differs.  Cache
writes (K/V rows; a recurrent model's states) are capture points too, so
prefill's and decode's cache bytes are compared at every token.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..common.ladder import _as_bits as _bits
from .capture import Recorder
from .checks import decode_prefixes, logprob_mismatch, scoring_batch

AGAINST = ("server", "vendor", "trainer-fp32")
DECODE_TOKENS = 160  # decode steps one token at a time: the decode path scores this many tokens a sequence
SHOWN = 6  # ops listed after the first difference


@dataclass
class OpDiff:
    """Where op ``name`` differs: ``rows`` of ``compared`` rows; the first
    (sequence, position) in that order, its first differing element (flat
    index into the row), both values, and the op's max |Δ| over all rows."""

    name: str
    rows: int
    compared: int
    key: tuple[int, int]
    element: int
    ours: float
    theirs: float
    max_abs: float


@dataclass
class PathReport:
    path: str
    order: list[str] = field(default_factory=list)  # ops compared, in forward order
    ops: int = 0  # ops compared
    rows: int = 0  # (sequence, position) rows compared, over all ops
    diffs: list[OpDiff] = field(default_factory=list)  # in forward order
    one_sided: list[str] = field(default_factory=list)  # ops only one side records
    conflicts: dict[str, int] = field(default_factory=dict)  # rows a side recorded twice with other bits
    tokens: int = 0
    tokens_differing: int = 0
    max_abs_logprob: float = 0.0

    @property
    def equal(self) -> bool:
        return not self.diffs and not self.tokens_differing and not self.conflicts

    def lines(self) -> list[str]:
        head = f"{self.path}: {self.ops} ops, {self.rows} rows and {self.tokens} log-probs compared"
        if self.equal:
            return [head + ": every byte equal"]
        out = [head]
        if self.diffs:
            d = self.diffs[0]
            out.append(f"  first difference: {d.name}, sequence {d.key[0]}, position {d.key[1]}, element {d.element}: "
                       f"trainer {d.ours!r} vs {self.path.split()[0]} {d.theirs!r}; max |Δ| in that op {d.max_abs:.3g} "
                       f"({d.rows} of {d.compared} rows differ)")
            for d in self.diffs[1:1 + SHOWN]:
                out.append(f"  then {d.name}: {d.rows} of {d.compared} rows, max |Δ| {d.max_abs:.3g}, first at "
                           f"sequence {d.key[0]}, position {d.key[1]}")
            if len(self.diffs) > 1 + SHOWN:
                last = self.diffs[-1]
                out.append(f"  ... and {len(self.diffs) - 1 - SHOWN} more ops, the last {last.name} "
                           f"(max |Δ| {last.max_abs:.3g})")
        for name, n in self.conflicts.items():
            out.append(f"  {name}: {n} rows recorded twice with other bits on one side")
        out.append(f"  log-probs: {self.tokens_differing} of {self.tokens} tokens differ, "
                   f"max |Δ| {self.max_abs_logprob:.3g}")
        if self.one_sided:
            out.append(f"  recorded on one side only: {', '.join(self.one_sided)}")
        return out


def compare(ours: Recorder, theirs: Recorder, path: str) -> PathReport:
    """Every op both sides recorded, row by row on their common keys."""
    rep = PathReport(path, conflicts={**ours.conflicts, **{f"{k} ({path})": v for k, v in theirs.conflicts.items()}})
    rep.one_sided = [n for n in ours.order if n not in theirs.rows] + [n for n in theirs.order if n not in ours.rows]
    for name in ours.order:
        if name not in theirs.rows:
            continue
        a, b = ours.rows[name], theirs.rows[name]
        keys = sorted(set(a) & set(b))
        if not keys:
            continue
        A, B = torch.stack([a[k] for k in keys]), torch.stack([b[k] for k in keys])
        rep.ops += 1
        rep.order.append(name)
        rep.rows += len(keys)
        if A.dtype == B.dtype and A.shape == B.shape:
            neq = (_bits(A) != _bits(B)).reshape(len(keys), -1)
        else:
            neq = (A.double() != B.double()).reshape(len(keys), -1)
        bad = neq.any(1)
        if not bool(bad.any()):
            continue
        r = int(bad.nonzero()[0, 0])
        e = int(neq[r].nonzero()[0, 0])
        delta = (A.double() - B.double()).abs()
        delta = delta[torch.isfinite(delta)]
        rep.diffs.append(OpDiff(name, int(bad.sum()), len(keys), keys[r], e, float(A[r].reshape(-1)[e]),
                                float(B[r].reshape(-1)[e]), float(delta.max()) if delta.numel() else float("nan")))
    return rep


def _logprob_diff(rep: PathReport, ours: list[torch.Tensor], theirs: list[torch.Tensor]) -> None:
    m, rep.max_abs_logprob = logprob_mismatch(ours, theirs)
    rep.tokens, rep.tokens_differing = m.tokens, m.differing


def _record_trainer(trainer, seqs, plens, sp) -> tuple[Recorder, list[torch.Tensor]]:
    rec = Recorder(seqs)
    with rec.attached_trainer(trainer), torch.no_grad():
        lps = trainer.logprobs(seqs, plens, sp)
    return rec, lps


def _record_server(engine, seqs, plens, sp, chunk_tokens=None) -> tuple[Recorder, list[torch.Tensor]]:
    rec = Recorder(seqs)
    with rec.attached_server(engine):
        lps = engine.score(seqs, plens, sp, chunk_tokens=chunk_tokens)
    return rec, lps


def _path(name, trainer, ours_seqs, plens, sp, record) -> tuple[PathReport, Recorder]:
    t_rec, t_lps = _record_trainer(trainer, ours_seqs, plens, sp)
    o_rec, o_lps = record()
    rep = compare(t_rec, o_rec, name)
    _logprob_diff(rep, t_lps, o_lps)
    return rep, o_rec


def _server_only(prefill: Recorder, decode: Recorder, path: str) -> PathReport:
    """The cache writes only a server makes (recurrent states at 64 boundaries): prefill's
    against decode's, on the positions both reached."""
    ops = [n for n in prefill.order if n.endswith(".state")]
    a, b = Recorder(()), Recorder(())
    for rec, src in ((a, prefill), (b, decode)):
        rec.order = [n for n in ops if n in src.rows]
        rec.rows = {n: src.rows[n] for n in rec.order}
    rep = compare(a, b, path)
    rep.one_sided = []
    return rep


def bisect(pair, *, against: str = "server", length: int = 300, batch: int = 3, seed: int = 0,
           decode_tokens: int = DECODE_TOKENS, progress=None) -> list[PathReport]:
    """Compare ``pair``'s trainer with the path ``against`` names on
    ``batch`` random sequences of mixed lengths up to ``length``; one report
    per path (prefill, decode).  The pair's engine must run eager
    (``cuda_graphs=False``): a replayed graph runs no capture point."""
    if against not in AGAINST:
        raise ValueError(f"against must be one of {', '.join(AGAINST)}, got {against!r}")
    say = progress or (lambda s: None)
    trainer, engine = pair.trainer, pair.server
    seqs, plens, sp = scoring_batch(pair.config.vocab_size, length, batch, seed)
    n_dec = min(length, decode_tokens)
    short, p_short = decode_prefixes(seqs, plens, n_dec)
    if against == "trainer-fp32":
        say("building the fp32 trainer")
        other = _fp32_copy(pair)
        say("recording the trainer and the fp32 trainer")
        return [_path("trainer-fp32", trainer, seqs, plens, sp, lambda: _record_trainer(other, seqs, plens, sp))[0]]
    server = engine if against == "server" else _vendor_engine(pair)
    say(f"recording the trainer and the {against} server's prefill")
    pre, pre_rec = _path(f"{against} prefill", trainer, seqs, plens, sp, lambda: _record_server(server, seqs, plens, sp))
    say(f"recording the trainer and the {against} server's decode (1 token a step, {n_dec} tokens)")
    dec, dec_rec = _path(f"{against} decode", trainer, short, p_short, sp,
                         lambda: _record_server(server, short, p_short, sp, chunk_tokens=1))
    reports = [pre, dec]
    if any(n.endswith(".state") for n in dec_rec.order):  # a recurrent model: its slot states at every boundary
        say(f"recording the {against} server's prefill in 64-token chunks for its states")
        chunked, _ = _record_server(server, short, p_short, sp, chunk_tokens=64)
        reports.append(_server_only(chunked, dec_rec, f"{against} states, 64-token prefill vs decode"))
    return reports


def _vendor_engine(pair):
    """The model's vendor server on a copy of the pair's server weights, eager."""
    from ..common.engine import Engine
    from . import model_module

    spec = model_module(pair.name).SPEC
    model = pair.server.model
    weights = {n: t.clone() for n, t in model.weights.items()}
    return Engine(spec.vendor_server_cls()(pair.config, weights), num_pages=pair.server.num_pages,
                  cuda_graphs=False, freeze_gc=False)


def _fp32_copy(pair):
    """The pair's trainer, rebuilt in fp32 with its weights upcast."""
    from . import model_module

    spec = model_module(pair.name).SPEC
    t = pair.trainer
    other = spec.trainer_cls(pair.config, device=t.device, dtype=torch.float32)
    with torch.no_grad():
        other.load_state_dict({n: p.float() for n, p in t.state_dict().items()})
    return other
