"""Qwen3 training module: packed variable-length forward, FP32 chosen-token
log-probabilities under the sampler's transforms, autograd through every kernel.

It calls the public (differentiable) functions of the same kernels whose
``_fwd`` launchers ``serve.py`` calls, layer for layer, so a token's
log-probability has the server's bits (the server fuses the q/k ``rmsnorm``
and ``rope`` with its cache write, ``qk_norm_rope_kv_fwd``: the same jit
helpers, the same bits).  Shapes: T packed tokens, H hidden, Hq / Hkv heads
of D channels, I intermediate, V vocabulary, R scored rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.attention import attention
from ...common.engine.sequence import adapter_position, one_each
from ...common.fp8 import Fp8WeightCache, fp8_linear
from ...common.lm_head import lm_head_logits
from ...common.lora import LoRAConfig, init_lora_weights, lora_add, lora_add_multi, lora_merge, lora_merge_fwd
from ...common.matmul import matmul
from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...common.rope import rope
from ...common.sampling import SamplingParams, params_to_tensors, sampling_logprobs
from ...common.swiglu import swiglu_gate_up
from .config import Qwen3Config
from .weights import LORA_TARGETS, lora_slices
from .._packing import pack_scored, sampling_list


class Weight(nn.Module):
    """One named parameter (``<name>.weight``), so module paths are the
    checkpoint names of ``weights.py``."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class AdapterRows(NamedTuple):
    """Which multi-mode LoRA adapter each packed token is scored under."""

    ids: torch.Tensor  # (T,) int64 adapter index, -1: the base model
    present: frozenset[int]  # the indices in ids (known on the host): only their branches run


class Linear(Weight):
    """y = x · Wᵀ with the batch-invariant matmul.  Every linear takes the
    batch's ``AdapterRows`` (only multi-mode LoRA reads them)."""

    def forward(self, x, adapters: AdapterRows | None = None):
        return matmul(x, self.weight)

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "weight": self.weight.detach()}


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


def check_lora_config(lora: LoRAConfig | Mapping) -> LoRAConfig:
    """A ``LoRAConfig`` (or a dict of its fields) checked for Qwen3, with
    ``target_modules`` as a list of projections in layer order
    ("all-linear": all seven)."""
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
    targets = lora.target_modules
    if targets == "all-linear":
        targets = list(LORA_TARGETS)
    elif isinstance(targets, str):
        targets = [targets]
    if not targets:
        raise ValueError(f"LoRA target_modules is empty: name some of {', '.join(LORA_TARGETS)} (or 'all-linear')")
    unknown = [t for t in targets if t not in LORA_TARGETS]
    if unknown:
        raise ValueError(f"unknown LoRA target module {unknown[0]!r} for qwen3; known: {', '.join(LORA_TARGETS)} "
                         f"(or 'all-linear')")
    return LoRAConfig(r=r, lora_alpha=alpha, target_modules=[t for t in LORA_TARGETS if t in targets],
                      use_rslora=lora.use_rslora, base_model_name_or_path=lora.base_model_name_or_path)


def check_adapter_configs(adapters: Mapping) -> dict[str, LoRAConfig]:
    """Multi mode: ``{adapter name: LoRAConfig or dict}`` checked for Qwen3
    (``check_lora_config``), in the given order (the adapters' indices)."""
    if not isinstance(adapters, Mapping) or not adapters:
        raise ValueError(f"multi-mode LoRA needs a non-empty {{adapter name: LoRAConfig or dict}}, got {adapters!r}")
    out = {}
    for name, lora in adapters.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"adapter names must be non-empty strings, got {name!r}")
        try:
            out[name] = check_lora_config(lora)
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


