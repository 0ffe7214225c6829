"""GLM-5 served with vendor kernels: the mismatch this project removes.

The aligned server's pools ("mla" rows [latent | rope key], "index" keys), engine interface and
weights, with a conventional serving stack's arithmetic:

- ``F.linear`` for every projection (BLAS tiling that follows the batch shape); an FP8 weight
  is dequantized to the activation dtype first (weight-only, as a W8A16 fallback runs it);
- transformers' RMSNorm (fp32 statistics, the weight applied after rounding back),
  ``F.layer_norm`` for the indexer key, and RoPE as ``apply_rotary_pos_emb_interleave``
  computes it (cos / sin of fp32 ``positions * inv_freq`` cast to the activation dtype);
- absorbed MLA as vLLM / SGLang run it: q_nope · W_UK and o · W_UVᵀ as batched matmuls,
  the attention as fp32 ``softmax(q · kᵀ · scale) · v`` over each row's gathered selection;
- the indexer as transformers scores it (``torch.matmul``, ReLU, the head weights by matmul)
  and ``torch.topk`` (ties broken however topk breaks them, not by position);
- the router as transformers' ``GlmMoeDsaTopkRouter``, the routed experts on
  ``common/moe/vendor.py`` (FP8 stacks dequantized first) and the shared expert added in the
  model dtype.

Not the trainer's bits (K3 > 0): ``load_pair(..., server_kernels="vendor")``, ``alignzoo bisect
--against vendor``.  Where both select the same positions its log-probs stay close (the fp32 tiny
preset with every position kept: 1.4e-6); at the preset's top-32, ``torch.topk`` breaks the
indexer's exact-0.0 ties otherwise than our rule, and the log-probs then part by ~0.6.
Separate and multi-adapter LoRA are refused (merged LoRA is a plain weight).  ``forward`` reads
nothing of the batch on the host: row chunks and top-k widths follow shapes only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.engine.model_api import ForwardBatch
from ...common.fp8 import dequantize_weight_fp8
from ...common.kv_cache import write_row_fwd
from ...common.moe import dequantize_experts_fp8
from ...common.moe.vendor import experts_vendor
from ...common.rope import inv_freq_and_attention_factor
from ..moe_block import routed_extras
from .config import INDEXER_NORM_EPS, LATENT_NORM_EPS
from .serve import Glm5Server
from .train import kv_b_heads

ROW_CHUNK = 256  # query rows gathered at once: bounds the (rows, keys, D) buffers
PAGE = 64


def _rmsnorm(x, w, eps):
    """transformers' ``GlmMoeDsaRMSNorm``: fp32 statistics, rounded back, then times the weight."""
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _rope(x, cos, sin):
    """``apply_rotary_pos_emb_interleave`` on x (T, H, Dr): pairs (2i, 2i + 1) in, halves out;
    cos, sin (T, Dr / 2) in x.dtype."""
    c, s = cos[:, None], sin[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def _slots(block_table, seq_idx, pos):
    """Flat pool slots of positions ``pos`` (n, K) of each row's sequence (-1 / unmapped: slot 0)."""
    pos = pos.long().clamp(min=0)
    pages = block_table[seq_idx.long()[:, None], pos // PAGE].long().clamp(min=0)
    return pages * PAGE + pos % PAGE


class Glm5VendorServer(Glm5Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._lora or self._experts_lora:
            raise NotImplementedError("the vendor server does not apply separate or multi LoRA adapters; "
                                      "use lora_mode='merged'")
        c = self.cfg
        inv_freq, self.rope_scale = inv_freq_and_attention_factor(c.qk_rope_head_dim, c.rope_theta, c.rope_yarn)
        self.inv_freq = inv_freq.to(self.device)  # (Dr / 2,) fp32, transformers' bits

    # ---------------------------------------------------------------- torch's arithmetic
    def _weight(self, prefix, dtype):
        """A projection's weight in ``dtype``: FP8 codes times their block scales, else as stored."""
        w, scale_inv = self.weights[prefix + "weight"], self.weights.get(prefix + "weight_scale_inv")
        return w if scale_inv is None else dequantize_weight_fp8(w, scale_inv, dtype)

    def linear(self, x, prefix, adapter_ids=None):
        return F.linear(x, self._weight(prefix, x.dtype))

    def _cos_sin(self, positions, dtype):
        """The first half of transformers' cat(freqs, freqs) cos / sin, (T, Dr / 2) in ``dtype``."""
        freqs = positions.float()[:, None] * self.inv_freq[None]
        return (freqs.cos() * self.rope_scale).to(dtype), (freqs.sin() * self.rope_scale).to(dtype)

    # ---------------------------------------------------------------- attention
    def _q_and_row(self, h, L, cos, sin):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.attn."
        Rkv, Dn = c.kv_lora_rank, c.qk_nope_head_dim
        q_resid = _rmsnorm(self.linear(h, p + "q_a."), self.w(p + "q_a_norm.weight"), LATENT_NORM_EPS)
        q = self.linear(q_resid, p + "q_b.").view(T, c.num_heads, c.qk_head_dim)
        kv = self.linear(h, p + "kv_a.")
        latent = _rmsnorm(kv[:, :Rkv], self.w(p + "kv_a_norm.weight"), LATENT_NORM_EPS)
        k_rope = _rope(kv[:, None, Rkv:], cos, sin)[:, 0]
        w_uk, _ = kv_b_heads(self._weight(p + "kv_b.", h.dtype), c)  # (Hq, Dn, Rkv)
        q_nope = torch.bmm(q[:, :, :Dn].transpose(0, 1), w_uk).transpose(0, 1)  # (T, Hq, Rkv)
        q_abs = torch.cat([q_nope, _rope(q[:, :, Dn:], cos, sin)], dim=-1)
        self.tap("attn.q", q_abs, L)
        return q_resid, q_abs, latent, k_rope

    def _select(self, h, q_resid, L, batch, seq_idx, cache, cos, sin):
        """transformers' indexer over the keys in the "index" pool, ``torch.topk``; returned as the
        aligned server returns it (n, top_k) int32, ascending, -1 pads, for the same taps."""
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.indexer."
        Di, Dr, Hi = c.index_head_dim, c.qk_rope_head_dim, c.index_n_heads
        rows = batch.pools["index"]
        q = F.linear(q_resid, self.w(p + "wq_b.weight")).view(T, Hi, Di)
        q = torch.cat([_rope(q[..., :Dr], cos, sin), q[..., Dr:]], dim=-1)
        k = F.layer_norm(F.linear(h, self.w(p + "wk.weight")), (Di,), self.w(p + "k_norm.weight"),
                         self.w(p + "k_norm.bias"), INDEXER_NORM_EPS)
        k = torch.cat([_rope(k[:, None, :Dr], cos, sin)[:, 0], k[:, Dr:]], dim=-1)
        write_row_fwd((k,), cache["k"], rows.slot_mapping)
        self.tap_cache("indexer.k", cache["k"].flatten(2), rows.slot_mapping, L)
        w = F.linear(h.float(), self.w(p + "weights_proj.weight").float()) * Hi ** -0.5  # (T, Hi)
        table = cache["k"].view(-1, Di)
        n_keys = rows.block_table.shape[1] * PAGE
        j = torch.arange(n_keys, device=h.device)
        top = min(c.index_topk, n_keys)
        sel = torch.full((T, c.index_topk), -1, dtype=torch.int32, device=h.device)
        for a in range(0, T, ROW_CHUNK):
            b = min(a + ROW_CHUNK, T)
            keys = table[_slots(rows.block_table, seq_idx[a:b], j.expand(b - a, -1))].float()  # (n, L, Di)
            scores = F.relu(torch.matmul(q[a:b].float(), keys.transpose(1, 2)) * c.indexer_scale)  # (n, Hi, L)
            index = torch.matmul(w[a:b, None], scores)[:, 0]  # (n, L)
            future = j[None] > batch.positions[a:b, None]
            idx = index.masked_fill(future, float("-inf")).topk(top, dim=-1).indices
            idx = torch.where(idx <= batch.positions[a:b, None], idx, n_keys).sort(dim=-1).values
            sel[a:b, :top] = torch.where(idx == n_keys, -1, idx).to(torch.int32)
        self.tap("indexer.selected", sel, L)
        return sel

    def _attend(self, q_abs, sel, L, batch, seq_idx, cache):
        """fp32 softmax(q · kᵀ · scale) · v over each row's selected rows of the "mla" pool."""
        c, T, p = self.cfg, q_abs.shape[0], f"layers.{L}.attn."
        Rkv = c.kv_lora_rank
        table = cache["row"].view(-1, cache["row"].shape[-1])
        block_table = batch.pools["mla"].block_table
        o = torch.empty(T, c.num_heads, Rkv, dtype=q_abs.dtype, device=q_abs.device)
        for a in range(0, T, ROW_CHUNK):
            b = min(a + ROW_CHUNK, T)
            ok = sel[a:b] >= 0  # (n, K)
            kv = table[_slots(block_table, seq_idx[a:b], sel[a:b])].float()
            kv = torch.where(ok[..., None], kv, 0.0)  # a pad's slot may hold any bytes, NaN too
            s = torch.matmul(q_abs[a:b].float(), kv.transpose(1, 2)) * c.softmax_scale  # (n, Hq, K)
            prob = torch.softmax(s.masked_fill(~ok[:, None], float("-inf")), dim=-1)
            o[a:b] = torch.matmul(prob, kv[..., :Rkv]).to(q_abs.dtype)
        self.tap("attn.out", o, L)
        _, w_uv = kv_b_heads(self._weight(p + "kv_b.", q_abs.dtype), c)  # (Hq, Dv, Rkv)
        v = torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(T, -1)
        y = self.linear(v, p + "o.")
        self.tap("attn.o_proj", y, L)
        return y

    # ---------------------------------------------------------------- MLP and MoE
    def _mlp(self, h, L, batch):
        g, u = self.linear(h, f"layers.{L}.mlp.gate_up.").chunk(2, dim=-1)
        return self.linear(F.silu(g) * u, f"layers.{L}.mlp.down.")

    def _route(self, h, p):
        """transformers' ``GlmMoeDsaTopkRouter`` -> (weights (T, k) fp32, ids (T, k) int64)."""
        c = self.cfg
        E, G = c.n_routed_experts, c.n_group
        scores = F.linear(h.float(), self.w(p + "gate.weight").float()).sigmoid()
        choice = scores + self.w(p + "correction_bias.weight")
        groups = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(c.topk_group, dim=-1)[1], 1)
        keep = keep[:, :, None].expand(-1, G, E // G).reshape(-1, E).bool()
        ids = choice.masked_fill(~keep, float("-inf")).topk(c.num_experts_per_tok, dim=-1)[1]
        w = scores.gather(1, ids)
        return w / (w.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor, ids

    def _moe(self, h, L):
        p = f"layers.{L}.moe."
        w, ids = self._route(h, p)
        self.tap("moe.router.ids", ids, L)
        self.tap("moe.router.weights", w, L)
        gu, d = self.w(p + "gate_up.weight"), self.w(p + "down.weight")
        if p + "gate_up.weight_scale_inv" in self.weights:
            gu, d = dequantize_experts_fp8(gu, self.w(p + "gate_up.weight_scale_inv"), d,
                                           self.w(p + "down.weight_scale_inv"), h.dtype)
        routed = experts_vendor(h, ids, w, gu, d)
        self.tap("moe.routed", routed, L)
        g, u = self.linear(h, p + "shared_gate_up.").chunk(2, dim=-1)
        y = routed + self.linear(F.silu(g) * u, p + "shared_down.")
        self.tap("moe.out", y, L)
        return y, ids, w

    # ---------------------------------------------------------------- the step
    def forward(self, batch: ForwardBatch, caches):
        """-> (FP32 logits (R, V) of ``batch.logit_rows``, {"routed_experts", "routed_weights"}).
        transformers' decoder layer: residual adds in the model dtype, each norm on the sum."""
        c, eps, tap = self.cfg, self.cfg.rms_norm_eps, self.tap
        T, B = batch.tokens.shape[0], batch.cu_seqlens_q.shape[0] - 1
        seq_idx = torch.arange(B, device=self.device).repeat_interleave(batch.cu_seqlens_q.diff(), output_size=T)
        residual = self.w("embed.weight")[batch.tokens]
        cos, sin = self._cos_sin(batch.positions, residual.dtype)
        slots, sel, routed = batch.pools["mla"].slot_mapping, None, ([], [])
        for i, cache in enumerate(caches["mla"]):
            h = _rmsnorm(residual, self.w(f"layers.{i}.attn_norm.weight"), eps)
            tap("attn_norm", h, i)
            q_resid, q_abs, latent, k_rope = self._q_and_row(h, i, cos, sin)
            write_row_fwd((latent, k_rope), cache["row"], slots)
            self.tap_cache("attn.kv_row", cache["row"].flatten(2), slots, i)
            if i in self._index_slot:
                sel = self._select(h, q_resid, i, batch, seq_idx, caches["index"][self._index_slot[i]], cos, sin)
            residual = residual + self._attend(q_abs, sel, i, batch, seq_idx, cache)
            h = _rmsnorm(residual, self.w(f"layers.{i}.mlp_norm.weight"), eps)
            tap("mlp_norm", h, i)
            if c.mlp_layer_types[i] == "dense":
                residual = residual + self._mlp(h, i, batch)
                continue
            y, ids, w = self._moe(h, i)
            residual = residual + y
            routed[0].append(ids)
            routed[1].append(w)
        h = _rmsnorm(residual[batch.logit_rows], self.w("norm.weight"), eps)
        tap("norm", h, rows="logits")
        logits = F.linear(h, self.lm_head_weight).float()
        tap("lm_head.logits", logits, rows="logits")
        return (logits, routed_extras(*routed)) if routed[0] else logits
