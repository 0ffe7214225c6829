"""Qwen3 training module: packed variable-length forward, FP32 chosen-token
log-probabilities under the sampler's transforms, autograd through every kernel.

It calls the public (differentiable) functions of the same kernels whose
``_fwd`` launchers ``serve.py`` calls, layer for layer, so a token's
log-probability has the server's bits.  Shapes: T packed tokens, H hidden,
Hq / Hkv heads of D channels, I intermediate, V vocabulary, R scored rows.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.attention import attention
from ...common.fp8 import Fp8WeightCache, fp8_linear
from ...common.lm_head import lm_head_logits
from ...common.lora import LoRAConfig, init_lora_weights, lora_add, lora_merge, lora_merge_fwd
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


class Linear(Weight):
    """y = x · Wᵀ with the batch-invariant matmul."""

    def forward(self, x):
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
              ``.data`` bypass the version counters: rebuild by assigning
              ``_key = None`` after them.
    separate: y = x · Wᵀ, then each adapted column slice
              y_p = ``lora_add(y_p, x, A_p, B_p, s)``; the server runs
              ``lora_add_fwd`` on the same slices (``serve.py``).
    """

    def __init__(self, base: Linear, slices: Sequence[tuple[str, int, int]], targets: Sequence[str], r: int,
                 scale: float, mode: str, seeds: Mapping[str, int]):
        nn.Module.__init__(self)
        self.weight = base.weight
        self.slices = tuple(slices)  # ((projection, first row, end row), ...) covering W's rows
        self.mode, self.scale = mode, scale
        self.lora_A, self.lora_B = nn.ParameterDict(), nn.ParameterDict()
        w = self.weight
        for p, lo, hi in self.slices:
            if p in targets:
                a, b = init_lora_weights(hi - lo, w.shape[1], r, seed=seeds[p], dtype=w.dtype, device=w.device)
                self.lora_A[p], self.lora_B[p] = nn.Parameter(a), nn.Parameter(b)
        self._key, self._merged = None, None

    @property
    def adapted(self) -> list[tuple[str, int, int]]:
        return [(p, lo, hi) for p, lo, hi in self.slices if p in self.lora_A]

    @torch.no_grad()
    def merge(self) -> torch.Tensor:
        """A new W' (N, K) in W's dtype (not cached)."""
        w = self.weight.detach()
        merged = w.clone()
        for p, lo, hi in self.adapted:
            merged[lo:hi] = lora_merge_fwd(w[lo:hi], self.lora_A[p], self.lora_B[p], self.scale)
        return merged

    def merged_weight(self) -> torch.Tensor:
        """The cached W', rebuilt only when W, an A or a B was written since."""
        key = tuple((t._version, t.data_ptr()) for t in (self.weight, *self.lora_A.values(), *self.lora_B.values()))
        if key != self._key:
            self._key, self._merged = key, self.merge()
        return self._merged

    def forward(self, x):
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


LORA_MODES = ("merged", "separate")


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


