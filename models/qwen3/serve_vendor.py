"""Qwen3 served with vendor kernels: the mismatch this project removes.

The same engine interface and weights as ``serve.py``, but the arithmetic of
a typical serving stack: ``F.linear`` (batch-shape-dependent GEMM tiling),
transformers-style RMSNorm and RoPE (cos/sin computed in fp32 on the device
from inverse frequencies built once), and torch's fast attention paths
(``common/attention/vendor.py``: flash varlen for packed prefill, compiled
flex_attention over the paged cache for decode; SDPA on the CPU).  Its
log-probs differ from the trainer's (K3 > 0): used by the RL example's
``--unaligned`` mode and as the vendor baseline of the engine benchmark.

Like the aligned server, ``forward`` never reads the batch on the host in
decode, so decode is captured into CUDA graphs (an eager prefill reads its
key count once, as a vendor stack's metadata does).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.engine.model_api import ForwardBatch
from ...common.attention.vendor import VendorAttention
from ...common.kv_cache import write_kv_fwd
from ...common.rope import inv_freq_and_attention_factor
from .serve import Qwen3Server


def _rmsnorm(x, w, eps):
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    """x: (T, H, D); cos, sin: (T, D) fp32 -> transformers' rotate_half rotation in x.dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    rot = torch.cat((-x2, x1), dim=-1)
    return (x * cos[:, None].to(x.dtype) + rot * sin[:, None].to(x.dtype))


class Qwen3VendorServer(Qwen3Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        cfg = self.cfg
        inv_freq, scale = inv_freq_and_attention_factor(cfg.head_dim, cfg.rope_theta, cfg.rope_yarn)
        self.inv_freq = inv_freq.to(self.device)  # (D/2,) fp32, transformers' bits
        self.rope_scale = scale

    def _cos_sin(self, positions):
        """transformers' rotary embedding: fp32 (T, D) cos and sin of positions * inv_freq."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.rope_scale == 1.0:
            return emb.cos(), emb.sin()
        return emb.cos() * self.rope_scale, emb.sin() * self.rope_scale

    def forward(self, batch: ForwardBatch, caches) -> torch.Tensor:
        cfg = self.cfg
        T, Hq, Hkv, D = batch.tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cos, sin = self._cos_sin(batch.positions)
        kv = batch.pools["kv"]
        attend = VendorAttention(batch.cu_seqlens_q, batch.seq_lens, kv.block_table, batch.max_seqlen_q,
                                 caches["kv"][0]["k"].shape[0], n_tokens=T)
        x = self.w("embed.weight")[batch.tokens]
        residual, tap = x, self.tap
        for i, layer in enumerate(caches["kv"]):
            k_cache, v_cache, p = layer["k"], layer["v"], f"layers.{i}."
            if i:
                residual = x + residual
            h = _rmsnorm(residual, self.w(p + "attn_norm.weight"), eps)
            tap("attn.norm", h, i)
            qkv = F.linear(h, self.w(p + "qkv.weight"))
            tap("attn.qkv", qkv, i)
            q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = _rope(_rmsnorm(q.reshape(T, Hq, D), self.w(p + "q_norm.weight"), eps), cos, sin).contiguous()
            k = _rope(_rmsnorm(k.reshape(T, Hkv, D), self.w(p + "k_norm.weight"), eps), cos, sin).contiguous()
            v = v.reshape(T, Hkv, D).contiguous()
            tap("attn.q", q, i)
            tap("attn.k", k, i)
            tap("attn.v", v, i)
            write_kv_fwd(k, v, k_cache, v_cache, kv.slot_mapping)
            o = attend(q, k, v, k_cache, v_cache)
            tap("attn.out", o, i)
            x = F.linear(o.reshape(T, Hq * D), self.w(p + "o.weight"))
            tap("attn.o_proj", x, i)
            residual = x + residual
            h = _rmsnorm(residual, self.w(p + "mlp_norm.weight"), eps)
            tap("mlp.norm", h, i)
            gu = F.linear(h, self.w(p + "gate_up.weight"))
            tap("mlp.gate_up", gu, i)
            gate, up = gu.chunk(2, dim=-1)
            a = F.silu(gate) * up
            tap("mlp.swiglu", a, i)
            x = F.linear(a, self.w(p + "down.weight"))
            tap("mlp.down", x, i)
        h = _rmsnorm((x + residual)[batch.logit_rows], self.w("norm.weight"), eps)
        tap("norm", h, rows="logits")
        logits = F.linear(h, self.lm_head_weight).float()
        tap("lm_head.logits", logits, rows="logits")
        return logits
