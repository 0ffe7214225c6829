"""Hugging Face checkpoint loading and saving (name maps per model)."""
from .checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    HFCheckpoint,
    check_model_type,
    read_hf_config,
    save_hf_checkpoint,
)
from .formats import (FORMATS, FP8_BLOCK128, FP8_BLOCK128_E8M0, MXFP4, DequantizedSource, QuantRule, Stored,
                      WeightFormat, plan_quantization, quantize_for_save)
from .name_map import Fuse, NameMap, OneOf, Stack, WeightMismatchError, open_source

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "FORMATS",
    "FP8_BLOCK128",
    "FP8_BLOCK128_E8M0",
    "MXFP4",
    "CheckpointError",
    "DequantizedSource",
    "Fuse",
    "HFCheckpoint",
    "NameMap",
    "OneOf",
    "QuantRule",
    "Stack",
    "Stored",
    "WeightFormat",
    "WeightMismatchError",
    "check_model_type",
    "open_source",
    "plan_quantization",
    "quantize_for_save",
    "read_hf_config",
    "save_hf_checkpoint",
]
