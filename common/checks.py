"""Registry of the primitives' ladder checks, used by ``alignzoo check``.

Each entry names a module whose ``ladder(device)`` returns a list of
``RungResult`` (rung 1, rung 2 and an accuracy row against float64).
"""
from __future__ import annotations

import importlib

import torch

from .ladder import RungResult

PRIMITIVES: dict[str, str] = {
    "matmul": "alignzoo.common.matmul.checks",
    "rmsnorm": "alignzoo.common.rmsnorm.checks",
    "rope": "alignzoo.common.rope.checks",
    "qk_norm_rope": "alignzoo.common.qk_norm_rope.checks",
    "swiglu": "alignzoo.common.swiglu.checks",
    "lm_head": "alignzoo.common.lm_head.checks",
    "sampling": "alignzoo.common.sampling.checks",
    "tree": "alignzoo.common.tree.checks",
    "attention": "alignzoo.common.attention.checks",
    "fp8": "alignzoo.common.fp8.checks",
    "lora": "alignzoo.common.lora.checks",
    "moe": "alignzoo.common.moe.checks",
    "gdn": "alignzoo.common.gdn.checks",
    "mhc": "alignzoo.common.mhc.checks",
    "compress": "alignzoo.common.compress.checks",
}


def available_primitives() -> list[str]:
    out = []
    for name, mod in PRIMITIVES.items():
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith(mod.rsplit(".", 1)[0]):
                continue
            raise
        out.append(name)
    return out


def run_primitive(name: str, device: torch.device) -> list[RungResult]:
    if name not in PRIMITIVES:
        raise KeyError(f"unknown primitive {name!r}; known: {', '.join(PRIMITIVES)}")
    return importlib.import_module(PRIMITIVES[name]).ladder(device)
