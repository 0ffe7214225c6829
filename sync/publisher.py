"""Trainer side: diff the forward weights against the last shipped version."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch

from .checksum import combine_checksums, tensor_checksum
from .layout import Layout, as_int, layout_of
from .payload import NonFiniteWeights, Payload, SyncStats, TensorDelta


class Publisher:
    """Builds one ``Payload`` per optimizer step with only the changed blocks.

    ``get_weights()`` returns the trainer's forward weights ``{name: tensor}``
    (what the next forward reads: bf16/fp32 parameters, float8 codes and their
    scales), on any device.  The publisher keeps a shadow copy of the last
    shipped version on the same device (one more copy of the weights) and
    compares bytes against it with a few vectorized ops per tensor.
    ``rows_per_block`` (R) sets the row blocks of non-float8 tensors.
    ``check_finite``: refuse to publish changed blocks that hold NaN/Inf
    (``NonFiniteWeights``, naming the tensors), counted in the pass that
    checksums them; the publisher is then as it was before the call.
    """

    def __init__(self, get_weights: Callable[[], dict[str, torch.Tensor]], *, rows_per_block: int = 64,
                 check_finite: bool = False):
        if not callable(get_weights):
            raise TypeError(f"get_weights must be a callable returning {{name: tensor}}, "
                            f"got {type(get_weights).__name__}")
        if isinstance(rows_per_block, bool) or not isinstance(rows_per_block, int) or rows_per_block < 1:
            raise ValueError(f"rows_per_block must be an int >= 1, got {rows_per_block!r}")
        self.get_weights = get_weights
        self.rows_per_block = rows_per_block
        self.check_finite = check_finite
        self.version = 0
        self._shadow: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, Layout] = {}
        self._sums: dict[str, int] = {}  # tensor_checksum of each shadow tensor

    def publish(self, *, full: bool = False) -> Payload:
        """Diff the current weights against the last published version and
        return the payload of version ``self.version + 1``.  The first publish,
        and ``full=True`` (to resync a receiver that lost versions), ship every
        block.  The payload's tensors are copies: the trainer may step on."""
        t0 = time.perf_counter()
        weights = self._read()
        full = full or not self._shadow
        layouts = self._layouts if self._shadow else \
            {n: layout_of(n, w, weights, self.rows_per_block) for n, w in weights.items()}
        with torch.no_grad():
            tensors = {name: self._delta(name, weights[name], layouts[name], full) for name in sorted(weights)}
        bad = {n: d.nonfinite for n, d in tensors.items() if d.nonfinite}
        if bad:
            raise NonFiniteWeights(f"the trainer's weights hold NaN/Inf values in changed blocks: "
                                   f"{', '.join(f'{n!r} ({k})' for n, k in bad.items())}; v{self.version + 1} was not "
                                   f"published (the server keeps v{self.version})")
        self._layouts = layouts
        try:
            with torch.no_grad():
                for name, d in tensors.items():
                    self._update_shadow(name, weights[name], d)
        except BaseException:
            self._shadow.clear()  # partly updated: the next publish ships everything
            raise
        end = combine_checksums({n: (w.dtype, tuple(w.shape), self._sums[n]) for n, w in self._shadow.items()})
        base, self.version = self.version, self.version + 1
        payload = Payload(self.version, base, full, tensors, end)
        payload.manifest_hash = payload.compute_manifest_hash()
        if any(w.is_cuda for w in weights.values()):
            torch.cuda.synchronize()
        payload.stats = SyncStats(
            blocks_changed=sum(d.indices.numel() for d in tensors.values()),
            blocks_total=sum(lay.num_blocks for lay in self._layouts.values()),
            bytes_shipped=sum(d.nbytes for d in tensors.values()),
            bytes_full=sum(w.numel() * w.element_size() for w in weights.values()),
            tensors_changed=sum(d.indices.numel() > 0 for d in tensors.values()), tensors_total=len(tensors),
            seconds=time.perf_counter() - t0)
        return payload

    def _delta(self, name: str, w: torch.Tensor, lay: Layout, full: bool) -> TensorDelta:
        """One tensor's changed blocks, NaN/Inf counted (``check_finite``); the shadow is not touched yet."""
        shadow = self._shadow.get(name)
        indices, data = self._diff(w, shadow, lay, full or shadow is None)
        delta = TensorDelta(tuple(w.shape), w.dtype, lay, indices, data, "")
        if self.check_finite:
            delta.checksum, delta.nonfinite = delta.checksum_and_nonfinite()
        else:
            delta.checksum = delta.compute_checksum()
        return delta

    def _update_shadow(self, name: str, w: torch.Tensor, delta: TensorDelta) -> None:
        shadow = self._shadow.get(name)
        if shadow is not None and not delta.indices.numel():
            return
        if shadow is None:
            self._shadow[name] = shadow = torch.empty_like(w, memory_format=torch.contiguous_format)
        if delta.indices.numel() == delta.layout.num_blocks:  # the data is the whole tensor, hashed by _delta
            shadow.view(-1).copy_(delta.data)
            self._sums[name] = delta.data_checksum
        else:
            shadow.copy_(w)
            self._sums[name] = tensor_checksum(shadow)

    @staticmethod
    def _diff(w: torch.Tensor, shadow: torch.Tensor | None, lay: Layout,
              full: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(changed block indices (n,) int64, their data (m,) w.dtype) of one tensor."""
        dev = w.device
        if lay.num_blocks == 0:
            return torch.empty(0, dtype=torch.int64, device=dev), torch.empty(0, dtype=w.dtype, device=dev)
        if full:
            return torch.arange(lay.num_blocks, device=dev), w.reshape(-1).clone()
        cur = as_int(w).reshape(lay.view)  # (E, N, M)
        ne = cur != as_int(shadow).view(lay.view)
        blocks = lay.changed_blocks(ne)  # (E, nbr, nbc)
        indices = blocks.view(-1).nonzero().view(-1)
        if indices.numel() == lay.num_blocks:
            return indices, w.reshape(-1).clone()
        if indices.numel() == 0:
            return indices, torch.empty(0, dtype=w.dtype, device=dev)
        return indices, cur[lay.mask(blocks)].reshape(-1).view(w.dtype)

    def _read(self) -> dict[str, torch.Tensor]:
        weights = self.get_weights()
        if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                    for k, v in weights.items()):
            raise TypeError("get_weights() must return a dict {name: tensor}")
        weights = {n: w.detach() for n, w in weights.items()}
        if self._shadow:
            added = sorted(set(weights) - set(self._shadow))
            gone = sorted(set(self._shadow) - set(weights))
            if added or gone:
                raise ValueError(f"the trainer's weights changed names since v{self.version}: "
                                 f"new {added[:5]}, gone {gone[:5]}")
            for n, w in weights.items():
                s = self._shadow[n]
                if (w.shape, w.dtype, w.device) != (s.shape, s.dtype, s.device):
                    raise ValueError(f"tensor {n!r} changed since v{self.version}: {tuple(s.shape)} {s.dtype} on "
                                     f"{s.device} -> {tuple(w.shape)} {w.dtype} on {w.device}")
        return weights
