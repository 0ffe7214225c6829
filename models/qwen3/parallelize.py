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

``cp_plan``: the trainer's context-parallel plan (``parallel/cp.py``): whole q heads and GQA groups per
position, and the functions of ``train.py`` that read a parameter, each routed to its owner's replay.

``pp_plan``: the trainer's pipeline plan (``parallel/pp.py``): contiguous layer ranges per stage, the
embedding on the first, the final norm and LM head on the last, the pair (x, residual) crossing.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...parallel.cp import CPPlan, autograd_dw
from ...parallel.pp import PPPlan
from ...parallel.tp import Column, Row, TPPlan, Vocab, unit_range
from . import train


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


# --- context parallelism (the trainer) --------------------------------------------------------------------


def _rmsnorm_route(fn, attach):
    def routed(x, w, eps=1e-6):
        return attach(fn(x, w, eps), w, x, autograd_dw(lambda x_, w_: fn(x_, w_, eps)))

    return routed


def _rmsnorm_residual_route(fn, attach):
    """The fused norm's dw is the plain norm's on the new residual (``rmsnorm_bwd``: dw = dw_sum(dy · n))."""

    def routed(x, residual, w, eps=1e-6):
        y, new_residual = fn(x, residual, w, eps)
        return attach(y, w, new_residual, autograd_dw(lambda x_, w_: rmsnorm(x_, w_, eps))), new_residual

    return routed


def cp_plan(cfg) -> CPPlan:
    """Qwen3's context-parallel plan (``parallel/cp.py``): whole q heads and whole GQA groups per position,
    so CP must divide Hkv (and Hq); ``train.py``'s attention and norms routed, its linears hooked."""
    return CPPlan(
        heads=((cfg.num_heads, "q heads"), (cfg.num_kv_heads, "k/v heads")),
        module=train,
        attention="attention",
        routes={"rmsnorm": _rmsnorm_route, "rmsnorm_residual": _rmsnorm_residual_route},
        first_layer="layers.0",
        embed="embed.weight",
    )


# --- pipeline parallelism (the trainer) -------------------------------------------------------------------


def _pp_embed(trainer, tokens):
    return trainer.embed.weight[tokens], None  # the first block takes the embedding as x and as residual


def _pp_layer(trainer, layer, carry, positions, cu_seqlens, max_seqlen):
    """One block as ``Qwen3Trainer.hidden`` runs it (checkpointed there, so here)."""
    if trainer.activation_checkpointing and torch.is_grad_enabled():
        return checkpoint(layer, *carry, positions, cu_seqlens, max_seqlen, None, use_reentrant=False)
    return layer(*carry, positions, cu_seqlens, max_seqlen)


def _pp_head(trainer, carry, rows):
    x, residual = carry
    h = rmsnorm_residual(x[rows], residual[rows], trainer.norm.weight, trainer.cfg.rms_norm_eps)[0]
    trainer.tap("norm", h, rows="logits")
    return h


def pp_plan(cfg) -> PPPlan:
    """Qwen3's pipeline plan (``parallel/pp.py``): blocks ``layers.{lo..hi-1}`` per stage; what crosses a
    boundary is a block's output pair (x, residual), each (T, H) in the embedding's dtype."""
    return PPPlan(
        num_layers=cfg.num_layers,
        layers="layers",
        embed=_pp_embed,
        layer=_pp_layer,
        head=_pp_head,
        carry=("x", "residual"),
        width=cfg.hidden_size,
        dtype_of="embed.weight",
        first=("embed",),
        last=("norm", "lm_head"),
    )
