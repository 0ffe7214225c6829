"""The MoE block of the zoo's MoE models, trainer and server side by side:
router -> router replay -> routed experts (LoRA inside) -> shared expert -> one
combine.  The models differ only in the parts a ``MoESpec`` names:

    model                   router                              experts  shared expert
    qwen35_gdn              SoftmaxRouter(k)                    BF16     GatedSharedExpert(Is)
    glm5_sparse_fp8         SigmoidRouter(k, n_group,           FP8      SharedExpert(n_shared · I)
                              topk_group, routed_scaling_factor)
    deepseek_v4_mhc_mxfp4   HashRouter(k, vocab, scale) in the  MXFP4    SharedExpert(Is), limit=swiglu_limit
                              first layers, SqrtSoftplusRouter(k, scale) after

``MoEBlock`` (the trainer's module) calls the public kernels; ``moe_block_fwd``
(the server's twin) their ``_fwd`` launchers, op for op, with the same capture
points ("moe.router.ids", "moe.router.weights", "moe.routed", "moe.out").  The
routed sum stays fp32 and is added to the shared expert by the FP64 tree in
logical order (routed, shared), rounded once.

A model holds the block as ``layers.{i}.moe``; its tensors under that prefix:
``gate.weight`` (E, H) (fp32 for the sigmoid router, as transformers keeps
it), ``correction_bias.weight`` (E,) fp32 (e_score_correction_bias: sigmoid and
sqrt-softplus) or ``tid2eid.weight`` (V, k) int64 (hash), ``gate_up`` /
``down`` in the experts' format (``Bf16Experts``, ``Fp8Experts``,
``Mxfp4Experts``), ``shared_gate_up`` / ``shared_down`` (and ``shared_gate``,
gated), and the experts' LoRA ``lora_A.<gate_up|down>`` / ``lora_B.<...>``.

It lives in ``models/``, not ``common/moe/``, because it composes model-level
pieces: ``Linear`` layers that take the batch's ``AdapterRows``, the server's
``linear`` (its FP8 and LoRA branches), the capture taps of ``capture.py``, the
replay rows ``TrainerBase.logprobs`` packs and the extras it reads back.
``common/moe`` stays the op folder its kernels and references live in.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..common.layers import Linear, Weight
from ..common.matmul import matmul, matmul_fwd
from ..common.moe import (
    Fp8ExpertsCache,
    experts_fp8_fwd,
    experts_fwd,
    experts_mxfp4_fwd,
    hash_route,
    hash_route_fwd,
    moe_combine,
    moe_experts,
    moe_experts_mxfp4,
    router_replay,
    sigmoid_topk,
    sigmoid_topk_fwd,
    softmax_topk,
    softmax_topk_fwd,
    sqrtsoftplus_topk,
    sqrtsoftplus_topk_fwd,
)
from ..common.moe.lora import ExpertsAdapter, expert_lora_of
from ..common.moe.router import sigmoid_fp32
from ..common.swiglu import swiglu_fwd, swiglu_gate_up
from ..common.tree import tree_reduce_fwd
from .capture import no_tap

ROUTED_EXPERTS, ROUTED_WEIGHTS = "routed_experts", "routed_weights"  # the extras TrainerBase.logprobs(replay=) reads


# ---------------------------------------------------------------- routers


class Router:
    """What the block reads of a router: ``top_k``; ``gate_dtype`` (the gate
    projection's weight and input dtype; None: the model's); ``tables(E)``,
    {name: (shape, dtype)} of its frozen tensors beside the gate; ``route``
    (trainer) and ``route_fwd`` (server): (logits (T, E), {table: tensor},
    tokens (T,)) -> (weights (T, k), ids (T, k) int64); and ``replay``: the
    server's routing in place of its own, its weights recomputed at the
    replayed ids (``common.moe.router_replay``, by ``scoring`` and
    ``routed_scaling_factor``)."""

    gate_dtype: torch.dtype | None = None
    routed_scaling_factor: float = 1.0

    def tables(self, E: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {}

    def replay(self, logits, ids, weights, mode: str):
        return router_replay(logits, ids, weights, mode=mode, scoring=self.scoring,
                             routed_scaling_factor=self.routed_scaling_factor)


@dataclass(frozen=True)
class SoftmaxRouter(Router):
    """Qwen3.5's: softmax over the logits, the top k renormalised, weights in the logits' dtype."""

    top_k: int
    scoring = "softmax"

    def route(self, logits, tables, tokens):
        return softmax_topk(logits, self.top_k)

    def route_fwd(self, logits, tables, tokens):
        return softmax_topk_fwd(logits, self.top_k)


@dataclass(frozen=True)
class SigmoidRouter(Router):
    """GLM-5's (DeepSeek-V3's): sigmoid scores of fp32 logits; the top k of score +
    e_score_correction_bias within the best ``topk_group`` of ``n_group`` groups; the
    unbiased scores renormalised, times ``routed_scaling_factor``, in fp32."""

    top_k: int
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    scoring = "sigmoid"
    gate_dtype = torch.float32

    def tables(self, E):
        return {"correction_bias": ((E,), torch.float32)}

    def route(self, logits, tables, tokens):
        return sigmoid_topk(logits, tables["correction_bias"], self.top_k, n_group=self.n_group,
                            topk_group=self.topk_group, routed_scaling_factor=self.routed_scaling_factor)

    def route_fwd(self, logits, tables, tokens):
        return sigmoid_topk_fwd(logits, tables["correction_bias"], self.top_k, self.n_group, self.topk_group,
                                self.routed_scaling_factor)


@dataclass(frozen=True)
class SqrtSoftplusRouter(Router):
    """DeepSeek-V4's learned router: sqrt(softplus) scores, the top k of score +
    e_score_correction_bias, the unbiased scores renormalised times ``routed_scaling_factor``."""

    top_k: int
    routed_scaling_factor: float = 1.0
    scoring = "sqrtsoftplus"

    def tables(self, E):
        return {"correction_bias": ((E,), torch.float32)}

    def route(self, logits, tables, tokens):
        return sqrtsoftplus_topk(logits, tables["correction_bias"], self.top_k,
                                 routed_scaling_factor=self.routed_scaling_factor)

    def route_fwd(self, logits, tables, tokens):
        return sqrtsoftplus_topk_fwd(logits, tables["correction_bias"], self.top_k, self.routed_scaling_factor)


@dataclass(frozen=True)
class HashRouter(Router):
    """DeepSeek-V4's first layers: the experts are ``tid2eid[token]`` (a frozen (V, k)
    table); the sqrt(softplus) scores only weight them, as ``SqrtSoftplusRouter``'s."""

    top_k: int
    vocab_size: int
    routed_scaling_factor: float = 1.0
    scoring = "sqrtsoftplus"

    def tables(self, E):
        return {"tid2eid": ((self.vocab_size, self.top_k), torch.int64)}

    def route(self, logits, tables, tokens):
        return hash_route(logits, tokens, tables["tid2eid"], routed_scaling_factor=self.routed_scaling_factor)

    def route_fwd(self, logits, tables, tokens):
        return hash_route_fwd(logits, tokens, tables["tid2eid"], self.routed_scaling_factor)


