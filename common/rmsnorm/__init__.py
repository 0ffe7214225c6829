"""RMSNorm: plain, fused residual-add, gated (Qwen3.5 GDN) and unweighted (DeepSeek-V4's q heads), batch-invariant,
with backward; an fp32 weight beside bf16 rows rounds once (DeepSeek-V4's norms)."""
from .naive import rmsnorm_gated_ref, rmsnorm_ref, rmsnorm_residual_ref
from .op import rmsnorm, rmsnorm_bwd, rmsnorm_fwd, rmsnorm_gated, rmsnorm_residual, rmsnorm_unweighted

__all__ = [
    "rmsnorm",
    "rmsnorm_residual",
    "rmsnorm_gated",
    "rmsnorm_unweighted",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_ref",
    "rmsnorm_residual_ref",
    "rmsnorm_gated_ref",
]
