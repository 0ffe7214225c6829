"""Paged KV cache: 64-token pages, per-sequence block tables, one writer.

``PAGE_SIZE`` is also the attention kernels' KV block (``BLOCK_N``): block j of
a sequence is exactly its page ``block_table[j]``, so the paged paths and the
packed training path walk the same 64-position blocks.
"""
from .block_manager import BlockManager, OutOfPages
from .op import PAGE_SIZE, allocate_kv_cache, write_kv, write_kv_fwd

__all__ = ["PAGE_SIZE", "BlockManager", "OutOfPages", "allocate_kv_cache", "write_kv", "write_kv_fwd"]
