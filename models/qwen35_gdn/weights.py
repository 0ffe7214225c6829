"""Qwen3.5-MoE checkpoint names (transformers ``Qwen3_5MoeForCausalLM``, and the
multimodal ``Qwen3_5MoeForConditionalGeneration`` whose language model sits
under ``model.language_model.*``) <-> ours.

Ours, per layer i (fused where one GEMM reads several HF projections):
  layers.{i}.attn_norm / mlp_norm          zero-centred RMSNorm weights (the norm reads 1 + w)
  GDN layers:   layers.{i}.gdn.in_proj     [in_proj_qkv | in_proj_z | in_proj_b | in_proj_a]
                layers.{i}.gdn.conv        conv1d.weight (C, 1, 4), depthwise, no bias
                layers.{i}.gdn.dt_bias / A_log / norm / out
  attention:    layers.{i}.attn.qkv        [q_proj (q and its gate, per head) | k_proj | v_proj]
                layers.{i}.attn.q_norm / k_norm (zero-centred) / o
  MoE:          layers.{i}.moe.gate        the router (E, H)
                layers.{i}.moe.gate_up     (E, 2I, H): transformers' experts.gate_up_proj, or the per-expert
                                           gate_proj/up_proj tensors stacked
                layers.{i}.moe.down        (E, H, I)
                layers.{i}.moe.shared_gate_up / shared_down / shared_gate
"""
from __future__ import annotations

import logging
import os
import re

import torch

from ...weights import CheckpointError, Fuse, HFCheckpoint, NameMap, OneOf, Stack, open_source, read_hf_config
from ...weights.lora_names import LoraNames

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
log = logging.getLogger("alignzoo.models")

# LoRA: each HF projection an adapter may target -> its module under the layer (PEFT names the module)
LORA_TARGETS = {
    "in_proj_qkv": "linear_attn.in_proj_qkv", "in_proj_z": "linear_attn.in_proj_z",
    "in_proj_b": "linear_attn.in_proj_b", "in_proj_a": "linear_attn.in_proj_a", "out_proj": "linear_attn.out_proj",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
}


# LoRA on the routed experts (PEFT's target_parameters): HF parameter -> (our experts module, which)
LORA_PARAM_SLOTS = {"mlp.experts.gate_up_proj": ("moe", "gate_up"), "mlp.experts.down_proj": ("moe", "down")}
# transformers' Qwen3_5MoeExperts registers gate_up_proj before down_proj: PEFT nests their adapters in that order
LORA_PARAM_ORDER = ("gate_up_proj", "down_proj")


def text_config(config: dict) -> dict:
    """The language model's config dict (the multimodal config keeps it under text_config)."""
    return config.get("text_config", config) if config.get("model_type") == "qwen3_5_moe" else config


def check_checkpoint_config(config: dict) -> None:
    """Raise, naming what it is, unless ``config`` (config.json) is a Qwen3.5-MoE model, text-only or multimodal."""
    if config.get("model_type") not in MODEL_TYPES:
        arch = ", ".join(config.get("architectures") or []) or "no architectures listed"
        raise CheckpointError(f"checkpoint is {config.get('model_type')} ({arch}), not Qwen3.5-MoE (model_type one of "
                              f"{', '.join(MODEL_TYPES)})")


def lora_slices(cfg) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """{our layer: ((HF projection, first row, end row), ...)} of the fused weights."""
    c, v, hv = cfg.conv_dim, cfg.gdn_value_dim, cfg.gdn_v_heads
    qg, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {
        "gdn.in_proj": (("in_proj_qkv", 0, c), ("in_proj_z", c, c + v), ("in_proj_b", c + v, c + v + hv),
                        ("in_proj_a", c + v + hv, c + v + 2 * hv)),
        "gdn.out": (("out_proj", 0, cfg.hidden_size),),
        "attn.qkv": (("q_proj", 0, qg), ("k_proj", qg, qg + kv), ("v_proj", qg + kv, qg + 2 * kv)),
        "attn.o": (("o_proj", 0, cfg.hidden_size),),
    }


# layers.{i}.<projection> <-> model.layers.{i}.<module> (a multimodal checkpoint's: model.language_model.layers...);
# an experts adapter layers.{i}.moe.<gate_up|down> <-> model.layers.{i}.mlp.experts:<parameter>
_LORA_NAMES = LoraNames(LORA_TARGETS, LORA_PARAM_SLOTS, prefixes=("model.", "model.language_model."))
lora_to_hf = _LORA_NAMES.to_hf
lora_from_hf = _LORA_NAMES.from_hf


