"""The trainer-side layers every model composes: a named weight, the
batch-invariant linear, its FP8 form, and its LoRA forms (merged, separate,
several adapters per batch).  Module paths are the checkpoint names of a
model's ``weights.py`` (``<name>.weight``), so ``forward_weights`` of these
layers is exactly what its server reads.

Shapes: T tokens, N output and K input features, r LoRA rank.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn

from .fp8 import Fp8WeightCache, fp8_linear
from .lora import LoRAConfig, init_lora_weights, lora_add, lora_add_multi, lora_merge, lora_merge_fwd
from .lora.peft import matches_target
from .matmul import matmul


class Weight(nn.Module):
    """One named parameter (``<name>.weight``), so module paths are the
    checkpoint names of ``weights.py``.  ``forward_weights(prefix)``: what the
    server reads of it (``TrainerBase.forward_weights`` asks every module)."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "weight": self.weight.detach()}


class WeightBias(Weight):
    """``<name>.weight`` and ``<name>.bias`` (a LayerNorm's affine pair)."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__(*shape, device=device, dtype=dtype)
        self.bias = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "weight": self.weight.detach(), prefix + "bias": self.bias.detach()}


class AdapterRows(NamedTuple):
    """Which multi-mode LoRA adapter each packed token is scored under."""

    ids: torch.Tensor  # (T,) int64 adapter index, -1: the base model
    present: frozenset[int]  # the indices in ids (known on the host): only their branches run


class Linear(Weight):
    """y = x · Wᵀ with the batch-invariant matmul.  Every linear takes the
    batch's ``AdapterRows`` (only multi-mode LoRA reads them)."""

    def forward(self, x, adapters: AdapterRows | None = None):
        return matmul(x, self.weight)


class _Rows(torch.autograd.Function):
    """Hands out the cached W' (N, K) itself and routes the rows [lo, hi) of
    dW' to the per-slice aliases (views of W' from ``lora_merge``) that carry
    them on to A and B: W' is read in place, never concatenated per forward."""

    @staticmethod
    def forward(ctx, merged, spans, *parts):
        ctx.spans = spans
        return merged

    @staticmethod
    def backward(ctx, dw):
        return (None, None, *(dw[lo:hi] for lo, hi in ctx.spans))


class LoRALinear(Linear):
    """A frozen base W (N, K) whose row slices carry LoRA adapters: for each
    adapted HF projection p fused in W (``qkv`` = [q | k | v] rows),
    ``lora_A[p]`` (r, K) and ``lora_B[p]`` (rows of p, r), scale s.

    merged:   y = x · W'ᵀ, W' = W with each adapted slice replaced by
              ``lora_merge_fwd(W_p, A_p, B_p, s)`` (others keep W's bits).
              W' is built once per adapter version (any in-place write to W, A
              or B: an optimizer step, ``copy_``) and is the very tensor the
              forward reads and ``forward_weights`` ships.  Writes through
              ``.data`` (or fused optimizers) bypass the version counters:
              call ``invalidate()`` (``pair.sync()`` does) after them.
    separate: y = x · Wᵀ, then each adapted column slice
              y_p = ``lora_add(y_p, x, A_p, B_p, s)``; the server runs
              ``lora_add_fwd`` on the same slices (``serve.py``).
    """

    def __init__(self, base: Linear, slices: Sequence[tuple[str, int, int]], r: int, scale: float, mode: str,
                 seeds: Mapping[str, int]):
        nn.Module.__init__(self)
        self.weight = base.weight
        self.slices = tuple(slices)  # ((projection, first row, end row), ...) covering W's rows
        self.mode, self.scale = mode, scale
        _add_adapter(self, self.weight, self.slices, r, seeds)
        self._key, self._merged = None, None

    @property
    def adapted(self) -> list[tuple[str, int, int]]:
        return [(p, lo, hi) for p, lo, hi in self.slices if p in self.lora_A]

    def merge(self) -> torch.Tensor:
        """A new W' (N, K) in W's dtype (not cached)."""
        return _merge(self.weight, self, self.slices, self.scale)

    def invalidate(self) -> None:
        """Rebuild W' at the next use (for writes the version counter misses)."""
        self._key = None

    def merged_weight(self) -> torch.Tensor:
        """The cached W', rebuilt only when W, an A or a B was written since."""
        key = tuple((t._version, t.data_ptr()) for t in (self.weight, *self.lora_A.values(), *self.lora_B.values()))
        if key != self._key:
            self._key, self._merged = key, self.merge()
        return self._merged

    def forward(self, x, adapters: AdapterRows | None = None):
        if self.mode == "separate":
            return self.add_lora(matmul(x, self.weight), x)
        merged = self.merged_weight()
        if torch.is_grad_enabled():
            w = self.weight
            parts = [lora_merge(w[lo:hi], self.lora_A[p], self.lora_B[p], self.scale, merged=merged[lo:hi])
                     for p, lo, hi in self.adapted]
            merged = _Rows.apply(merged, tuple((lo, hi) for _, lo, hi in self.adapted), *parts)
        return matmul(x, merged)

    def add_lora(self, y, x):
        """y: (T, N) = x · Wᵀ, x: (T, K) -> (T, N) with each adapted slice's branch added."""
        parts = [lora_add(y[:, lo:hi], x, self.lora_A[p], self.lora_B[p], self.scale) if p in self.lora_A
                 else y[:, lo:hi] for p, lo, hi in self.slices]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """merged: ``<prefix>weight`` = W'; separate: W and ``<prefix>lora_A.<p>``, ``<prefix>lora_B.<p>``."""
        if self.mode == "merged":
            return {prefix + "weight": self.merged_weight()}
        out = {prefix + "weight": self.weight.detach()}
        for p in self.lora_A:
            out[f"{prefix}lora_A.{p}"] = self.lora_A[p].detach()
            out[f"{prefix}lora_B.{p}"] = self.lora_B[p].detach()
        return out


