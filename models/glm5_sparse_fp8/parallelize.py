"""GLM-5's expert-parallel plan: which weights are per-expert stacks.  ``parallel/ep.py`` applies it;
the model's forward (``serve.py``) stays single-device and runs unchanged on every rank.

- ``moe.gate_up`` (E, 2I, H) and ``moe.down`` (E, H, I) of every sparse layer: split by expert, EP
  position q holding experts [q·E/EP, (q+1)·E/EP); with FP8 experts their codes and their
  ``weight_scale_inv`` (E, ·, ·) alike (each expert's 128x128 blocks are its own, so a cut between
  experts cuts no block);
- the sigmoid router's gate and correction bias, the shared expert, the dense MLP layers, MLA, the
  indexers, embedding, norms and LM head: replicated (the router's groups are of whole experts and it
  runs on every rank, so every rank knows every row's owner);
- the experts' separate LoRA adapters: replicated, each rank reading its experts' slices.
"""
from __future__ import annotations

from ...parallel.ep import EPPlan


def ep_plan(cfg) -> EPPlan:
    stacks = tuple(f"layers.{{}}.moe.{s}.{t}" for s in ("gate_up", "down") for t in ("weight", "weight_scale_inv"))
    return EPPlan(stacks=stacks, layers=cfg.sparse_layers, num_experts=cfg.n_routed_experts)
