"""Qwen3.5-MoE training module: packed varlen forward over Gated DeltaNet and
gated attention layers, each followed by a MoE block; FP32 chosen-token
log-probabilities under the sampler's transforms; autograd through every
kernel.

It calls the public (differentiable) functions of the kernels whose ``_fwd``
launchers ``serve.py`` calls, op for op.  Shapes: T packed tokens, H hidden,
Hq / Hkv attention heads of D channels, Hk / Hv GDN heads of K / V channels,
E experts, k slots, R scored rows.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.attention import attention
from ...common.gdn import conv1d, gdn, l2norm_fwd
from ...common.layers import AdapterRows, Linear, Weight
from ...common.moe.router import sigmoid_fp32
from ...common.rmsnorm import rmsnorm, rmsnorm_gated, rmsnorm_residual
from ...common.rope import rope
from ..base import TrainerBase
from ..capture import no_tap
from ..moe_block import GatedSharedExpert, MoEBlock, MoESpec, SoftmaxRouter
from .config import Qwen35GdnConfig
from .weights import LORA_PARAM_SLOTS, LORA_TARGETS, lora_slices

NAME = "qwen35_gdn"


def zc(w: torch.Tensor) -> torch.Tensor:
    """A zero-centred RMSNorm weight as the norm reads it: 1 + w, in w's dtype
    (both sides add it the same way, one rounding)."""
    return w + 1


def softplus_fp32(x: torch.Tensor) -> torch.Tensor:
    """transformers' softplus (threshold 20) from exp and log1p, whose CPU bits
    do not depend on an element's place in the tensor (F.softplus's do)."""
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(torch.minimum(x, torch.full_like(x, 20.0)))))


def gdn_gates(a, b, A_log, dt_bias):
    """(T, Hv) each -> (g, beta) fp32: g = -exp(A_log) · softplus(a + dt_bias), beta = sigmoid(b)."""
    g = -(torch.exp(A_log.float()) * softplus_fp32(a.float() + dt_bias.float()))
    return g, sigmoid_fp32(b.float())


def qk_l2norm(q, k, K: int):
    """L2-normalized q (scaled by K^-0.5) and k, fp32 (T, Hk, K)."""
    return l2norm_fwd(q) * (K ** -0.5), l2norm_fwd(k)


def gated(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o · sigmoid(gate) in fp32, one rounding to o's dtype (the attention output gate)."""
    return (o.float() * sigmoid_fp32(gate.float())).to(o.dtype)


class GDNMixer(nn.Module):
    """One Gated DeltaNet token mixer (transformers' Qwen3_5MoeGatedDeltaNet)."""

    def __init__(self, cfg: Qwen35GdnConfig, index: int, **kw):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.in_proj = Linear(cfg.gdn_in_size, cfg.hidden_size, **kw)  # [qkv | z | b | a] rows
        self.conv = Weight(cfg.conv_dim, 1, cfg.conv_kernel, **kw)
        self.dt_bias = Weight(cfg.gdn_v_heads, **kw)  # in the model dtype, as transformers keeps them; read as fp32
        self.A_log = Weight(cfg.gdn_v_heads, **kw)
        self.norm = Weight(cfg.gdn_v_dim, **kw)
        self.out = Linear(cfg.hidden_size, cfg.gdn_value_dim, **kw)

    tap = staticmethod(no_tap)

    def forward(self, h, cu_seqlens, adapters=None):
        c, T, L = self.cfg, h.shape[0], self.index
        Hk, Hv, K, V = c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim
        proj = self.in_proj(h, adapters)
        self.tap("gdn.in_proj", proj, L)
        qkv, z, b, a = proj.split([c.conv_dim, c.gdn_value_dim, Hv, Hv], dim=-1)
        qkv = conv1d(qkv, self.conv.weight.squeeze(1), cu_seqlens)  # causal depthwise k=4, SiLU
        self.tap("gdn.conv", qkv, L)
        q, k, v = qkv.split([c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        q, k = qk_l2norm(q.reshape(T, Hk, K), k.reshape(T, Hk, K), K)
        g, beta = gdn_gates(a, b, self.A_log.weight, self.dt_bias.weight)  # fp32 (T, Hv) each
        o = gdn(q, k, v.reshape(T, Hv, V), g, beta, cu_seqlens).to(h.dtype)  # (T, Hv, V)
        self.tap("gdn.core", o, L)
        o = rmsnorm_gated(o.reshape(T * Hv, V), z.reshape(T * Hv, V).contiguous(), self.norm.weight, c.rms_norm_eps)
        y = self.out(o.reshape(T, Hv * V), adapters)
        self.tap("gdn.out", y, L)
        return y


class AttnMixer(nn.Module):
    """One gated attention mixer (transformers' Qwen3_5MoeAttention)."""

    def __init__(self, cfg: Qwen35GdnConfig, index: int, **kw):
        super().__init__()
        self.cfg, self.index = cfg, index
        D = cfg.head_dim
        self.qkv = Linear(cfg.attn_qkv_size, cfg.hidden_size, **kw)  # [q | gate per head, | k | v]
        self.q_norm = Weight(D, **kw)
        self.k_norm = Weight(D, **kw)
        self.o = Linear(cfg.hidden_size, cfg.num_heads * D, **kw)

    tap = staticmethod(no_tap)

    def forward(self, h, positions, cu_seqlens, max_seqlen, adapters=None):
        c, T, L = self.cfg, h.shape[0], self.index
        Hq, Hkv, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        qkv = self.qkv(h, adapters)
        self.tap("attn.qkv", qkv, L)
        qg, k, v = qkv.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        qg = qg.reshape(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        q = rope(rmsnorm(q.contiguous(), zc(self.q_norm.weight), eps), positions, c.rope)
        k = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), zc(self.k_norm.weight), eps), positions, c.rope)
        v = v.reshape(T, Hkv, D).contiguous()
        self.tap("attn.q", q, L)
        self.tap("attn.k", k, L)
        self.tap("attn.v", v, L)
        o = gated(attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen), gate)
        self.tap("attn.out", o, L)
        y = self.o(o.reshape(T, Hq * D), adapters)
        self.tap("attn.o_proj", y, L)
        return y


