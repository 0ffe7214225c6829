"""Qwen3 serving module: the engine's ``ServeModel`` for Qwen3.

Layer for layer the trainer's computation (``train.py``), through the same
kernels' ``_fwd`` launchers: no autograd, no input checks, no host syncs (decode
is replayed from CUDA graphs).  One launcher is the server's own:
``qk_norm_rope_kv_fwd`` fuses the trainer's q/k ``rmsnorm`` and ``rope`` with
the cache write into one launch, built from the same ``@triton.jit`` helpers
(CPU: the same functions), so it has their bits.  Attention reads the paged
cache after the new tokens' k/v are written to it, so prefill, chunked prefill
and decode all go through ``paged_attention_fwd``, whose rows equal the
trainer's packed ``attention`` bitwise.

LoRA: merged adapters need nothing here (the trainer ships W' as the layer's
``weight``); separate ones arrive as ``layers.{i}.<layer>.lora_A.<projection>``
(r, K) and ``...lora_B.<projection>`` (rows, r), and ``linear`` adds their
branch to that projection's column slice with ``lora_add_fwd``, as the
trainer's ``LoRALinear`` does with ``lora_add``.  Multi-mode adapter j arrives
as ``layers.{i}.<layer>.adapters.{j}.lora_A.<projection>`` (and ``lora_B``),
and each adapted slice runs ``lora_add_multi_fwd`` over the batch's
``adapter_ids`` (every adapter's branch on every row, the row's own kept:
static shapes, so decode graphs capture it), as ``MultiLoRALinear`` does
with ``lora_add_multi``.
"""
from __future__ import annotations

import torch

from ...common.attention import paged_attention_fwd
from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import PagedPool
from ...common.qk_norm_rope import qk_norm_rope_kv_fwd
from ...common.swiglu import swiglu_fwd
from ..base import ServerBase
from .weights import lora_slices


class Qwen3Server(ServerBase):
    """Qwen3's forward over the server's weights (``ServerBase``: the weight
    dict, the RoPE table, LoRA branches, ``linear``, ``_norm``, the final norm
    and LM head)."""

    lora_slices_of = staticmethod(lora_slices)

    def cache_pools(self) -> dict[str, PagedPool]:
        """One paged K/V pool: per layer a k and a v row of (Hkv, D) per position."""
        c = self.cfg
        return {"kv": PagedPool({"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.head_dim)}, self.dtype,
                                c.num_layers)}

    def forward(self, batch: ForwardBatch, caches) -> torch.Tensor:
        """-> FP32 logits (R, V) of ``batch.logit_rows``.

        Per layer: attn_norm (fused residual add after the first), the qkv
        projection, ``qk_norm_rope_kv_fwd`` (q/k RMSNorm, RoPE at
        ``positions`` and the k/v cache write in one launch, reading the
        qkv rows in place; the bits of the trainer's ``rope(rmsnorm(.))``),
        paged attention over the cache, the o projection, mlp_norm (fused
        residual add), gate_up, SwiGLU, down."""
        cfg = self.cfg
        T, Hq, Hkv, D = batch.tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        x, residual = self.w("embed.weight")[batch.tokens], None
        kv = batch.pools["kv"]
        tap, tap_cache = self.tap, self.tap_cache
        for i, layer in enumerate(caches["kv"]):
            k_cache, v_cache, p = layer["k"], layer["v"], f"layers.{i}."
            if residual is None:
                h, residual = self._norm(x, p + "attn_norm.weight")[0], x
            else:
                h, residual = self._norm(x, p + "attn_norm.weight", residual)
            tap("attn.norm", h, i)
            qkv = self.linear(h, p + "qkv.", batch.adapter_ids)  # (T, (Hq + 2 Hkv) D)
            tap("attn.qkv", qkv, i)
            q = qk_norm_rope_kv_fwd(qkv, self.w(p + "q_norm.weight"), self.w(p + "k_norm.weight"), cfg.rms_norm_eps,
                                    batch.positions, self.rope, k_cache, v_cache, kv.slot_mapping, Hq, Hkv)
            tap("attn.q", q, i)
            tap_cache("attn.k", k_cache, kv.slot_mapping, i)
            tap_cache("attn.v", v_cache, kv.slot_mapping, i)
            o = paged_attention_fwd(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens, kv.block_table,
                                    max_seqlen_q=batch.max_seqlen_q)[0]
            tap("attn.out", o, i)
            x = self.linear(o.reshape(T, Hq * D), p + "o.", batch.adapter_ids)
            tap("attn.o_proj", x, i)
            h, residual = self._norm(x, p + "mlp_norm.weight", residual)
            tap("mlp.norm", h, i)
            gu = self.linear(h, p + "gate_up.", batch.adapter_ids)
            tap("mlp.gate_up", gu, i)
            I = cfg.intermediate_size
            a = swiglu_fwd(gu[:, :I], gu[:, I:])
            tap("mlp.swiglu", a, i)
            x = self.linear(a, p + "down.", batch.adapter_ids)
            tap("mlp.down", x, i)
        return self._logits(x, residual, batch)
