"""Torch's own fast attention over the paged cache: the vendor baseline.

Neither batch-invariant nor the trainer's bits: this is what a conventional
serving stack runs, for the vendor servers (``models/*/serve_vendor.py``) that
the aligned engines are measured against and that show the mismatch.  On CUDA
it takes the standard fast paths of the device's torch:

- prefill (packed new tokens): flash varlen (``aten._flash_attention_forward``,
  causal, bottom-right aligned, GQA native) over the new rows' own k/v when no
  sequence has cached keys, else over each sequence's keys gathered from its
  pages (chunked prefill: one gather per layer of the keys it reads, no more);
- decode (one new token per sequence): compiled ``flex_attention`` whose block
  mask lists each sequence's pages in place in the cache (page 64) with a
  mask_mod cutting its last page at seq_len: it reads only the cached pages,
  and its shapes are static, so it captures into the decode CUDA graph.

On the CPU (tests only) both are SDPA over K/V gathered over the whole block
table with an explicit causal mask.

Shapes: T new tokens of B sequences, Hq / Hkv heads of D channels, P pages of
S = PAGE_SIZE slots, W block-table columns.
"""
from __future__ import annotations

import importlib

import torch
import torch.nn.functional as F

from ..kv_cache import PAGE_SIZE

_FLEX = None


def _flex():
    """``torch.compile(flex_attention)``, once: one compile per decode shape
    (a graph bucket), so dynamo's recompile limit is raised to keep every
    bucket on the fused kernel instead of the unfused fallback."""
    global _FLEX
    if _FLEX is None:
        from torch.nn.attention.flex_attention import flex_attention

        dynamo_config = importlib.import_module("torch._dynamo").config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 256))
                break
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


