"""DeepSeek-V4 served with vendor kernels: the mismatch this project removes.

The aligned server's pools ("win", "c4" / "c128", "i4", "rings"), its gathers of each query row's
[compressed | window] rows (``_entries``), its engine interface, capture points and extras, with
transformers' ``modeling_deepseek_v4`` arithmetic in torch's ordinary kernels:

- ``F.linear`` for every projection (BLAS tiling that follows the batch shape); an FP8 weight is
  dequantized to the activation dtype first; the grouped ``o_a`` as ``DeepseekV4GroupedLinear``'s ``bmm``;
- ``DeepseekV4HyperConnection`` / ``DeepseekV4HyperHead``: fp32 ``F.linear`` mixes, torch softmax and
  Sinkhorn, ``(pre · streams).sum`` rounded once; the decoder layer's mix ``post · out + combᵀ @ streams``
  in the stream dtype;
- ``DeepseekV4RMSNorm`` (fp32 statistics, times the fp32 weight, one rounding), the unweighted q norm
  (its fp32 rsqrt rounded, then a bf16 product), interleaved RoPE from fp32 ``positions · inv_freq`` cos / sin
  cast to the activation dtype (``apply_rotary_pos_emb``);
- the compressors' pooling ``(kv · softmax(gate + position_bias, fp32).to(kv)).sum`` over the window the
  ring state gives (``common.compress.cpu.window_slots`` gathers it, ``ring_update`` keeps it: data movement);
- eager attention: ``q · kᵀ · scale`` in the model dtype, the sinks concatenated as a logit, fp32
  softmax, the probabilities rounded, ``· v``; the conjugate RoPE on the output;
- the indexer as ``DeepseekV4IndexerScorer`` scores it (fp32 ``matmul``, ReLU, the head weights) and
  ``torch.topk`` (ties broken however topk breaks them, not to the smaller row);
- ``DeepseekV4TopKRouter`` / ``DeepseekV4HashRouter`` in the model dtype, the routed experts on
  ``common/moe/vendor.py`` (MXFP4 stacks dequantized first), the clamped shared expert added in the
  model dtype.

Not the trainer's bits: ``load(..., server_kernels="vendor")``, ``alignzoo bisect --against vendor``.
Separate and multi-adapter LoRA are refused (merged LoRA is a plain weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ...common.compress.cpu import ring_update, slot_bias, window_slots
from ...common.fp8 import dequantize_weight_fp8
from ...common.kv_cache import PAGE_SIZE
from ...common.moe import dequantize_experts_mxfp4
from ...common.moe.vendor import experts_vendor
from ...common.rope import inv_freq_and_attention_factor
from ..moe_block import MXFP4, HashRouter
from .config import CSA
from .serve import DeepseekV4Server, _pool_of, _ring

ROW_CHUNK = 256  # indexer query rows scored at once: bounds the (rows, keys, Di) gather


def _rmsnorm(x, w, eps):
    """transformers' ``DeepseekV4RMSNorm``: fp32 statistics, times the (fp32) weight, rounded once."""
    x32 = x.float()
    return (w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def _rmsnorm_unweighted(x, eps):
    """``DeepseekV4UnweightedRMSNorm``: the fp32 rsqrt rounded to x's dtype, then the product in it."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def _rope(x, cos, sin):
    """``apply_rotary_pos_emb`` on x (T, H, D): pairs (2i, 2i + 1) of the last Dr channels in fp32, rounded
    back; cos, sin (T, Dr / 2) in x.dtype."""
    c, s = cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]
    Dr = c.shape[-1]
    nope, rope = x[..., :-Dr], x[..., -Dr:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([nope, (rope.float() * c + half.float() * s).to(x.dtype)], dim=-1)


def _mix(out, streams, post, comb):
    """The decoder layer's mix: post · out + combᵀ @ streams, in the stream dtype."""
    dt = streams.dtype
    return post.to(dt)[..., None] * out[:, None] + torch.matmul(comb.to(dt).transpose(-1, -2), streams)


class DeepseekV4VendorServer(DeepseekV4Server):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self._lora or self._experts_lora or self.adapter_names:
            raise NotImplementedError("the vendor server does not apply separate or multi LoRA adapters; "
                                      "use lora_mode='merged'")
        c = self.cfg
        self._freqs = {}
        for spec in (c.main_rope, c.compress_rope):
            inv_freq, scale = inv_freq_and_attention_factor(spec.rotary_dim, spec.base, spec.yarn)
            self._freqs[spec] = (inv_freq.to(self.device), scale)  # transformers' fp32 bits

    # ---------------------------------------------------------------- torch's arithmetic
    def linear(self, x, prefix, adapter_ids=None):
        w, scale_inv = self.weights[prefix + "weight"], self.weights.get(prefix + "weight_scale_inv")
        return F.linear(x, w if scale_inv is None else dequantize_weight_fp8(w, scale_inv, x.dtype))

    def _cos_sin(self, positions, spec, dtype):
        """``DeepseekV4RotaryEmbedding``: (T, Dr / 2) cos / sin of fp32 positions · inv_freq, in ``dtype``."""
        inv_freq, scale = self._freqs[spec]
        freqs = positions.float()[:, None] * inv_freq[None]
        return (freqs.cos() * scale).to(dtype), (freqs.sin() * scale).to(dtype)

    def _hc(self, streams, prefix):
        """``DeepseekV4HyperConnection`` -> (post (T, N) fp32, comb (T, N, N) fp32, collapsed (T, H))."""
        c, N, T = self.cfg, self.cfg.hc_mult, streams.shape[0]
        fn, base, scale = (self.w(prefix + n) for n in ("fn", "base", "scale"))
        flat = streams.reshape(T, -1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + c.rms_norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, fn.float()).split([N, N, N * N], dim=-1)
        pre_b, post_b, comb_b = base.split([N, N, N * N])
        pre = torch.sigmoid(pre_w * scale[0] + pre_b) + c.hc_eps
        post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
        comb = torch.softmax(comb_w.view(T, N, N) * scale[2] + comb_b.view(N, N), dim=-1) + c.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + c.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + c.hc_eps)
        return post, comb, (pre[..., None] * streams).sum(dim=1).to(streams.dtype)

    # ---------------------------------------------------------------- compressors and indexer
    def _compress(self, h, prefix, ring, rate, overlap, batch, starts, at):
        """A compressor's new rows (R, width) as transformers pools them (zeros where a token completes no
        group, ``at`` None); the ring continues in place, read before it is updated."""
        c, T = self.cfg, h.shape[0]
        kv, gate = self.linear(h, prefix + "kv."), self.linear(h, prefix + "gate.")
        idx = torch.arange(T, device=h.device) if at is None else at
        kv_s, gate_s, pad = window_slots(kv, gate, idx, batch.cu_seqlens_q, rate=rate, overlap=overlap, starts=starts,
                                         slots=batch.state_slots, ring_kv=ring["ring_kv"], ring_gate=ring["ring_gate"])
        ring_update(kv, gate, batch.cu_seqlens_q, starts, batch.state_slots, ring["ring_kv"], ring["ring_gate"])
        logit = (gate_s + slot_bias(self.w(prefix + "position_bias"), rate, overlap)).masked_fill(pad[..., None],
                                                                                               float("-inf"))
        rows = (kv_s * logit.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)  # (R, width)
        pos = batch.positions[idx]
        closes = (pos + 1) % rate == 0
        rows = torch.where(closes[:, None], rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
        rows = _rmsnorm(rows, self.w(prefix + "kv_norm.weight"), c.rms_norm_eps)
        row_pos = ((torch.div(pos + 1, rate, rounding_mode="floor") - 1) * rate).clamp(min=0)
        cos, sin = self._cos_sin(row_pos, c.compress_rope, rows.dtype)
        return _rope(rows[:, None], cos, sin)[:, 0]

    def _select(self, h, q_resid, L, batch, seq_idx, caches, starts, at):
        """The CSA indexer: its rows into "i4", then ``DeepseekV4IndexerScorer`` and ``torch.topk`` -> (T,
        index_topk) int32 visible rows, ascending, -1 pads (the aligned server's layout, for the same taps)."""
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.indexer."
        rate, Hi, Di = dict(c.compress_rates)[CSA], c.index_n_heads, c.index_head_dim
        cache = caches["i4"][self._slot[L]]["k"]
        rows = self._compress(h, p, _ring(caches["rings"][0], f"i{L}."), rate, True, batch, starts, at)
        self._write_rows(rows, "i4", cache, batch, at)
        cos, sin = self._cos_sin(batch.positions, c.compress_rope, h.dtype)
        q = _rope(self.linear(q_resid, p + "q_b.").view(T, Hi, Di), cos, sin).float()
        w = self.linear(h, p + "weights_proj.").float() * Hi ** -0.5  # (T, Hi)
        visible = torch.div(batch.positions + 1, rate, rounding_mode="floor")
        table, block_table = cache.view(-1, Di), batch.pools["i4"].block_table.long()
        n_keys = block_table.shape[1] * PAGE_SIZE
        j = torch.arange(n_keys, device=h.device)
        top = min(c.index_topk, n_keys)
        sel = torch.full((T, c.index_topk), -1, dtype=torch.int32, device=h.device)
        for a in range(0, T, ROW_CHUNK):
            b = min(a + ROW_CHUNK, T)
            ok = j[None] < visible[a:b, None]  # (n, L)
            slots = block_table[seq_idx[a:b, None], j // PAGE_SIZE].clamp(min=0) * PAGE_SIZE + j % PAGE_SIZE
            keys = torch.where(ok[..., None], table[slots].float(), 0.0)  # an unwritten row may hold any bytes
            scores = F.relu(torch.matmul(q[a:b], keys.transpose(1, 2))) * c.indexer_scale  # (n, Hi, L)
            index = (scores * w[a:b, :, None]).sum(dim=1).masked_fill(~ok, float("-inf"))
            idx = index.topk(top, dim=-1).indices
            idx = torch.where(idx < visible[a:b, None], idx, n_keys).sort(dim=-1).values
            sel[a:b, :top] = torch.where(idx == n_keys, -1, idx).to(torch.int32)
        self.tap("indexer.selected", sel, L)
        return sel

    # ---------------------------------------------------------------- attention
    def _attention(self, h, L, batch, seq_idx, caches, starts, at):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}."
        eps, Hq, D = c.rms_norm_eps, c.num_heads, c.head_dim
        cos, sin = self._cos_sin(batch.positions, c.rope_for(L), h.dtype)
        q_resid = _rmsnorm(self.linear(h, p + "attn.q_a."), self.w(p + "attn.q_a_norm.weight"), eps)
        q = _rope(_rmsnorm_unweighted(self.linear(q_resid, p + "attn.q_b.").view(T, Hq, D), eps), cos, sin)
        kv = _rmsnorm(self.linear(h, p + "attn.kv."), self.w(p + "attn.kv_norm.weight"), eps)
        kv = _rope(kv[:, None], cos, sin)[:, 0]
        self.tap("attn.q", q, L)
        self.tap("attn.kv_row", kv, L)
        self._write_rows(kv, "win", caches["win"][L]["row"], batch, None)
        pool, picked = _pool_of(c, L), None
        if pool is not None:
            rows = self._compress(h, p + "compressor.", _ring(caches["rings"][0], f"c{L}."), c.rate(L),
                                  c.layer_types[L] == CSA, batch, starts, at)
            self._write_rows(rows, pool, caches[pool][self._slot[L]]["row"], batch, at)
        if c.layer_types[L] == CSA:
            picked = self._select(h, q_resid, L, batch, seq_idx, caches, starts, at)
        rows, sel = self._entries(L, batch, seq_idx, caches, picked)
        ok = sel >= 0  # (T, E)
        kv = torch.where(ok[..., None], rows.view(T, -1, D), 0.0)  # a pad's slot may hold any bytes
        s = torch.matmul(q, kv.transpose(1, 2)) * c.softmax_scale  # (T, Hq, E) in the model dtype
        s = s.masked_fill(~ok[:, None], float("-inf"))
        logits = torch.cat([s, self.w(p + "attn.sinks").view(1, Hq, 1).expand(T, Hq, 1)], dim=-1)  # fp32
        probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
        o = _rope(torch.matmul(probs.to(kv.dtype), kv), cos, -sin)
        self.tap("attn.out", o, L)
        G = c.o_groups
        w_a = self.w(p + "attn.o_a.weight")
        x = o.reshape(T, G, -1).transpose(0, 1)  # (G, T, Hq D / G)
        grouped = torch.bmm(x, w_a.view(G, -1, x.shape[-1]).transpose(1, 2)).transpose(0, 1).reshape(T, -1)
        y = self.linear(grouped, p + "attn.o_b.")
        self.tap("attn.o_proj", y, L)
        return y, picked

    # ---------------------------------------------------------------- MoE
    def _moe(self, h, L, batch):
        """``DeepseekV4SparseMoeBlock`` -> (y (T, H), ids (T, k), weights (T, k))."""
        c, spec, p = self.cfg, self.moe_specs[L], f"layers.{L}.moe."
        lim = spec.limit
        scores = F.softplus(F.linear(h, self.w(p + "gate.weight"))).sqrt()  # (T, E) in the model dtype
        if isinstance(spec.router, HashRouter):
            ids = self.w(p + "tid2eid.weight")[batch.tokens].long()
        else:
            biased = scores + self.w(p + "correction_bias.weight")
            ids = torch.topk(biased, c.num_experts_per_tok, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * c.routed_scaling_factor
        self.tap("moe.router.ids", ids, L)
        self.tap("moe.router.weights", w, L)
        if spec.experts is MXFP4:
            gu, d = dequantize_experts_mxfp4(self.w(p + "gate_up.weight"), self.w(p + "gate_up.weight_scale"),
                                             self.w(p + "down.weight"), self.w(p + "down.weight_scale"), h.dtype)
        else:
            gu, d = self.w(p + "gate_up.weight"), self.w(p + "down.weight")
        routed = experts_vendor(h, ids, w, gu, d, lim)
        self.tap("moe.routed", routed, L)
        g, u = self.linear(h, p + "shared_gate_up.").chunk(2, dim=-1)
        y = routed + self.linear(F.silu(g.clamp(max=lim)) * u.clamp(min=-lim, max=lim), p + "shared_down.")
        self.tap("moe.out", y, L)
        return y, ids, w

    # ---------------------------------------------------------------- the step
    def _logits(self, streams, batch) -> torch.Tensor:
        """``DeepseekV4HyperHead``, the final norm, the LM head."""
        c, x = self.cfg, streams[batch.logit_rows]
        fn, base, scale = (self.w("hc_head." + n) for n in ("fn", "base", "scale"))
        flat = x.flatten(1).float()
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + c.rms_norm_eps)
        pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + c.hc_eps
        h = _rmsnorm((pre[..., None] * x).sum(dim=1).to(x.dtype), self.w("norm.weight"), c.rms_norm_eps)
        self.tap("norm", h, rows="logits")
        logits = F.linear(h, self.lm_head_weight).float()
        self.tap("lm_head.logits", logits, rows="logits")
        return logits

    # the step itself is the aligned server's (``DeepseekV4Server.forward``) over the pieces above
    def _norm_row(self, x, name):
        return _rmsnorm(x, self.w(name), self.cfg.rms_norm_eps)

    def _mix(self, out, streams, post, comb):
        return _mix(out, streams, post, comb)

