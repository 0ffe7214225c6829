"""Toy ``ServeModel``s that use each cache-pool kind, and their no-cache
references, for the engine's pool tests (CPU, eager).

Every toy: token + position embedding, one paged-attention layer over the
"kv" pool (the real kernels: ``write_kv_fwd``, ``paged_attention_fwd``), one
layer of its kind, then the LM head.  Every op is elementwise, a fixed-order
loop, or a batch-invariant kernel, so a row's bits cannot depend on the
batch, the chunking or the cache placement, and the reference (the whole
sequence at once, no cache) gives them too:

  state   h_p = a * h_{p-1} + x_p in fp32 per channel (a recurrent state in
          a ``StatePool`` slot; a chunk from position 0 starts at zero)
  rate    every ``rate`` positions one row 0.5 * x_p of a ``RatePool``; each
          token adds the fp32 sum of the rows completed up to it, in row order
  window  attention over the last ``window`` positions of a ``WindowPool``

Each toy also returns per-token extras: "top2" (T, 2) int32, the two largest
of the first 8 hidden channels, and "score" (T,) fp32, their first value.
"""
from __future__ import annotations

import torch

from alignzoo.common.attention import attention_fwd, paged_attention_fwd
from alignzoo.common.kv_cache import PAGE_SIZE, PagedPool, RatePool, StatePool, WindowPool, write_kv_fwd
from alignzoo.common.lm_head import lm_head_logits
from alignzoo.common.matmul import matmul_fwd

H, HQ, HKV, D = 40, 2, 1, 16