def _add_adapter(holder: nn.Module, w: torch.Tensor, slices, r: int, seeds: Mapping[str, int]) -> None:
    """Give ``holder`` ``lora_A`` / ``lora_B`` ParameterDicts with a fresh
    adapter (``init_lora_weights``: seeded A, B = 0) on each slice of W that
    ``seeds`` names (the targeted ones, each with its seed)."""
    holder.lora_A, holder.lora_B = nn.ParameterDict(), nn.ParameterDict()
    for p, lo, hi in slices:
        if p in seeds:
            a, b = init_lora_weights(hi - lo, w.shape[1], r, seed=seeds[p], dtype=w.dtype, device=w.device)
            holder.lora_A[p], holder.lora_B[p] = nn.Parameter(a), nn.Parameter(b)


@torch.no_grad()
def _merge(w: torch.Tensor, holder: nn.Module, slices, scale: float) -> torch.Tensor:
    """W with each slice ``holder`` adapts replaced by ``lora_merge_fwd``: a new (N, K) tensor."""
    w = w.detach()
    merged = w.clone()
    for p, lo, hi in slices:
        if p in holder.lora_A:
            merged[lo:hi] = lora_merge_fwd(w[lo:hi], holder.lora_A[p], holder.lora_B[p], scale)
    return merged


class MultiLoRALinear(Linear):
    """A frozen base W (N, K) with several named adapters (multi mode):
    ``adapters[j]`` holds adapter j's ``lora_A[p]`` (r_j, K) and ``lora_B[p]``
    (rows of p, r_j) on each slice p its config targets, scale ``scales[j]``.

    y = x · Wᵀ, then each slice some adapter targets gets
    y_p = ``lora_add_multi(y_p, x, ids, [A_j,p], [B_j,p], scales)``: a row
    of adapter j gets j's separate-mode branch (bit for bit), a row of none,
    or of an adapter without a branch on p, keeps y_p.  Only the adapters in
    the batch run (``AdapterRows.present``); the server runs every adapter's
    branch on every row (``lora_add_multi_fwd``: static shapes for CUDA
    graphs) and gets the same rows.
    """

    def __init__(self, base: Linear, slices: Sequence[tuple[str, int, int]],
                 adapters: Sequence[tuple[LoRAConfig, Mapping[str, int]]]):
        nn.Module.__init__(self)
        self.weight = base.weight
        self.slices = tuple(slices)
        self.scales = tuple(lora.scale for lora, _ in adapters)
        self.adapters = nn.ModuleList()
        for lora, seeds in adapters:
            holder = nn.Module()
            _add_adapter(holder, self.weight, self.slices, lora.r, seeds)
            self.adapters.append(holder)

    def merge(self, j: int) -> torch.Tensor:
        """W' (N, K) of adapter j alone, as merged mode builds it (not cached)."""
        return _merge(self.weight, self.adapters[j], self.slices, self.scales[j])

    def forward(self, x, adapters: AdapterRows | None = None):
        y = matmul(x, self.weight)
        if adapters is None or not adapters.present:
            return y
        parts = []
        for p, lo, hi in self.slices:
            on = [j in adapters.present and p in m.lora_A for j, m in enumerate(self.adapters)]
            if not any(on):
                parts.append(y[:, lo:hi])
                continue
            a_n = [m.lora_A[p] if o else None for m, o in zip(self.adapters, on)]
            b_n = [m.lora_B[p] if o else None for m, o in zip(self.adapters, on)]
            parts.append(lora_add_multi(y[:, lo:hi], x, adapters.ids, a_n, b_n, self.scales))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """W, and ``<prefix>adapters.<j>.lora_A.<p>`` / ``...lora_B.<p>`` of every adapter j."""
        out = {prefix + "weight": self.weight.detach()}
        for j, m in enumerate(self.adapters):
            for p in m.lora_A:
                out[f"{prefix}adapters.{j}.lora_A.{p}"] = m.lora_A[p].detach()
                out[f"{prefix}adapters.{j}.lora_B.{p}"] = m.lora_B[p].detach()
        return out


