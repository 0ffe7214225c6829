"""q/k RMSNorm + RoPE + paged KV-cache write in one launch (the server's attention prologue)."""
from .naive import qk_norm_rope_ref
from .op import qk_norm_rope_kv, qk_norm_rope_kv_fwd

__all__ = ["qk_norm_rope_kv", "qk_norm_rope_kv_fwd", "qk_norm_rope_ref"]
