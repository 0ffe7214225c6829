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

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.attention import attention
from ...common.layers import AdapterRows, Fp8Linear, Linear, Weight
from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...common.rope import rope
from ...common.swiglu import swiglu_gate_up
from ..base import TrainerBase
from ..capture import no_tap
from .config import Qwen3Config
from .weights import LORA_TARGETS, MODEL_TYPE as NAME, lora_slices


class Qwen3Block(nn.Module):
    def __init__(self, cfg: Qwen3Config, index: int = 0, device=None, dtype=None, fp8: bool = False):
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
        self.index = index

    tap = staticmethod(no_tap)

    def forward(self, x, residual, positions, cu_seqlens, max_seqlen, adapters: AdapterRows | None = None):
        """x: (T, H) the previous block's output; residual: (T, H) or None
        (first block, x is the embedding) -> (mlp_out, residual)."""
        cfg = self.cfg
        T, Hq, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, L, tap = cfg.rms_norm_eps, self.index, self.tap
        if residual is None:
            h, residual = rmsnorm(x, self.attn_norm.weight, eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, self.attn_norm.weight, eps)
        tap("attn.norm", h, L)
        qkv = self.qkv(h, adapters)
        tap("attn.qkv", qkv, L)
        q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(rmsnorm(q.reshape(T, Hq, D).contiguous(), self.q_norm.weight, eps), positions, cfg.rope)
        k = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), self.k_norm.weight, eps), positions, cfg.rope)
        v = v.reshape(T, Hkv, D).contiguous()
        tap("attn.q", q, L)
        tap("attn.k", k, L)
        tap("attn.v", v, L)
        o = attention(q, k, v, cu_seqlens, max_seqlen=max_seqlen)
        tap("attn.out", o, L)
        x = self.o(o.reshape(T, Hq * D), adapters)
        tap("attn.o_proj", x, L)
        h, residual = rmsnorm_residual(x, residual, self.mlp_norm.weight, eps)
        tap("mlp.norm", h, L)
        gu = self.gate_up(h, adapters)
        tap("mlp.gate_up", gu, L)
        a = swiglu_gate_up(gu)
        tap("mlp.swiglu", a, L)
        y = self.down(a, adapters)
        tap("mlp.down", y, L)
        return y, residual


class Qwen3Trainer(TrainerBase):
    """Parameters are named as in ``weights.py`` (``embed.weight``,
    ``layers.{i}.qkv.weight``, ...); ``lm_head`` is absent when tied.  With
    ``fp8`` the four projections of each block are FP32 masters read through
    their FP8 quantization; embeddings, norms and the LM head stay in dtype.
    LoRA, ``lm_head_weight``, ``logits``, ``forward_weights`` and ``logprobs``: ``models/base.py``."""

    model_name = NAME
    lora_targets = tuple(LORA_TARGETS)
    lora_slices_of = staticmethod(lora_slices)

    def __init__(self, cfg: Qwen3Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__(cfg, activation_checkpointing=activation_checkpointing, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Qwen3Block(cfg, i, **kw, fp8=fp8) for i in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)

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
        h = rmsnorm_residual(x[rows], residual[rows], self.norm.weight, self.cfg.rms_norm_eps)[0]
        self.tap("norm", h, rows="logits")
        return h
