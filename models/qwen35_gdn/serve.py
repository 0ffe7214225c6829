"""Qwen3.5-MoE serving module: the engine's ``ServeModel``.

Op for op the trainer's computation (``train.py``) through the same kernels'
``_fwd`` launchers.  Two cache pools: the gated attention layers' paged K/V
("kv"), and per sequence, for every GDN layer, its recurrent state, open
64-row chunk and 3-row conv tail ("gdn", a ``StatePool``).  A GDN layer
continues each sequence from its slot at the batch's first position for it
(``gdn_fwd``/``conv1d_fwd``): prefill from position 0 never reads the slot,
chunked prefill and decode continue the open chunk row by row with the
trainer's arithmetic, so every path gives the trainer's bits.

Per-token extras: the routed experts of every MoE layer, "routed_experts"
(T, L, k) int32 and "routed_weights" (T, L, k) fp32, in the router's slot
order, for router replay.
"""
from __future__ import annotations

import torch

from ...common.attention import paged_attention_fwd
from ...common.engine.model_api import ForwardBatch
from ...common.gdn import conv1d_fwd, conv1d_state_fields, gdn_fwd, gdn_state_fields
from ...common.kv_cache import PagedPool, StatePool, write_kv_fwd
from ...common.rmsnorm import rmsnorm_fwd
from ...common.rope import rope_fwd
from ..base import ServerBase
from ..moe_block import moe_block_fwd, routed_extras, server_experts_lora
from .config import Qwen35GdnConfig
from .train import gated, gdn_gates, moe_spec, qk_l2norm, zc
from .weights import lora_slices


