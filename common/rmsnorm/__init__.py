"""RMSNorm: plain, fused residual-add and gated (Qwen3.5 GDN), batch-invariant, with backward."""
from .naive import rmsnorm_gated_ref, rmsnorm_ref, rmsnorm_residual_ref
from .op import rmsnorm, rmsnorm_bwd, rmsnorm_fwd, rmsnorm_gated, rmsnorm_residual

__all__ = [
    "rmsnorm",
    "rmsnorm_residual",
    "rmsnorm_gated",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_ref",
    "rmsnorm_residual_ref",
    "rmsnorm_gated_ref",
]
