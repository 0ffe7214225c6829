"""Qwen3 (dense) configuration: the fields our trainer and server read, named
presets, and conversion from / to a transformers ``config.json``."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ...common.rope import RopeSpec, rope_parameters_hf
from ...common.rope.table import Yarn
from ...weights import CheckpointError
from ..config import check_fields, errors_name, read_config_json, require_keys


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 4096            # H
    intermediate_size: int = 12288     # I (SwiGLU width)
    num_layers: int = 36
    num_heads: int = 32                # Hq
    num_kv_heads: int = 8              # Hkv (GQA)
    head_dim: int = 128                # D; Qwen3 decouples it from H / Hq
    rope_theta: float = 1_000_000.0
    rope_yarn: Yarn | None = None      # rope_scaling / rope_parameters of type "yarn"
    rms_norm_eps: float = 1e-6
    max_position: int = 40960          # max_position_embeddings: the RoPE table's rows
    tie_word_embeddings: bool = False  # lm_head shares the embedding (0.6B does)

    def __post_init__(self):
        check_fields(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                            "num_kv_heads", "head_dim", "max_position"))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2 or self.head_dim > 256:
            raise ValueError(f"head_dim must be even and <= 256 (the attention kernel's limit), got {self.head_dim}")

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def rope(self) -> RopeSpec:
        return RopeSpec(rotary_dim=self.head_dim, base=self.rope_theta, max_position=self.max_position,
                        pairing="half", rotary_slice="first", yarn=self.rope_yarn)

    def replace(self, **changes) -> "Qwen3Config":
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> "Qwen3Config":
        if name not in PRESETS:
            raise ValueError(f"unknown qwen3 preset {name!r}; known: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike, *, where: str | None = None) -> "Qwen3Config":
        """From a transformers Qwen3 ``config.json`` (a path, its directory, or
        the dict; ``where`` names a dict's file in error messages)."""
        config, where = read_config_json(config, "qwen3", where)
        from .weights import check_checkpoint_config

        check_checkpoint_config(config)
        require_keys(config, _REQUIRED_HF, where, "a qwen3 config.json")
        unsupported = {k: config[k] for k in ("attention_bias", "use_sliding_window") if config.get(k)}
        if unsupported:
            raise NotImplementedError(f"qwen3 config options not supported: {unsupported}")
        n_heads = config["num_attention_heads"]
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise CheckpointError(f"{where}: num_attention_heads must be a positive int, got {n_heads!r}")
        with errors_name(where):  # our own checks first: transformers' (inside RopeSpec.from_hf) name no file
            cfg = cls(
                vocab_size=config["vocab_size"],
                hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"],
                num_layers=config["num_hidden_layers"],
                num_heads=n_heads,
                num_kv_heads=config.get("num_key_value_heads") or n_heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
                rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                max_position=config["max_position_embeddings"],
                tie_word_embeddings=config.get("tie_word_embeddings", False),
            )
            spec = RopeSpec.from_hf(config)
            return cfg.replace(rope_theta=spec.base, rope_yarn=spec.yarn)

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A transformers ``config.json`` dict (``Qwen3ForCausalLM`` loads it)."""
        rope = rope_parameters_hf(self.rope_theta, self.rope_yarn)
        return {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "use_sliding_window": False,
            "dtype": torch_dtype,
        }


_REQUIRED_HF = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings")

PRESETS: dict[str, Qwen3Config] = {
    # Odd sizes on purpose; small enough that the CPU path runs the contract tests in seconds.
    "tiny": Qwen3Config(vocab_size=151, hidden_size=72, intermediate_size=200, num_layers=2, num_heads=4,
                        num_kv_heads=2, head_dim=24, rope_theta=10000.0, max_position=4096),
    "qwen3-0.6b": Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_layers=28,
                              num_heads=16, num_kv_heads=8, head_dim=128, tie_word_embeddings=True),
    "qwen3-8b": Qwen3Config(),
}
