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
from torch import nn

from .._validate import FLOAT_DTYPES, check_tensor
from ..lora.adapter import init_lora_weights
from ..lora.op import fp32_scale


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
        return fp32_scale(self.scale)

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


class ExpertsAdapter(nn.Module):
    """The trainer's LoRA over one layer's stacked experts ``w_gate_up`` (E, 2I, H) and ``w_down``
    (E, H, I), held as the experts module's ``ATTR``: ``lora_A[p]`` (E, r, in) and ``lora_B[p]``
    (E, out, r) for p in ``KEYS`` targeted; A seeded per expert as ``init_lora_weights`` draws it,
    B = 0 (a no-op until it trains).

    separate: the experts run on the base weights with the adapter inside (``expert_lora``:
              an ``ExpertLoRA``, zeros for a projection not targeted; the server builds the
              same from the shipped tensors).
    merged:   the experts run on W'_e = dtype(W_e + s · B_e A_e) (fp32 product, one rounding),
              built once per adapter version (``merged``), the very tensor the server is sent;
              its gradient reaches A and B through ``_MergedExperts``.
    """

    ATTR = "experts_lora"
    KEYS = ("gate_up", "down")

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, keys, r: int, scale: float, mode: str,
                 seeds: dict[str, int], dtype: torch.dtype | None = None):
        super().__init__()
        self.mode, self.scale, self.r = mode, scale, r
        self._base = {"gate_up": w_gate_up, "down": w_down}  # the frozen experts (a dict: not registered again)
        # the adapters' dtype: the experts' own, or the activations' where the experts are FP32 masters read as FP8
        dt = dtype or w_gate_up.dtype
        self._like = {p: torch.zeros((), dtype=dt, device=w.device).expand(w.shape) for p, w in self._base.items()}
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        for p, w in self._base.items():
            if p in keys:
                E, out, K = w.shape
                ab = [init_lora_weights(out, K, r, seed=seeds[p] * 1_000_003 + e, dtype=dt, device=w.device)
                      for e in range(E)]
                self.lora_A[p] = nn.Parameter(torch.stack([a for a, _ in ab]))
                self.lora_B[p] = nn.Parameter(torch.stack([b for _, b in ab]))
        self._key, self._merged = None, None

    def invalidate(self) -> None:
        self._key = None

    def expert_lora(self) -> ExpertLoRA:
        """separate mode: the ``ExpertLoRA`` the experts add (a projection not targeted: zeros)."""
        return expert_lora_of({p: (self.lora_A[p], self.lora_B[p]) for p in self.lora_A}, self._like["gate_up"],
                              self._like["down"], self.r, self.scale)

    def merge(self) -> dict[str, torch.Tensor]:
        """{p: a new W'} of the targeted projections (not cached)."""
        return {p: merge_experts(self._base[p], self.lora_A[p], self.lora_B[p], self.scale) for p in self.lora_A}

    def merged(self) -> dict[str, torch.Tensor]:
        """merged mode: {p: the cached W'} (differentiable in A and B when grad is on)."""
        tensors = (*self._base.values(), *self.lora_A.values(), *self.lora_B.values())
        key = tuple((t._version, t.data_ptr()) for t in tensors)
        if key != self._key:
            self._key, self._merged = key, self.merge()
        if not torch.is_grad_enabled():
            return self._merged
        return {p: _MergedExperts.apply(m, self.lora_A[p], self.lora_B[p], self.scale) for p, m in self._merged.items()}

    def served_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """What the server reads, under the experts module's ``prefix`` ("layers.{i}.moe."): merged,
        the W' as ``<prefix><p>.weight``; separate, ``<prefix>lora_A.<p>`` and ``<prefix>lora_B.<p>``."""
        if self.mode == "merged":
            return {f"{prefix}{p}.weight": w for p, w in self.merged().items()}
        out = {}
        for p in self.lora_A:
            out[f"{prefix}lora_A.{p}"] = self.lora_A[p].detach()
            out[f"{prefix}lora_B.{p}"] = self.lora_B[p].detach()
        return out


@torch.no_grad()
def merge_experts(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = dtype(W + s · B A) per expert: w (E, out, in), a (E, r, in), b (E, out, r)."""
    return (w.detach().float() + fp32_scale(scale) * torch.bmm(b.detach().float(), a.detach().float())).to(w.dtype)


class _MergedExperts(torch.autograd.Function):
    """The cached W' as the forward's weight, with W' = W + s·B·A's gradient to A and B (W is frozen)."""

    @staticmethod
    def forward(ctx, merged, a, b, scale):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return merged.view_as(merged)

    @staticmethod
    def backward(ctx, dw):
        a, b = ctx.saved_tensors
        g = dw.float() * fp32_scale(ctx.scale)
        da = torch.bmm(b.float().transpose(1, 2), g).to(a.dtype)
        db = torch.bmm(g, a.float().transpose(1, 2)).to(b.dtype)
        return None, da, db, None


def expert_lora_of(ab: dict[str, tuple[torch.Tensor, torch.Tensor]], w_gate_up, w_down, r: int,
                   scale: float) -> ExpertLoRA:
    """An ``ExpertLoRA`` from {"gate_up" and / or "down": (A, B)}, zeros (rank r) for a projection
    without an adapter (B = 0 adds exactly nothing: the base's bits)."""
    out = []
    for p, w in (("gate_up", w_gate_up), ("down", w_down)):
        if p in ab:
            out += list(ab[p])
        else:
            E, o, K = w.shape
            out += [w.new_zeros(E, r, K), w.new_zeros(E, o, r)]
    return ExpertLoRA(*out, scale=scale)
