"""A toy ``ServeModel`` for the engine tests, built from the real kernels.

Token + learned position embedding, ``num_layers`` of [qkv projection ->
paged attention (write_kv_fwd, paged_attention_fwd) -> output projection,
residual], then the LM head.  bf16, odd sizes (vocab 97, hidden 48, 3 query
heads over 1 kv head of 16).  Every op is batch-invariant, so the engine's
bitwise promises are checked against real kernels, not a mock.  ``adapters``
names LoRA adapters on the qkv projection (ranks 3, 5, 3, ...), served per
token by ``batch.adapter_ids`` (``lora_add_multi_fwd``).
"""
from __future__ import annotations

import torch

from alignzoo.common.attention import paged_attention_fwd
from alignzoo.common.engine import ForwardBatch
from alignzoo.common.kv_cache import PagedPool, write_kv_fwd
from alignzoo.common.lm_head import lm_head_logits
from alignzoo.common.lora import lora_add_multi_fwd
from alignzoo.common.matmul import matmul_fwd


class ToyServeModel:
    def __init__(self, *, vocab_size=97, hidden=48, num_heads=3, num_kv_heads=1, head_dim=16, num_layers=2,
                 max_position=2048, device="cpu", dtype=torch.bfloat16, seed=0, adapters=()):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, std):
            return (torch.randn(*shape, generator=g) * std).to(dtype).to(device)

        self.vocab_size, self.max_position, self.device = vocab_size, max_position, torch.device(device)
        self.num_heads, self.num_kv_heads, self.head_dim, self.dtype = num_heads, num_kv_heads, head_dim, dtype
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        self.embed = w(vocab_size, hidden, std=1.0)  # (V, H)
        self.pos_embed = w(max_position, hidden, std=0.5)  # (P, H)
        self.layers = [(w(q + 2 * kv, hidden, std=hidden**-0.5), w(hidden, q, std=q**-0.5))
                       for _ in range(num_layers)]  # wqkv (q+2kv, H), wo (H, q)
        # std 2/sqrt(H): logits of a few units, so top-k/p/min-p cut real tails
        self.lm_head = w(vocab_size, hidden, std=2 * hidden**-0.5)  # (V, H)
        self.adapter_names = tuple(adapters)
        ranks = [(3, 5)[j % 2] for j in range(len(adapters))]
        # per layer: ([A_j (r_j, H)], [B_j (q+2kv, r_j)]); scales alpha / r with alpha 8
        self.lora = [([w(r, hidden, std=hidden**-0.5) for r in ranks], [w(q + 2 * kv, r, std=r**-0.5) for r in ranks])
                     for _ in range(num_layers)]
        self.lora_scales = [8 / r for r in ranks]
        self.weights = {"embed": self.embed, "pos_embed": self.pos_embed, "lm_head": self.lm_head}
        self.weights |= {f"layers.{i}.{n}": t for i, ws in enumerate(self.layers) for n, t in zip(("qkv", "o"), ws)}

    def cache_pools(self):
        return {"kv": PagedPool({"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.head_dim)},
                                self.dtype, len(self.layers))}

    def forward(self, batch: ForwardBatch, caches) -> torch.Tensor:
        """-> (R, V) fp32 logits of ``batch.logit_rows``."""
        T = batch.tokens.shape[0]
        hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        x = self.embed[batch.tokens] + self.pos_embed[batch.positions]  # (T, H)
        kv = batch.pools["kv"]
        for (wqkv, wo), (a_n, b_n), layer in zip(self.layers, self.lora, caches["kv"]):
            k_cache, v_cache = layer["k"], layer["v"]
            qkv = matmul_fwd(x, wqkv)  # (T, (hq + 2 hkv) d)
            if a_n:
                qkv = lora_add_multi_fwd(qkv, x, batch.adapter_ids, a_n, b_n, self.lora_scales)
            q = qkv[:, : hq * d].reshape(T, hq, d).contiguous()
            k = qkv[:, hq * d : (hq + hkv) * d].reshape(T, hkv, d).contiguous()
            v = qkv[:, (hq + hkv) * d :].reshape(T, hkv, d).contiguous()
            write_kv_fwd(k, v, k_cache, v_cache, kv.slot_mapping)
            o, _ = paged_attention_fwd(q, k_cache, v_cache, batch.cu_seqlens_q, batch.seq_lens, kv.block_table,
                                       max_seqlen_q=batch.max_seqlen_q)  # (T, hq, d)
            x = x + matmul_fwd(o.reshape(T, hq * d), wo)
        return lm_head_logits(x[batch.logit_rows].contiguous(), self.lm_head)  # (R, V) fp32
