"""Qwen3's tensor-parallel plan: how each server weight shards.  ``parallel/tp.py`` applies it; the
model's forward (``serve.py``) stays single-device and runs unchanged on every rank with the config
``local_config`` returns (its share of the heads and of the MLP width).

- ``qkv``: column-parallel by heads, each of q, k, v split over the ranks (a k/v head replicated where
  the ranks outnumber the k/v heads, so a rank's q heads always find their GQA group beside them);
- ``o``: row-parallel, its K laid out by q head as the attention output arrives;
- ``gate_up``: column-parallel, gate and up each split (SwiGLU pairs gate column j with up column j);
- ``down``: row-parallel over the MLP width;
- ``lm_head``: vocabulary-sharded (a tied head shards a copy of the embedding's rows);
- the embedding and every norm weight: replicated.
"""
from __future__ import annotations

from ...parallel.tp import Column, Row, TPPlan, Vocab, unit_range


def local_config(cfg, tp: int):
    """The config one rank's forward sees: Hq / tp q heads, max(Hkv / tp, 1) k/v heads, I / tp MLP columns."""
    return cfg.replace(
        num_heads=_units(cfg.num_heads, tp, "q heads"),
        num_kv_heads=_units(cfg.num_kv_heads, tp, "k/v heads"),
        intermediate_size=_units(cfg.intermediate_size, tp, "intermediate_size"),
    )


def _units(n: int, tp: int, what: str) -> int:
    lo, hi = unit_range(n, tp, 0, what)
    return hi - lo


def tp_plan(cfg) -> TPPlan:
    Hq, Hkv, D, I = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return TPPlan(
        weights={
            "layers.{}.qkv.weight": Column(((Hq, D, "q heads"), (Hkv, D, "k/v heads"), (Hkv, D, "k/v heads"))),
            "layers.{}.o.weight": Row(((Hq, D, "q heads"),)),
            "layers.{}.gate_up.weight": Column(((I, 1, "intermediate_size"), (I, 1, "intermediate_size"))),
            "layers.{}.down.weight": Row(((I, 1, "intermediate_size"),)),
            "lm_head.weight": Vocab(),
        },
        num_layers=cfg.num_layers,
        local_config=local_config,
    )
