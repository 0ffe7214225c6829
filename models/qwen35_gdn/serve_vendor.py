"""Qwen3.5-MoE served with vendor kernels: the mismatch this project removes.

The aligned server's cache layout and engine interface, with a conventional serving stack's
arithmetic: ``F.linear`` for every projection and the router, the routed experts on
``torch._grouped_mm`` (``common/moe/vendor.py``, SiLU·up in the model dtype), transformers-style
zero-centred RMSNorm in torch ops (the layer norms, the final norm, q/k), torch's fast attention
(``common/attention/vendor.py``, its plan made once per forward), and on CUDA the delta rule of
``common/gdn/vendor.py``: fla's chunk kernel for prefill, the per-token recurrent update in place
at the slot for decode.  A GDN layer keeps the zoo's conv and gated RMSNorm.  Used by
``--unaligned`` runs, ``alignzoo bisect --against vendor`` and the engine benchmark's baseline.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.attention.vendor import VendorAttention
from ...common.engine.model_api import ForwardBatch
from ...common.gdn.vendor import gdn_vendor_fwd
from ...common.kv_cache import write_kv_fwd
from ...common.moe.vendor import experts_vendor
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

    def gdn_core(self, q, k, v, g, beta, batch, starts, layer):
        return gdn_vendor_fwd(q, k, v, g, beta, batch.cu_seqlens_q, start_positions=starts, cache=layer,
                              slots=batch.state_slots)

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
        out = experts_vendor(h, ids, w, self.w(p + "moe.gate_up.weight"), self.w(p + "moe.down.weight"))
        g, u = F.linear(h, self.w(p + "moe.shared_gate_up.weight")).chunk(2, dim=-1)
        shared = F.linear(F.silu(g) * u, self.w(p + "moe.shared_down.weight"))
        out = out + torch.sigmoid(F.linear(h, self.w(p + "moe.shared_gate.weight"))) * shared
        self.tap("moe.out", out, L)
        return out, ids, w
