"""The payload of one weight version: the changed blocks of every tensor, with checksums."""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from .checksum import checksums_and_nonfinite, dtype_name, tensor_checksum
from .layout import Layout

FORMAT = "alignzoo.sync/1"


class SyncError(RuntimeError):
    """A payload the receiver refuses (or a publisher will not build).
    Raised before any write: the receiver's weights are untouched."""


class VersionSkew(SyncError):
    """The payload is a delta against another version than the receiver holds."""


class LayoutMismatch(SyncError):
    """Names, shapes, dtypes or block layout differ between payload and receiver."""


class CorruptPayload(SyncError):
    """Torn or corrupted payload: sizes or checksums do not match."""


class EndStateMismatch(SyncError):
    """The payload's blocks, staged over the receiver's weights, do not hash
    to what the publisher had (checked before anything is written).  When the
    receiver's weights are no longer the version it applied last (changed out
    of band), it then holds no valid version, and only a full payload repairs
    it; otherwise the payload was damaged and the receiver keeps its version."""


class NonFiniteWeights(SyncError):
    """A tensor holds NaN or Inf (a publisher or receiver built with
    ``check_finite=True``, as ``Pair`` builds them)."""


@dataclass(eq=False)
class TensorDelta:
    """The changed blocks of one tensor (see ``layout.py`` for the blocks)."""
    shape: tuple[int, ...]
    dtype: torch.dtype
    layout: Layout
    indices: torch.Tensor  # (n,) int64, ascending flat block indices
    data: torch.Tensor  # (m,) dtype: the elements of those blocks, in memory order
    checksum: str  # "<indices checksum><data checksum>", 2 x 16 hex
    nonfinite: int = 0  # NaN/Inf elements of data, when the publisher counted them

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * self.indices.element_size() + self.data.numel() * self.data.element_size()

    @property
    def data_checksum(self) -> int:
        """``tensor_checksum(data)``, as ``checksum`` says: of a tensor's bytes when all its blocks ship."""
        return int(self.checksum[16:], 16)

    def compute_checksum(self) -> str:
        return f"{tensor_checksum(self.indices):016x}{tensor_checksum(self.data):016x}"

    def checksum_and_nonfinite(self) -> tuple[str, int]:
        """(``compute_checksum()``, the NaN/Inf elements of ``data``) from one read of the bytes."""
        (ci, _), (cd, bad) = checksums_and_nonfinite([self.indices, self.data])
        return f"{ci:016x}{cd:016x}", bad

    def manifest(self) -> dict:
        return {"shape": list(self.shape), "dtype": dtype_name(self.dtype), "view": list(self.layout.view),
                "block": list(self.layout.block), "num_indices": self.indices.numel(),
                "num_data": self.data.numel(), "checksum": self.checksum}


@dataclass
class SyncStats:
    blocks_changed: int
    blocks_total: int
    bytes_shipped: int  # block indices + data
    bytes_full: int  # all weights
    tensors_changed: int
    tensors_total: int
    seconds: float  # publish time: diff, gather, checksums

    def __str__(self) -> str:
        frac = self.bytes_shipped / max(self.bytes_full, 1)
        return (f"{self.blocks_changed}/{self.blocks_total} blocks in {self.tensors_changed}/{self.tensors_total} "
                f"tensors, {_size(self.bytes_shipped)} of {_size(self.bytes_full)} ({frac:.2%}), {self.seconds:.3f} s")


@dataclass(eq=False)
class Payload:
    """Weights version ``version`` as a delta against ``base_version``.

    ``tensors`` names every tensor of the model (unchanged ones with no
    blocks), so the receiver can check it holds the same set.  ``full``: every
    block is shipped (the first publish, or ``publish(full=True)``): it
    applies on any older version.  ``end_checksum`` is ``weights_checksum``
    of the publisher's weights, which the receiver's must equal after the
    apply.  ``manifest_hash`` is sha256 of ``manifest()``."""
    version: int
    base_version: int
    full: bool
    tensors: dict[str, TensorDelta]
    end_checksum: str
    manifest_hash: str = ""
    stats: SyncStats | None = None

    def manifest(self) -> dict:
        """Everything but the block data (which the per-tensor checksums cover), as JSON-able dict."""
        return {"format": FORMAT, "version": self.version, "base_version": self.base_version, "full": self.full,
                "end_checksum": self.end_checksum,
                "tensors": {n: self.tensors[n].manifest() for n in sorted(self.tensors)}}

    def compute_manifest_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.manifest(), sort_keys=True).encode()).hexdigest()

    def changed_blocks(self) -> dict[str, list[int]]:
        """{name: ascending block indices} of the tensors with changed blocks."""
        return {n: d.indices.tolist() for n, d in sorted(self.tensors.items()) if d.indices.numel()}

    def header(self) -> dict:
        """What a transport sends before the tensors: manifest, its hash, stats."""
        return {"manifest": self.manifest(), "manifest_hash": self.manifest_hash,
                "stats": asdict(self.stats) if self.stats is not None else None}

    @classmethod
    def from_header(cls, header: dict, arrays: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Payload:
        """Rebuild a payload from ``header()`` and ``{name: (indices, data)}``.
        Raises CorruptPayload if the header is malformed; sizes and checksums
        are the receiver's to check."""
        try:
            m = header["manifest"]
            if m.get("format") != FORMAT:
                raise ValueError(f"format {m.get('format')!r}, expected {FORMAT!r}")
            tensors = {}
            for name, t in m["tensors"].items():
                idx, data = arrays[name]
                tensors[name] = TensorDelta(tuple(t["shape"]), parse_dtype(t["dtype"]),
                                            Layout(tuple(t["view"]), tuple(t["block"])), idx, data, t["checksum"])
            stats = SyncStats(**header["stats"]) if header.get("stats") else None
            return cls(int(m["version"]), int(m["base_version"]), bool(m["full"]), tensors, m["end_checksum"],
                       header["manifest_hash"], stats)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptPayload(f"malformed payload header: {type(e).__name__}: {e}") from None


def parse_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""
