"""Train/serve mismatch metrics.

K3 = ρ − 1 − log ρ with ρ = exp(lp_train − lp_serve) (Schulman's estimator):
non-negative, and zero exactly when the two log-probabilities are equal.  It is
computed in float64 as expm1(d) − d (d = lp_train − lp_serve), which is 0.0 for
d == 0 and keeps precision for tiny d.  ``differing`` counts tokens whose FP32
bits differ — the contract is differing == 0, which implies K3 == 0.

These are plain element-wise torch ops on either device (no reduction whose
order could matter is involved in the per-token values); they sit off the
hot path, so there is no Triton kernel.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .ladder import rows_differing


def k3(lp_train: torch.Tensor, lp_serve: torch.Tensor) -> torch.Tensor:
    """Per-token K3 in float64.  lp_*: (T,) log-probabilities of the same tokens."""
    if lp_train.shape != lp_serve.shape:
        raise ValueError(f"lp_train has shape {tuple(lp_train.shape)} but lp_serve has {tuple(lp_serve.shape)}")
    d = lp_train.double() - lp_serve.double()
    return torch.expm1(d) - d


@dataclass
class Mismatch:
    tokens: int
    differing: int  # tokens whose FP32 bits differ
    k3_mean: float
    k3_max: float
    max_abs_diff: float  # max |lp_train − lp_serve|

    @property
    def exact(self) -> bool:
        return self.differing == 0

    def as_dict(self) -> dict:
        return asdict(self)


def mismatch(lp_train: torch.Tensor, lp_serve: torch.Tensor) -> Mismatch:
    """Summary of the mismatch between two log-probability tensors of the same tokens."""
    if lp_train.dtype != lp_serve.dtype:
        raise TypeError(f"lp_train is {lp_train.dtype} but lp_serve is {lp_serve.dtype}: compare like with like")
    a, b = lp_train.reshape(-1), lp_serve.reshape(-1).to(lp_train.device)
    if a.numel() == 0:
        return Mismatch(0, 0, 0.0, 0.0, 0.0)
    k = k3(a, b)
    return Mismatch(
        tokens=a.numel(),
        differing=int(rows_differing(a, b).sum()),
        k3_mean=float(k.mean()),
        k3_max=float(k.max()),
        max_abs_diff=float((a.double() - b.double()).abs().max()),
    )
