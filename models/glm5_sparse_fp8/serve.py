"""GLM-5 serving module: the engine's ``ServeModel``.

Op for op the trainer's computation (``train.py``) through the same kernels'
``_fwd`` launchers.  Two paged pools:

- "mla": per layer, one row per position, [kv_a_layernorm(latent) (Rkv) | rope
  key (Dr)] (GLM-5: 512 + 64), written by ``write_row_fwd`` from its two parts
  and read whole by the sparse attention (its first Rkv columns are the value);
- "index": per "full" indexer layer, the indexer's key (Di) of every position.

A full layer scores each new row against its sequence's keys in the "index"
pool and keeps the top ``index_topk`` (``paged_index_select_fwd``: the trainer's
``index_select`` bits, whether the keys came from this chunk or an earlier one);
a shared layer attends with the last full layer's selection, as the trainer does.

Per-token extras: the routed experts of every MoE layer ("routed_experts",
"routed_weights", (T, L_moe, k)), for router replay; on request
(``SamplingParams(extras=("index_selected",))``), "index_selected" (T, L_full,
index_topk) int32, every full indexer layer's selection, for index replay.
"""
from __future__ import annotations

import torch

from ...common.dsa import index_key_norm, paged_index_select_fwd
from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import PagedPool, write_row_fwd
from ...common.matmul import matmul_fwd
from ...common.rmsnorm import rmsnorm_fwd
from ...common.rope import rope_fwd, rope_table
from ...common.sparse_attention import paged_sparse_attention_fwd
from ...common.swiglu import swiglu_fwd
from ..base import ServerBase
from ..moe_block import moe_block_fwd, routed_extras, server_experts_lora
from .config import INDEXER_NORM_EPS, LATENT_NORM_EPS, Glm5Config
from .train import INDEX_SELECTED, absorb_q, indexer_weights, moe_spec, unabsorb_o
from .weights import lora_slices