class Qwen3Block(nn.Module):
    def __init__(self, cfg: Qwen3Config, device=None, dtype=None, fp8: bool = False):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        H, D = cfg.hidden_size, cfg.head_dim
        linear = Fp8Linear if fp8 else Linear
        self.attn_norm = Weight(H, **kw)
        self.qkv = linear(cfg.qkv_size, H, **kw)  # [q | k | v] rows
        self.q_norm = Weight(D, **kw)
        self.k_norm = Weight(D, **kw)
        self.o = linear(H, cfg.num_heads * D, **kw)
        self.mlp_norm = Weight(H, **kw)
        self.gate_up = linear(2 * cfg.intermediate_size, H, **kw)  # [gate | up] rows
        self.down = linear(H, cfg.intermediate_size, **kw)
        self.cfg = cfg

    def forward(self, x, residual, positions, cu_seqlens, max_seqlen, adapters: AdapterRows | None = None):
        """x: (T, H) the previous block's output; residual: (T, H) or None
        (first block, x is the embedding) -> (mlp_out, residual)."""
        cfg = self.cfg
        T, Hq, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if residual is None:
            h, residual = rmsnorm(x, self.attn_norm.weight, eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, self.attn_norm.weight, eps)
        q, k, v = self.qkv(h, adapters).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(rmsnorm(q.reshape(T, Hq, D).contiguous(), self.q_norm.weight, eps), positions, cfg.rope)
        k = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), self.k_norm.weight, eps), positions, cfg.rope)
        o = attention(q, k, v.reshape(T, Hkv, D).contiguous(), cu_seqlens, max_seqlen=max_seqlen)
        x = self.o(o.reshape(T, Hq * D), adapters)
        h, residual = rmsnorm_residual(x, residual, self.mlp_norm.weight, eps)
        return self.down(swiglu_gate_up(self.gate_up(h, adapters)), adapters), residual


