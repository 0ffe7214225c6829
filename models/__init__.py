"""Per-architecture aligned pairs (one folder per model: config, train, serve).

A model is listed only once its trainer/server pair keeps the contract; each
entry names the module whose ``load(checkpoint, config, device, dtype, **kw)``
builds its ``Pair``.
"""
from __future__ import annotations

import importlib

_REGISTRY: dict[str, str] = {
    "qwen3": "alignzoo.models.qwen3",
    "qwen35_gdn": "alignzoo.models.qwen35_gdn",
    "glm5_sparse_fp8": "alignzoo.models.glm5_sparse_fp8",
    "deepseek_v4_mhc_mxfp4": "alignzoo.models.deepseek_v4_mhc_mxfp4",
}


def available_models() -> list[str]:
    return sorted(_REGISTRY)


def model_module(name: str):
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; known models: {', '.join(available_models())}")
    return importlib.import_module(_REGISTRY[name])
