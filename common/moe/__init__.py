"""Mixture of experts: routers whose selections and weights do not depend on
the batch, routed experts whose token arithmetic does not depend on how many
tokens each expert got (Triton grouped kernels on CUDA, element-wise dots on
the CPU) in bf16, FP8 (GLM-5) and MXFP4 (DeepSeek-V4, computed packed), the
combine of routed and shared parts, and router replay."""
from .naive import experts_fp8_ref, experts_ref
from .op import (
    Fp8ExpertsCache,
    dequantize_experts_fp8,
    dequantize_experts_mxfp4,
    experts_fp8_fwd,
    experts_fwd,
    experts_mxfp4_fwd,
    moe_combine,
    moe_experts,
    moe_experts_fp8,
    moe_experts_mxfp4,
    quantize_experts_fp8,
    quantize_experts_mxfp4,
)
from .router import (
    EXPERT_SHAPES,
    ExpertShape,
    hash_route,
    hash_route_fwd,
    router_replay,
    router_weights,
    router_weights_fwd,
    sigmoid_topk,
    sigmoid_topk_fwd,
    softmax_topk,
    softmax_topk_fwd,
    sqrtsoftplus_topk,
    sqrtsoftplus_topk_fwd,
)
from .router_naive import hash_route_ref, router_weights_ref, sigmoid_topk_ref, softmax_topk_ref, sqrtsoftplus_topk_ref

__all__ = [
    "EXPERT_SHAPES",
    "ExpertShape",
    "Fp8ExpertsCache",
    "dequantize_experts_fp8",
    "dequantize_experts_mxfp4",
    "experts_fp8_fwd",
    "experts_fp8_ref",
    "experts_fwd",
    "experts_mxfp4_fwd",
    "experts_ref",
    "hash_route",
    "hash_route_fwd",
    "hash_route_ref",
    "moe_combine",
    "moe_experts",
    "moe_experts_fp8",
    "moe_experts_mxfp4",
    "quantize_experts_fp8",
    "quantize_experts_mxfp4",
    "router_replay",
    "router_weights",
    "router_weights_fwd",
    "router_weights_ref",
    "sigmoid_topk",
    "sigmoid_topk_fwd",
    "sigmoid_topk_ref",
    "softmax_topk",
    "softmax_topk_fwd",
    "softmax_topk_ref",
    "sqrtsoftplus_topk",
    "sqrtsoftplus_topk_fwd",
    "sqrtsoftplus_topk_ref",
]
