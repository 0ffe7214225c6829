"""Qwen3 served with vendor kernels: the mismatch this project removes.

The same engine interface and weights as ``serve.py``, but the arithmetic of
a typical serving stack: ``F.linear`` (batch-shape-dependent GEMM tiling),
transformers-style RMSNorm and RoPE (cos/sin computed in fp32 on the device),
and ``scaled_dot_product_attention`` over K/V gathered from the paged cache.
Its log-probs differ from the trainer's (K3 > 0): used by the RL example's
``--unaligned`` mode and as the vendor baseline of the engine benchmark.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import PAGE_SIZE, write_kv_fwd
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
    def forward(self, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        cfg = self.cfg
        T, Hq, Hkv, D = batch.tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, device=self.device, dtype=torch.float32) / D))
        freqs = batch.positions.float()[:, None] * inv_freq[None]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        B, Lq = batch.seq_lens.shape[0], batch.max_seqlen_q
        t = torch.arange(T, device=self.device)
        b_of = torch.searchsorted(batch.cu_seqlens_q[1:].long(), t, right=True).clamp(max=B - 1)
        j_of = t - batch.cu_seqlens_q[b_of].long()
        q_len = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()
        kpos = torch.arange(batch.block_table.shape[1] * PAGE_SIZE, device=self.device)
        qpos = (batch.seq_lens.long() - q_len)[:, None] + torch.arange(Lq, device=self.device)[None]  # (B, Lq)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # (B, Lq, Lk): causal; keys past seq_len are after qpos
        x = self.w("embed.weight")[batch.tokens]
        residual = x
        for i, (k_cache, v_cache) in enumerate(kv_cache):
            p = f"layers.{i}."
            if i:
                residual = x + residual
            h = _rmsnorm(residual, self.w(p + "attn_norm.weight"), eps)
            q, k, v = F.linear(h, self.w(p + "qkv.weight")).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
            q = _rope(_rmsnorm(q.reshape(T, Hq, D), self.w(p + "q_norm.weight"), eps), cos, sin)
            k = _rope(_rmsnorm(k.reshape(T, Hkv, D), self.w(p + "k_norm.weight"), eps), cos, sin)
            write_kv_fwd(k.contiguous(), v.reshape(T, Hkv, D).contiguous(), k_cache, v_cache, batch.slot_mapping)
            K = k_cache[batch.block_table.long()].flatten(1, 2)  # (B, Lk, Hkv, D)
            V = v_cache[batch.block_table.long()].flatten(1, 2)
            Q = q.new_zeros(B, Lq, Hq, D)
            Q[b_of, j_of] = q
            o = F.scaled_dot_product_attention(Q.transpose(1, 2), K.transpose(1, 2), V.transpose(1, 2),
                                               attn_mask=mask[:, None], enable_gqa=True)  # (B, Hq, Lq, D)
            o = o.transpose(1, 2)[b_of, j_of].reshape(T, Hq * D)
            residual = F.linear(o, self.w(p + "o.weight")) + residual
            h = _rmsnorm(residual, self.w(p + "mlp_norm.weight"), eps)
            gate, up = F.linear(h, self.w(p + "gate_up.weight")).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, self.w(p + "down.weight"))
        h = _rmsnorm((x + residual)[batch.logit_rows], self.w("norm.weight"), eps)
        return F.linear(h, self.lm_head_weight).float()