class Glm5Server(ServerBase):
    """``ServerBase``: the weight dict, the RoPE table, LoRA branches, ``linear``, the final norm and LM head."""

    lora_slices_of = staticmethod(lora_slices)
    on_request_extras = (INDEX_SELECTED,)

    def __init__(self, cfg: Glm5Config, weights: dict[str, torch.Tensor], lora_scale: float | None = None,
                 lora_adapters: tuple[tuple[str, float], ...] = ()):
        super().__init__(cfg, weights, lora_scale, lora_adapters)
        rope_table(cfg.indexer_rope, self.device)  # built before any CUDA-graph capture, as the base's
        fp8 = any(k.startswith("layers.") and ".moe.gate_up.weight_scale_inv" in k for k in weights)
        self.moe_spec = moe_spec(cfg, fp8)
        self._index_slot = {i: n for n, i in enumerate(cfg.indexer_layers)}
        self._experts_lora = {i: lora for i in cfg.sparse_layers
                              if (lora := server_experts_lora(self, self.moe_spec, i)) is not None}

    def cache_pools(self) -> dict:
        c = self.cfg
        return {"mla": PagedPool({"row": (1, c.kv_lora_rank + c.qk_rope_head_dim)}, self.dtype, c.num_layers),
                "index": PagedPool({"k": (1, c.index_head_dim)}, self.dtype, len(c.indexer_layers))}

    def _q_and_row(self, h, L, batch):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.attn."
        Rkv, Dr, ids = c.kv_lora_rank, c.qk_rope_head_dim, batch.adapter_ids
        q_resid = rmsnorm_fwd(self.linear(h, p + "q_a.", ids), self.w(p + "q_a_norm.weight"), LATENT_NORM_EPS)[0]
        q = rope_fwd(self.linear(q_resid, p + "q_b.", ids).view(T, c.num_heads, c.qk_head_dim), batch.positions,
                     c.rope, check=False)
        kv = self.linear(h, p + "kv_a.", ids)
        latent = rmsnorm_fwd(kv[:, :Rkv].contiguous(), self.w(p + "kv_a_norm.weight"), LATENT_NORM_EPS)[0]
        k_rope = rope_fwd(kv[:, Rkv:].contiguous().view(T, 1, Dr), batch.positions, c.rope, check=False).view(T, Dr)
        q_abs = absorb_q(q, self.w(p + "kv_b.weight"), c, matmul_fwd)
        self.tap("attn.q", q_abs, L)
        return q_resid, q_abs, latent, k_rope

    def _select(self, h, q_resid, L, batch, seq_idx, cache):
        """A full layer's indexer: its keys into the "index" pool, then each row's top-k over them."""
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.indexer."
        rows = batch.pools["index"]
        q = rope_fwd(matmul_fwd(q_resid, self.w(p + "wq_b.weight")).view(T, c.index_n_heads, c.index_head_dim),
                     batch.positions, c.indexer_rope, check=False)
        k = index_key_norm(matmul_fwd(h, self.w(p + "wk.weight")), self.w(p + "k_norm.weight"),
                           self.w(p + "k_norm.bias"), INDEXER_NORM_EPS)
        k = rope_fwd(k.view(T, 1, c.index_head_dim), batch.positions, c.indexer_rope, check=False)
        write_row_fwd((k,), cache["k"], rows.slot_mapping)
        self.tap_cache("indexer.k", cache["k"].flatten(2), rows.slot_mapping, L)
        w = indexer_weights(h, self.w(p + "weights_proj.weight"), c, matmul_fwd)
        sel = paged_index_select_fwd(q, cache["k"], w, seq_idx, rows.block_table, batch.positions,
                                     scale=c.indexer_scale, top_k=c.index_topk)
        self.tap("indexer.selected", sel, L)
        return sel

    def _attend(self, q_abs, sel, L, batch, seq_idx, cache):
        c, p = self.cfg, f"layers.{L}.attn."
        o = paged_sparse_attention_fwd(q_abs, cache["row"], sel, seq_idx, batch.pools["mla"].block_table,
                                       scale=c.softmax_scale, v_dim=c.kv_lora_rank)[0]
        self.tap("attn.out", o, L)
        y = self.linear(unabsorb_o(o, self.w(p + "kv_b.weight"), c, matmul_fwd), p + "o.", batch.adapter_ids)
        self.tap("attn.o_proj", y, L)
        return y

    def _mlp(self, h, L, batch):
        I, p = self.cfg.intermediate_size, f"layers.{L}.mlp."
        gu = self.linear(h, p + "gate_up.", batch.adapter_ids)
        return self.linear(swiglu_fwd(gu[:, :I], gu[:, I:]), p + "down.", batch.adapter_ids)

    def forward(self, batch: ForwardBatch, caches):
        """-> (FP32 logits (R, V) of ``batch.logit_rows``, {"routed_experts", "routed_weights"})."""
        c = self.cfg
        T, B = batch.tokens.shape[0], batch.cu_seqlens_q.shape[0] - 1
        seq_idx = torch.repeat_interleave(torch.arange(B, device=self.device), batch.cu_seqlens_q.diff(),
                                          output_size=T)
        mla = batch.pools["mla"]
        x, residual, sel = self.w("embed.weight")[batch.tokens], None, None
        ids_all, w_all, sels = [], [], []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            if residual is None:
                h, residual = self._norm(x, p + "attn_norm.weight")[0], x
            else:
                h, residual = self._norm(x, p + "attn_norm.weight", residual)
            self.tap("attn_norm", h, i)
            q_resid, q_abs, latent, k_rope = self._q_and_row(h, i, batch)
            cache = caches["mla"][i]
            write_row_fwd((latent, k_rope), cache["row"], mla.slot_mapping)
            self.tap_cache("attn.kv_row", cache["row"].flatten(2), mla.slot_mapping, i)
            if i in self._index_slot:
                sel = self._select(h, q_resid, i, batch, seq_idx, caches["index"][self._index_slot[i]])
                sels.append(sel)
            x = self._attend(q_abs, sel, i, batch, seq_idx, cache)
            h, residual = self._norm(x, p + "mlp_norm.weight", residual)
            self.tap("mlp_norm", h, i)
            if c.mlp_layer_types[i] == "dense":
                x = self._mlp(h, i, batch)
            else:
                x, ids, w = moe_block_fwd(self, self.moe_spec, h, i, batch, self._experts_lora.get(i))
                ids_all.append(ids)
                w_all.append(w)
        logits = self._logits(x, residual, batch)
        extras = routed_extras(ids_all, w_all) if ids_all else {}
        if INDEX_SELECTED in batch.want_extras:  # index replay: only when a request of this step asked
            extras[INDEX_SELECTED] = torch.stack(sels, 1)
        return logits, extras
