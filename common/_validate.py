"""Input checks shared by every primitive: a bad input fails with a message
that names the argument and what was wrong with it, before any kernel runs."""
from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float32)


def check_tensor(
    name: str,
    t: torch.Tensor,
    *,
    dtypes: Sequence[torch.dtype] | None = None,
    ndim: int | Sequence[int] | None = None,
    contiguous: bool = True,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of: {allowed}")
    if ndim is not None:
        dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in dims:
            raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dimensions, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()} for shape {tuple(t.shape)}); call .contiguous() first")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    devices = {n: t.device for n, t in tensors.items() if t is not None}
    if len({str(d) for d in devices.values()}) > 1:
        desc = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"inputs are on different devices: {desc}")
    return next(iter(devices.values()))


def check_dim(name: str, got: int, want: int, what: str) -> None:
    if got != want:
        raise ValueError(f"{name}: {what} is {got}, expected {want}")


def check_int(name: str, v, lo: int = 1, *, bound: str | None = None) -> None:
    """``v`` must be an int (a bool is not one) >= ``lo``; else ValueError
    "{name} must be an int {bound}, got {v!r}" (``bound``: ">= lo" unless given)."""
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"{name} must be an int {bound or f'>= {lo}'}, got {v!r}")
