"""What a model folder provides, written down: a ``ModelSpec``.

A model of the zoo is its config, its weight names, its block math and its
own kernels; everything else (``models/loading.py``, ``models/base.py``,
``common/``) is shared.  Its ``__init__.py`` builds one ``SPEC`` and the
registry (``models/__init__.py``) names the module.  ``models/README.md``
walks through adding one.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModelSpec:
    """name:              the registry name (``load_pair(name)``)
    config_cls:        a frozen dataclass with ``preset(name)``, ``from_hf(dict
                       | path)``, ``to_hf(dtype) -> dict`` and ``replace(**kw)``
    presets:           {preset name: config}; "tiny" is the default
    trainer_cls:       a ``base.TrainerBase``: ``(cfg, *, device, dtype,
                       activation_checkpointing, fp8)``
    server_cls:        a ``base.ServerBase`` (the engine's ``ServeModel``):
                       ``(cfg, weights, lora_scale=, lora_adapters=)``
    vendor_server_cls: () -> the deliberately misaligned server on torch's
                       kernels (imported on demand)
    from_hf:           (source, cfg, dtype, device) -> {our name: tensor}
    to_hf:             ({our name: tensor}, cfg) -> {HF name: tensor}
    lora_from_hf, lora_to_hf: PEFT module name <-> ``layers.{i}.<projection>``
                       (an experts adapter: ``<module>:<parameter>`` <-> ``layers.{i}.moe.<gate_up|down>``)
    init_weights:      (trainer, seed) -> None, the seeded random init
    lora_param_order:  the HF experts module's parameters in registration order (PEFT's nesting of
                       their adapters; ``common/lora/peft.py``); () for a model without experts LoRA
    fp32_names:        suffixes of the tensors the model keeps FP32 in any dtype (GLM-5's router and
                       indexer weights_proj, as transformers keeps them): saved in FP32, not cast
    """

    name: str
    config_cls: type
    presets: Mapping[str, Any]
    trainer_cls: type
    server_cls: type
    vendor_server_cls: Callable[[], type]
    from_hf: Callable[..., dict]
    to_hf: Callable[..., dict]
    lora_from_hf: Callable[[str], str | None]
    lora_to_hf: Callable[[str], str]
    init_weights: Callable[..., None]
    lora_param_order: tuple[str, ...] = ()
    fp32_names: tuple[str, ...] = ()
