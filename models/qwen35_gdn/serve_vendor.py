"""Qwen3.5-MoE served with vendor kernels: the mismatch this project removes.

The aligned server's cache layout and engine interface, with a typical
serving stack's arithmetic: ``F.linear`` for every projection, the router and
the experts (transformers' per-expert loop, SiLU·up in the model dtype),
transformers-style zero-centred RMSNorm in torch ops (the layer norms, the
final norm, q/k), and torch's fast attention (``common/attention/vendor.py``,
its plan made once per forward).  A GDN layer keeps the zoo's conv, core and
gated RMSNorm (the state layout the engine pools); its projections, the norms
and the MoE around it are what part.  Used by ``--unaligned`` runs and
``alignzoo bisect --against vendor``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.attention.vendor import VendorAttention
from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import write_kv_fwd
from ...common.rope import rope_fwd
from .serve import Qwen35GdnServer


def _rmsnorm(x, w, eps):
    """transformers' zero-centred RMSNorm: x · rsqrt(mean(x²) + eps) · (1 + w) in fp32, one rounding."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


class Qwen35GdnVendorServer(Qwen35GdnServer):
    _attend: VendorAttention | None = None  # this forward's attention plan (``forward`` sets it)

    def forward(self, batch: ForwardBatch, caches):
        kv = caches.get("kv")
        if kv:  # one plan for every attention layer of the step (the same batch and pages)
            self._attend = VendorAttention(batch.cu_seqlens_q, batch.seq_lens, batch.pools["kv"].block_table,
                                           batch.max_seqlen_q, kv[0]["k"].shape[0], n_tokens=batch.tokens.shape[0])
        try:
            return super().forward(batch, caches)
        finally:
            self._attend = None

    def linear(self, x, prefix, adapter_ids):
        return F.linear(x, self.weights[prefix + "weight"])

    def _norm(self, x, name, residual=None):
        if residual is not None:
            residual = x + residual
            x = residual
        return _rmsnorm(x, self.w(name), self.cfg.rms_norm_eps), residual

    def _attn(self, h, L, layer, batch):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}."
        Hq, Hkv, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        kv = batch.pools["kv"]
        qkv = self.linear(h, p + "attn.qkv.", None)
        self.tap("attn.qkv", qkv, L)
        qg, k, v = qkv.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        qg = qg.reshape(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, Hq * D)
        q = rope_fwd(_rmsnorm(q, self.w(p + "attn.q_norm.weight"), eps).contiguous(), batch.positions, self.rope,
                     check=False)
        k = rope_fwd(_rmsnorm(k.reshape(T, Hkv, D), self.w(p + "attn.k_norm.weight"), eps).contiguous(),
                     batch.positions, self.rope, check=False)
        v = v.reshape(T, Hkv, D).contiguous()
        self.tap("attn.q", q, L)
        self.tap("attn.k", k, L)
        self.tap("attn.v", v, L)
        write_kv_fwd(k, v, layer["k"], layer["v"], kv.slot_mapping)
        o = self._attend(q, k, v, layer["k"], layer["v"]).reshape(T, Hq * D) * torch.sigmoid(gate)
        return self.linear(o, p + "attn.o.", None)

    def _moe(self, h, L, batch):
        c, p = self.cfg, f"layers.{L}."
        logits = F.linear(h, self.w(p + "moe.gate.weight"))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        w, ids = torch.topk(probs, c.experts_per_token, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        self.tap("moe.router.ids", ids, L)
        self.tap("moe.router.weights", w, L)
        gu_w, d_w = self.w(p + "moe.gate_up.weight"), self.w(p + "moe.down.weight")
        out = torch.zeros_like(h)
        for e in range(c.num_experts):  # transformers' loop (the vendor pays its host syncs)
            t, j = (ids == e).nonzero(as_tuple=True)
            if t.numel():
                g, u = F.linear(h[t], gu_w[e]).chunk(2, dim=-1)
                out.index_add_(0, t, F.linear(F.silu(g) * u, d_w[e]) * w[t, j, None])
        g, u = F.linear(h, self.w(p + "moe.shared_gate_up.weight")).chunk(2, dim=-1)
        shared = F.linear(F.silu(g) * u, self.w(p + "moe.shared_down.weight"))
        out = out + torch.sigmoid(F.linear(h, self.w(p + "moe.shared_gate.weight"))) * shared
        self.tap("moe.out", out, L)
        return out, ids, w
