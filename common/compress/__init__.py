"""DeepSeek-V4's KV compressors (C4 with overlap, C128 without) after the kv/gate projections: one
per-group routine for the trainer's packed form and the server's stateful form, the same bits."""
from .naive import compress_ref
from .op import (compress, compress_bwd, compress_fwd, compress_state_fields, compress_step, group_ends, ring_len,
                 visible_rows)

__all__ = ["compress", "compress_bwd", "compress_fwd", "compress_ref", "compress_state_fields", "compress_step",
           "group_ends", "ring_len", "visible_rows"]