class Frozen(Weight):
    """A router table no gradient changes (``<name>.weight``; transformers keeps these as
    buffers): e_score_correction_bias (fp32), tid2eid (int64).  A ``Weight``, so
    ``forward_weights`` ships it; the model's ``init_weights`` fills it (``fill=``)."""

    def __init__(self, *shape: int, device=None, dtype=None):
        nn.Module.__init__(self)
        self.weight = nn.Parameter(torch.zeros(*shape, device=device, dtype=dtype), requires_grad=False)


# ---------------------------------------------------------------- shared experts


@dataclass(frozen=True)
class SharedExpert:
    """A SwiGLU MLP of ``width`` that every token goes through (GLM-5, DeepSeek-V4;
    n_shared_experts of width I are one of width n·I, as transformers builds them),
    clamped as the routed experts are (``MoESpec.limit``)."""

    width: int

    def make(self, block, H: int, linear, kw) -> None:
        block.shared_gate_up = linear(2 * self.width, H, **kw)
        block.shared_down = linear(H, self.width, **kw)

    def part(self, block, h, adapters, limit) -> torch.Tensor:
        """The trainer's contribution to the combine, fp32 (T, H)."""
        return block.shared_down(swiglu_gate_up(block.shared_gate_up(h, adapters), limit), adapters).float()

    def part_fwd(self, server, p: str, h, adapter_ids, limit) -> torch.Tensor:
        Is = self.width
        gu = server.linear(h, p + "shared_gate_up.", adapter_ids)
        return server.linear(swiglu_fwd(gu[:, :Is], gu[:, Is:], limit), p + "shared_down.", adapter_ids).float()


