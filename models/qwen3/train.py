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
from ...common.lm_head import lm_head_logits
from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...common.rope import rope
from ...common.swiglu import swiglu_gate_up
from ..base import TrainerBase
from .config import Qwen3Config
from .weights import LORA_TARGETS, MODEL_TYPE as NAME, lora_slices


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


class Qwen3Trainer(TrainerBase):
    """Parameters are named as in ``weights.py`` (``embed.weight``,
    ``layers.{i}.qkv.weight``, ...); ``lm_head`` is absent when tied.  With
    ``fp8`` the four projections of each block are FP32 masters read through
    their FP8 quantization; embeddings, norms and the LM head stay in dtype.
    LoRA, ``forward_weights`` and ``logprobs``: ``models/base.py``."""

    model_name = NAME
    lora_targets = tuple(LORA_TARGETS)

    def __init__(self, cfg: Qwen3Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__(cfg, activation_checkpointing=activation_checkpointing, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Qwen3Block(cfg, **kw, fp8=fp8) for _ in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)

    def lora_slices(self) -> dict[str, tuple[tuple[str, int, int], ...]]:
        return lora_slices(self.cfg)

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
