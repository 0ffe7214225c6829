"""DeepSeek-V4 serving module: the engine's ``ServeModel``.

Op for op the trainer's computation (``train.py``) through the same kernels' ``_fwd`` launchers.  Pools:

- "win" (a window pool): every layer's token rows (the shared K = V row, D), of which only the last
  ``sliding_window`` positions are read; pages behind the window go back;
- "c4" / "c128" (rate pools): the CSA / HCA layers' compressed rows (D), one per ``rate`` positions, written
  by the token that completes the group;
- "i4" (a rate pool): the CSA layers' indexer rows (Di);
- "rings" (one state slot per sequence): every compressor's ring of its last kv / gate rows
  (``common.compress.compress_state_fields``), so a group split across steps gives the trainer's row.

A query row attends to [its compressed rows | its window's token rows] plus the sinks, gathered from the two
pools in that order (``_entries``), the order the trainer's packed layout gives: the same entries in the same
order through the same launcher (``sparse_attention_fwd``), so the same bits.
"""
from __future__ import annotations

import torch

from ...common.compress import compress_state_fields, compress_step, group_ends
from ...common.dsa import paged_index_select_fwd
from ...common.engine.model_api import ForwardBatch
from ...common.kv_cache import PAGE_SIZE, RatePool, StatePool, WindowPool, write_row_fwd
from ...common.lm_head import lm_head_logits_fwd
from ...common.matmul import matmul_fwd
from ...common.mhc import hc_collapse_fwd, hc_head_fwd, hc_mix_fwd, hc_weights_fwd
from ...common.rmsnorm import rmsnorm_fwd
from ...common.rope import rope_fwd, rope_table
from ...common.sparse_attention import sparse_attention_fwd
from ..base import ServerBase
from ..moe_block import moe_block_fwd, routed_extras, server_experts_lora
from .config import CSA, HCA, DeepseekV4Config
from .train import INDEX_SELECTED, grouped_o, moe_spec
from .weights import lora_slices


def _pool_of(cfg: DeepseekV4Config, layer: int) -> str | None:
    return {CSA: "c4", HCA: "c128"}.get(cfg.layer_types[layer])