class Qwen3Trainer(nn.Module):
    """Parameters are named as in ``weights.py`` (``embed.weight``,
    ``layers.{i}.qkv.weight``, ...); ``lm_head`` is absent when tied.  With
    ``fp8`` the four projections of each block are FP32 masters read through
    their FP8 quantization; embeddings, norms and the LM head stay in dtype."""

    def __init__(self, cfg: Qwen3Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.fp8 = fp8
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Qwen3Block(cfg, **kw, fp8=fp8) for _ in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.activation_checkpointing = activation_checkpointing
        self.lora: LoRAConfig | None = None  # merged / separate
        self.adapter_configs: dict[str, LoRAConfig] = {}  # multi: {name: config}, in adapter-index order
        self.lora_mode: str | None = None

    def add_lora(self, lora: LoRAConfig | Mapping, mode: str = "merged", seed: int = 0) -> None:
        """Freeze every parameter and give each targeted projection of every
        layer an adapter: A from ``init_lora_weights`` with a seed drawn from
        ``seed`` per (adapter, layer, projection), B = 0, so the model
        computes exactly what it did until B trains.  ``mode``: "merged"
        (``LoRALinear``: the forward and the server read W' = W + s·B·A),
        "separate" (base output plus the adapter branch, on both sides) or
        "multi" (``MultiLoRALinear``: ``lora`` is ``{adapter name: LoRAConfig
        or dict}``, each adapter its own rank, scale and targets; a sequence
        picks one in ``logprobs(..., adapters=)``, a request in the server's
        ``generate(..., adapters=)``)."""
        if self.lora_mode is not None:
            raise RuntimeError("this trainer already has LoRA adapters")
        if mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
        if self.fp8:
            raise NotImplementedError("LoRA on an FP8 trainer is not supported yet (the adapters would need the "
                                      "FP8 GEMM's rounding points); use bf16 or fp32 with LoRA")
        configs = check_adapter_configs(lora) if mode == "multi" else {None: check_lora_config(lora)}
        for p in self.parameters():
            p.requires_grad_(False)
        order, L = list(LORA_TARGETS), self.cfg.num_layers
        for i, block in enumerate(self.layers):
            for name, layer_slices in lora_slices(self.cfg).items():
                # one seed per (adapter, layer, projection), distinct across pair seeds for < 10^6 of them;
                # adapter 0 gets the seeds of the single-adapter modes
                ads = [(cfg, {p: seed * 1_000_003 + 1 + len(order) * (i + j * L) + order.index(p)
                              for p, _, _ in layer_slices if p in cfg.target_modules})
                       for j, cfg in enumerate(configs.values())]
                if not any(seeds for _, seeds in ads):
                    continue
                if mode == "multi":
                    m = MultiLoRALinear(getattr(block, name), layer_slices, ads)
                else:
                    ((cfg, seeds),) = ads
                    m = LoRALinear(getattr(block, name), layer_slices, cfg.r, cfg.scale, mode, seeds)
                setattr(block, name, m)
        if mode == "multi":
            self.adapter_configs = configs
        else:
            self.lora = configs[None]
        self.lora_mode = mode

    @property
    def adapter_names(self) -> tuple[str, ...]:
        """Multi mode: the adapters' names, in index order (else empty)."""
        return tuple(self.adapter_configs)

    def adapter_index(self, name: str) -> int:
        """The index of multi-mode adapter ``name``; a clear error for any other."""
        if self.lora_mode != "multi":
            raise ValueError(f"adapter {name!r} asked for, but this model has no named LoRA adapters (load it with "
                             f"lora_mode='multi', lora_adapters={{name: config or PEFT dir}})")
        if name is None:
            raise ValueError(f"name one of the adapters {', '.join(map(repr, self.adapter_configs))} (multi-mode LoRA)")
        return adapter_position(name, self.adapter_names, "the model has")

    def lora_modules(self, adapter: str | None = None) -> dict[str, tuple[nn.Module, str]]:
        """{``layers.{i}.<projection>``: (the module holding its ``lora_A`` /
        ``lora_B``, projection)} in layer order; multi mode: of the named adapter."""
        j = self.adapter_index(adapter) if self.lora_mode == "multi" or adapter is not None else None
        out = {}
        for i, block in enumerate(self.layers):
            for name, layer_slices in lora_slices(self.cfg).items():
                m = getattr(block, name)
                holder = m.adapters[j] if isinstance(m, MultiLoRALinear) else m if isinstance(m, LoRALinear) else None
                if holder is not None:
                    out |= {f"layers.{i}.{p}": (holder, p) for p, _, _ in layer_slices if p in holder.lora_A}
        return out

    def lora_config(self, adapter: str | None = None) -> LoRAConfig | None:
        """The LoRA config (multi mode: of the named adapter; a clear error
        unless ``adapter`` fits the mode, as ``lora_modules``)."""
        if self.lora_mode == "multi" or adapter is not None:
            self.adapter_index(adapter)
            return self.adapter_configs[adapter]
        return self.lora

    def lora_adapters(self, adapter: str | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{``layers.{i}.<projection>``: (A (r, K), B (rows, r))}: the live
        parameters (for ``save_peft_adapter`` with ``weights.lora_to_hf``);
        multi mode: of the named adapter."""
        return {n: (m.lora_A[p], m.lora_B[p]) for n, (m, p) in self.lora_modules(adapter).items()}

    def adapter_parameters(self, adapter: str | None = None) -> list[nn.Parameter]:
        """The trainable A and B tensors (of the named adapter, in multi mode): what an optimizer steps."""
        return [t for ab in self.lora_adapters(adapter).values() for t in ab]

    def set_lora_adapters(self, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                          adapter: str | None = None) -> None:
        """Copy ``{layers.{i}.<projection>: (A, B)}`` into the adapters (multi
        mode: the named one) in place (cast to their dtype); the names must
        be exactly this trainer's and the shapes equal.  Call ``pair.sync()``
        after it."""
        own = self.lora_adapters(adapter)
        if set(adapters) != set(own):
            missing, extra = sorted(set(own) - set(adapters)), sorted(set(adapters) - set(own))
            raise ValueError(f"the adapter does not fit this model's LoRA modules: missing {missing[:4]}"
                             f"{' ...' if len(missing) > 4 else ''}, unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}")
        for n, (a, b) in adapters.items():
            pa, pb = own[n]
            if a.shape != pa.shape or b.shape != pb.shape:
                raise ValueError(f"{n}: A {tuple(a.shape)}, B {tuple(b.shape)}; this model's are "
                                 f"A {tuple(pa.shape)}, B {tuple(pb.shape)}")
        with torch.no_grad():
            for n, (a, b) in adapters.items():
                own[n][0].copy_(a)
                own[n][1].copy_(b)

    def invalidate_caches(self) -> None:
        """Drop the derived weights (FP8 codes, merged LoRA W'): the next
        forward or ``forward_weights()`` rebuilds them from the masters.  The
        caches key on each tensor's version counter, which torch.optim's
        ``fused=True`` kernels leave alone; ``Pair.sync()`` calls this once
        per optimizer step, so such steps are never missed."""
        for m in self.modules():
            if m is not self and callable(getattr(m, "invalidate", None)):
                m.invalidate()

    def forward_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the forward reads, named as the server's weights: the
        parameters, and for FP8 layers their cached codes and scales
        (``<layer>.weight`` e4m3, ``<layer>.weight_scale_inv`` fp32)."""
        out = {}
        for name, module in self.named_modules():
            prefix = name + "." if name else ""
            if isinstance(module, (Linear, Fp8Linear)):  # LoRALinear and MultiLoRALinear too
                out.update(module.forward_weights(prefix))
            elif isinstance(module, Weight):
                out[prefix + "weight"] = module.weight.detach()
        return out

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None):
        """Final normed hidden states of ``rows``.

        tokens, positions: (T,) int64; cu_seqlens: (B + 1,) int32;
        rows: (R,) int64 indices into T; adapters: multi-mode LoRA's
        adapter of each token (None: the base model) -> (R, H)."""
        x, residual = self.embed.weight[tokens], None
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, residual = checkpoint(layer, x, residual, positions, cu_seqlens, max_seqlen, adapters,
                                         use_reentrant=False)
            else:
                x, residual = layer(x, residual, positions, cu_seqlens, max_seqlen, adapters)
        return rmsnorm_residual(x[rows], residual[rows], self.norm.weight, self.cfg.rms_norm_eps)[0]

    def logits(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None):
        """FP32 next-token logits (R, V) of ``rows``; differentiable."""
        return lm_head_logits(self.hidden(tokens, positions, cu_seqlens, rows, max_seqlen, adapters),
                              self.lm_head_weight)

    def logprobs(
        self,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        prompt_lens: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
    ) -> list[torch.Tensor]:
        """FP32 log-probs of ``sequence[prompt_len:]`` for each sequence, under
        the sampling transforms of its ``SamplingParams`` (default: plain
        softmax) and, in multi-mode LoRA, the adapter ``adapters`` names (one
        for all or one per sequence; None: the base model), bitwise equal to
        the server's; differentiable."""
        params = sampling_list(sampling, len(sequences))
        ids = self._adapter_ids(adapters, len(sequences))
        batch = pack_scored(sequences, prompt_lens, self.cfg.vocab_size, self.cfg.max_position, self.embed.weight.device)
        rows = None
        if any(j >= 0 for j in ids):
            per_token = torch.repeat_interleave(torch.tensor(ids, device=batch.tokens.device),
                                                batch.cu_seqlens.diff(), output_size=batch.tokens.shape[0])
            rows = AdapterRows(per_token, frozenset(ids) - {-1})
        logits = self.logits(batch.tokens, batch.positions, batch.cu_seqlens, batch.rows, batch.max_seqlen, rows)
        per_row = [p for p, n in zip(params, batch.counts) for _ in range(n)]
        t = params_to_tensors(per_row, [0] * len(per_row), device=logits.device)
        lp = sampling_logprobs(logits, batch.targets, t["temperature"], t["top_k"], t["top_p"], t["min_p"])
        return list(lp.split(batch.counts))

    def _adapter_ids(self, adapters, n: int) -> list[int]:
        """Per sequence, the index of its multi-mode adapter (-1: none)."""
        ids = []
        for i, a in enumerate(one_each(adapters, n, "sequences", "adapters")):
            try:
                ids.append(-1 if a is None else self.adapter_index(a))
            except (TypeError, ValueError) as e:
                raise type(e)(f"sequence {i}: {e}") from None
        return ids
