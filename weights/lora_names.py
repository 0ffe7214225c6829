"""Our LoRA adapter names <-> the PEFT module names of a transformers checkpoint, for a model's
``lora_to_hf`` / ``lora_from_hf``: ``layers.{i}.<projection>`` <-> ``model.layers.{i}.<module>``, and an
experts adapter (PEFT's target_parameters) ``layers.{i}.<experts module>.<gate_up|down>`` <->
``model.layers.{i}.<module>:<parameter>``."""
from __future__ import annotations

from collections.abc import Mapping


class LoraNames:
    """``targets``: {HF projection: its module under a layer}; ``param_slots``: {HF parameter under a layer:
    (our experts module, "gate_up" or "down")}; ``prefixes``: where a checkpoint keeps the layers (the first
    is what ``to_hf`` writes; a multimodal checkpoint's language model sits under another)."""

    def __init__(self, targets: Mapping[str, str], param_slots: Mapping[str, tuple[str, str]] | None = None,
                 prefixes: tuple[str, ...] = ("model.",)):
        self.targets, self.param_slots, self.prefixes = dict(targets), dict(param_slots or {}), prefixes

    def to_hf(self, name: str) -> str:
        _, i, *rest = name.split(".")
        p = self.prefixes[0]
        if len(rest) == 2:
            hf = next(h for h, slot in self.param_slots.items() if slot == tuple(rest))
            module, param = hf.rsplit(".", 1)
            return f"{p}layers.{i}.{module}:{param}"
        return f"{p}layers.{i}.{self.targets[rest[0]]}"

    def from_hf(self, module: str) -> str | None:
        """None for a module that is no target of this model."""
        for prefix in self.prefixes:
            if not module.startswith(prefix + "layers."):
                continue
            rest = module[len(prefix) + len("layers."):].split(".", 1)
            if len(rest) != 2 or not rest[0].isdigit():
                return None
            if ":" in rest[1]:
                slot = self.param_slots.get(rest[1].replace(":", "."))
                return None if slot is None else f"layers.{int(rest[0])}.{slot[0]}.{slot[1]}"
            proj = next((p for p, m in self.targets.items() if m == rest[1]), None)
            return None if proj is None else f"layers.{int(rest[0])}.{proj}"
        return None