class DeepseekV4Server(ServerBase):
    """``ServerBase``: the weight dict, LoRA branches, ``linear``; the mHC head, the final norm and the LM head
    are this model's own (``_logits``)."""

    lora_slices_of = staticmethod(lora_slices)
    on_request_extras = (INDEX_SELECTED,)

    def __init__(self, cfg: DeepseekV4Config, weights: dict[str, torch.Tensor], lora_scale: float | None = None,
                 lora_adapters: tuple[tuple[str, float], ...] = ()):
        super().__init__(cfg, weights, lora_scale, lora_adapters)
        for spec in (cfg.main_rope, cfg.compress_rope):
            rope_table(spec, self.device)  # built before any CUDA-graph capture
        self.moe_specs = [moe_spec(cfg, i) for i in range(cfg.num_layers)]
        self._slot = {i: n for n, i in enumerate(cfg.csa_layers)} | {i: n for n, i in enumerate(cfg.hca_layers)}
        self._experts_lora = {i: lora for i in range(cfg.num_layers)
                              if (lora := server_experts_lora(self, self.moe_specs[i], i)) is not None}

    def cache_pools(self) -> dict:
        c = self.cfg
        pools = {"win": WindowPool({"row": (1, c.head_dim)}, self.dtype, c.num_layers, window=c.sliding_window,
                                   ring=True)}
        rings = {}
        if c.csa_layers:
            rate = dict(c.compress_rates)[CSA]
            pools["c4"] = RatePool({"row": (1, c.head_dim)}, self.dtype, len(c.csa_layers), rate=rate)
            pools["i4"] = RatePool({"k": (1, c.index_head_dim)}, self.dtype, len(c.csa_layers), rate=rate)
            for L in c.csa_layers:
                rings |= _ring_fields(f"c{L}.", rate, 2 * c.head_dim, True, self.dtype)
                rings |= _ring_fields(f"i{L}.", rate, 2 * c.index_head_dim, True, self.dtype)
        if c.hca_layers:
            rate = dict(c.compress_rates)[HCA]
            pools["c128"] = RatePool({"row": (1, c.head_dim)}, self.dtype, len(c.hca_layers), rate=rate)
            for L in c.hca_layers:
                rings |= _ring_fields(f"c{L}.", rate, c.head_dim, False, self.dtype)
        if rings:
            pools["rings"] = StatePool(rings, 1)
        return pools

    # ------------------------------------------------------------ pieces
    def _hc(self, streams, prefix):
        c = self.cfg
        fn, base, scale = (self.w(prefix + n) for n in ("fn", "base", "scale"))
        pre, post, comb, _, _ = hc_weights_fwd(streams, fn, base, scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        return post, comb, hc_collapse_fwd(streams, pre)

    def _compress(self, h, prefix, ring, rate, overlap, batch, starts, at):
        """A compressor's new rows (R, width) (every token's when ``at`` is None, zeros where none completes),
        normed and rotated at their group's first position; the ring continues in place."""
        c = self.cfg
        kv, gate = self.linear(h, prefix + "kv.", batch.adapter_ids), self.linear(h, prefix + "gate.", batch.adapter_ids)
        rows = compress_step(kv, gate, self.w(prefix + "position_bias"), batch.cu_seqlens_q, starts,
                             batch.state_slots, ring, rate=rate, overlap=overlap, at=at)
        pos = batch.positions if at is None else batch.positions[at]
        row_pos = ((torch.div(pos + 1, rate, rounding_mode="floor") - 1) * rate).clamp(min=0)
        rows = rmsnorm_fwd(rows, self.w(prefix + "kv_norm.weight"), c.rms_norm_eps)[0]
        R, width = rows.shape
        return rope_fwd(rows.view(R, 1, width), row_pos, c.compress_rope, check=False).view(R, width)

    def _write_rows(self, rows, pool: str, cache, batch, at):
        slots = batch.pools[pool].slot_mapping
        write_row_fwd((rows,), cache, slots if at is None else slots[at])

    def _select(self, h, q_resid, L, batch, seq_idx, caches, starts, at):
        """The CSA indexer: its rows into "i4", then each query's index_topk visible rows (-1 pads)."""
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.indexer."
        rate = dict(c.compress_rates)[CSA]
        ring = _ring(caches["rings"][0], f"i{L}.")
        cache = caches["i4"][self._slot[L]]["k"]
        rows = self._compress(h, p, ring, rate, True, batch, starts, at)
        self._write_rows(rows, "i4", cache, batch, at)
        q = rope_fwd(matmul_fwd(q_resid, self.w(p + "q_b.weight")).view(T, c.index_n_heads, c.index_head_dim),
                     batch.positions, c.compress_rope, check=False)
        w = matmul_fwd(h, self.w(p + "weights_proj.weight")).float() * (c.index_n_heads ** -0.5)
        visible = torch.div(batch.positions + 1, rate, rounding_mode="floor")
        sel = paged_index_select_fwd(q, cache, w, seq_idx, batch.pools["i4"].block_table,
                                     (visible - 1).clamp(min=0),
                                     scale=c.indexer_scale, top_k=c.index_topk)
        sel = torch.where((visible > 0)[:, None], sel, -1)
        self.tap("indexer.selected", sel, L)
        return sel

    def _entries(self, L, batch, seq_idx, caches, picked):
        """(rows (n E, D), sel (n, E)): each query row's compressed rows (the picked ones, or every visible one)
        then its window's token rows, gathered from their pools into a block of E rows per query row; ``sel``
        marks the valid ones (-1 the rest), ascending, as the trainer's [compressed | token] layout has them."""
        c, n = self.cfg, batch.positions.shape[0]
        pos, dev, W, D = batch.positions, self.device, c.sliding_window, c.head_dim
        win = batch.pools["win"].block_table.long()
        j = pos[:, None] - W + 1 + torch.arange(W, device=dev)  # (n, W)
        jc = j.clamp(min=0)
        ring = (jc // PAGE_SIZE) % win.shape[1]  # the window's ring table (WindowPool.ring): its width follows W
        parts = [(caches["win"][L]["row"].view(-1, D), win[seq_idx[:, None], ring] * PAGE_SIZE + jc % PAGE_SIZE, j >= 0)]
        pool = _pool_of(c, L)
        if pool is not None:
            rate, table_c = c.rate(L), batch.pools[pool].block_table.long()
            if picked is None:  # HCA: every row w < (p + 1) // rate, over the table's width (no host read: graphs)
                visible = torch.div(pos + 1, rate, rounding_mode="floor")
                K = table_c.shape[1] * PAGE_SIZE
                w = torch.arange(K, device=dev).expand(n, K)
                ok_c = w < visible[:, None]
            else:
                w, ok_c = picked.long().clamp(min=0), picked >= 0
            slot_c = table_c[seq_idx[:, None], w // PAGE_SIZE] * PAGE_SIZE + w % PAGE_SIZE
            parts.insert(0, (caches[pool][self._slot[L]]["row"].view(-1, D), slot_c, ok_c))
        rows = torch.cat([src[torch.where(ok, s, 0)] for src, s, ok in parts], 1)  # (n, E, D)
        ok = torch.cat([ok for _, _, ok in parts], 1)
        E = ok.shape[1]
        sel = torch.where(ok, torch.arange(E, device=dev), -1).to(torch.int32)
        return rows.reshape(n * E, D), sel

    def _attention(self, h, L, batch, seq_idx, caches, starts, at):
        c, T, p = self.cfg, h.shape[0], f"layers.{L}.attn."
        spec, eps, ids = c.rope_for(L), c.rms_norm_eps, batch.adapter_ids
        q_resid = rmsnorm_fwd(self.linear(h, p + "q_a.", ids), self.w(p + "q_a_norm.weight"), eps)[0]
        q = rmsnorm_fwd(self.linear(q_resid, p + "q_b.", ids).view(T, c.num_heads, c.head_dim), None, eps)[0]
        q = rope_fwd(q, batch.positions, spec, check=False)
        kv = rmsnorm_fwd(self.linear(h, p + "kv.", ids), self.w(p + "kv_norm.weight"), eps)[0]
        kv = rope_fwd(kv.view(T, 1, c.head_dim), batch.positions, spec, check=False).view(T, c.head_dim)
        self.tap("attn.q", q, L)
        self.tap("attn.kv_row", kv, L)
        write_row_fwd((kv,), caches["win"][L]["row"], batch.pools["win"].slot_mapping)
        pool, picked = _pool_of(c, L), None
        if pool is not None:
            rows = self._compress(h, f"layers.{L}.compressor.", _ring(caches["rings"][0], f"c{L}."), c.rate(L),
                                  c.layer_types[L] == CSA, batch, starts, at)
            self._write_rows(rows, pool, caches[pool][self._slot[L]]["row"], batch, at)
        if c.layer_types[L] == CSA:
            picked = self._select(h, q_resid, L, batch, seq_idx, caches, starts, at)
        rows, sel = self._entries(L, batch, seq_idx, caches, picked)
        n, E = sel.shape
        cu = torch.arange(n + 1, device=self.device, dtype=torch.int32)  # each query row its own block of rows
        o, _ = sparse_attention_fwd(q, rows, sel, cu, scale=c.softmax_scale, v_dim=c.head_dim, cu_seqlens_kv=cu * E,
                                    sinks=self.w(p + "sinks"))
        o = rope_fwd(o, batch.positions, spec, conjugate=True, check=False)
        self.tap("attn.out", o, L)
        y = self.linear(grouped_o(o.reshape(T, -1), self.w(p + "o_a.weight"), c.o_groups, matmul_fwd), p + "o_b.", ids)
        self.tap("attn.o_proj", y, L)
        return y, picked

    def _norm_row(self, x, name):
        """DeepseekV4RMSNorm: the fp32 weight, one rounding."""
        return rmsnorm_fwd(x, self.w(name), self.cfg.rms_norm_eps)[0]

    def _mix(self, out, streams, post, comb):
        return hc_mix_fwd(out, streams, post, comb)

    def _moe(self, h, L, batch):
        return moe_block_fwd(self, self.moe_specs[L], h, L, batch, self._experts_lora.get(L))

    def _logits(self, streams, batch) -> torch.Tensor:
        c, rows = self.cfg, batch.logit_rows
        fn, base, scale = (self.w("hc_head." + n) for n in ("fn", "base", "scale"))
        x = hc_head_fwd(streams[rows], fn, base, scale, c.hc_eps, c.rms_norm_eps)[0]
        h = rmsnorm_fwd(x, self.w("norm.weight"), c.rms_norm_eps)[0]
        self.tap("norm", h, rows="logits")
        logits = lm_head_logits_fwd(h, self.lm_head_weight)
        self.tap("lm_head.logits", logits, rows="logits")
        return logits

    def forward(self, batch: ForwardBatch, caches):
        """-> (FP32 logits (R, V) of ``batch.logit_rows``, {"routed_experts", "routed_weights"})."""
        c = self.cfg
        T, B = batch.tokens.shape[0], batch.cu_seqlens_q.shape[0] - 1
        seq_idx = torch.repeat_interleave(torch.arange(B, device=self.device), batch.cu_seqlens_q.diff(),
                                          output_size=T)
        starts = batch.positions[batch.cu_seqlens_q[:-1].long().clamp(max=max(T - 1, 0))]
        x = self.w("embed.weight")[batch.tokens]
        streams = x[:, None].expand(T, c.hc_mult, x.shape[1]).contiguous()
        ats = {}  # eager steps build only the groups they complete; decode every token's (fixed shapes)
        if batch.max_seqlen_q > 1:
            for rate in {c.rate(L) for L in range(c.num_layers)} - {0}:
                ats[rate] = group_ends(batch.cu_seqlens_q, rate, starts)[0]
        ids_all, w_all, sels = [], [], []
        for i in range(c.num_layers):
            p = f"layers.{i}."
            post, comb, x = self._hc(streams, p + "attn_hc.")
            h = self._norm_row(x, p + "attn_norm.weight")
            self.tap("attn_norm", h, i)
            a, picked = self._attention(h, i, batch, seq_idx, caches, starts, ats.get(c.rate(i)))
            if picked is not None:
                sels.append(picked)
            streams = self._mix(a, streams, post, comb)
            post, comb, x = self._hc(streams, p + "ffn_hc.")
            h = self._norm_row(x, p + "mlp_norm.weight")
            self.tap("mlp_norm", h, i)
            y, ids, w = self._moe(h, i, batch)
            streams = self._mix(y, streams, post, comb)
            ids_all.append(ids)
            w_all.append(w)
        extras = routed_extras(ids_all, w_all)
        if INDEX_SELECTED in batch.want_extras:  # index replay: only when a request of this step asked
            extras[INDEX_SELECTED] = torch.stack(sels, 1)
        return self._logits(streams, batch), extras


def _ring_fields(prefix: str, rate: int, channels: int, overlap: bool, dtype) -> dict:
    return {prefix + k: v for k, v in compress_state_fields(rate, channels, overlap=overlap, dtype=dtype).items()}


def _ring(state: dict, prefix: str) -> dict:
    return {"ring_kv": state[prefix + "ring_kv"], "ring_gate": state[prefix + "ring_gate"]}
