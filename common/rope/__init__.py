"""Rotary position embedding: FP32 CPU-built table, FP32 rotation, one rounding."""
from .naive import rope_ref
from .op import rope, rope_bwd, rope_fwd
from .table import (RopeSpec, Yarn, build_table, clear_rope_tables, inv_freq_and_attention_factor, rope_parameters_hf,
                    rope_table)

__all__ = [
    "RopeSpec",
    "Yarn",
    "build_table",
    "clear_rope_tables",
    "inv_freq_and_attention_factor",
    "rope",
    "rope_bwd",
    "rope_fwd",
    "rope_parameters_hf",
    "rope_ref",
    "rope_table",
]
