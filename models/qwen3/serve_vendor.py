"""Qwen3 served with vendor kernels: the mismatch this project removes.

The same engine interface and weights as ``serve.py``, but the arithmetic of
a typical serving stack: ``F.linear`` (batch-shape-dependent GEMM tiling),
transformers-style RMSNorm and RoPE (cos/sin computed in fp32 on the device
from inverse frequencies built once), and ``scaled_dot_product_attention``
over K/V gathered from the paged cache.  Its log-probs differ from the
trainer's (K3 > 0): used by the RL example's ``--unaligned`` mode and as the
vendor baseline of the engine benchmark.

Like the aligned server, ``forward`` never reads the batch on the host, so
decode is captured into CUDA graphs.  Attention gathers the whole block-table
width per sequence (B, W * 64 keys): in a captured decode graph that width is
the engine's ``max_position / 64`` pages, whatever the context, so
``benchmarks/bench_engine.py`` cuts max_position to the benchmark's length.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import PAGE_SIZE, write_kv_fwd
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


def _attention(q, k, v, mask):
    """q: (B, L, Hq, D); k, v: (B, S, Hkv, D); mask: (B, L, S) bool, True = attend -> (B, L, Hq, D).

    The G = Hq / Hkv query heads sharing a kv head are folded into the query
    length (G * L rows against Hkv heads), so SDPA sees equal head counts and
    takes the mask without K/V repeated G times."""
    B, L, Hq, D = q.shape
    Hkv, S = k.shape[2], k.shape[1]
    G = Hq // Hkv
    qf = q.reshape(B, L, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, L * G, D)
    m = mask[:, None, :, None, :].expand(B, 1, L, G, S).reshape(B, 1, L * G, S)
    o = F.scaled_dot_product_attention(qf, k.transpose(1, 2), v.transpose(1, 2), attn_mask=m)  # (B, Hkv, L*G, D)
    return o.reshape(B, Hkv, L, G, D).permute(0, 2, 1, 3, 4).reshape(B, L, Hq, D)


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

    def forward(self, batch: ForwardBatch, kv_cache) -> torch.Tensor:
        cfg = self.cfg
        T, Hq, Hkv, D = batch.tokens.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cos, sin = self._cos_sin(batch.positions)
        B, Lq = batch.seq_lens.shape[0], batch.max_seqlen_q
        pages = batch.block_table.long()
        kpos = torch.arange(pages.shape[1] * PAGE_SIZE, device=self.device)
        if Lq == 1:  # decode: one new token per sequence, T == B
            mask = kpos[None, None, :] < batch.seq_lens.long()[:, None, None]  # (B, 1, Lk)
        else:  # packed new tokens -> (B, Lq) rows, causal over cached + new keys
            t = torch.arange(T, device=self.device)
            b_of = torch.searchsorted(batch.cu_seqlens_q[1:].long(), t, right=True).clamp(max=B - 1)
            j_of = t - batch.cu_seqlens_q[b_of].long()
            q_len = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()
            qpos = (batch.seq_lens.long() - q_len)[:, None] + torch.arange(Lq, device=self.device)[None]  # (B, Lq)
            mask = kpos[None, None, :] <= qpos[:, :, None]  # (B, Lq, Lk): keys past seq_len are after qpos
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
            K = k_cache[pages].flatten(1, 2)  # (B, Lk, Hkv, D)
            V = v_cache[pages].flatten(1, 2)
            if Lq == 1:
                o = _attention(q[:, None], K, V, mask).reshape(T, Hq * D)
            else:
                Q = q.new_zeros(B, Lq, Hq, D)
                Q[b_of, j_of] = q
                o = _attention(Q, K, V, mask)[b_of, j_of].reshape(T, Hq * D)
            residual = F.linear(o, self.w(p + "o.weight")) + residual
            h = _rmsnorm(residual, self.w(p + "mlp_norm.weight"), eps)
            gate, up = F.linear(h, self.w(p + "gate_up.weight")).chunk(2, dim=-1)
            x = F.linear(F.silu(gate) * up, self.w(p + "down.weight"))
        h = _rmsnorm((x + residual)[batch.logit_rows], self.w("norm.weight"), eps)
        return F.linear(h, self.lm_head_weight).float()