LORA_MODES = ("merged", "separate", "multi")


def check_lora_config(lora: LoRAConfig | Mapping, targets: Sequence[str], model: str,
                      param_targets: Sequence[str] = ()) -> LoRAConfig:
    """A ``LoRAConfig`` (or a dict of its fields) checked against the
    projections ``targets`` of ``model`` (in layer order), with
    ``target_modules`` as a list of them in that order ("all-linear": all),
    and its ``target_parameters`` against the parameters ``param_targets``
    (HF names under a layer, e.g. "mlp.experts.gate_up_proj"; a dotted suffix
    of one names it, as in PEFT), as their full names in that order."""
    if isinstance(lora, Mapping):
        unknown = set(lora) - set(LoRAConfig.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown LoRA config fields {sorted(unknown)}; fields: "
                             f"{sorted(LoRAConfig.__dataclass_fields__)}")
        lora = LoRAConfig(**lora)
    if not isinstance(lora, LoRAConfig):
        raise TypeError(f"lora must be a LoRAConfig or a dict of its fields, got {type(lora).__name__}")
    r, alpha = lora.r, lora.lora_alpha
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA rank r must be an integer >= 1, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"lora_alpha must be a finite number, got {alpha!r}")
    known, asked = list(targets), lora.target_modules
    if asked == "all-linear":
        asked = known
    elif isinstance(asked, str):
        asked = [asked]
    params = [lora.target_parameters] if isinstance(lora.target_parameters, str) else list(lora.target_parameters)
    if not asked and not params:
        extra = f"; or target_parameters, some of {', '.join(param_targets)}" if param_targets else ""
        raise ValueError(f"LoRA target_modules is empty: name some of {', '.join(known)} (or 'all-linear'){extra}")
    unknown = [t for t in asked if t not in known]
    if unknown:
        raise ValueError(f"unknown LoRA target module {unknown[0]!r} for {model}; known: {', '.join(known)} "
                         f"(or 'all-linear')")
    for t in params:
        if not any(matches_target(p, t) for p in param_targets):
            have = ", ".join(param_targets) or "none (LoRA on parameters is for MoE experts)"
            raise ValueError(f"unknown LoRA target parameter {t!r} for {model}; known: {have}")
    return LoRAConfig(r=r, lora_alpha=alpha, target_modules=[t for t in known if t in asked],
                      use_rslora=lora.use_rslora, base_model_name_or_path=lora.base_model_name_or_path,
                      target_parameters=[p for p in param_targets if any(matches_target(p, t) for t in params)])


def check_adapter_configs(adapters: Mapping, targets: Sequence[str], model: str,
                          param_targets: Sequence[str] = ()) -> dict[str, LoRAConfig]:
    """Multi mode: ``{adapter name: LoRAConfig or dict}``, each checked by
    ``check_lora_config``, in the given order (the adapters' indices)."""
    if not isinstance(adapters, Mapping) or not adapters:
        raise ValueError(f"multi-mode LoRA needs a non-empty {{adapter name: LoRAConfig or dict}}, got {adapters!r}")
    out = {}
    for name, lora in adapters.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        try:
            out[name] = check_lora_config(lora, targets, model, param_targets)
        except (TypeError, ValueError) as e:
            raise type(e)(f"adapter {name!r}: {e}") from None
    return out


class Fp8Linear(Weight):
    """An FP32 master weight whose forward reads its FP8 quantization (e4m3,
    128x128 blocks), made once per optimizer step (``Fp8WeightCache``): the
    trainer, the server and the weight sync all read those very codes."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__(*shape, device=device, dtype=torch.float32)
        self.cache = Fp8WeightCache(self.weight)

    def invalidate(self) -> None:
        """Requantize at the next use (for writes the version counter misses)."""
        self.cache.invalidate()

    def forward(self, x, adapters: AdapterRows | None = None):
        return fp8_linear(x, self.weight, *self.cache.get())

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        codes, scale_inv = self.cache.get()
        return {prefix + "weight": codes, prefix + "weight_scale_inv": scale_inv}
