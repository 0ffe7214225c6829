"""Qwen3.5-MoE's expert-parallel plan: which weights are per-expert stacks.  ``parallel/ep.py`` applies
it; the model's forward (``serve.py``) stays single-device and runs unchanged on every rank.

- ``moe.gate_up`` (E, 2I, H) and ``moe.down`` (E, H, I) of every layer: split by expert, EP position
  q holding experts [q·E/EP, (q+1)·E/EP);
- the router's gate (E, H), the shared expert and its sigmoid gate, attention, GDN, embedding, norms
  and LM head: replicated (the router runs on every rank, so every rank knows every row's owner);
- the experts' separate LoRA adapters: replicated, each rank reading its experts' slices.
"""
from __future__ import annotations

from ...parallel.ep import EPPlan


def ep_plan(cfg) -> EPPlan:
    return EPPlan(stacks=("layers.{}.moe.gate_up.weight", "layers.{}.moe.down.weight"),
                  layers=tuple(range(cfg.num_layers)), num_experts=cfg.num_experts)
