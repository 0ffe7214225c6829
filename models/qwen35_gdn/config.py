"""Qwen3.5-MoE (Gated DeltaNet + gated attention hybrid, MoE): the fields our
trainer and server read, named presets, and conversion from / to a
transformers ``config.json`` (``Qwen3_5MoeTextConfig``; the multimodal
``Qwen3_5MoeConfig`` keeps it under ``text_config``)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ...common.rope import RopeSpec
from ..config import check_fields, errors_name, read_config_json, require_keys

LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class Qwen35GdnConfig:
    vocab_size: int = 248320
    hidden_size: int = 2048                 # H
    num_layers: int = 40
    layer_types: tuple[str, ...] = tuple(("linear_attention",) * 3 + ("full_attention",)) * 10
    # gated attention layers
    num_heads: int = 16                     # Hq
    num_kv_heads: int = 2                   # Hkv
    head_dim: int = 256                     # D
    rope_theta: float = 10_000.0
    partial_rotary_factor: float = 0.25     # rotary_dim = D * 0.25
    # Gated DeltaNet layers
    gdn_k_heads: int = 16                   # Hk (linear_num_key_heads)
    gdn_v_heads: int = 32                   # Hv (GVA: more value than query/key heads)
    gdn_k_dim: int = 128                    # K
    gdn_v_dim: int = 128                    # V
    conv_kernel: int = 4
    # MoE
    num_experts: int = 256                  # E
    experts_per_token: int = 8              # k
    moe_intermediate_size: int = 512        # I
    shared_intermediate_size: int = 512     # Is
    rms_norm_eps: float = 1e-6
    max_position: int = 32768
    tie_word_embeddings: bool = False

    def __post_init__(self):
        check_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                            "gdn_k_heads", "gdn_v_heads", "gdn_k_dim", "gdn_v_dim", "conv_kernel", "num_experts",
                            "experts_per_token", "moe_intermediate_size", "shared_intermediate_size", "max_position"))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if len(self.layer_types) != self.num_layers or any(t not in LAYER_TYPES for t in self.layer_types):
            raise ValueError(f"layer_types must be {self.num_layers} of {LAYER_TYPES}, got {self.layer_types!r}")
        if self.num_heads % self.num_kv_heads or self.gdn_v_heads % self.gdn_k_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads and gdn_v_heads of gdn_k_heads")
        if self.head_dim > 256 or self.head_dim % 2:
            raise ValueError(f"head_dim must be even and <= 256 (the attention kernel's limit), got {self.head_dim}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} > num_experts {self.num_experts}")
        if self.conv_kernel != 4:
            raise NotImplementedError(f"the causal conv keeps a 3-row tail: conv_kernel must be 4, got {self.conv_kernel}")

    # ---------------------------------------------------------------- derived sizes
    @property
    def gdn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    @property
    def attn_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def gdn_key_dim(self) -> int:
        return self.gdn_k_heads * self.gdn_k_dim

    @property
    def gdn_value_dim(self) -> int:
        return self.gdn_v_heads * self.gdn_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: [q | k | v]."""
        return 2 * self.gdn_key_dim + self.gdn_value_dim

    @property
    def gdn_in_size(self) -> int:
        """Rows of the fused GDN input projection: [qkv | z | b | a]."""
        return self.conv_dim + self.gdn_value_dim + 2 * self.gdn_v_heads

    @property
    def attn_qkv_size(self) -> int:
        """Rows of the fused attention projection: [q and its gate, per head | k | v]."""
        return (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(rotary_dim=int(self.head_dim * self.partial_rotary_factor), base=self.rope_theta,
                        max_position=self.max_position, pairing="half", rotary_slice="first")

    def replace(self, **changes) -> "Qwen35GdnConfig":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "Qwen35GdnConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown qwen35_gdn preset {name!r}; known: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike, *, where: str | None = None) -> "Qwen35GdnConfig":
        """From a transformers config.json (a path, its directory or the dict; ``where`` names a dict's
        file in error messages): ``Qwen3_5MoeTextConfig`` (model_type qwen3_5_moe_text) or the
        multimodal ``Qwen3_5MoeConfig`` (qwen3_5_moe, the text model under text_config)."""
        config, where = read_config_json(config, "qwen35_gdn", where)
        from .weights import check_checkpoint_config, text_config

        check_checkpoint_config(config)
        t = text_config(config)
        require_keys(t, _REQUIRED_HF, where, "a Qwen3.5-MoE config")
        n_layers, n_heads = t["num_hidden_layers"], t["num_attention_heads"]
        with errors_name(where):
            spec = RopeSpec.from_hf(config)
            head_dim = t.get("head_dim") or t["hidden_size"] // n_heads
            return cls(
                vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], num_layers=n_layers,
                layer_types=tuple(t.get("layer_types") or _types(n_layers, t.get("full_attention_interval", 4))),
                num_heads=n_heads, num_kv_heads=t.get("num_key_value_heads") or n_heads, head_dim=head_dim,
                rope_theta=spec.base, partial_rotary_factor=spec.rotary_dim / head_dim,
                gdn_k_heads=t["linear_num_key_heads"], gdn_v_heads=t["linear_num_value_heads"],
                gdn_k_dim=t.get("linear_key_head_dim", 128), gdn_v_dim=t.get("linear_value_head_dim", 128),
                conv_kernel=t.get("linear_conv_kernel_dim", 4), num_experts=t["num_experts"],
                experts_per_token=t.get("num_experts_per_tok", 8), moe_intermediate_size=t["moe_intermediate_size"],
                shared_intermediate_size=t.get("shared_expert_intermediate_size", t["moe_intermediate_size"]),
                rms_norm_eps=t.get("rms_norm_eps", 1e-6), max_position=t.get("max_position_embeddings", 32768),
                tie_word_embeddings=config.get("tie_word_embeddings", t.get("tie_word_embeddings", False)),
            )

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A transformers config.json dict that ``Qwen3_5MoeForCausalLM`` loads."""
        return {
            "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "linear_num_key_heads": self.gdn_k_heads, "linear_num_value_heads": self.gdn_v_heads,
            "linear_key_head_dim": self.gdn_k_dim, "linear_value_head_dim": self.gdn_v_dim,
            "linear_conv_kernel_dim": self.conv_kernel, "num_experts": self.num_experts,
            "num_experts_per_tok": self.experts_per_token, "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_intermediate_size, "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings, "attention_bias": False, "dtype": torch_dtype,
        }


_REQUIRED_HF = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "linear_num_key_heads",
                "linear_num_value_heads", "num_experts", "moe_intermediate_size")


def _types(n: int, interval: int = 4) -> tuple[str, ...]:
    return tuple("full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n))


PRESETS: dict[str, Qwen35GdnConfig] = {
    # Odd sizes on purpose; both layer types, GVA, top-3 of 7 experts; small enough for the CPU contract tests.
    "tiny": Qwen35GdnConfig(vocab_size=151, hidden_size=72, num_layers=4, layer_types=_types(4, 2), num_heads=3,
                            num_kv_heads=1, head_dim=32, rope_theta=10000.0, gdn_k_heads=2, gdn_v_heads=4,
                            gdn_k_dim=24, gdn_v_dim=20, num_experts=7, experts_per_token=3,
                            moe_intermediate_size=40, shared_intermediate_size=48, max_position=4096),
    "qwen3.5-35b-a3b": Qwen35GdnConfig(),
    # Real per-layer shapes, four layers (three GDN, one attention, all MoE): trainer and server fit one H200.
    "qwen3.5-35b-a3b-4l": Qwen35GdnConfig(num_layers=4, layer_types=_types(4)),
}
