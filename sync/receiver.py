"""Server side: validate a payload completely, its end state included, then write it in place."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .checksum import combine_checksums, tensor_checksums, weights_checksum
from .layout import Layout, as_int
from .payload import CorruptPayload, EndStateMismatch, LayoutMismatch, NonFiniteWeights, Payload, VersionSkew


@dataclass
class _Write:
    target: torch.Tensor  # the receiver's tensor as (E, N, M) integers, sharing its storage
    layout: Layout
    indices: torch.Tensor  # (n,) on the target's device
    data: torch.Tensor  # (m,) integers on the target's device
    name: str = ""

    @property
    def whole(self) -> bool:
        """Every block ships: the data is the whole tensor."""
        return self.indices.numel() == self.layout.num_blocks


class Receiver:
    """Holds the server's weights ``{name: tensor}`` (the very tensors the
    engine reads; CUDA graphs may point at them) and applies payloads to them
    in place: never rebinding a name, only copying into the blocks.

    ``version`` is the weights version held: 0 at the start (the first,
    full, payload applies on it), None once its weights are known to be no
    version (they changed out of band: only a full payload applies then).
    ``verify_end_state``: before writing, compare ``weights_checksum`` of
    the weights as the payload would leave them with the publisher's (a
    tensor shipped whole checksums as its data, already checked; the others
    are hashed in one pass on their device, each partly changed one staged
    in a copy), so a payload that would not give the trainer's bytes writes
    nothing.  ``check_finite``: refuse a payload whose data holds NaN/Inf
    (``NonFiniteWeights``), counted in the pass that checksums the data.
    """

    def __init__(self, weights: dict[str, torch.Tensor], *, version: int = 0, verify_end_state: bool = True,
                 check_finite: bool = False):
        if not isinstance(weights, dict):
            raise TypeError(f"weights must be a dict {{name: tensor}}, got {type(weights).__name__}")
        for n, w in weights.items():
            if not isinstance(w, torch.Tensor):
                raise TypeError(f"weights[{n!r}] is a {type(w).__name__}, not a tensor")
            if not w.is_contiguous():
                raise ValueError(f"weights[{n!r}] is not contiguous: payload blocks are written through a "
                                 f"contiguous view of the tensor's storage")
        self.weights = weights
        self.version: int | None = version
        self.verify_end_state = verify_end_state
        self.check_finite = check_finite
        self._end: str | None = None  # weights_checksum of the version applied last

    def apply(self, payload: Payload) -> None:
        """Check everything (versions, names, shapes, dtypes, block layout,
        index ranges, sizes, checksums, finiteness, the end state), then copy
        the changed blocks into the weights.  A refused payload raises
        ``SyncError`` (``VersionSkew``, ``LayoutMismatch``, ``CorruptPayload``,
        ``NonFiniteWeights``, ``EndStateMismatch``) before anything is written."""
        self.write(payload, self.check(payload))

    def check(self, payload: Payload) -> list[_Write]:
        """``apply``'s checks alone, nothing written -> the writes ``write`` makes (a caller that must hear
        from several receivers before any writes: ``parallel/layout_sync.py``)."""
        writes = self._validate(payload)
        if self.verify_end_state:
            self._check_end_state(payload, writes)
        return writes

    def write(self, payload: Payload, writes: list[_Write]) -> None:
        """Copy ``check(payload)``'s writes into the weights and take the payload's version."""
        try:
            with torch.no_grad():
                for wr in writes:
                    _write(wr, wr.target)
        except BaseException:
            self.version = self._end = None  # half-written
            raise
        self.version, self._end = payload.version, payload.end_checksum

    def _check_end_state(self, p: Payload, writes: list[_Write]) -> None:
        """The weights as the payload would leave them must hash to the publisher's."""
        sums = {wr.name: p.tensors[wr.name].data_checksum for wr in writes if wr.whole}  # checked by _validate
        staged = {wr.name: _write(wr, wr.target.clone()) for wr in writes if wr.indices.numel() and not wr.whole}
        rest = [n for n in self.weights if n not in sums]
        sums.update(zip(rest, tensor_checksums([staged.get(n, self.weights[n]) for n in rest])))
        got = combine_checksums({n: (w.dtype, tuple(w.shape), sums[n]) for n, w in self.weights.items()})
        if got == p.end_checksum:
            return
        intact = self._end is not None and weights_checksum(self.weights) == self._end
        if intact:  # the server is still the version it applied last: the payload is what is wrong
            raise EndStateMismatch(
                f"payload v{p.version} would leave the server's weights checksumming {got[:16]}… but the trainer's "
                f"are {p.end_checksum[:16]}…: its blocks are damaged; nothing was written, the server keeps "
                f"v{self.version}; resync with a full payload (Publisher.publish(full=True))")
        self.version = self._end = None
        raise EndStateMismatch(
            f"payload v{p.version} would leave the server's weights checksumming {got[:16]}… but the trainer's are "
            f"{p.end_checksum[:16]}…: the server's weights were not v{p.base_version} before the apply (changed "
            f"out of band?); nothing was written, and the server holds no valid version until a full payload "
            f"(Publisher.publish(full=True), or pair.sync(), which sends one itself)")

    # ------------------------------------------------------------ checks
    def _validate(self, p: Payload) -> list[_Write]:
        if not isinstance(p, Payload):
            raise TypeError(f"apply takes a Payload, got {type(p).__name__}")
        self._check_version(p)
        unknown = sorted(set(p.tensors) - set(self.weights))
        missing = sorted(set(self.weights) - set(p.tensors))
        if unknown or missing:
            raise LayoutMismatch(f"payload v{p.version} and the server hold different tensors: "
                                 f"unknown to the server {unknown[:5]}, missing from the payload {missing[:5]}")
        writes = []
        for name in sorted(p.tensors):
            d, w = p.tensors[name], self.weights[name]
            if (tuple(d.shape), d.dtype) != (tuple(w.shape), w.dtype):
                raise LayoutMismatch(f"tensor {name!r}: the payload has {tuple(d.shape)} {d.dtype}, "
                                     f"the server {tuple(w.shape)} {w.dtype}")
            try:
                d.layout.check(w.numel())
            except ValueError as e:
                raise LayoutMismatch(f"tensor {name!r}: bad block layout: {e}") from None
            writes.append(self._check_blocks(name, d, w, p.full))
        nonfinite = {}
        for name in sorted(p.tensors):
            d = p.tensors[name]
            got, bad = d.checksum_and_nonfinite() if self.check_finite else (d.compute_checksum(), 0)
            if got != d.checksum:
                raise CorruptPayload(f"tensor {name!r}: checksum mismatch (payload says {d.checksum}, its block "
                                     f"indices and data hash to {got}): the payload was corrupted in transit")
            if bad:
                nonfinite[name] = bad
        if nonfinite:
            raise NonFiniteWeights(f"payload v{p.version} holds NaN/Inf values: "
                                   f"{', '.join(f'{n!r} ({k})' for n, k in nonfinite.items())}; nothing was written, "
                                   f"the server keeps v{self.version}")
        got = p.compute_manifest_hash()
        if got != p.manifest_hash:
            raise CorruptPayload(f"payload v{p.version}: manifest hash mismatch (says {p.manifest_hash[:16]}…, "
                                 f"is {got[:16]}…): its metadata was altered in transit")
        for wr in writes:  # last: a failed transfer leaves nothing half-written
            wr.indices = wr.indices.to(wr.target.device)
            wr.data = as_int(wr.data.to(wr.target.device))
        return writes

    def _check_version(self, p: Payload) -> None:
        if not isinstance(p.version, int) or not isinstance(p.base_version, int) or p.version <= p.base_version:
            raise VersionSkew(f"payload version {p.version!r} must be an int above its base version {p.base_version!r}")
        if p.full:
            if self.version is not None and p.version <= self.version:
                raise VersionSkew(f"full payload v{p.version} is not newer than the server's v{self.version}")
        elif self.version is None:
            raise VersionSkew(f"payload v{p.version} is a delta against v{p.base_version}, but the server holds no "
                              f"valid version (an earlier apply failed its end-state check): send a full payload")
        elif p.base_version != self.version:
            raise VersionSkew(f"payload v{p.version} is a delta against v{p.base_version}, but the server holds "
                              f"v{self.version}: apply the versions in order, or resync with a full payload")

    @staticmethod
    def _check_blocks(name: str, d, w: torch.Tensor, full: bool) -> _Write:
        lay, idx, data = d.layout, d.indices, d.data
        if not isinstance(idx, torch.Tensor) or idx.dtype != torch.int64 or idx.dim() != 1:
            raise CorruptPayload(f"tensor {name!r}: block indices must be a 1-D int64 tensor")
        if not isinstance(data, torch.Tensor) or data.dtype != w.dtype or data.dim() != 1:
            raise CorruptPayload(f"tensor {name!r}: data must be a 1-D {w.dtype} tensor, got "
                                 f"{getattr(data, 'dtype', type(data).__name__)} {tuple(getattr(data, 'shape', ()))}")
        n = idx.numel()
        if n:
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= lay.num_blocks:
                raise CorruptPayload(f"tensor {name!r}: block index out of range [{lo}, {hi}]: the tensor has "
                                     f"{lay.num_blocks} blocks (grid {lay.grid})")
            if n > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise CorruptPayload(f"tensor {name!r}: block indices are not strictly increasing")
        if full and n != lay.num_blocks:
            raise CorruptPayload(f"tensor {name!r}: a full payload must ship all {lay.num_blocks} blocks, got {n}")
        need = lay.numel_of(idx) if n else 0
        if data.numel() != need:
            raise CorruptPayload(f"tensor {name!r}: torn payload: {data.numel()} data elements for {n} blocks "
                                 f"of {need} elements")
        return _Write(as_int(w).view(lay.view), lay, idx, data, name)