class Qwen35GdnServer(ServerBase):
    """``ServerBase``: the weight dict, the RoPE table, LoRA branches, ``linear``,
    ``_norm`` (zero-centred here: ``norm_weight``), the final norm and LM head."""

    lora_slices_of = staticmethod(lora_slices)

    def __init__(self, cfg: Qwen35GdnConfig, weights: dict[str, torch.Tensor], lora_scale: float | None = None,
                 lora_adapters: tuple[tuple[str, float], ...] = ()):
        super().__init__(cfg, weights, lora_scale, lora_adapters)
        self._slot = {i: n for n, i in enumerate(cfg.gdn_layers)} | {i: n for n, i in enumerate(cfg.attn_layers)}
        self.moe_spec = moe_spec(cfg)
        # {layer: ExpertLoRA} of the layers whose experts carry a separate-mode adapter
        self._experts_lora = {i: lora for i in range(cfg.num_layers)
                              if (lora := server_experts_lora(self, self.moe_spec, i)) is not None}

    def cache_pools(self) -> dict:
        c = self.cfg
        pools = {}
        if c.attn_layers:
            pools["kv"] = PagedPool({"k": (c.num_kv_heads, c.head_dim), "v": (c.num_kv_heads, c.head_dim)},
                                    self.dtype, len(c.attn_layers))
        if c.gdn_layers:
            fields = gdn_state_fields(c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim)
            fields |= conv1d_state_fields(c.conv_dim, self.dtype)
            pools["gdn"] = StatePool(fields, len(c.gdn_layers))
        return pools

    def norm_weight(self, name: str) -> torch.Tensor:
        return zc(self.w(name))

    def _gdn(self, h, L, layer, batch, starts):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}."
        Hk, Hv, K, V = c.gdn_k_heads, c.gdn_v_heads, c.gdn_k_dim, c.gdn_v_dim
        proj = self.linear(h, p + "gdn.in_proj.", batch.adapter_ids)
        self.tap("gdn.in_proj", proj, L)
        qkv, z, b, a = proj.split([c.conv_dim, c.gdn_value_dim, Hv, Hv], dim=-1)
        qkv = conv1d_fwd(qkv, self.w(p + "gdn.conv.weight").squeeze(1), batch.cu_seqlens_q, tail=layer["conv_tail"],
                         slots=batch.state_slots, start_positions=starts)
        self.tap("gdn.conv", qkv, L)
        q, k, v = qkv.split([c.gdn_key_dim, c.gdn_key_dim, c.gdn_value_dim], dim=-1)
        q, k = qk_l2norm(q.reshape(T, Hk, K), k.reshape(T, Hk, K), K)
        g, beta = gdn_gates(a, b, self.w(p + "gdn.A_log.weight"), self.w(p + "gdn.dt_bias.weight"))
        o = self.gdn_core(q, k, v.reshape(T, Hv, V), g, beta, batch, starts, layer).to(h.dtype)
        self.tap("gdn.core", o, L)
        self.tap_state("gdn.state", layer["state"], batch.state_slots, starts, batch.cu_seqlens_q, L)
        o = rmsnorm_fwd(o.reshape(T * Hv, V), self.w(p + "gdn.norm.weight"), c.rms_norm_eps,
                        z=z.reshape(T * Hv, V).contiguous())[0]
        y = self.linear(o.reshape(T, Hv * V), p + "gdn.out.", batch.adapter_ids)
        self.tap("gdn.out", y, L)
        return y

    def gdn_core(self, q, k, v, g, beta, batch, starts, layer):
        """The delta rule over the batch, each sequence from its slot (the vendor server swaps in its own);
        an eager step's host lists spare the prefill its device reads."""
        hl = batch.host
        return gdn_fwd(q, k, v, g, beta, batch.cu_seqlens_q, start_positions=starts, cache=layer,
                       slots=batch.state_slots, host=hl and (hl.cu_seqlens_q, hl.starts, hl.state_slots))

    def _attn(self, h, L, layer, batch):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}."
        Hq, Hkv, D, eps = c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps
        kv = batch.pools["kv"]
        qkv = self.linear(h, p + "attn.qkv.", batch.adapter_ids)
        self.tap("attn.qkv", qkv, L)
        qg, k, v = qkv.split([2 * Hq * D, Hkv * D, Hkv * D], dim=-1)
        qg = qg.reshape(T, Hq, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]
        q = rope_fwd(rmsnorm_fwd(q.contiguous(), zc(self.w(p + "attn.q_norm.weight")), eps)[0], batch.positions,
                     self.rope, check=False)
        k = rope_fwd(rmsnorm_fwd(k.reshape(T, Hkv, D).contiguous(), zc(self.w(p + "attn.k_norm.weight")), eps)[0],
                     batch.positions, self.rope, check=False)
        v = v.reshape(T, Hkv, D).contiguous()
        write_kv_fwd(k, v, layer["k"], layer["v"], kv.slot_mapping)
        self.tap("attn.q", q, L)
        self.tap_cache("attn.k", layer["k"], kv.slot_mapping, L)
        self.tap_cache("attn.v", layer["v"], kv.slot_mapping, L)
        o = gated(paged_attention_fwd(q, layer["k"], layer["v"], batch.cu_seqlens_q, batch.seq_lens, kv.block_table,
                                      max_seqlen_q=batch.max_seqlen_q)[0], gate)
        self.tap("attn.out", o, L)
        y = self.linear(o.reshape(T, Hq * D), p + "attn.o.", batch.adapter_ids)
        self.tap("attn.o_proj", y, L)
        return y

    def _moe(self, h, L, batch):
        return moe_block_fwd(self, self.moe_spec, h, L, batch, self._experts_lora.get(L))

    def forward(self, batch: ForwardBatch, caches):
        """-> (FP32 logits (R, V) of ``batch.logit_rows``, {"routed_experts", "routed_weights"})."""
        c = self.cfg
        T = batch.tokens.shape[0]
        x, residual = self.w("embed.weight")[batch.tokens], None
        # each sequence's first new position: where its GDN slot continues (position 0: the slot is not read)
        starts = batch.positions[batch.cu_seqlens_q[:-1].long().clamp(max=max(T - 1, 0))]
        ids_all, w_all = [], []
        for i, kind in enumerate(c.layer_types):
            p = f"layers.{i}."
            if residual is None:
                h, residual = self._norm(x, p + "attn_norm.weight")[0], x
            else:
                h, residual = self._norm(x, p + "attn_norm.weight", residual)
            self.tap("attn_norm", h, i)
            if kind == "linear_attention":
                x = self._gdn(h, i, caches["gdn"][self._slot[i]], batch, starts)
            else:
                x = self._attn(h, i, caches["kv"][self._slot[i]], batch)
            h, residual = self._norm(x, p + "mlp_norm.weight", residual)
            self.tap("mlp_norm", h, i)
            x, ids, w = self._moe(h, i, batch)
            ids_all.append(ids)
            w_all.append(w)
        logits = self._logits(x, residual, batch)
        return logits, routed_extras(ids_all, w_all)
