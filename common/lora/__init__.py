"""LoRA adapters on the batch-invariant matmul: merged, separate and multi-adapter
serving modes with one body for trainer and server, seeded init, PEFT-layout I/O."""
from .adapter import LoRAAdapter, collect_adapters, init_lora_weights, stack_adapters
from .cache import MergedLoRACache
from .naive import lora_linear_ref, lora_merge_ref
from .op import (
    lora_add,
    lora_add_fwd,
    lora_add_multi,
    lora_add_multi_fwd,
    lora_linear_multi,
    lora_linear_multi_fwd,
    lora_linear_separate,
    lora_linear_separate_fwd,
    lora_merge,
    lora_merge_fwd,
)
from .peft import LoRAConfig, load_peft_adapter, save_peft_adapter

__all__ = [
    "lora_merge", "lora_merge_fwd", "MergedLoRACache",
    "lora_linear_separate", "lora_linear_separate_fwd", "lora_add", "lora_add_fwd",
    "lora_linear_multi", "lora_linear_multi_fwd", "lora_add_multi", "lora_add_multi_fwd",
    "init_lora_weights", "LoRAAdapter", "collect_adapters", "stack_adapters",
    "LoRAConfig", "save_peft_adapter", "load_peft_adapter",
    "lora_linear_ref", "lora_merge_ref",
]
