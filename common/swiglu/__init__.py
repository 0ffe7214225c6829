"""SwiGLU: FP32 SiLU(gate) * up with one rounding, optional DeepSeek-V4 clamp, with backward."""
from .naive import swiglu_ref
from .op import swiglu, swiglu_bwd, swiglu_fwd, swiglu_gate_up

__all__ = ["swiglu", "swiglu_gate_up", "swiglu_fwd", "swiglu_bwd", "swiglu_ref"]