@dataclass(frozen=True)
class GatedSharedExpert(SharedExpert):
    """Qwen3.5's: the shared expert times sigmoid(h · shared_gate) (``shared_gate`` (1, H)), in fp32."""

    def make(self, block, H, linear, kw):
        super().make(block, H, linear, kw)
        block.shared_gate = Weight(1, H, **kw)

    def part(self, block, h, adapters, limit):
        shared = super().part(block, h, adapters, limit)
        return shared * sigmoid_fp32(matmul(h, block.shared_gate.weight).float())  # (T, 1)

    def part_fwd(self, server, p, h, adapter_ids, limit):
        shared = super().part_fwd(server, p, h, adapter_ids, limit)
        return shared * sigmoid_fp32(matmul_fwd(h, server.w(p + "shared_gate.weight")).float())


# ---------------------------------------------------------------- expert formats


def _separate_lora(block):
    """The ``ExpertLoRA`` a separate-mode adapter adds inside quantized experts (None without one)."""
    ad = block.experts_lora
    if ad is not None and ad.mode == "merged":
        raise NotImplementedError("merged LoRA on quantized experts would requantize W' every step; use "
                                  "lora_mode='separate'")
    return None if ad is None else ad.expert_lora()


class Bf16Experts:
    """Stacks in the model's dtype (bf16; fp32 in tests): ``gate_up`` (E, 2I, H), ``down``
    (E, H, I), shipped as they are; LoRA merged into them or separate inside the kernel."""

    def make(self, block, E, I, H, kw):
        block.gate_up = Weight(E, 2 * I, H, **kw)
        block.down = Weight(E, H, I, **kw)

    def routed(self, block, h, ids, w, limit):
        gu, d, lora, ad = block.gate_up.weight, block.down.weight, None, block.experts_lora
        if ad is not None and ad.mode == "merged":
            merged = ad.merged()
            gu, d = merged.get("gate_up", gu), merged.get("down", d)
        elif ad is not None:
            lora = ad.expert_lora()
        return moe_experts(h, ids, w, gu, d, limit=limit, lora=lora)

    def routed_fwd(self, server, p, h, ids, w, limit, lora):
        return experts_fwd(h, ids, w, server.w(p + "gate_up.weight"), server.w(p + "down.weight"), limit, lora=lora)

    def forward_weights(self, block, prefix):
        return {}

    def invalidate(self, block):
        pass


class Fp8Experts:
    """GLM-5's: FP32 master stacks read through their FP8 codes (e4m3 in 128x128 blocks,
    ``quantize_experts_fp8``), made once per optimizer step (``Fp8ExpertsCache``), as
    ``Fp8Linear`` is for a projection; the server reads ``<stack>.weight`` (the codes) and
    ``<stack>.weight_scale_inv``.  A frozen master gets no gradient."""

    def make(self, block, E, I, H, kw):
        kw = {**kw, "dtype": torch.float32}
        block.gate_up = Weight(E, 2 * I, H, **kw)
        block.down = Weight(E, H, I, **kw)
        block.fp8_cache = Fp8ExpertsCache(block.gate_up.weight, block.down.weight)

    def routed(self, block, h, ids, w, limit):
        return block.fp8_cache.experts(h, ids, w, limit=limit, lora=_separate_lora(block))

    def routed_fwd(self, server, p, h, ids, w, limit, lora):
        return experts_fp8_fwd(h, ids, w, server.w(p + "gate_up.weight"), server.w(p + "gate_up.weight_scale_inv"),
                               server.w(p + "down.weight"), server.w(p + "down.weight_scale_inv"), limit, lora)

    def forward_weights(self, block, prefix):
        gu, gu_s, d, d_s = block.fp8_cache.get()
        return {prefix + "gate_up.weight": gu, prefix + "gate_up.weight_scale_inv": gu_s,
                prefix + "down.weight": d, prefix + "down.weight_scale_inv": d_s}

    def invalidate(self, block):
        block.fp8_cache.invalidate()


