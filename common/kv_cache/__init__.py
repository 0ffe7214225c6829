"""Cache pools (paged, at a rate, windowed, per-sequence state) behind one
manager; the paged KV cache: 64-token pages, per-sequence block tables, one writer.

``PAGE_SIZE`` is also the attention kernels' KV block (``BLOCK_N``): block j of
a sequence is exactly its page ``block_table[j]``, so the paged paths and the
packed training path walk the same 64-position blocks.
"""
from .block_manager import BlockManager, OutOfPages, StateSlots, WindowManager
from .pools import CacheManager, PagedPool, PoolLimits, RatePool, StatePool, WindowPool
from .op import PAGE_SIZE, allocate_kv_cache, write_kv, write_kv_fwd, write_row, write_row_fwd

__all__ = ["PAGE_SIZE", "BlockManager", "CacheManager", "OutOfPages", "PagedPool", "PoolLimits", "RatePool",
           "StatePool", "StateSlots", "WindowManager", "WindowPool", "allocate_kv_cache", "write_kv", "write_kv_fwd",
           "write_row", "write_row_fwd"]