class PoolToy:
    def __init__(self, kind: str, *, rate: int = 4, window: int = 100, vocab_size: int = 61, max_position: int = 2048,
                 seed: int = 0):
        g = torch.Generator().manual_seed(seed)

        def w(*shape, std):
            return (torch.randn(*shape, generator=g) * std).bfloat16()

        self.kind, self.rate, self.window = kind, rate, window
        self.vocab_size, self.max_position, self.device = vocab_size, max_position, torch.device("cpu")
        qkv = (HQ + 2 * HKV) * D
        self.weights = {"embed": w(vocab_size, H, std=1.0), "pos": w(max_position, H, std=0.5),
                        "qkv": w(qkv, H, std=H**-0.5), "o": w(H, HQ * D, std=(HQ * D) ** -0.5),
                        "qkv2": w(qkv, H, std=H**-0.5), "o2": w(H, HQ * D, std=(HQ * D) ** -0.5),
                        "decay": (torch.rand(H, generator=g) * 0.5 + 0.45).float(),
                        "lm_head": w(vocab_size, H, std=2 * H**-0.5)}

    def cache_pools(self):
        kv = {"k": (HKV, D), "v": (HKV, D)}
        pools = {"kv": PagedPool(kv, torch.bfloat16, 1)}
        if self.kind == "state":
            pools["state"] = StatePool({"h": ((H,), torch.float32)}, 1)
        elif self.kind == "rate":
            pools["c"] = RatePool({"row": (H,)}, torch.bfloat16, 1, rate=self.rate)
        elif self.kind == "window":
            pools["win"] = WindowPool(kv, torch.bfloat16, 1, window=self.window)
        return pools

    # ---------------------------------------------------------------- shared pieces
    def _embed(self, tokens, positions):
        return self.weights["embed"][tokens] + self.weights["pos"][positions]  # (T, H) bf16

    def _qkv(self, x, name):
        qkv = matmul_fwd(x, self.weights[name])  # the fixed-order matmul: CPU torch.mm is not batch-invariant
        T = x.shape[0]
        return (qkv[:, :HQ * D].reshape(T, HQ, D).contiguous(), qkv[:, HQ * D:(HQ + HKV) * D].reshape(T, HKV, D).contiguous(),
                qkv[:, (HQ + HKV) * D:].reshape(T, HKV, D).contiguous())

    def _out(self, x, o, name):
        return x + matmul_fwd(o.reshape(x.shape[0], HQ * D), self.weights[name])

    def _head(self, x):
        top = x[:, :8].float().topk(2, dim=-1)
        return {"top2": top.indices.to(torch.int32), "score": top.values[:, 0].contiguous()}

    # ---------------------------------------------------------------- the server
    def forward(self, batch, caches):
        x = self._embed(batch.tokens, batch.positions)
        kv = batch.pools["kv"]
        q, k, v = self._qkv(x, "qkv")
        layer = caches["kv"][0]
        write_kv_fwd(k, v, layer["k"], layer["v"], kv.slot_mapping)
        o, _ = paged_attention_fwd(q, layer["k"], layer["v"], batch.cu_seqlens_q, batch.seq_lens, kv.block_table,
                                   max_seqlen_q=batch.max_seqlen_q)
        x = self._out(x, o, "o")
        x = getattr(self, f"_serve_{self.kind}")(x, batch, caches)
        extras = self._head(x)
        return lm_head_logits(x[batch.logit_rows].contiguous(), self.weights["lm_head"]), extras

    def _serve_state(self, x, batch, caches):
        st = caches["state"][0]["h"]  # (S, H) fp32
        cu, slots, T = batch.cu_seqlens_q.long(), batch.state_slots, x.shape[0]
        qlen, B = cu[1:] - cu[:-1], slots.shape[0]
        first = batch.positions[cu[:-1].clamp(max=T - 1)]
        h = torch.where((first > 0)[:, None], st[slots.clamp(min=0)], torch.zeros(B, H))  # a chunk from 0 reads none
        out = torch.zeros(T, H)
        for j in range(batch.max_seqlen_q):
            on = qlen > j
            idx = (cu[:-1] + j).clamp(max=T - 1)
            h = torch.where(on[:, None], self.weights["decay"] * h + x[idx].float(), h)
            out[idx[on]] = h[on]
        keep = slots >= 0
        st[slots[keep]] = h[keep]
        return x + out.bfloat16()

    def _serve_rate(self, x, batch, caches):
        rows = caches["c"][0]["row"].flatten(0, 1)  # (P * 64, H)
        c = batch.pools["c"]
        write = c.slot_mapping >= 0
        rows[c.slot_mapping[write]] = (x[write].float() * 0.5).bfloat16()  # rows first: later tokens of the chunk read them
        cu, T = batch.cu_seqlens_q.long(), x.shape[0]
        b_of = torch.searchsorted(cu[1:], torch.arange(T), right=True)
        n = (batch.positions + 1) // self.rate  # rows completed up to each token
        acc = torch.zeros(T, H)
        for r in range(int(n.max()) if T else 0):
            page = c.block_table[b_of, r // PAGE_SIZE].long().clamp(min=0)
            acc = torch.where((r < n)[:, None], acc + rows[page * PAGE_SIZE + r % PAGE_SIZE].float(), acc)
        return x + acc.bfloat16()

    def _serve_window(self, x, batch, caches):
        q, k, v = self._qkv(x, "qkv2")
        layer, win = caches["win"][0], batch.pools["win"]
        write_kv_fwd(k, v, layer["k"], layer["v"], win.slot_mapping)
        o, _ = paged_attention_fwd(q, layer["k"], layer["v"], batch.cu_seqlens_q, batch.seq_lens, win.block_table,
                                   max_seqlen_q=batch.max_seqlen_q, window=self.window)
        return self._out(x, o, "o2")

    # ---------------------------------------------------------------- the reference: the whole sequence, no cache
    def reference(self, seq: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (logits (L, V) fp32 of every position, extras {name: (L, ...)})."""
        L = len(seq)
        tokens, positions = torch.tensor(seq), torch.arange(L)
        cu = torch.tensor([0, L], dtype=torch.int32)
        x = self._embed(tokens, positions)
        q, k, v = self._qkv(x, "qkv")
        x = self._out(x, attention_fwd(q, k, v, cu)[0], "o")
        if self.kind == "state":
            h, out = torch.zeros(H), torch.zeros(L, H)
            for p in range(L):
                h = self.weights["decay"] * h + x[p].float()
                out[p] = h
            x = x + out.bfloat16()
        elif self.kind == "rate":
            rows = (x.float() * 0.5).bfloat16()
            out = torch.stack([_row_sum(rows, p, self.rate) for p in range(L)]) if L else torch.zeros(0, H)
            x = x + out.bfloat16()
        elif self.kind == "window":
            q, k, v = self._qkv(x, "qkv2")
            x = self._out(x, attention_fwd(q, k, v, cu, window=self.window)[0], "o2")
        return lm_head_logits(x.contiguous(), self.weights["lm_head"]), self._head(x)


def _row_sum(rows: torch.Tensor, p: int, rate: int) -> torch.Tensor:
    """The fp32 sum, in row order, of the rows completed up to position p
    (row r is completed at position (r + 1) * rate - 1, from the token there)."""
    acc = torch.zeros(rows.shape[1])
    for r in range((p + 1) // rate):
        acc = acc + rows[(r + 1) * rate - 1].float()
    return acc