def _write(wr: _Write, into: torch.Tensor) -> torch.Tensor:
    """Copy ``wr``'s blocks into ``into`` (its target, or a copy of it: (E, N, M) integers); returns ``into``."""
    if wr.whole:
        into.view(-1).copy_(wr.data)
    elif wr.indices.numel():
        mask = wr.layout.mask(wr.layout.blocks_from_indices(wr.indices))
        into[mask] = wr.data.view(-1, wr.layout.view[2]) if mask.dim() == 2 else wr.data
    return into


def apply_between_steps(engine, receiver: Receiver, payload: Payload, writes: list[_Write] | None = None) -> int:
    """Apply ``payload`` through ``engine.update_weights``: between two engine
    steps, so no forward reads half-written weights; completions sampled
    after it carry ``weight_version == payload.version``.  Returns that
    version.  A refused payload raises and leaves the engine's version as it was.
    ``writes``: ``receiver.check(payload)``'s, already checked (not checked again)."""
    def fn():
        if writes is None:
            receiver.apply(payload)
        else:
            receiver.write(payload, writes)
        engine.set_weight_version(payload.version - 1)  # update_weights adds one

    version = engine.update_weights(fn)
    if version != payload.version:
        raise RuntimeError(f"engine.update_weights returned version {version}, expected {payload.version}")
    return version
