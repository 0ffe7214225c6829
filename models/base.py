"""What every model's trainer and server share, so that a model folder holds
only its config, its weight names and its block math.

``TrainerBase`` (an ``nn.Module``): LoRA in three modes over the model's
``layers`` (``add_lora`` replaces each targeted ``Linear`` of a block by its
LoRA form), the adapters' accessors, ``forward_weights`` (the tensors the
forward reads, named as the server's weights), ``invalidate_caches`` and
``logprobs`` over ``logits`` (the LM head on the subclass's ``hidden``).  A
subclass sets ``model_name``, ``lora_targets`` (HF projections in layer
order) and ``lora_slices_of`` (its ``weights.lora_slices``: cfg -> {block
attribute: ((projection, first row, end row), ...)}), and provides
``hidden(tokens, positions, cu_seqlens, rows, max_seqlen, adapters)``.

``ServerBase``: the server's weight dict (``.weights``, what sync writes
into), its device and dtype, the RoPE table (built before any CUDA-graph
capture), ``linear`` (the fixed-order matmul, its FP8 form when the layer's
``weight_scale_inv`` is there, and the separate or multi-mode LoRA branch the
trainer's layer adds), ``_norm`` and ``_logits`` (the final norm and LM head).
A subclass sets ``lora_slices_of`` and provides ``cache_pools()`` and
``forward``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..common.engine.sequence import adapter_position, one_each
from ..common.fp8 import fp8_matmul_fwd
from ..common.layers import (
    LORA_MODES,
    AdapterRows,
    LoRALinear,
    MultiLoRALinear,
    check_adapter_configs,
    check_lora_config,
)
from ..common.lm_head import lm_head_logits, lm_head_logits_fwd
from ..common.lora import LoRAConfig, lora_add_fwd, lora_add_multi_fwd
from ..common.matmul import matmul_fwd
from ..common.moe.lora import ExpertsAdapter
from ..common.rmsnorm import rmsnorm_fwd
from ..common.rope import rope_table
from ..common.sampling import SamplingParams, params_to_tensors, sampling_logprobs
from ._packing import pack_scored, sampling_list
from .capture import no_tap, no_tap_cache, no_tap_state


def check_lora_mode(mode: str, fp8: bool = False, lora: LoRAConfig | None = None) -> None:
    """The LoRA mode is one of ``LORA_MODES``; an FP8 trainer takes LoRA only on its FP8 experts, in
    separate mode (the adapter added inside the experts' computation, the base kept as FP8 codes):
    ``load`` and ``add_lora`` refuse the rest alike."""
    if mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {mode!r}")
    if fp8 and (mode != "separate" or lora is None or lora.target_modules or not lora.target_parameters):
        raise NotImplementedError("LoRA with fp8=True adapts the FP8 experts only: lora_mode='separate' with "
                                  "target_parameters (the experts) and no target_modules (a projection's adapter "
                                  "would need the FP8 GEMM's rounding points); use bf16 or fp32 for projections")


def _no_lora_slices(cfg) -> dict[str, tuple[tuple[str, int, int], ...]]:
    raise NotImplementedError("set lora_slices_of to the model's weights.lora_slices")


def _owner(block: nn.Module, path: str) -> tuple[nn.Module | None, str]:
    """(the module holding the last part of a dotted ``path``, that attribute); (None, ...) when the
    block has no such submodule (a hybrid model's other layer type)."""
    *parents, attr = path.split(".")
    owner = block
    for p in parents:
        owner = getattr(owner, p, None)
        if owner is None:
            return None, attr
    return (owner, attr) if hasattr(owner, attr) else (None, attr)


INDEX_SELECTED = "index_selected"  # the on-request extra of an indexer model: (T, indexer layers, top_k) int32


def first_bad_selection(s: torch.Tensor, limit: torch.Tensor) -> tuple[int, int, int] | None:
    """(token, layer, entry) of the first entry of s (n, layers, k) that is below -1, not below ``limit`` (n,) (the
    candidates token t may select), out of ascending order or a candidate after a -1 pad; None if none is."""
    valid = s >= 0
    bad = (s < -1) | (s >= limit[:, None, None]) & valid
    ascending = (s[..., 1:] > s[..., :-1]) | ~valid[..., 1:]
    bad[..., 1:] |= ~ascending | (valid[..., 1:] & ~valid[..., :-1])  # a candidate after a pad, or out of order
    return tuple(int(v) for v in bad.nonzero()[0]) if bool(bad.any()) else None


class TrainerBase(nn.Module):
    model_name: str = ""
    lora_targets: tuple[str, ...] = ()
    lora_slices_of = staticmethod(_no_lora_slices)  # the model's ``weights.lora_slices``
    # LoRA on parameters (an MoE layer's stacked experts): {HF parameter under a layer: (our module
    # holding ``gate_up`` / ``down`` experts, which of them)}, e.g. {"mlp.experts.down_proj": ("moe", "down")}
    lora_param_slots: dict[str, tuple[str, str]] = {}
    tap = staticmethod(no_tap)  # capture points (``models/capture.py``): off unless a Recorder attaches

    def __init__(self, cfg, *, activation_checkpointing: bool = False, fp8: bool = False):
        super().__init__()
        self.cfg = cfg
        self.fp8 = fp8
        self.activation_checkpointing = activation_checkpointing
        self.lora: LoRAConfig | None = None  # merged / separate
        self.adapter_configs: dict[str, LoRAConfig] = {}  # multi: {name: config}, in adapter-index order
        self.lora_mode: str | None = None

    def lora_slices(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        return self.lora_slices_of(self.cfg)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    @classmethod
    def check_lora(cls, lora: LoRAConfig | Mapping) -> LoRAConfig:
        """``lora`` checked against this model's projections (``check_lora_config``)."""
        return check_lora_config(lora, cls.lora_targets, cls.model_name, tuple(cls.lora_param_slots))

    @classmethod
    def check_adapters(cls, adapters: Mapping) -> dict[str, LoRAConfig]:
        return check_adapter_configs(adapters, cls.lora_targets, cls.model_name, tuple(cls.lora_param_slots))

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
        configs = self.check_adapters(lora) if mode == "multi" else {None: self.check_lora(lora)}
        check_lora_mode(mode, self.fp8, None if mode == "multi" else configs[None])
        if mode == "multi" and any(c.target_parameters for c in configs.values()):
            raise NotImplementedError("LoRA on the experts (target_parameters) runs in the merged and separate modes; "
                                      "multi-mode adapters target projections (target_modules) only")
        for p in self.parameters():
            p.requires_grad_(False)
        order, L = list(self.lora_targets), len(self.layers)
        for i, block in enumerate(self.layers):
            for name, layer_slices in self.lora_slices().items():
                # one seed per (adapter, layer, projection), distinct across pair seeds for < 10^6 of them;
                # adapter 0 gets the seeds of the single-adapter modes
                ads = [(cfg, {p: seed * 1_000_003 + 1 + len(order) * (i + j * L) + order.index(p)
                              for p, _, _ in layer_slices if p in cfg.target_modules})
                       for j, cfg in enumerate(configs.values())]
                owner, attr = _owner(block, name)
                if owner is None or not any(seeds for _, seeds in ads):  # a layer type without this projection
                    continue
                if mode == "multi":
                    m = MultiLoRALinear(getattr(owner, attr), layer_slices, ads)
                else:
                    ((cfg, seeds),) = ads
                    m = LoRALinear(getattr(owner, attr), layer_slices, cfg.r, cfg.scale, mode, seeds)
                setattr(owner, attr, m)
        if mode != "multi" and configs[None].target_parameters:
            self._add_experts_lora(configs[None], mode, seed)
        if mode == "multi":
            self.adapter_configs = configs
        else:
            self.lora = configs[None]
        self.lora_mode = mode

    def _experts_slots(self, targets) -> dict[str, list[str]]:
        """{our experts module path: [its targeted keys]} for HF parameter names ``targets``."""
        out: dict[str, list[str]] = {}
        for hf, (path, key) in self.lora_param_slots.items():
            if hf in targets:
                out.setdefault(path, []).append(key)
        return out

    def _add_experts_lora(self, cfg: LoRAConfig, mode: str, seed: int) -> None:
        """An ``ExpertsAdapter`` on every layer's targeted experts (a seed per layer and projection)."""
        for i, block in enumerate(self.layers):
            for path, keys in self._experts_slots(cfg.target_parameters).items():
                owner, attr = _owner(block, path)
                if owner is None:
                    continue
                experts = getattr(owner, attr)
                seeds = {k: seed * 1_000_003 + 500_009 + 2 * i + ExpertsAdapter.KEYS.index(k) for k in keys}
                setattr(experts, ExpertsAdapter.ATTR, ExpertsAdapter(*self.experts_base(experts), keys, cfg.r,
                                                                     cfg.scale, mode, seeds,
                                                                     dtype=self.embed.weight.dtype))

    def experts_base(self, experts) -> tuple[torch.Tensor, torch.Tensor]:
        """The stacks (E, 2I, H), (E, H, I) an experts adapter takes its shapes from (and merges into)."""
        return experts.gate_up.weight, experts.down.weight

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
            for name, layer_slices in self.lora_slices().items():
                owner, attr = _owner(block, name)
                m = None if owner is None else getattr(owner, attr)
                holder = m.adapters[j] if isinstance(m, MultiLoRALinear) else m if isinstance(m, LoRALinear) else None
                if holder is not None:
                    out |= {f"layers.{i}.{p}": (holder, p) for p, _, _ in layer_slices if p in holder.lora_A}
            for path in {path for path, _ in self.lora_param_slots.values()}:
                owner, attr = _owner(block, path)
                ad = None if owner is None else getattr(getattr(owner, attr), ExpertsAdapter.ATTR, None)
                if ad is not None:
                    out |= {f"layers.{i}.{path}.{p}": (ad, p) for p in ad.lora_A}
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
        """The tensors the forward reads, named as the server's weights: what
        each module's ``forward_weights(prefix)`` says the server reads of it
        (a ``Weight``'s parameter; an FP8 layer's cached codes and scales,
        ``<layer>.weight`` e4m3 and ``<layer>.weight_scale_inv`` fp32; merged
        LoRA's W'; an MoE block's quantized experts), a module's entries laid
        over its children's.  No module type is special-cased here: a layer
        that stores its weights its own way says so in its own method."""
        out: dict[str, torch.Tensor] = {}

        def visit(module: nn.Module, prefix: str) -> None:
            for name, child in module.named_children():
                visit(child, f"{prefix}{name}.")
            served = getattr(module, "forward_weights", None)
            if module is not self and callable(served):  # after its children: a layer's codes replace its masters
                out.update(served(prefix))

        visit(self, "")
        return out

    def logits(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None,
               **kw) -> torch.Tensor:
        """FP32 next-token logits (R, V) of ``rows``: the LM head on ``hidden``
        (``kw``: the model's own, e.g. ``replay``); differentiable."""
        logits = lm_head_logits(self.hidden(tokens, positions, cu_seqlens, rows, max_seqlen, adapters, **kw),
                                self.lm_head_weight)
        self.tap("lm_head.logits", logits, rows="logits")
        return logits

    def logprobs(
        self,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        prompt_lens: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        adapters: str | None | Sequence[str | None] = None,
        *,
        replay: Sequence[Mapping[str, torch.Tensor]] | None = None,
        replay_mode: str = "straight-through",
    ) -> list[torch.Tensor]:
        """FP32 log-probs of ``sequence[prompt_len:]`` for each sequence, under
        the sampling transforms of its ``SamplingParams`` (default: plain
        softmax) and, in multi-mode LoRA, the adapter ``adapters`` names (one
        for all or one per sequence; None: the base model), bitwise equal to
        the server's; differentiable.

        ``replay`` (MoE models): per sequence the server's per-token extras
        (``Completion.extras``, or ``score(..., return_extras=True)``'s), whose
        "routed_experts" (n - 1, L, k) and "routed_weights" route the trainer's
        MoE layers instead of its own routers (router replay: the routing the
        sampler used, e.g. under stale weights); the last token, never fed to
        the server, keeps the trainer's own.  ``replay_mode``: "frozen" or
        "straight-through" (``common.moe.router_replay``)."""
        params = sampling_list(sampling, len(sequences))
        ids = self._adapter_ids(adapters, len(sequences))
        batch = pack_scored(sequences, prompt_lens, self.cfg.vocab_size, self.cfg.max_position, self.device)
        rows = None
        if any(j >= 0 for j in ids):
            per_token = torch.repeat_interleave(torch.tensor(ids, device=batch.tokens.device),
                                                batch.cu_seqlens.diff(), output_size=batch.tokens.shape[0])
            rows = AdapterRows(per_token, frozenset(ids) - {-1})
        kw = {} if replay is None else self.replay_kwargs(replay, sequences, batch, replay_mode)
        logits = self.logits(batch.tokens, batch.positions, batch.cu_seqlens, batch.rows, batch.max_seqlen, rows, **kw)
        per_row = [p for p, n in zip(params, batch.counts) for _ in range(n)]
        t = params_to_tensors(per_row, [0] * len(per_row), device=logits.device)
        lp = sampling_logprobs(logits, batch.targets, t["temperature"], t["top_k"], t["top_p"], t["min_p"])
        return list(lp.split(batch.counts))

    def index_replay_shape(self) -> tuple[int, int] | None:
        """(indexer layers, top_k) of a model whose server returns its selections as the on-request extra
        "index_selected" (GLM-5, DeepSeek-V4); None: no index replay."""
        return None

    def check_index_selection(self, s: torch.Tensor, entry: int) -> None:
        """ValueError unless s (n, layers, top_k) of one sequence is a selection the model's indexer could have made."""
        raise NotImplementedError

    def replay_kwargs(self, replay, sequences, batch, mode: str) -> dict:
        """``hidden``'s keywords for the server's extras ``replay`` (one entry per sequence): the routed
        experts (``replay``); with index replay (``index_replay_shape``), the routing where the entries hold
        "routed_experts", the selections (``index_replay``) where they hold "index_selected", or both."""
        if self.index_replay_shape() is None:
            return {"replay": self._replay_rows(replay, sequences, batch, mode)}
        if len(replay) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(replay)} replay entries: one per sequence")
        kw = {}
        if any("routed_experts" in ex for ex in replay):
            kw["replay"] = self._replay_rows(replay, sequences, batch, mode)
        if any(INDEX_SELECTED in ex for ex in replay):
            kw["index_replay"] = self._index_rows(replay, batch)
        if not kw:
            raise ValueError("the replay entries hold neither routed_experts nor index_selected: pass the server's "
                             "Completion.extras (index_selected needs SamplingParams(extras=('index_selected',)))")
        return kw

    def _index_rows(self, replay, batch):
        """Per indexer layer (selection (T, top_k) int32, rows that have one (T,)), each entry checked by the
        model's ``check_index_selection``."""
        shape = self.index_replay_shape()
        sels, have = [], []
        for i, (ex, n) in enumerate(zip(replay, batch.cu_seqlens.diff().tolist())):
            s = ex.get(INDEX_SELECTED)
            if s is None:
                raise ValueError(f"replay entry {i} has no {INDEX_SELECTED}: every entry needs one, or none")
            if s.dtype.is_floating_point or s.dtype == torch.bool or tuple(s.shape) != (n - 1, *shape):
                raise ValueError(f"replay entry {i}: {INDEX_SELECTED} is {s.dtype} {tuple(s.shape)}, want integer "
                                 f"({n - 1}, {shape[0]}, {shape[1]}) for a sequence of {n} tokens")
            self.check_index_selection(s.long(), i)
            sels.append(torch.cat([s.to(torch.int32), s.new_full((1, *shape), -1, dtype=torch.int32)]))
            have.append(torch.arange(n) < n - 1)
        sel, have = torch.cat(sels).to(self.device), torch.cat(have).to(self.device)
        return [(sel[:, j].contiguous(), have) for j in range(shape[0])]

    def _replay_rows(self, replay, sequences, batch, mode: str):
        """Per layer (ids (T, k), weights (T, k), rows with a replay (T,) bool, mode) of the packed batch."""
        if len(replay) != len(sequences):
            raise ValueError(f"{len(sequences)} sequences but {len(replay)} replay entries: one per sequence")
        ids, ws, have = [], [], []
        for i, (ex, n) in enumerate(zip(replay, batch.cu_seqlens.diff().tolist())):
            if "routed_experts" not in ex or "routed_weights" not in ex:
                raise ValueError(f"replay entry {i} has no routed_experts / routed_weights: pass a MoE model's "
                                 f"Completion.extras")
            e, w = ex["routed_experts"], ex["routed_weights"]
            if e.shape[0] != n - 1 or w.shape != e.shape:
                raise ValueError(f"replay entry {i}: routed_experts {tuple(e.shape)} and routed_weights "
                                 f"{tuple(w.shape)}, want ({n - 1}, layers, k) for a sequence of {n} tokens")
            pad = torch.zeros(1, *e.shape[1:], dtype=e.dtype)
            ids.append(torch.cat([e, pad]))
            ws.append(torch.cat([w, pad.to(w.dtype)]))
            have.append(torch.arange(n) < n - 1)
        dev = self.device
        ids, ws, have = torch.cat(ids).to(dev), torch.cat(ws).to(dev), torch.cat(have).to(dev)
        return [(ids[:, j], ws[:, j], have, mode) for j in range(ids.shape[1])]

    def _adapter_ids(self, adapters, n: int) -> list[int]:
        """Per sequence, the index of its multi-mode adapter (-1: none)."""
        ids = []
        for i, a in enumerate(one_each(adapters, n, "sequences", "adapters")):
            try:
                ids.append(-1 if a is None else self.adapter_index(a))
            except (TypeError, ValueError) as e:
                raise type(e)(f"sequence {i}: {e}") from None
        return ids


class ServerBase:
    """Holds the server's copy of the weights (a dict named as the trainer's
    forward weights; a tied ``lm_head`` is the embedding) and the LoRA
    branches its layers add.  ``lora_scale``: lora_alpha / r of separate-mode
    adapters in ``weights``; ``lora_adapters``: ((name, scale), ...) of the
    multi-mode adapters in index order (requests name them: ``adapter_names``)."""

    lora_slices_of = staticmethod(_no_lora_slices)  # the model's ``weights.lora_slices``
    tap = staticmethod(no_tap)  # capture points (``models/capture.py``): off unless a Recorder attaches
    tap_cache = staticmethod(no_tap_cache)
    tap_state = staticmethod(no_tap_state)

    def __init__(self, cfg, weights: dict[str, torch.Tensor], lora_scale: float | None = None,
                 lora_adapters: tuple[tuple[str, float], ...] = ()):
        self.cfg = cfg
        self.weights = weights
        self.lora_scale = lora_scale
        self.adapter_names = tuple(name for name, _ in lora_adapters)
        self.adapter_scales = [scale for _, scale in lora_adapters]
        # {layer prefix: ((first row, end row, branch), ...)} for layers with adapters, branch as
        # ``_branch``; sync writes in place and never adds names, so this holds for the server's life
        self._lora = {}
        for i in range(cfg.num_layers):
            for name, slices in self.lora_slices().items():
                prefix = f"layers.{i}.{name}."
                branches = [self._branch(prefix, p) for p, _, _ in slices]
                if any(b is not None for b in branches):
                    self._lora[prefix] = tuple((lo, hi, b) for (_, lo, hi), b in zip(slices, branches))
        if self._lora and lora_scale is None and not self.adapter_names:
            raise ValueError("the weights hold LoRA adapters (lora_A.*) but no lora_scale was given")
        self.device = weights["embed.weight"].device
        self.dtype = weights["embed.weight"].dtype
        self.vocab_size = cfg.vocab_size
        self.max_position = cfg.max_position
        self.rope = getattr(cfg, "rope", None)
        if self.rope is not None:
            rope_table(self.rope, self.device)  # built and copied before any CUDA-graph capture

    def lora_slices(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        return self.lora_slices_of(self.cfg)

    def _branch(self, prefix: str, p: str):
        """Projection p's adapter tensors in layer ``prefix``: separate (A, B);
        multi ([A_j or None], [B_j or None]) over the adapters; None if none."""
        w = self.weights
        if not self.adapter_names:
            a = w.get(f"{prefix}lora_A.{p}")
            return None if a is None else (a, w[f"{prefix}lora_B.{p}"])
        names = [f"{prefix}adapters.{j}.lora_%s.{p}" for j in range(len(self.adapter_names))]
        a_n, b_n = [w.get(n % "A") for n in names], [w.get(n % "B") for n in names]
        return None if all(a is None for a in a_n) else (a_n, b_n)

    def w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.weights.get("lm_head.weight", self.weights["embed.weight"])

    def norm_weight(self, name: str) -> torch.Tensor:
        """An RMSNorm weight as ``_norm`` reads it (a zero-centred model: 1 + w)."""
        return self.w(name)

    def _norm(self, x, name, residual=None):
        """rmsnorm_fwd of x (with the residual add fused when ``residual`` is given) -> (y, new residual)."""
        y, new_residual, _ = rmsnorm_fwd(x, self.norm_weight(name), self.cfg.rms_norm_eps, residual)
        return y, new_residual

    def _logits(self, x, residual, batch) -> torch.Tensor:
        """The final norm (residual add fused) and the LM head on ``batch.logit_rows`` -> FP32 logits (R, V)."""
        rows = batch.logit_rows
        h = self._norm(x[rows], "norm.weight", residual[rows])[0]
        self.tap("norm", h, rows="logits")
        logits = lm_head_logits_fwd(h, self.lm_head_weight)
        self.tap("lm_head.logits", logits, rows="logits")
        return logits

    def linear(self, x, prefix, adapter_ids):
        """x · Wᵀ; an FP8 layer (its ``weight_scale_inv`` present) reads its
        codes; a layer with LoRA adapters adds their branches (multi mode:
        each row its own adapter's, by ``adapter_ids`` (T,))."""
        scale_inv = self.weights.get(prefix + "weight_scale_inv")
        if scale_inv is not None:
            return fp8_matmul_fwd(x, self.weights[prefix + "weight"], scale_inv)
        y = matmul_fwd(x, self.weights[prefix + "weight"])
        slices = self._lora.get(prefix)
        if slices is None:
            return y
        parts = []
        for lo, hi, branch in slices:
            if branch is None:
                parts.append(y[:, lo:hi])
            elif self.adapter_names:
                parts.append(lora_add_multi_fwd(y[:, lo:hi], x, adapter_ids, *branch, self.adapter_scales))
            else:
                parts.append(lora_add_fwd(y[:, lo:hi], x, *branch, self.lora_scale))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
