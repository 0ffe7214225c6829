"""Rungs 1 and 2 of the verification ladder, for any row-wise primitive.

Rung 1: run the same call twice and compare bytes.
Rung 2: feed the same rows inside other batches (sizes 1..N, shuffled order,
padding rows, other launch configurations) and compare each row's bytes with
its bytes in the reference batch.

A primitive is "row-wise" when output row i depends only on input row i and on
the shared arguments (weights, vocabulary, ...).  Each op folder has a
``checks.py`` whose ``ladder(device)`` builds its inputs and calls these.

Bits are compared as integers (``bitwise_equal``), so NaN payloads and signed
zeros count, unlike ``torch.equal`` on floats.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

_INT_VIEW = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


@dataclass
class RungResult:
    primitive: str
    rung: int
    check: str
    passed: bool
    compared: int  # rows (or tensors) compared
    differing: int  # of those, how many differ in at least one bit
    detail: str = ""
    extra: dict = field(default_factory=dict)


def _as_bits(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.bool or not (t.is_floating_point() or t.is_complex()):
        return t
    return t.contiguous().view(_INT_VIEW[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when a and b have the same shape, dtype and bytes."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_as_bits(a), _as_bits(b))


def rows_differing(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Bool mask over the leading dim: True where the row's bits differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"cannot compare {tuple(a.shape)}/{a.dtype} with {tuple(b.shape)}/{b.dtype}")
    ne = _as_bits(a) != _as_bits(b)
    return ne.reshape(ne.shape[0], -1).any(dim=1) if ne.dim() > 1 else ne


def _outputs(out) -> tuple[torch.Tensor, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def rung1_repeat(primitive: str, fn: Callable, *args, **kwargs) -> RungResult:
    """Run fn twice on the same inputs; every output must have the same bytes."""
    first = _outputs(fn(*args, **kwargs))
    second = _outputs(fn(*args, **kwargs))
    bad = sum(not bitwise_equal(a, b) for a, b in zip(first, second))
    return RungResult(primitive, 1, "run twice", bad == 0, len(first), bad)


def _pad_like(t: torch.Tensor, n: int) -> torch.Tensor:
    """Padding rows: zeros for floats, copies of row 0 for integer inputs
    (ids, positions and seeds must stay valid)."""
    if t.is_floating_point():
        return torch.zeros((n, *t.shape[1:]), dtype=t.dtype, device=t.device)
    return t[:1].expand(n, *t.shape[1:]).clone()


def rung2_rows(
    primitive: str,
    fn: Callable,
    rows: Sequence[torch.Tensor],
    *,
    shared: dict | None = None,
    configs: Sequence[dict] = ({},),
    batch_sizes: Sequence[int] = (1, 2, 3, 7),
    seed: int = 0,
) -> RungResult:
    """Each row's output bytes must not depend on the batch around it.

    ``fn(*row_tensors, **shared, **config)`` returns a tensor (or tuple of
    tensors) whose leading dim is the row dim.  The reference is the whole
    batch under ``configs[0]``; every config is then tried on: the whole batch
    reversed, a shuffled batch with padding rows mixed in, and random subsets
    of each size in ``batch_sizes``.
    """
    shared = shared or {}
    n = rows[0].shape[0]
    if any(r.shape[0] != n for r in rows):
        raise ValueError("all row tensors need the same leading dim")
    ref = _outputs(fn(*rows, **shared, **configs[0]))
    g = torch.Generator().manual_seed(seed)
    trials: list[tuple[str, torch.Tensor, int]] = [("reversed", torch.arange(n - 1, -1, -1), 0)]
    trials.append(("shuffled+pad", torch.randperm(n, generator=g), max(1, n // 3)))
    for b in batch_sizes:
        if b <= n:
            trials.append((f"size {b}", torch.randperm(n, generator=g)[:b], 0))
    compared = differing = 0
    failures: list[str] = []
    for ci, cfg in enumerate(configs):
        for label, idx, n_pad in trials:
            batch = [r[idx.to(r.device)] for r in rows]
            keep = torch.arange(len(idx))
            if n_pad:
                # interleave padding rows at random places
                total = len(idx) + n_pad
                perm = torch.randperm(total, generator=g)
                keep = perm[: len(idx)]
                pads = [_pad_like(r, n_pad) for r in rows]
                full = []
                for b_t, p_t in zip(batch, pads):
                    out_t = torch.empty((total, *b_t.shape[1:]), dtype=b_t.dtype, device=b_t.device)
                    out_t[keep.to(b_t.device)] = b_t
                    out_t[perm[len(idx):].to(b_t.device)] = p_t
                    full.append(out_t)
                batch = full
            got = _outputs(fn(*batch, **shared, **cfg))
            for o_ref, o_got in zip(ref, got):
                mask = rows_differing(o_got[keep.to(o_got.device)], o_ref[idx.to(o_ref.device)])
                compared += mask.numel()
                bad = int(mask.sum())
                differing += bad
                if bad:
                    failures.append(f"config {ci} {label}: {bad} rows")
    detail = "; ".join(failures[:4])
    return RungResult(primitive, 2, "batch/order/pad/config", differing == 0, compared, differing, detail)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (fla's ratio); NaN anywhere -> inf."""
    o, r = out.double(), ref.double()
    if torch.isnan(o).any() or torch.isnan(r).any():
        return float("inf")
    denom = r.norm().item()
    diff = (o - r).norm().item()
    return diff / denom if denom > 0 else diff


def accuracy(primitive: str, out: torch.Tensor, ref: torch.Tensor, bound: float, what: str = "vs float64") -> RungResult:
    e = rel_err(out, ref)
    return RungResult(primitive, 0, what, e <= bound, out.numel(), 0, f"rel err {e:.2e} (bound {bound:.0e})", {"rel_err": e})
