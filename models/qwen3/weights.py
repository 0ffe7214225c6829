"""Qwen3 checkpoint names (transformers ``Qwen3ForCausalLM``) <-> ours.

``cfg`` below is any object with the fields of ``Qwen3Config``: vocab_size (V), hidden_size (H),
intermediate_size (I), num_layers, num_heads (Hq), num_kv_heads (Hkv), head_dim (D),
tie_word_embeddings.
"""
from __future__ import annotations

import os

import torch

from ...weights import HFCheckpoint, NameMap, check_model_type, read_hf_config

MODEL_TYPE = "qwen3"
ARCHITECTURES = ("Qwen3ForCausalLM",)

HF_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "layers.{}.qkv.weight": (
        "model.layers.{}.self_attn.q_proj.weight",
        "model.layers.{}.self_attn.k_proj.weight",
        "model.layers.{}.self_attn.v_proj.weight",
    ),
    "layers.{}.q_norm.weight": "model.layers.{}.self_attn.q_norm.weight",
    "layers.{}.k_norm.weight": "model.layers.{}.self_attn.k_norm.weight",
    "layers.{}.o.weight": "model.layers.{}.self_attn.o_proj.weight",
    "layers.{}.mlp_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "layers.{}.gate_up.weight": ("model.layers.{}.mlp.gate_proj.weight", "model.layers.{}.mlp.up_proj.weight"),
    "layers.{}.down.weight": "model.layers.{}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


# LoRA: each Hugging Face projection an adapter may target -> its module under ``model.layers.{i}``
# (PEFT names an adapter by that module); ``lora_slices`` says where its rows sit in our layers.
LORA_TARGETS = {
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def lora_slices(cfg) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """{our layer: ((HF projection, first row, end row), ...)}: where each projection's rows sit in
    our (fused) weight, e.g. ``qkv``: q_proj rows [0, Hq·D), k_proj [Hq·D, (Hq+Hkv)·D), v_proj after."""
    q, kv, I, H = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size, cfg.hidden_size
    return {
        "qkv": (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv)),
        "o": (("o_proj", 0, H),),
        "gate_up": (("gate_proj", 0, I), ("up_proj", I, 2 * I)),
        "down": (("down_proj", 0, H),),
    }


def lora_to_hf(name: str) -> str:
    """Our adapter name ``layers.{i}.<projection>`` -> its HF module ``model.layers.{i}.self_attn.q_proj``."""
    _, i, proj = name.split(".")
    return f"model.layers.{i}.{LORA_TARGETS[proj]}"


def lora_from_hf(module: str) -> str | None:
    """The inverse of ``lora_to_hf``; None for a module that is no Qwen3 projection."""
    parts = module.split(".")
    if len(parts) != 5 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return None
    proj = parts[4]
    if LORA_TARGETS.get(proj) != ".".join(parts[3:]):
        return None
    return f"layers.{int(parts[2])}.{proj}"


def name_map(cfg) -> NameMap:
    d = cfg.head_dim
    return NameMap(
        HF_NAMES,
        split_sizes={
            "layers.{}.qkv.weight": (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d),
            "layers.{}.gate_up.weight": (cfg.intermediate_size, cfg.intermediate_size),
        },
        tied={"lm_head.weight": "embed.weight"},
        tie_word_embeddings=cfg.tie_word_embeddings,
        name=MODEL_TYPE,
    )


def expected(cfg, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{our name: (shape, dtype)}``; ``lm_head.weight`` only when embeddings are untied."""
    V, H, I, D = cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = {
        "attn_norm.weight": (H,),
        "qkv.weight": ((cfg.num_heads + 2 * cfg.num_kv_heads) * D, H),
        "q_norm.weight": (D,),
        "k_norm.weight": (D,),
        "o.weight": (H, cfg.num_heads * D),
        "mlp_norm.weight": (H,),
        "gate_up.weight": (2 * I, H),
        "down.weight": (H, I),
    }
    shapes = {"embed.weight": (V, H)}
    shapes |= {f"layers.{i}.{k}": s for i in range(cfg.num_layers) for k, s in layer.items()}
    shapes["norm.weight"] = (H,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    return {k: (s, dtype) for k, s in shapes.items()}


def check_checkpoint_config(config: dict) -> None:
    """Raise, naming what it is, unless ``config`` (config.json) is a Qwen3 causal LM."""
    check_model_type(config, MODEL_TYPE, ARCHITECTURES)


def from_hf(source, cfg, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """Our tensors from a checkpoint directory, an ``HFCheckpoint`` or a ``{hf_name: tensor}`` dict.

    A directory's config.json must be Qwen3. Fused: ``layers.{i}.qkv.weight`` ((Hq+2Hkv)·D, H) =
    cat(q_proj, k_proj, v_proj); ``layers.{i}.gate_up.weight`` (2I, H) = cat(gate_proj, up_proj).
    """
    if isinstance(source, (str, os.PathLike, HFCheckpoint)):
        check_checkpoint_config(read_hf_config(source.path if isinstance(source, HFCheckpoint) else source))
    return name_map(cfg).from_hf(source, expected(cfg, dtype), device=device)


def to_hf(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF-named tensors (views of ours) for ``save_hf_checkpoint``; lm_head dropped when tied."""
    return name_map(cfg).to_hf(tensors)
