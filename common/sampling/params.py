"""Per-request sampling parameters (DESIGN §6) and their per-row tensors."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, checked when built.

    temperature 0 is greedy; top_k 0 (or >= vocabulary) is off; top_p 1.0 is
    off; min_p 0.0 is off.  The transforms run in the fixed order
    temperature -> top-k -> top-p -> min-p (``alignzoo.common.sampling.op``).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("temperature", "top_p", "min_p"):
            if not is_real(getattr(self, name)):
                raise TypeError(f"{name} must be a float, got {type(getattr(self, name)).__name__}")
        for name in ("top_k", "max_new_tokens", "seed"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {type(getattr(self, name)).__name__}")
        t = float(self.temperature)
        if not (t == 0.0 or 1e-5 <= t < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or a finite value >= 1e-5, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 or >= vocabulary size means off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (1.0 means off), got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0 means off), got {self.min_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not -(2**63) <= self.seed < 2**63:
            raise ValueError(f"seed must fit in int64, got {self.seed}")
        ids = tuple(self.stop_token_ids)
        if any(not is_int(i) or i < 0 for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)


def params_to_tensors(
    params: Sequence[SamplingParams], steps: Sequence[int], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """One row per request: the keyword tensors of ``sample`` / ``sample_fwd``
    (temperature, top_k, top_p, min_p, seed, step)."""
    if len(params) != len(steps):
        raise ValueError(f"{len(params)} params but {len(steps)} steps: one step per request")

    def col(name, dtype):
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

    return {
        "temperature": col("temperature", torch.float32),
        "top_k": col("top_k", torch.int64),
        "top_p": col("top_p", torch.float32),
        "min_p": col("min_p", torch.float32),
        "seed": col("seed", torch.int64),
        "step": torch.tensor(list(steps), dtype=torch.int64, device=device),
    }