def hf_names(cfg, prefix: str = "model.") -> dict:
    p, E = prefix, cfg.num_experts
    L = p + "layers.{}."
    names = {
        "embed.weight": p + "embed_tokens.weight",
        "norm.weight": p + "norm.weight",
        "lm_head.weight": "lm_head.weight",
        "layers.{}.attn_norm.weight": L + "input_layernorm.weight",
        "layers.{}.mlp_norm.weight": L + "post_attention_layernorm.weight",
        "layers.{}.gdn.in_proj.weight": (L + "linear_attn.in_proj_qkv.weight", L + "linear_attn.in_proj_z.weight",
                                         L + "linear_attn.in_proj_b.weight", L + "linear_attn.in_proj_a.weight"),
        "layers.{}.gdn.conv.weight": L + "linear_attn.conv1d.weight",
        "layers.{}.gdn.dt_bias.weight": L + "linear_attn.dt_bias",
        "layers.{}.gdn.A_log.weight": L + "linear_attn.A_log",
        "layers.{}.gdn.norm.weight": L + "linear_attn.norm.weight",
        "layers.{}.gdn.out.weight": L + "linear_attn.out_proj.weight",
        "layers.{}.attn.qkv.weight": (L + "self_attn.q_proj.weight", L + "self_attn.k_proj.weight",
                                      L + "self_attn.v_proj.weight"),
        "layers.{}.attn.q_norm.weight": L + "self_attn.q_norm.weight",
        "layers.{}.attn.k_norm.weight": L + "self_attn.k_norm.weight",
        "layers.{}.attn.o.weight": L + "self_attn.o_proj.weight",
        "layers.{}.moe.gate.weight": L + "mlp.gate.weight",
        "layers.{}.moe.gate_up.weight": OneOf((
            L + "mlp.experts.gate_up_proj",
            Fuse((Stack(L + "mlp.experts.{expert}.gate_proj.weight", E),
                  Stack(L + "mlp.experts.{expert}.up_proj.weight", E)), dim=1),
        )),
        "layers.{}.moe.down.weight": OneOf((L + "mlp.experts.down_proj",
                                            Stack(L + "mlp.experts.{expert}.down_proj.weight", E))),
        "layers.{}.moe.shared_gate_up.weight": (L + "mlp.shared_expert.gate_proj.weight",
                                                L + "mlp.shared_expert.up_proj.weight"),
        "layers.{}.moe.shared_down.weight": L + "mlp.shared_expert.down_proj.weight",
        "layers.{}.moe.shared_gate.weight": L + "mlp.shared_expert_gate.weight",
    }
    return names


# What a multimodal checkpoint has beside the language model (left out on load, named in the log).
NOT_LANGUAGE = (r"^model\.visual\.", r"^mtp\.", r"^model\.mtp\.")


def name_map(cfg, prefix: str = "model.") -> NameMap:
    c, v, hv, Is = cfg.conv_dim, cfg.gdn_value_dim, cfg.gdn_v_heads, cfg.shared_intermediate_size
    D = cfg.head_dim
    return NameMap(
        hf_names(cfg, prefix),
        split_sizes={
            "layers.{}.gdn.in_proj.weight": (c, v, hv, hv),
            "layers.{}.attn.qkv.weight": (2 * cfg.num_heads * D, cfg.num_kv_heads * D, cfg.num_kv_heads * D),
            "layers.{}.moe.shared_gate_up.weight": (Is, Is),
        },
        tied={"lm_head.weight": "embed.weight"},
        tie_word_embeddings=cfg.tie_word_embeddings,
        ignore=(r"(^|\.)rotary_emb\.inv_freq$", *NOT_LANGUAGE),
        name="qwen3_5_moe",
    )


def expected(cfg, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{our name: (shape, dtype)}."""
    H, V = cfg.hidden_size, cfg.vocab_size
    E, I, Is = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    D, Hq = cfg.head_dim, cfg.num_heads
    out = {"embed.weight": ((V, H), dtype), "norm.weight": ((H,), dtype)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ((V, H), dtype)
    for i, t in enumerate(cfg.layer_types):
        p = f"layers.{i}."
        out |= {p + "attn_norm.weight": ((H,), dtype), p + "mlp_norm.weight": ((H,), dtype),
                p + "moe.gate.weight": ((E, H), dtype), p + "moe.gate_up.weight": ((E, 2 * I, H), dtype),
                p + "moe.down.weight": ((E, H, I), dtype), p + "moe.shared_gate_up.weight": ((2 * Is, H), dtype),
                p + "moe.shared_down.weight": ((H, Is), dtype), p + "moe.shared_gate.weight": ((1, H), dtype)}
        if t == "linear_attention":
            out |= {p + "gdn.in_proj.weight": ((cfg.gdn_in_size, H), dtype),
                    p + "gdn.conv.weight": ((cfg.conv_dim, 1, cfg.conv_kernel), dtype),
                    p + "gdn.dt_bias.weight": ((cfg.gdn_v_heads,), dtype),
                    p + "gdn.A_log.weight": ((cfg.gdn_v_heads,), dtype),
                    p + "gdn.norm.weight": ((cfg.gdn_v_dim,), dtype),
                    p + "gdn.out.weight": ((H, cfg.gdn_value_dim), dtype)}
        else:
            out |= {p + "attn.qkv.weight": ((cfg.attn_qkv_size, H), dtype), p + "attn.q_norm.weight": ((D,), dtype),
                    p + "attn.k_norm.weight": ((D,), dtype), p + "attn.o.weight": ((H, Hq * D), dtype)}
    return out


def checkpoint_prefix(names) -> str:
    """"model.language_model." for a multimodal checkpoint, else "model."."""
    return "model.language_model." if any(n.startswith("model.language_model.") for n in names) else "model."


def from_hf(source, cfg, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """Our tensors from a checkpoint (directory, ``HFCheckpoint`` or {hf_name: tensor}); a directory's
    config.json must be Qwen3.5-MoE; a multimodal checkpoint's vision tower and MTP head are left out,
    and the log says so."""
    if isinstance(source, (str, os.PathLike, HFCheckpoint)):
        check_checkpoint_config(read_hf_config(source.path if isinstance(source, HFCheckpoint) else source))
    with open_source(source) as src:
        names = list(src.keys())
        prefix = checkpoint_prefix(names)
        skipped = [n for n in names if any(re.search(r, n) for r in NOT_LANGUAGE)]
        if skipped:
            log.info("qwen35_gdn: left out %d tensors beside the language model (%s...)", len(skipped), skipped[0])
        return name_map(cfg, prefix).from_hf(src, expected(cfg, dtype), device=device)


def to_hf(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF-named tensors for ``save_hf_checkpoint``, as ``Qwen3_5MoeForCausalLM`` names them."""
    return name_map(cfg).to_hf(tensors)
