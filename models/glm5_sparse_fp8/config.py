"""GLM-5 (MLA + DSA sparse attention + MoE, FP8 block checkpoints): the fields
the trainer and the server will read, named presets, and conversion from / to
a transformers ``config.json`` (``GlmMoeDsaConfig``, model_type glm_moe_dsa).

What transformers' ``modeling_glm_moe_dsa`` fixes beside these fields:
  - the latent norms ``q_a_layernorm`` / ``kv_a_layernorm`` are RMSNorms built
    without an eps, so 1e-6 (``LATENT_NORM_EPS``), not ``rms_norm_eps``;
  - the indexer's ``k_norm`` is a LayerNorm with bias, eps 1e-6 (``INDEXER_NORM_EPS``);
  - RoPE reads pairs (2i, 2i + 1) and writes (i, i + r/2) (``apply_rotary_pos_emb_interleave``):
    on the last ``qk_rope_head_dim`` dims of the MLA query head / of ``kv_a_proj_with_mqa``'s
    output (``rope``), on the first ones of the indexer's heads (``indexer_rope``);
  - the router's weight and ``e_score_correction_bias`` stay FP32 (``_keep_in_fp32_modules_strict``).
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from ...common.rope import RopeSpec, rope_parameters_hf
from ...common.rope.table import Yarn
from ...weights import CheckpointError
from ...weights.fp8 import is_fp8_checkpoint
from ..config import check_fields, errors_name, read_config_json, require_keys

ATTENTION_TYPES = ("indexed_attention",)
INDEXER_TYPES = ("full", "shared")      # "shared": no indexer; reuses the last full layer's top-k
MLP_TYPES = ("dense", "sparse")         # "sparse": routed experts + shared experts
LATENT_NORM_EPS = 1e-6
INDEXER_NORM_EPS = 1e-6


@dataclass(frozen=True)
class Fp8BlockQuant:
    """A checkpoint's ``quantization_config`` for FP8 block weights (``quant_method`` "fp8"):
    e4m3 codes + fp32 ``weight_scale_inv`` per 128x128 block (``weights.formats.FP8_BLOCK128``).
    ``modules_to_not_convert`` is kept as written (GLM-5-FP8 lists the indexer's weights_proj);
    the weights reader goes by which tensors carry a ``weight_scale_inv``, not by this list."""
    activation_scheme: str = "dynamic"
    modules_to_not_convert: tuple[str, ...] | None = None

    def to_hf(self) -> dict[str, Any]:
        out = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
               "activation_scheme": self.activation_scheme}
        if self.modules_to_not_convert is not None:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out

    @classmethod
    def from_hf(cls, q: dict[str, Any]) -> Fp8BlockQuant:
        if q.get("quant_method") != "fp8":
            raise NotImplementedError(f"quantization_config quant_method {q.get('quant_method')!r}: only 'fp8' "
                                      f"(e4m3 + weight_scale_inv on 128x128 blocks) is supported")
        is_fp8_checkpoint({"quantization_config": q})  # NotImplementedError for blocks other than [128, 128]
        if q.get("fmt", "e4m3") != "e4m3":
            raise NotImplementedError(f"quantization_config fmt {q.get('fmt')!r}: only e4m3 codes are supported")
        skip = q.get("modules_to_not_convert")
        return cls(activation_scheme=q.get("activation_scheme", "dynamic"),
                   modules_to_not_convert=None if skip is None else tuple(skip))


@dataclass(frozen=True)
class Glm5Config:
    vocab_size: int = 154880
    hidden_size: int = 6144                 # H
    intermediate_size: int = 12288          # I_dense: the dense MLP layers' SwiGLU width
    num_layers: int = 78
    layer_types: tuple[str, ...] = ("indexed_attention",) * 78
    # MLA
    num_heads: int = 64                     # Hq (num_attention_heads; num_key_value_heads must equal it)
    q_lora_rank: int = 2048                 # Rq: q_a_proj's output, the q residual the indexer reads
    kv_lora_rank: int = 512                 # Rkv: the cached latent
    qk_nope_head_dim: int = 192             # Dn
    qk_rope_head_dim: int = 64              # Dr: rotary dims of q and of the shared key row
    v_head_dim: int = 256                   # Dv
    # DSA indexer
    indexer_types: tuple[str, ...] = ("full",) * 78
    index_n_heads: int = 32                 # Hi
    index_head_dim: int = 128               # Di (its first Dr dims are rotated)
    index_topk: int = 2048                  # positions each query attends to (all of them when fewer)
    # MoE
    mlp_layer_types: tuple[str, ...] = ("dense",) * 3 + ("sparse",) * 75
    moe_intermediate_size: int = 2048       # I: one routed expert's width
    n_routed_experts: int = 256             # E
    n_shared_experts: int = 1               # the shared expert is n_shared x I wide
    num_experts_per_tok: int = 8            # k
    n_group: int = 1                        # expert groups: top-k_group groups by their top-2 sum, then top-k
    topk_group: int = 1
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    # RoPE, norms, embeddings
    rope_theta: float = 10_000.0
    rope_yarn: Yarn | None = None           # rope_parameters of type "yarn" (it also scales the softmax)
    rms_norm_eps: float = 1e-5
    max_position: int = 202752              # max_position_embeddings: the RoPE table's rows
    tie_word_embeddings: bool = False
    quantization: Fp8BlockQuant | None = None   # the checkpoint's quantization_config, when it has one

    def __post_init__(self):
        name = type(self).__name__
        check_fields(self, ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                            "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "index_n_heads", "index_head_dim", "index_topk", "moe_intermediate_size",
                            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "n_group", "topk_group",
                            "max_position"),
                     reals=("rms_norm_eps", "rope_theta", "routed_scaling_factor"))
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"{name}.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        for field, allowed in (("layer_types", ATTENTION_TYPES), ("indexer_types", INDEXER_TYPES),
                               ("mlp_layer_types", MLP_TYPES)):
            types = getattr(self, field)
            if isinstance(types, str) or not hasattr(types, "__iter__"):
                raise ValueError(f"{name}.{field} must be a list of {self.num_layers} of {allowed}, got {types!r}")
            types = tuple(types)
            object.__setattr__(self, field, types)
            if len(types) != self.num_layers:
                raise ValueError(f"{name}.{field} has {len(types)} entries for num_layers {self.num_layers}: "
                                 f"{list(types)} (give one per layer when changing num_layers)")
            bad = sorted({t for t in types if t not in allowed}, key=str)
            if bad:
                raise ValueError(f"{name}.{field}: {bad} not among {allowed}")
        if self.indexer_types[0] != "full":
            raise ValueError(f"{name}.indexer_types[0] is 'shared': a shared layer reuses the last full layer's "
                             f"selection, and layer 0 has none before it; got {list(self.indexer_types)}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"{name}.qk_rope_head_dim must be even (RoPE rotates pairs), got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise ValueError(f"{name}.index_head_dim {self.index_head_dim} < qk_rope_head_dim "
                             f"{self.qk_rope_head_dim}: the indexer rotates its first qk_rope_head_dim dims")
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise ValueError(f"{name}.n_routed_experts {E} is not a multiple of n_group {G}")
        if G > 1 and E // G < 2:
            raise ValueError(f"{name}: {E // G} expert(s) per group; a group is scored by its top-2 experts' sum")
        if self.topk_group > G:
            raise ValueError(f"{name}.topk_group {self.topk_group} > n_group {G}")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise ValueError(f"{name}.num_experts_per_tok {self.num_experts_per_tok} > the "
                             f"{self.topk_group * (E // G)} experts of the topk_group {self.topk_group} groups kept")
        if self.rope_yarn is not None and not isinstance(self.rope_yarn, Yarn):
            raise ValueError(f"{name}.rope_yarn must be a Yarn or None, got {self.rope_yarn!r}")
        if self.quantization is not None and not isinstance(self.quantization, Fp8BlockQuant):
            raise ValueError(f"{name}.quantization must be an Fp8BlockQuant or None, got {self.quantization!r}")

    # ---------------------------------------------------------------- derived sizes
    @property
    def qk_head_dim(self) -> int:
        """Dn + Dr: one query head, [nope | rope]."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def first_k_dense_replace(self) -> int:
        """How many leading layers are dense (``mlp_layer_types`` is the truth; config.json carries both)."""
        n = 0
        while n < self.num_layers and self.mlp_layer_types[n] == "dense":
            n += 1
        return n

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "dense")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "sparse")

    @property
    def indexer_layers(self) -> tuple[int, ...]:
        """The layers that own an indexer (``"full"``); the others reuse the last one's selection."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def selection_source(self, layer: int) -> int:
        """The full layer whose top-k ``layer`` attends with (itself when full)."""
        return max(i for i in self.indexer_layers if i <= layer)

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def rope(self) -> RopeSpec:
        """MLA: the last Dr dims of each query head and the rope key, pairs read interleaved, written halved."""
        return RopeSpec(rotary_dim=self.qk_rope_head_dim, base=self.rope_theta, max_position=self.max_position,
                        pairing="interleaved_to_half", rotary_slice="last", yarn=self.rope_yarn)

    @property
    def indexer_rope(self) -> RopeSpec:
        """The indexer: the same table on the first Dr dims of its query heads and its key."""
        return self.rope.replace(rotary_slice="first")

    @property
    def softmax_scale(self) -> float:
        """MLA's q·k scale: (Dn + Dr)^-0.5, times mscale² under YaRN with mscale_all_dim
        (transformers' ``yarn_apply_mscale``, the same Python float arithmetic)."""
        scale = self.qk_head_dim ** (-0.5)
        y = self.rope_yarn
        if y is not None and y.mscale_all_dim:
            m = 0.1 * y.mscale_all_dim * math.log(y.factor) + 1.0 if y.factor > 1 else 1.0
            scale = scale * m * m
        return scale

    @property
    def indexer_scale(self) -> float:
        """The indexer's q·k scale Di^-0.5; its head weights are also scaled by Hi^-0.5."""
        return self.index_head_dim ** -0.5

    def replace(self, **changes) -> Glm5Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> Glm5Config:
        if name not in PRESETS:
            raise ValueError(f"unknown glm5_sparse_fp8 preset {name!r}; known: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike, *, where: str | None = None) -> Glm5Config:
        """From a transformers ``config.json`` (a path, its directory or the dict; ``where`` names a
        dict's file in error messages) of model_type glm_moe_dsa.  Absent per-layer lists are derived
        as ``GlmMoeDsaConfig.__post_init__`` derives them (``mlp_layer_types`` from
        ``first_k_dense_replace``; ``indexer_types`` from ``index_topk_pattern`` or
        ``index_topk_freq`` / ``index_skip_topk_offset``)."""
        config, where = read_config_json(config, "glm5_sparse_fp8", where)
        from .weights import check_checkpoint_config

        try:
            check_checkpoint_config(config)
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from e
        require_keys(config, _REQUIRED_HF, where, "a GLM-5 (glm_moe_dsa) config")
        unsupported = {k: config[k] for k in ("attention_bias", "mlp_bias") if config.get(k)}
        for key, fits in (("hidden_act", "silu"), ("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
            if key in config and config[key] != fits:
                unsupported[key] = config[key]
        if unsupported:
            raise NotImplementedError(f"{where}: glm_moe_dsa options not supported: {unsupported}")
        n_layers, n_heads = config["num_hidden_layers"], config["num_attention_heads"]
        if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
            raise CheckpointError(f"{where}: num_hidden_layers must be a positive int, got {n_layers!r}")
        if not isinstance(n_heads, int) or isinstance(n_heads, bool) or n_heads < 1:
            raise CheckpointError(f"{where}: num_attention_heads must be a positive int, got {n_heads!r}")
        n_kv = config.get("num_key_value_heads", n_heads)
        if n_kv is not None and n_kv != n_heads:
            raise CheckpointError(f"{where}: num_key_value_heads {n_kv} != num_attention_heads {n_heads}: MLA expands "
                                  f"the latent into every head, transformers would repeat its heads")
        q = config.get("quantization_config")
        with errors_name(where):
            quant = Fp8BlockQuant.from_hf(q) if q else None
            cfg = cls(
                vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
                intermediate_size=config["intermediate_size"], num_layers=n_layers,
                layer_types=_list(config, "layer_types") or ("indexed_attention",) * n_layers,
                num_heads=n_heads, q_lora_rank=config["q_lora_rank"], kv_lora_rank=config["kv_lora_rank"],
                qk_nope_head_dim=config["qk_nope_head_dim"], qk_rope_head_dim=config["qk_rope_head_dim"],
                v_head_dim=config["v_head_dim"],
                indexer_types=_list(config, "indexer_types") or _indexer_types(config, n_layers),
                index_n_heads=config.get("index_n_heads", 32), index_head_dim=config.get("index_head_dim", 128),
                index_topk=config.get("index_topk", 2048),
                mlp_layer_types=_list(config, "mlp_layer_types")
                or _mlp_types(n_layers, config.get("first_k_dense_replace", 3)),
                moe_intermediate_size=config["moe_intermediate_size"],
                n_routed_experts=config.get("n_routed_experts", config.get("num_experts", 256)),
                n_shared_experts=config.get("n_shared_experts", 1),
                num_experts_per_tok=config.get("num_experts_per_tok", 8), n_group=config.get("n_group", 1),
                topk_group=config.get("topk_group", 1), routed_scaling_factor=config.get("routed_scaling_factor", 2.5),
                norm_topk_prob=config.get("norm_topk_prob", True), rms_norm_eps=config.get("rms_norm_eps", 1e-5),
                max_position=config.get("max_position_embeddings", 202752),
                tie_word_embeddings=config.get("tie_word_embeddings", False), quantization=quant,
            )
            spec = RopeSpec.from_hf(config)
            if spec.rotary_dim != cfg.qk_rope_head_dim:
                raise ValueError(f"rope_parameters rotate {spec.rotary_dim} dims, qk_rope_head_dim is "
                                 f"{cfg.qk_rope_head_dim}: partial rotary is not part of GLM-5")
            return cfg.replace(rope_theta=spec.base, rope_yarn=spec.yarn)

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A transformers config.json dict that ``GlmMoeDsaConfig(**d)`` and ``GlmMoeDsaForCausalLM`` load."""
        rope = rope_parameters_hf(self.rope_theta, self.rope_yarn)
        out = {
            "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_heads, "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank, "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim, "v_head_dim": self.v_head_dim,
            "indexer_types": list(self.indexer_types), "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk,
            "mlp_layer_types": list(self.mlp_layer_types), "first_k_dense_replace": self.first_k_dense_replace,
            "moe_intermediate_size": self.moe_intermediate_size, "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "n_group": self.n_group, "topk_group": self.topk_group,
            "routed_scaling_factor": self.routed_scaling_factor, "norm_topk_prob": self.norm_topk_prob,
            "hidden_act": "silu", "rope_parameters": rope, "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position, "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": False, "attention_dropout": 0.0, "dtype": torch_dtype,
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        return out


_REQUIRED_HF = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                "moe_intermediate_size")


def _list(config: dict, key: str) -> tuple | None:
    """A per-layer list from config.json (None when absent); a string is refused, not split into letters."""
    v = config.get(key)
    if v is None:
        return None
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise ValueError(f"{key} must be a list with one entry per layer, got {v!r}")
    return tuple(v)


def _mlp_types(n: int, first_k_dense: int) -> tuple[str, ...]:
    if not isinstance(first_k_dense, int) or isinstance(first_k_dense, bool) or first_k_dense < 0:
        raise ValueError(f"first_k_dense_replace must be an int >= 0, got {first_k_dense!r}")
    k = min(first_k_dense, n)
    return ("dense",) * k + ("sparse",) * (n - k)


def _indexer_types(config: dict, n: int) -> tuple[str, ...]:
    """As ``GlmMoeDsaConfig.__post_init__``: ``index_topk_pattern`` ("F"/"S" letters or a list), else
    full where max(i - offset + 1, 0) % freq == 0 (freq ``index_topk_freq`` 1, offset
    ``index_skip_topk_offset`` 2: every layer full by default)."""
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        if isinstance(pattern, str):
            unknown = sorted(set(pattern) - {"F", "S"})
            if unknown:
                raise ValueError(f"index_topk_pattern {pattern!r} has letters {unknown}; F (full) and S (shared) are known")
            return tuple({"F": "full", "S": "shared"}[c] for c in pattern)
        return tuple(pattern)
    freq = max(config.get("index_topk_freq", 1), 1)
    offset = config.get("index_skip_topk_offset", 2)
    return tuple("full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n))


def _layers(n: int, indexer: tuple[str, ...], first_k_dense: int, **fields) -> dict[str, Any]:
    return dict(num_layers=n, layer_types=("indexed_attention",) * n, indexer_types=indexer,
                mlp_layer_types=_mlp_types(n, first_k_dense), **fields)


PRESETS: dict[str, Glm5Config] = {
    # Odd sizes on purpose, CPU-fast. top-32 selection, far below the ladder's ~1,000-token sequences;
    # layers: dense + full indexer, then sparse: shared, full, shared (a shared layer after a dense one and
    # after a sparse one). 9 experts in 3 groups of 3, top-2 groups, top-4 experts.
    "tiny": Glm5Config(**_layers(4, ("full", "shared", "full", "shared"), 1),
                       vocab_size=151, hidden_size=72, intermediate_size=200, num_heads=3, q_lora_rank=52,
                       kv_lora_rank=36, qk_nope_head_dim=20, qk_rope_head_dim=16, v_head_dim=28,
                       index_n_heads=3, index_head_dim=24, index_topk=32, moe_intermediate_size=40,
                       n_routed_experts=9, n_shared_experts=1, num_experts_per_tok=4, n_group=3, topk_group=2,
                       max_position=4096),
    # GLM-5 as released: GlmMoeDsaConfig's defaults (78 layers, 3 dense, every indexer full, 256 experts).
    "glm-5": Glm5Config(),
    # Real per-layer shapes (hidden 6144, Hq 64, q_lora 2048, kv_lora 512 + rope 64, heads 192 + 64 / v 256,
    # indexer 32 x 128, dense MLP 12288, experts 2048 wide, top-8, vocab 154,880), cut to 4 layers (1 dense + 3
    # sparse; indexers full, shared, full, shared) and 16 routed experts (of 256) so that a full-weight trainer
    # and the server fit one H200 (141 GB) together. Parameters (``expected``):
    #   embed + lm_head 2 x 154,880 x 6,144                          1.903 B
    #   MLA 4 x 165.0 M, indexers 2 x 9.4 M                          0.679 B
    #   dense MLP 3 x 12,288 x 6,144                                 0.226 B
    #   3 sparse layers: 16 routed + 1 shared experts x 37.7 M each, router 16 x 6,144     1.925 B
    #   total                                                        4.734 B
    # Trainer, FP32 master + grad + Adam m, v = 16 B/param:         75.7 GB
    # + its FP8 codes of the 2.83 B quantized params (unified FP8)   ~2.8 GB
    # Server: the same FP8 codes + bf16 embed / lm_head / norms      ~6.7 GB
    # = ~85 GB of weights and state, ~55 GB left for activations (4,096-token packs), the latent and indexer
    # caches and the allocator. At 32 experts it would be ~118 GB before any activation: too tight.
    "glm-5-h200": Glm5Config(**_layers(4, ("full", "shared", "full", "shared"), 1), n_routed_experts=16),
}