def moe_spec(cfg: Qwen35GdnConfig) -> MoESpec:
    """Qwen3.5's MoE block (``models/moe_block.py``): the softmax top-k router, experts in the
    model dtype, one shared expert behind a sigmoid gate."""
    return MoESpec(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, SoftmaxRouter(cfg.experts_per_token),
                   shared=GatedSharedExpert(cfg.shared_intermediate_size))


class Block(nn.Module):
    def __init__(self, cfg: Qwen35GdnConfig, index: int, **kw):
        super().__init__()
        self.cfg, self.index = cfg, index
        self.kind = cfg.layer_types[index]
        H = cfg.hidden_size
        self.attn_norm = Weight(H, **kw)
        if self.kind == "linear_attention":
            self.gdn = GDNMixer(cfg, index, **kw)
        else:
            self.attn = AttnMixer(cfg, index, **kw)
        self.mlp_norm = Weight(H, **kw)
        self.moe = MoEBlock(moe_spec(cfg), index, **kw)

    tap = staticmethod(no_tap)

    def forward(self, x, residual, positions, cu_seqlens, max_seqlen, adapters=None, replay=None):
        eps, L = self.cfg.rms_norm_eps, self.index
        if residual is None:
            h, residual = rmsnorm(x, zc(self.attn_norm.weight), eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, zc(self.attn_norm.weight), eps)
        self.tap("attn_norm", h, L)
        if self.kind == "linear_attention":
            x = self.gdn(h, cu_seqlens, adapters)
        else:
            x = self.attn(h, positions, cu_seqlens, max_seqlen, adapters)
        h, residual = rmsnorm_residual(x, residual, zc(self.mlp_norm.weight), eps)
        self.tap("mlp_norm", h, L)
        return self.moe(h, adapters, replay), residual


class Qwen35GdnTrainer(TrainerBase):
    """Parameters are named as in ``weights.py``.  LoRA, ``forward_weights``
    and ``logprobs``: ``models/base.py``; router replay: ``logprobs(...,
    replay=completion extras)``."""

    model_name = NAME
    lora_targets = tuple(LORA_TARGETS)
    lora_slices_of = staticmethod(lora_slices)
    lora_param_slots = LORA_PARAM_SLOTS

    def __init__(self, cfg: Qwen35GdnConfig, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        if fp8:
            raise NotImplementedError("qwen35_gdn has no FP8 path yet; load it in bf16 or fp32")
        super().__init__(cfg, activation_checkpointing=activation_checkpointing, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Block(cfg, i, **kw) for i in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None,
               replay=None):
        """Final normed hidden states (R, H) of ``rows``.  ``replay``: per layer
        (ids (T, k), weights (T, k), rows that have them (T,), mode) to route by instead of the router."""
        x, residual = self.embed.weight[tokens], None
        for i, layer in enumerate(self.layers):
            rep = None if replay is None else replay[i]
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, residual = checkpoint(layer, x, residual, positions, cu_seqlens, max_seqlen, adapters, rep,
                                         use_reentrant=False)
            else:
                x, residual = layer(x, residual, positions, cu_seqlens, max_seqlen, adapters, rep)
        h = rmsnorm_residual(x[rows], residual[rows], zc(self.norm.weight), self.cfg.rms_norm_eps)[0]
        self.tap("norm", h, rows="logits")
        return h
