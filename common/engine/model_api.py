"""What the engine needs from a model's serving module, and what it hands it.

The engine is model-agnostic: it schedules requests, owns the paged KV block
manager and samples, and asks the model for one thing — FP32 logits of chosen
rows of a packed batch of new tokens.  A model's ``serve.py`` implements
``ServeModel``; the same batch layout serves prefill, chunked prefill, decode
and teacher-forced scoring, so the model has one forward.

Shapes: T new tokens of B sequences, packed sequence after sequence; W pages
per block-table row; R logit rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch


@dataclass
class ForwardBatch:
    """One engine step's packed batch (all tensors on the model's device).

    tokens:       (T,) int64   new token ids
    positions:    (T,) int64   their positions in their sequences
    cu_seqlens_q: (B + 1,) int32  offsets of each sequence's new tokens
    seq_lens:     (B,) int32   cached + new tokens per sequence (>= its new tokens)
    block_table:  (B, W) int32 page of each 64-position block (unused entries 0)
    slot_mapping: (T,) int64   cache slot page * 64 + offset of each new token,
                               -1 for a padding token (nothing written)
    logit_rows:   (R,) int64   rows of ``tokens`` whose next-token logits are wanted
    adapter_ids:  (T,) int64   LoRA adapter of each token's request: an index
                               into the model's ``adapter_names``, -1 for none
                               (the base model; padding rows too)
    max_seqlen_q: int          max new tokens of one sequence (1 for decode)
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    logit_rows: torch.Tensor
    adapter_ids: torch.Tensor
    max_seqlen_q: int


@dataclass(frozen=True)
class KVCacheSpec:
    """Per-layer paged cache shape: each layer holds k and v of
    ``(num_pages, PAGE_SIZE, num_kv_heads, head_dim)`` in ``dtype``."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def bytes_per_page(self) -> int:
        from ..kv_cache import PAGE_SIZE

        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * PAGE_SIZE * self.num_kv_heads * self.head_dim * item


@runtime_checkable
class ServeModel(Protocol):
    """A model's serving module as the engine sees it.

    ``forward`` must not read the batch's values on the host (no ``.item()``,
    no ``.tolist()``): decode steps are captured into CUDA graphs and replayed
    with new values written into the same input tensors.  It must give row r
    of its output the same bits whatever else is in the batch (the contract).

    A model that serves several LoRA adapters in one batch also has
    ``adapter_names: tuple[str, ...]``: the names requests may ask for, in the
    order ``ForwardBatch.adapter_ids`` indexes them (absent: none).
    """

    vocab_size: int
    max_position: int
    device: torch.device

    def kv_cache_spec(self) -> KVCacheSpec: ...

    def allocate_kv_cache(self, num_pages: int) -> Any:
        """An opaque per-model cache object for ``num_pages`` pages."""
        ...

    def forward(self, batch: ForwardBatch, kv_cache: Any) -> torch.Tensor:
        """Write the new tokens' k/v into ``kv_cache`` and return the FP32
        logits ``(R, vocab_size)`` of ``batch.logit_rows``."""
        ...