class Fp8Linear(Weight):
    """An FP32 master weight whose forward reads its FP8 quantization (e4m3,
    128x128 blocks), made once per optimizer step (``Fp8WeightCache``): the
    trainer, the server and the weight sync all read those very codes."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__(*shape, device=device, dtype=torch.float32)
        self.cache = Fp8WeightCache(self.weight)

    def forward(self, x):
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

    def forward(self, x, residual, positions, cu_seqlens, max_seqlen):
        """x: (T, H) the previous block's output; residual: (T, H) or None
        (first block, x is the embedding) -> (mlp_out, residual)."""
        cfg = self.cfg
        T, Hq, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if residual is None:
            h, residual = rmsnorm(x, self.attn_norm.weight, eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, self.attn_norm.weight, eps)
        q, k, v = self.qkv(h).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(rmsnorm(q.reshape(T, Hq, D).contiguous(), self.q_norm.weight, eps), positions, cfg.rope)
        k = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), self.k_norm.weight, eps), positions, cfg.rope)
        o = attention(q, k, v.reshape(T, Hkv, D).contiguous(), cu_seqlens, max_seqlen=max_seqlen)
        x = self.o(o.reshape(T, Hq * D))
        h, residual = rmsnorm_residual(x, residual, self.mlp_norm.weight, eps)
        return self.down(swiglu_gate_up(self.gate_up(h))), residual


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
        self.lora: LoRAConfig | None = None
        self.lora_mode: str | None = None

    def add_lora(self, lora: LoRAConfig | Mapping, mode: str = "merged", seed: int = 0) -> None:
        """Freeze every parameter and give each targeted projection of every
        layer an adapter (``LoRALinear``): A from ``init_lora_weights`` with
        a seed drawn from ``seed`` per (layer, projection), B = 0, so the
        model computes exactly what it did until B trains.  ``mode``:
        "merged" (the forward and the server read W' = W + s·B·A) or
        "separate" (base output plus the adapter branch, on both sides)."""
        if self.lora is not None:
            raise RuntimeError("this trainer already has LoRA adapters")
        if mode not in LORA_MODES:
            raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
        if self.fp8:
            raise NotImplementedError("LoRA on an FP8 trainer is not supported yet (the adapters would need the "
                                      "FP8 GEMM's rounding points); use bf16 or fp32 with LoRA")
        lora = check_lora_config(lora)
        for p in self.parameters():
            p.requires_grad_(False)
        slices = lora_slices(self.cfg)
        for i, block in enumerate(self.layers):
            for name, layer_slices in slices.items():
                targets = [p for p, _, _ in layer_slices if p in lora.target_modules]
                if targets:
                    # one seed per (layer, projection), distinct across pair seeds for < 10^6 adapters
                    seeds = {p: seed * 1_000_003 + 1 + len(LORA_TARGETS) * i + list(LORA_TARGETS).index(p)
                             for p in targets}
                    setattr(block, name, LoRALinear(getattr(block, name), layer_slices, targets, lora.r, lora.scale,
                                                    mode, seeds))
        self.lora, self.lora_mode = lora, mode

    def lora_modules(self) -> dict[str, tuple[LoRALinear, str]]:
        """{``layers.{i}.<projection>``: (its LoRALinear, projection)} in layer order."""
        out = {}
        for i, block in enumerate(self.layers):
            for name in lora_slices(self.cfg):
                m = getattr(block, name)
                if isinstance(m, LoRALinear):
                    out |= {f"layers.{i}.{p}": (m, p) for p, _, _ in m.adapted}
        return out

    def lora_adapters(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{``layers.{i}.<projection>``: (A (r, K), B (rows, r))}: the live
        parameters (for ``save_peft_adapter`` with ``weights.lora_to_hf``)."""
        return {n: (m.lora_A[p], m.lora_B[p]) for n, (m, p) in self.lora_modules().items()}

    def set_lora_adapters(self, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy ``{layers.{i}.<projection>: (A, B)}`` into the adapters in place
        (cast to their dtype); the names must be exactly this trainer's and
        the shapes equal.  Call ``pair.sync()`` after it."""
        own = self.lora_adapters()
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

    def forward_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the forward reads, named as the server's weights: the
        parameters, and for FP8 layers their cached codes and scales
        (``<layer>.weight`` e4m3, ``<layer>.weight_scale_inv`` fp32)."""
        out = {}
        for name, module in self.named_modules():
            prefix = name + "." if name else ""
            if isinstance(module, (Linear, Fp8Linear)):  # LoRALinear too
                out.update(module.forward_weights(prefix))
            elif isinstance(module, Weight):
                out[prefix + "weight"] = module.weight.detach()
        return out

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None):
        """Final normed hidden states of ``rows``.

        tokens, positions: (T,) int64; cu_seqlens: (B + 1,) int32;
        rows: (R,) int64 indices into T -> (R, H)."""
        x, residual = self.embed.weight[tokens], None
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, residual = checkpoint(layer, x, residual, positions, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                x, residual = layer(x, residual, positions, cu_seqlens, max_seqlen)
        return rmsnorm_residual(x[rows], residual[rows], self.norm.weight, self.cfg.rms_norm_eps)[0]

    def logits(self, tokens, positions, cu_seqlens, rows, max_seqlen=None):
        """FP32 next-token logits (R, V) of ``rows``; differentiable."""
        return lm_head_logits(self.hidden(tokens, positions, cu_seqlens, rows, max_seqlen), self.lm_head_weight)

    def logprobs(
        self,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        prompt_lens: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[torch.Tensor]:
        """FP32 log-probs of ``sequence[prompt_len:]`` for each sequence, under
        the sampling transforms of its ``SamplingParams`` (default: plain
        softmax), bitwise equal to the server's; differentiable."""
        params = sampling_list(sampling, len(sequences))
        batch = pack_scored(sequences, prompt_lens, self.cfg.vocab_size, self.cfg.max_position, self.embed.weight.device)
        logits = self.logits(batch.tokens, batch.positions, batch.cu_seqlens, batch.rows, batch.max_seqlen)
        per_row = [p for p, n in zip(params, batch.counts) for _ in range(n)]
        t = params_to_tensors(per_row, [0] * len(per_row), device=logits.device)
        lp = sampling_logprobs(logits, batch.targets, t["temperature"], t["top_k"], t["top_p"], t["min_p"])
        return list(lp.split(batch.counts))
