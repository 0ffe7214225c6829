"""LoRA inside the routed experts: the adapter is added inside each expert's computation, so
the base weights stay in their format (bf16, FP8 codes, MXFP4 codes).

Per expert e, adapters A_gu (r, H), B_gu (2I, r) on the fused [gate | up] projection and
A_d (r, I), B_d (H, r) on the down projection, scale s = lora_alpha / r (rounded to fp32
once).  Rounding points, per (token, slot) row (the separate mode of ``common/lora``):

    t   = dtype(fp32 dot(x_t, A_gu[e]))           (r,) one rounding
    gu  = fl32(base_gu + fl32(s * fp32 dot(t, B_gu[e])))    before the clamp and SwiGLU
    t'  = dtype(fp32 dot(a, A_d[e]))              on the bf16 SwiGLU output (unquantized)
    c_j = fl32(fl32(base_c + fl32(s * fp32 dot(t', B_d[e]))) * w_tj)

where base_gu / base_c are the format's own fp32 dots (``cpu.py``).  Each dot is the same
batch-invariant dot as the base's (CPU ``fixed_order_dot``; CUDA the grouped kernel's K chain),
so a row's bits still depend on nothing but its own token and expert.
"""
from __future__ import annotations

import dataclasses

import torch

from .._validate import FLOAT_DTYPES, check_tensor


@dataclasses.dataclass(frozen=True)
class ExpertLoRA:
    """One adapter over every expert of a layer (shapes in the module docstring, stacked over E)."""

    a_gate_up: torch.Tensor  # (E, r, H)
    b_gate_up: torch.Tensor  # (E, 2I, r)
    a_down: torch.Tensor  # (E, r, I)
    b_down: torch.Tensor  # (E, H, r)
    scale: float  # lora_alpha / r

    @property
    def s(self) -> float:
        """fp32(scale) as a Python float: what every side multiplies by."""
        return torch.tensor(float(self.scale), dtype=torch.float32).item()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.a_gate_up, self.b_gate_up, self.a_down, self.b_down

    def check(self, E: int, H: int, I: int, dtype: torch.dtype, device: torch.device) -> None:
        r = self.a_gate_up.shape[1] if self.a_gate_up.ndim == 3 else -1
        want = {"a_gate_up": (E, r, H), "b_gate_up": (E, 2 * I, r), "a_down": (E, r, I), "b_down": (E, H, r)}
        for name, t in zip(want, self.tensors()):
            check_tensor(f"lora.{name}", t, dtypes=FLOAT_DTYPES, ndim=3)
            if tuple(t.shape) != want[name]:
                raise ValueError(f"lora.{name} has shape {tuple(t.shape)}; experts (E={E}, H={H}, I={I}) with "
                                 f"rank {r} need {want[name]}")
            if t.dtype != dtype or t.device != device:
                raise ValueError(f"lora.{name} is {t.dtype} on {t.device}; the activations are {dtype} on {device}")
