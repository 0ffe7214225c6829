"""Qwen3.5-MoE's parallel plans: the expert-parallel plan (which weights are per-expert stacks,
``parallel/ep.py``) and the server's tensor-parallel plan (``parallel/tp.py``).  The model's forward
(``serve.py``) stays single-device and runs unchanged on every rank.

``ep_plan``:

- ``moe.gate_up`` (E, 2I, H) and ``moe.down`` (E, H, I) of every layer: split by expert, EP position
  q holding experts [q·E/EP, (q+1)·E/EP);
- the router's gate (E, H), the shared expert and its sigmoid gate, attention, GDN, embedding, norms
  and LM head: replicated (the router runs on every rank, so every rank knows every row's owner);
- the experts' separate LoRA adapters: replicated, each rank reading its experts' slices.

``tp_plan``: attention and GDN split by head, the shared expert by its width, row-parallel layers
gathered (``parallel/tp.py``), so TP 2 / 4 rows are the TP 1 bits.  A rank's GDN StatePool (state, open
chunk, conv tail) holds its heads only, through ``local_config``.  The routed experts stay replicated:
they run outside ``linear`` (``moe_block.py``'s grouped kernel), and splitting each expert's width would
gather (R-1)/R·k·(I + H) values per token and layer (20 KiB at 35B-A3B's shapes, TP 2, bf16), more than the rest of
the layer; replicated they move nothing but every rank holds them all (35B-A3B: 32 G parameters, 64 GB
bf16): EP is the plan that shards them.  Received per token at 35B-A3B's shapes, TP 2, bf16, gathered in
logical order: GDN out (R-1)/R·(Hv·V + H) = 6 KiB or attention o (R-1)/R·(Hq·D + H) = 6 KiB, shared down
(R-1)/R·(Is + H) = 2.5 KiB, so 8.5 KiB a layer, 340 KiB over 40 layers; each logit row (R-1)/R·V fp32 =
485 KiB.
"""
from __future__ import annotations

from ...parallel.ep import EPPlan
from ...parallel.tp import Column, Row, TPPlan, Vocab, unit_count
from .config import Qwen35GdnConfig


def ep_plan(cfg) -> EPPlan:
    return EPPlan(stacks=("layers.{}.moe.gate_up.weight", "layers.{}.moe.down.weight"),
                  layers=tuple(range(cfg.num_layers)), num_experts=cfg.num_experts)


# --- tensor parallelism (the server) ----------------------------------------------------------------------


def local_config(cfg: Qwen35GdnConfig, tp: int) -> Qwen35GdnConfig:
    """The config one rank's forward sees: its share of the attention q and k/v heads, of the GDN qk and
    value heads (so ``cache_pools`` sizes the StatePool's fields, conv tail included, for those heads only)
    and of the shared expert's width; the routed experts whole."""
    return cfg.replace(
        num_heads=unit_count(cfg.num_heads, tp, "q heads"),
        num_kv_heads=unit_count(cfg.num_kv_heads, tp, "k/v heads"),
        gdn_k_heads=unit_count(cfg.gdn_k_heads, tp, "GDN qk heads"),
        gdn_v_heads=unit_count(cfg.gdn_v_heads, tp, "GDN value heads"),
        shared_intermediate_size=unit_count(cfg.shared_intermediate_size, tp, "shared_intermediate_size"),
    )


def tp_plan(cfg: Qwen35GdnConfig) -> TPPlan:
    """Server TP (``parallel/tp.py``), named per layer since a layer holds either GDN or attention weights.

    - GDN ``in_proj`` [q | k | v | z | b | a]: column-parallel by head, q and k by qk head, v, z, b and a by
      value head, so a rank's value heads [p·Hv/R, (p+1)·Hv/R) find their qk head h // (Hv/Hk) beside them
      (a qk head replicated where R is a multiple of Hk); ``conv`` (its channels are [q | k | v]),
      ``A_log`` and ``dt_bias`` split alike; the gated norm's weight (V,) is per-head shared: replicated;
      ``out``: row-parallel over the value heads, gathered.
    - attention ``qkv`` [q with its gate, per head | k | v]: column-parallel by head as qwen3's (a k/v head
      replicated where R exceeds Hkv); q_norm / k_norm (D,) replicated; partial RoPE is within a head;
      ``o``: row-parallel over the q heads, gathered.
    - MoE: router and routed experts replicated, the shared expert column/row-parallel over Is, its sigmoid
      gate (1, H) replicated; ``lm_head``: vocabulary-sharded.
    """
    Hq, Hkv, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    Hk, Hv, K, V, Is = cfg.gdn_k_heads, cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.gdn_v_dim, cfg.shared_intermediate_size
    qk, vh = (Hk, K, "GDN qk heads"), (Hv, V, "GDN value heads")
    gdn = {
        "gdn.in_proj.weight": Column((qk, qk, vh, vh, (Hv, 1, "GDN value heads"), (Hv, 1, "GDN value heads"))),
        "gdn.conv.weight": Column((qk, qk, vh)),
        "gdn.A_log.weight": Column(((Hv, 1, "GDN value heads"),)),
        "gdn.dt_bias.weight": Column(((Hv, 1, "GDN value heads"),)),
        "gdn.out.weight": Row((vh,)),
    }
    attn = {
        "attn.qkv.weight": Column(((Hq, 2 * D, "q heads"), (Hkv, D, "k/v heads"), (Hkv, D, "k/v heads"))),
        "attn.o.weight": Row(((Hq, D, "q heads"),)),
    }
    moe = {
        "moe.shared_gate_up.weight": Column(((Is, 1, "shared_intermediate_size"),
                                             (Is, 1, "shared_intermediate_size"))),
        "moe.shared_down.weight": Row(((Is, 1, "shared_intermediate_size"),)),
    }
    weights = {f"layers.{i}.{n}": k for i in range(cfg.num_layers)
               for n, k in {**(gdn if i in cfg.gdn_layers else attn), **moe}.items()}
    return TPPlan(weights=weights | {"lm_head.weight": Vocab()}, num_layers=cfg.num_layers, local_config=local_config)