class VendorAttention:
    """One forward's attention plan, made once and applied at every layer:
    the host reads (key counts of a prefill) and the decode block mask are
    built here, not per layer.

    cu_seqlens_q (B + 1,) int32; seq_lens (B,) int32 cached + new tokens;
    block_table (B, W) int32; max_seqlen_q: host int (1 for decode);
    num_pages: P of the caches; scale: None for D^-0.5."""

    def __init__(self, cu_seqlens_q, seq_lens, block_table, max_seqlen_q: int, num_pages: int, *,
                 n_tokens: int, scale: float | None = None):
        self.cu_q, self.seq_lens, self.block_table, self.max_q = cu_seqlens_q, seq_lens, block_table, max_seqlen_q
        self.scale = scale
        dev, B = seq_lens.device, seq_lens.shape[0]
        self.kind = "cpu" if dev.type != "cuda" else "decode" if max_seqlen_q == 1 and n_tokens == B else "prefill"
        if self.kind == "decode":
            self.mask = _decode_block_mask(seq_lens, block_table, num_pages)
        elif self.kind == "prefill":
            lens = seq_lens.long()
            tk = int(lens.sum())  # the one host read of an eager prefill, as a vendor stack's metadata has it
            self.slots = None  # no cached keys: the new rows are all the keys
            self.cu_k, self.max_k = cu_seqlens_q, max_seqlen_q
            if tk != n_tokens:
                self.cu_k = torch.zeros(B + 1, dtype=torch.int32, device=dev)
                self.cu_k[1:] = lens.cumsum(0)
                b_of = torch.repeat_interleave(torch.arange(B, device=dev), lens, output_size=tk)
                pos = torch.arange(tk, device=dev) - self.cu_k[b_of].long()
                self.slots = block_table.long()[b_of, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
                self.max_k = int(lens.max())

    def __call__(self, q, k, v, k_cache, v_cache) -> torch.Tensor:
        """q: (T, Hq, D); k, v: (T, Hkv, D) the new tokens' own, already
        written to k_cache, v_cache (P, S, Hkv, D) -> (T, Hq, D)."""
        if self.kind == "decode":
            B, Hq, D = q.shape
            P, S, Hkv, _ = k_cache.shape
            kf = k_cache.view(1, P * S, Hkv, D).transpose(1, 2)  # (1, Hkv, P * S, D): the pages in place
            vf = v_cache.view(1, P * S, Hkv, D).transpose(1, 2)
            return _flex()(q.unsqueeze(2), kf, vf, block_mask=self.mask, scale=self.scale,
                           enable_gqa=True).squeeze(2)
        if self.kind == "prefill":
            if self.slots is not None:
                k, v = k_cache.flatten(0, 1)[self.slots], v_cache.flatten(0, 1)[self.slots]
            return torch.ops.aten._flash_attention_forward(q, k, v, self.cu_q, self.cu_k, self.max_q, self.max_k,
                                                           0.0, True, False, scale=self.scale)[0]
        return _gathered_sdpa(q, k_cache, v_cache, self.cu_q, self.seq_lens, self.block_table, self.max_q, self.scale)


def _decode_block_mask(seq_lens, block_table, num_pages: int):
    """flex's BlockMask for one query per sequence over the cache viewed as
    one (P * S)-key sequence: row b lists its pages (block size S = a page),
    and the mask_mod cuts its last page at seq_len."""
    from torch.nn.attention.flex_attention import BlockMask

    B, S, P = seq_lens.shape[0], PAGE_SIZE, num_pages
    lens = seq_lens.long()
    kv_num = ((lens + S - 1) // S).to(torch.int32).view(B, 1, 1)
    # one column per physical page (flex checks P * S <= columns * S); columns past kv_num are never read
    kv_idx = torch.zeros(B, 1, 1, P, dtype=torch.int32, device=seq_lens.device)
    w = min(block_table.shape[1], P)
    kv_idx[:, 0, 0, :w] = block_table[:, :w]
    last = lens - 1
    last_page = block_table.long().gather(1, (last // S)[:, None]).squeeze(1)
    last_off = last % S

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx // S != last_page[b]) | (kv_idx % S <= last_off[b])

    return BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(128, S), mask_mod=mask_mod, seq_lengths=(1, P * S),
                                    compute_q_blocks=False)


def _gathered_sdpa(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, max_seqlen_q, scale):
    """SDPA over each sequence's K/V gathered over the whole block table: the
    G = Hq / Hkv query heads of a kv head are folded into the query length,
    so SDPA takes the mask without K/V repeated G times."""
    T, Hq, D = q.shape
    B, Lq, dev = seq_lens.shape[0], max_seqlen_q, q.device
    Hkv = k_cache.shape[2]
    G = Hq // Hkv
    pages = block_table.long()
    kpos = torch.arange(pages.shape[1] * PAGE_SIZE, device=dev)
    t = torch.arange(T, device=dev)
    b_of = torch.searchsorted(cu_seqlens_q[1:].long(), t, right=True).clamp(max=B - 1)
    j_of = t - cu_seqlens_q[b_of].long()
    q_len = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    qpos = (seq_lens.long() - q_len)[:, None] + torch.arange(Lq, device=dev)[None]  # (B, Lq)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # (B, Lq, Lk): keys past seq_len are after qpos
    K = k_cache[pages].flatten(1, 2).transpose(1, 2)  # (B, Hkv, Lk, D)
    V = v_cache[pages].flatten(1, 2).transpose(1, 2)
    Q = q.new_zeros(B, Lq, Hq, D)
    Q[b_of, j_of] = q
    Qf = Q.reshape(B, Lq, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Lq * G, D)
    m = mask[:, None, :, None, :].expand(B, 1, Lq, G, mask.shape[-1]).reshape(B, 1, Lq * G, mask.shape[-1])
    o = F.scaled_dot_product_attention(Qf, K, V, attn_mask=m, scale=scale)  # (B, Hkv, Lq * G, D)
    o = o.reshape(B, Hkv, Lq, G, D).permute(0, 2, 1, 3, 4).reshape(B, Lq, Hq, D)
    return o[b_of, j_of]
