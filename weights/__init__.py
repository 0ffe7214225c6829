"""Hugging Face checkpoint loading and saving (name maps per model)."""
from .checkpoint import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    HFCheckpoint,
    check_model_type,
    read_hf_config,
    save_hf_checkpoint,
)
from .name_map import Fuse, NameMap, OneOf, Stack, WeightMismatchError, open_source

__all__ = [
    "DEFAULT_MAX_SHARD_BYTES",
    "CheckpointError",
    "Fuse",
    "HFCheckpoint",
    "NameMap",
    "OneOf",
    "Stack",
    "WeightMismatchError",
    "check_model_type",
    "open_source",
    "read_hf_config",
    "save_hf_checkpoint",
]