class _Mxfp4Stack(nn.Module):
    """One frozen MXFP4 stack: ``weight`` (E, N, K/2) uint8 codes, ``weight_scale`` (E, N, K/32) uint8 E8M0."""

    def __init__(self, E, N, K, device=None):
        super().__init__()
        self.register_buffer("weight", torch.zeros(E, N, K // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(E, N, K // 32, dtype=torch.uint8, device=device))


class Mxfp4Experts:
    """DeepSeek-V4's: frozen MXFP4 stacks (``quantize_experts_mxfp4``: E2M1 codes two a
    byte, an E8M0 scale per 32 along K), computed packed; the server reads
    ``<stack>.weight`` and ``<stack>.weight_scale``.  They train through LoRA (separate)."""

    def make(self, block, E, I, H, kw):
        block.gate_up = _Mxfp4Stack(E, 2 * I, H, kw.get("device"))
        block.down = _Mxfp4Stack(E, H, I, kw.get("device"))

    def routed(self, block, h, ids, w, limit):
        gu, d = block.gate_up, block.down
        return moe_experts_mxfp4(h, ids, w, gu.weight, gu.weight_scale, d.weight, d.weight_scale, limit=limit,
                                 lora=_separate_lora(block))

    def routed_fwd(self, server, p, h, ids, w, limit, lora):
        return experts_mxfp4_fwd(h, ids, w, server.w(p + "gate_up.weight"), server.w(p + "gate_up.weight_scale"),
                                 server.w(p + "down.weight"), server.w(p + "down.weight_scale"), limit, lora)

    def forward_weights(self, block, prefix):
        return {f"{prefix}{s}.{t}": getattr(getattr(block, s), t)
                for s in ("gate_up", "down") for t in ("weight", "weight_scale")}

    def invalidate(self, block):
        pass


BF16, FP8, MXFP4 = Bf16Experts(), Fp8Experts(), Mxfp4Experts()


# ---------------------------------------------------------------- the block


@dataclass(frozen=True)
class MoESpec:
    """One model's MoE block: sizes, router, expert format, shared expert (None: none) and
    ``limit``, DeepSeek-V4's SwiGLU clamp on the routed and shared experts alike."""

    hidden_size: int  # H
    num_experts: int  # E
    intermediate_size: int  # I, one routed expert's
    router: Router
    experts: Bf16Experts | Fp8Experts | Mxfp4Experts = BF16
    shared: SharedExpert | None = None
    limit: float | None = None


class MoEBlock(nn.Module):
    """The trainer's block (module docstring).  ``linear``: the shared expert's projection
    class (``Linear``, or ``Fp8Linear`` in an FP8 trainer); ``experts_lora``: the
    ``ExpertsAdapter`` ``add_lora`` puts there when LoRA targets the experts."""

    def __init__(self, spec: MoESpec, index: int, *, linear=Linear, device=None, dtype=None):
        super().__init__()
        self.spec, self.index = spec, index
        kw = {"device": device, "dtype": dtype}
        E, H, r = spec.num_experts, spec.hidden_size, spec.router
        self.gate = Weight(E, H, device=device, dtype=r.gate_dtype or dtype)
        for name, (shape, table_dtype) in r.tables(E).items():
            setattr(self, name, Frozen(*shape, device=device, dtype=table_dtype))
        spec.experts.make(self, E, spec.intermediate_size, H, kw)
        if spec.shared is not None:
            spec.shared.make(self, H, linear, kw)
        self.experts_lora = None  # ExpertsAdapter.ATTR

    tap = staticmethod(no_tap)

    def forward(self, h, adapters=None, replay=None, tokens=None):
        """h: (T, H) -> (T, H); ``replay``: (ids, weights, rows that have them, mode) of the
        server's routing (``TrainerBase.logprobs``); ``tokens`` (T,): the hash router's input."""
        s, r, L = self.spec, self.spec.router, self.index
        logits = matmul(h if r.gate_dtype is None else h.to(r.gate_dtype), self.gate.weight)
        w, ids = r.route(logits, {n: getattr(self, n).weight for n in r.tables(s.num_experts)}, tokens)
        if replay is not None:  # the server's routing where it has one (not the sequence's last token)
            ids_r, w_r, have, mode = replay
            ids_r = torch.where(have[:, None], ids_r.long(), ids)
            w_r = torch.where(have[:, None], w_r.to(w.dtype), w.detach())
            w, ids = r.replay(logits, ids_r, w_r, mode)
        self.tap("moe.router.ids", ids, L)
        self.tap("moe.router.weights", w, L)
        routed = s.experts.routed(self, h, ids, w, s.limit)
        self.tap("moe.routed", routed, L)
        parts = [routed] if s.shared is None else [routed, s.shared.part(self, h, adapters, s.limit)]
        y = moe_combine(parts, h.dtype)
        self.tap("moe.out", y, L)
        return y

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        """What the server reads beyond the block's parameters, laid over them (``TrainerBase.forward_weights``
        asks a module after its children): the experts adapter's (merged W', or separate A and B), then
        quantized experts' codes and scales in place of the FP32 masters (none for BF16)."""
        out = {} if self.experts_lora is None else self.experts_lora.served_weights(prefix)
        return out | self.spec.experts.forward_weights(self, prefix)

    def invalidate(self) -> None:
        self.spec.experts.invalidate(self)


def moe_block_fwd(server, spec: MoESpec, h, L: int, batch, lora=None):
    """The server's twin of ``MoEBlock.forward`` for layer L, tensors under
    ``layers.{L}.moe.`` in ``server``'s weight dict (a ``ServerBase``: ``w``, ``linear``,
    ``tap``); ``lora``: the layer's ``server_experts_lora`` -> (y (T, H), ids (T, k),
    weights (T, k)): the last two are the layer's routed-experts extras (``routed_extras``)."""
    r, p = spec.router, f"layers.{L}.moe."
    logits = matmul_fwd(h if r.gate_dtype is None else h.to(r.gate_dtype), server.w(p + "gate.weight"))
    w, ids = r.route_fwd(logits, {n: server.w(f"{p}{n}.weight") for n in r.tables(spec.num_experts)}, batch.tokens)
    server.tap("moe.router.ids", ids, L)
    server.tap("moe.router.weights", w, L)
    routed = spec.experts.routed_fwd(server, p, h, ids, w, spec.limit, lora)
    server.tap("moe.routed", routed, L)
    parts = [routed] if spec.shared is None else [routed, spec.shared.part_fwd(server, p, h, batch.adapter_ids,
                                                                                 spec.limit)]
    y = tree_reduce_fwd(torch.stack(parts), h.dtype)
    server.tap("moe.out", y, L)
    return y, ids, w


def server_experts_lora(server, spec: MoESpec, L: int):
    """The ``ExpertLoRA`` of layer L's separate-mode experts adapter (``layers.{L}.moe.lora_A.<gate_up|down>``),
    or None; its tensors are the weight dict's, which sync writes in place: build it once per layer."""
    p = f"layers.{L}.moe."
    ab = {k: (server.w(f"{p}lora_A.{k}"), server.w(f"{p}lora_B.{k}"))
          for k in ExpertsAdapter.KEYS if f"{p}lora_A.{k}" in server.weights}
    if not ab:
        return None
    if server.lora_scale is None:
        raise ValueError("the weights hold experts' LoRA adapters (moe.lora_A.*) but no lora_scale was given")
    E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
    like = torch.zeros((), dtype=server.dtype, device=server.device)  # shapes for a projection without an adapter
    r = next(iter(ab.values()))[0].shape[1]
    return expert_lora_of(ab, like.expand(E, 2 * I, H), like.expand(E, H, I), r, server.lora_scale)


def routed_extras(ids: list[torch.Tensor], weights: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The MoE layers' routing, in layer order, as the server's per-token extras: "routed_experts"
    (T, L, k) int32 and "routed_weights" (T, L, k) fp32, the router's slot order."""
    return {ROUTED_EXPERTS: torch.stack([i.to(torch.int32) for i in ids], 1),
            ROUTED_WEIGHTS: torch.stack([w.float() for w in weights], 1)}
