"""DeepSeek-V4 (mHC residual streams, sliding-window + compressed attention, MXFP4 experts): the fields the
trainer and the server read, named presets, and conversion from / to a transformers ``config.json``
(``DeepseekV4Config``, model_type deepseek_v4).

What transformers' ``modeling_deepseek_v4`` fixes beside these fields:
  - attention is shared-KV MQA: one ``head_dim`` row per token is both key and value; q_b's output gets an
    unweighted RMSNorm per head; the output's rope slice is rotated back (position −t) before ``o_a``;
  - RoPE is interleaved (pairs (2i, 2i + 1) written in place) on the LAST ``qk_rope_head_dim`` dims;
    sliding layers use the "main" table (θ ``rope_theta``, plain), compressed layers and their compressors
    and indexer the "compress" table (θ ``compress_rope_theta``, YaRN with attention_factor forced to 1.0);
  - every norm weight, the mHC ``fn``/``base``/``scale``, the sinks and the compressors' ``position_bias``
    are FP32 (the modules are built ``.to(torch.float32)``);
  - a compressed row of group i sits at position ``i * rate`` and query t reads rows i < (t + 1) // rate.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from ...common.rope import RopeSpec
from ...common.rope.table import Yarn, rope_parameters_hf
from ...weights import CheckpointError
from ..config import check_fields, errors_name, read_config_json, require_keys

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
ATTENTION_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")             # hash_moe: experts picked by tid2eid[input_id]; moe: learned top-k
_RATE_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # the release's per-layer ``compress_ratios``
EXPERT_DTYPES = ("fp4", "fp8", "bf16")


@dataclass(frozen=True)
class V4Quant:
    """A checkpoint's ``quantization_config``: FP8 e4m3 dense linears on 128x128 blocks (scales FP32, or E8M0
    bytes when ``scale_fmt`` is "ue8m0", as the release ships them) and the routed experts in
    ``expert_dtype``: "fp4" = MXFP4 (E2M1 two per byte, one E8M0 scale per 32 along K), "fp8" as the dense
    linears, "bf16" unquantized."""
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str = "fp4"
    activation_scheme: str = "dynamic"

    def __post_init__(self):
        if self.expert_dtype not in EXPERT_DTYPES:
            raise NotImplementedError(f"expert_dtype {self.expert_dtype!r}: supported are {EXPERT_DTYPES}")
        if self.scale_fmt not in (None, "ue8m0"):
            raise NotImplementedError(f"scale_fmt {self.scale_fmt!r}: FP32 scales (none) or 'ue8m0' are supported")

    def to_hf(self) -> dict[str, Any]:
        out = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
               "activation_scheme": self.activation_scheme, "expert_dtype": self.expert_dtype}
        if self.scale_fmt is not None:
            out["scale_fmt"] = self.scale_fmt
        return out

    @classmethod
    def from_hf(cls, q: dict[str, Any], expert_dtype: str | None = None) -> V4Quant:
        """``expert_dtype`` may sit at the config's top level (V4) or inside the quantization config (V4.1)."""
        if q.get("quant_method") != "fp8":
            raise NotImplementedError(f"quantization_config quant_method {q.get('quant_method')!r}: DeepSeek-V4 "
                                      f"checkpoints are 'fp8' (dense e4m3 on 128x128 blocks) + MXFP4 experts")
        if list(q.get("weight_block_size", [128, 128])) != [128, 128]:
            raise NotImplementedError(f"weight_block_size {q.get('weight_block_size')}: only [128, 128]")
        if q.get("fmt", "e4m3") != "e4m3":
            raise NotImplementedError(f"quantization_config fmt {q.get('fmt')!r}: only e4m3 codes are supported")
        return cls(scale_fmt=q.get("scale_fmt"), expert_dtype=q.get("expert_dtype", expert_dtype or "fp8"),
                   activation_scheme=q.get("activation_scheme", "dynamic"))


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int = 129280
    hidden_size: int = 4096                 # H: one residual stream
    num_layers: int = 43
    layer_types: tuple[str, ...] = ()       # () -> transformers' default: 2 x HCA, then HCA / CSA alternating
    # attention (shared-KV MQA)
    num_heads: int = 64                     # Hq; one KV head, read as both K and V
    head_dim: int = 512                     # D: q heads and the shared KV row
    qk_rope_head_dim: int = 64              # Dr: the trailing rotated dims (partial_rotary_factor x D)
    q_lora_rank: int = 1024                 # Rq: q_a's output, the q residual the indexer also reads
    o_groups: int = 8                       # G: heads in G groups, each projected to o_lora_rank by o_a
    o_lora_rank: int = 1024
    sliding_window: int = 128               # every layer attends to the last W positions (itself included)
    compress_rates: tuple[tuple[str, int], ...] = ((CSA, 4), (HCA, 128))
    # the C4 indexer
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512                   # compressed rows each query keeps (all when fewer)
    # mHC
    hc_mult: int = 4                        # residual streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    # MoE (every layer: routed experts + one shared expert)
    mlp_layer_types: tuple[str, ...] = ()   # () -> 3 x hash_moe, then moe
    moe_intermediate_size: int = 2048       # I: one routed expert's width (and the shared expert's)
    n_routed_experts: int = 256             # E
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6            # k
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0              # gate <= limit, up in [-limit, limit], before SiLU(gate) * up
    # RoPE, norms, embeddings
    rope_theta: float = 10_000.0            # "main": sliding layers
    compress_rope_theta: float = 160_000.0  # "compress": CSA / HCA layers, their compressors and the indexer
    compress_yarn: Yarn | None = None
    rms_norm_eps: float = 1e-6
    max_position: int = 1_048_576
    tie_word_embeddings: bool = False
    num_nextn_predict_layers: int = 1       # the checkpoint's mtp layers: not built, skipped at load
    quantization: V4Quant | None = None

    def __post_init__(self):
        name = type(self).__name__
        check_fields(self, ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "qk_rope_head_dim",
                            "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "index_n_heads",
                            "index_head_dim", "index_topk", "hc_mult", "hc_sinkhorn_iters", "moe_intermediate_size",
                            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "max_position"),
                     reals=("rms_norm_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor",
                            "swiglu_limit", "hc_eps"))
        n = self.num_layers
        if not self.layer_types:
            object.__setattr__(self, "layer_types", (HCA,) * min(n, 2) + tuple(
                CSA if i % 2 else HCA for i in range(max(n - 2, 0))))
        if not self.mlp_layer_types:
            object.__setattr__(self, "mlp_layer_types", ("hash_moe",) * min(n, 3) + ("moe",) * max(n - 3, 0))
        object.__setattr__(self, "compress_rates", tuple(sorted(dict(self.compress_rates).items())))
        for field, allowed in (("layer_types", ATTENTION_TYPES), ("mlp_layer_types", MLP_TYPES)):
            types = getattr(self, field)
            if isinstance(types, str) or not hasattr(types, "__iter__"):
                raise ValueError(f"{name}.{field} must be a list of {n} of {allowed}, got {types!r}")
            types = tuple(types)
            object.__setattr__(self, field, types)
            if len(types) != n:
                raise ValueError(f"{name}.{field} has {len(types)} entries for num_layers {n}: {list(types)}")
            bad = sorted({t for t in types if t not in allowed}, key=str)
            if bad:
                raise ValueError(f"{name}.{field}: {bad} not among {allowed}")
        rates = dict(self.compress_rates)
        for t in (CSA, HCA):
            r = rates.get(t)
            if t in self.layer_types and (not isinstance(r, int) or isinstance(r, bool) or r < 2):
                raise ValueError(f"{name}.compress_rates[{t!r}] must be an int >= 2, got {r!r}")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"{name}.qk_rope_head_dim {self.qk_rope_head_dim} must be even and fit head_dim "
                             f"{self.head_dim} and index_head_dim {self.index_head_dim}")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"{name}: num_heads x head_dim = {self.num_heads * self.head_dim} is not a multiple "
                             f"of o_groups {self.o_groups}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError(f"{name}.num_experts_per_tok {self.num_experts_per_tok} > n_routed_experts "
                             f"{self.n_routed_experts}")
        if self.scoring_func != "sqrtsoftplus":
            raise NotImplementedError(f"{name}.scoring_func {self.scoring_func!r}: DeepSeek-V4 scores with "
                                      f"sqrtsoftplus; other routers are not built")
        if not isinstance(self.norm_topk_prob, bool):
            raise ValueError(f"{name}.norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.compress_yarn is not None and not isinstance(self.compress_yarn, Yarn):
            raise ValueError(f"{name}.compress_yarn must be a Yarn or None, got {self.compress_yarn!r}")
        if self.quantization is not None and not isinstance(self.quantization, V4Quant):
            raise ValueError(f"{name}.quantization must be a V4Quant or None, got {self.quantization!r}")

    # ---------------------------------------------------------------- derived sizes
    def rate(self, layer: int) -> int:
        """The layer's compression rate: 0 for a sliding-only layer."""
        return dict(self.compress_rates).get(self.layer_types[layer], 0)

    @property
    def csa_layers(self) -> tuple[int, ...]:
        """The layers with a C4 compressor and the indexer."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == CSA)

    @property
    def hca_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == HCA)

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_layer_types) if t == "hash_moe")

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    @property
    def hc_weights(self) -> int:
        """(2 + N) x N: the pre (N), post (N) and comb (N x N) coefficients one HyperConnection makes."""
        return (2 + self.hc_mult) * self.hc_mult

    @property
    def main_rope(self) -> RopeSpec:
        """Sliding layers: interleaved pairs on the last Dr dims, θ rope_theta, no scaling."""
        return RopeSpec(rotary_dim=self.qk_rope_head_dim, base=self.rope_theta, max_position=self.max_position,
                        pairing="interleaved", rotary_slice="last")

    @property
    def compress_rope(self) -> RopeSpec:
        """CSA / HCA layers, their compressed rows and the indexer's queries and keys."""
        return self.main_rope.replace(base=self.compress_rope_theta, yarn=self.compress_yarn)

    def rope_for(self, layer: int) -> RopeSpec:
        return self.main_rope if self.layer_types[layer] == SLIDING else self.compress_rope

    @property
    def softmax_scale(self) -> float:
        """head_dim^-0.5: no YaRN mscale (transformers forces the compress table's attention_factor to 1)."""
        return self.head_dim ** -0.5

    @property
    def indexer_scale(self) -> float:
        """The indexer's q·k scale index_head_dim^-0.5; its head weights are also scaled by index_n_heads^-0.5."""
        return self.index_head_dim ** -0.5

    def replace(self, **changes) -> DeepseekV4Config:
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str) -> DeepseekV4Config:
        if name not in PRESETS:
            raise ValueError(f"unknown deepseek_v4_mhc_mxfp4 preset {name!r}; known: {', '.join(PRESETS)}")
        return PRESETS[name]

    @classmethod
    def from_hf(cls, config: dict[str, Any] | str | os.PathLike, *, where: str | None = None) -> DeepseekV4Config:
        """From a transformers ``config.json`` (a path, its directory or the dict) of model_type deepseek_v4,
        including the legacy keys the release ships (``compress_ratios`` per layer, ``compress_rate_csa`` /
        ``_hca``, ``num_hash_layers``, ``qk_rope_head_dim``, a top-level ``expert_dtype``), folded in as
        ``DeepseekV4Config.__post_init__`` folds them."""
        config, where = read_config_json(config, "deepseek_v4_mhc_mxfp4", where)
        require_keys(config, _REQUIRED_HF, where, "a DeepSeek-V4 (deepseek_v4) config")
        unsupported = {k: config[k] for k in ("attention_bias", "mlp_bias") if config.get(k)}
        for key, fits in (("hidden_act", "silu"), ("scoring_func", "sqrtsoftplus"), ("num_key_value_heads", 1)):
            if key in config and config[key] != fits:
                unsupported[key] = config[key]
        if unsupported:
            raise NotImplementedError(f"{where}: deepseek_v4 options not supported: {unsupported}")
        n = config["num_hidden_layers"]
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise CheckpointError(f"{where}: num_hidden_layers must be a positive int, got {n!r}")
        with errors_name(where):
            rates = dict(config.get("compress_rates") or {CSA: 4, HCA: 128})
            for key, t in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
                if config.get(key) is not None:
                    rates[t] = config[key]
            layer_types = _list(config, "layer_types")
            if layer_types is None and config.get("compress_ratios") is not None:
                ratios = _list(config, "compress_ratios")
                unknown = sorted({r for r in ratios if r not in _RATE_TYPES}, key=str)
                if unknown:
                    raise ValueError(f"compress_ratios has {unknown}; known are {sorted(_RATE_TYPES)}")
                layer_types = tuple(_RATE_TYPES[r] for r in ratios)
            mlp_types = _list(config, "mlp_layer_types")
            if mlp_types is None:
                n_hash = config.get("num_hash_layers", 3)
                mlp_types = ("hash_moe",) * min(n, n_hash) + ("moe",) * max(n - n_hash, 0)
            head_dim = config.get("head_dim", 512)
            q = config.get("quantization_config")
            quant = V4Quant.from_hf(q, config.get("expert_dtype")) if q else None
            main = RopeSpec.from_hf(config, rope_key="main")
            compress = RopeSpec.from_hf(config, rope_key="compress")
            if main.rotary_dim != compress.rotary_dim:
                raise ValueError(f"rope_parameters rotate {main.rotary_dim} (main) and {compress.rotary_dim} "
                                 f"(compress) dims: one qk_rope_head_dim is part of DeepSeek-V4")
            return cls(
                vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=n,
                layer_types=tuple(layer_types[:n]) if layer_types else (), num_heads=config["num_attention_heads"],
                head_dim=head_dim, qk_rope_head_dim=main.rotary_dim, q_lora_rank=config["q_lora_rank"], o_groups=config.get("o_groups", 8),
                o_lora_rank=config.get("o_lora_rank", 1024), sliding_window=config.get("sliding_window", 128),
                compress_rates=tuple(rates.items()), index_n_heads=config.get("index_n_heads", 64),
                index_head_dim=config.get("index_head_dim", 128), index_topk=config.get("index_topk", 512),
                hc_mult=config.get("hc_mult", 4), hc_sinkhorn_iters=config.get("hc_sinkhorn_iters", 20),
                hc_eps=config.get("hc_eps", 1e-6), mlp_layer_types=tuple(mlp_types[:n]),
                moe_intermediate_size=config["moe_intermediate_size"],
                n_routed_experts=config.get("n_routed_experts", 256),
                n_shared_experts=config.get("n_shared_experts", 1),
                num_experts_per_tok=config.get("num_experts_per_tok", 6),
                scoring_func=config.get("scoring_func", "sqrtsoftplus"),
                norm_topk_prob=config.get("norm_topk_prob", True),
                routed_scaling_factor=config.get("routed_scaling_factor", 1.5),
                swiglu_limit=config.get("swiglu_limit", 10.0), rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                max_position=config.get("max_position_embeddings", 1_048_576),
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                num_nextn_predict_layers=config.get("num_nextn_predict_layers", 1) or 1, quantization=quant,
                rope_theta=main.base, compress_rope_theta=compress.base, compress_yarn=compress.yarn,
            )

    def to_hf(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """A transformers config.json dict that ``DeepseekV4Config(**d)`` and ``DeepseekV4ForCausalLM`` load."""
        partial = self.qk_rope_head_dim / self.head_dim
        main = {"rope_type": "default", "rope_theta": self.rope_theta, "partial_rotary_factor": partial}
        compress = {**rope_parameters_hf(self.compress_rope_theta, self.compress_yarn), "partial_rotary_factor": partial}
        out = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types), "num_attention_heads": self.num_heads, "num_key_value_heads": 1,
            "head_dim": self.head_dim, "partial_rotary_factor": partial, "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups, "o_lora_rank": self.o_lora_rank, "sliding_window": self.sliding_window,
            "compress_rates": dict(self.compress_rates), "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim, "index_topk": self.index_topk, "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters, "hc_eps": self.hc_eps,
            "mlp_layer_types": list(self.mlp_layer_types), "moe_intermediate_size": self.moe_intermediate_size,
            "n_routed_experts": self.n_routed_experts, "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok, "scoring_func": self.scoring_func,
            "norm_topk_prob": self.norm_topk_prob, "routed_scaling_factor": self.routed_scaling_factor,
            "swiglu_limit": self.swiglu_limit, "hidden_act": "silu", "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta, "rope_parameters": {"main": main, "compress": compress},
            "rms_norm_eps": self.rms_norm_eps, "max_position_embeddings": self.max_position,
            "tie_word_embeddings": self.tie_word_embeddings, "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, "dtype": torch_dtype,
        }
        if self.quantization is not None:
            out["quantization_config"] = self.quantization.to_hf()
        return out


_REQUIRED_HF = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "q_lora_rank",
                "moe_intermediate_size")


def _list(config: dict, key: str) -> tuple | None:
    """A per-layer list from config.json (None when absent); a string is refused, not split into letters."""
    v = config.get(key)
    if v is None:
        return None
    if isinstance(v, str) or not isinstance(v, (list, tuple)):
        raise ValueError(f"{key} must be a list with one entry per layer, got {v!r}")
    return tuple(v)


# Flash's compress table: YaRN x16 over a 64K original context (transformers' attention_factor 1.0).
_FLASH_YARN = Yarn(factor=16.0, original_max_position_embeddings=65536, beta_fast=32.0, beta_slow=1.0,
                   attention_factor=1.0)

# Odd sizes on purpose, CPU-fast; a ~1,000-token ladder sequence crosses ~250 C4 and ~60 C16 groups, leaves
# the 40-token window many times over, and the indexer keeps 24 of up to ~250 compressed rows. Layers:
# HCA (hash-routed), CSA, sliding, CSA; 9 experts, top-3; K of every MXFP4 matrix a multiple of 32.
_TINY = DeepseekV4Config(
    vocab_size=151, hidden_size=64, num_layers=4, layer_types=(HCA, CSA, SLIDING, CSA), num_heads=3,
    head_dim=40, qk_rope_head_dim=16, q_lora_rank=36, o_groups=3, o_lora_rank=20, sliding_window=40,
    compress_rates=((CSA, 4), (HCA, 16)), index_n_heads=3, index_head_dim=24, index_topk=24,
    mlp_layer_types=("hash_moe", "moe", "moe", "moe"), moe_intermediate_size=32, n_routed_experts=9,
    num_experts_per_tok=3, compress_yarn=Yarn(factor=4.0, original_max_position_embeddings=2048,
                                              attention_factor=1.0), max_position=8192)

PRESETS: dict[str, DeepseekV4Config] = {
    "tiny": _TINY,
    # The same with the experts as frozen MXFP4 codes (the release's format), computed packed.
    "tiny-mxfp4": _TINY.replace(quantization=V4Quant(expert_dtype="fp4")),
    # DeepSeek-V4-Flash's shapes (DeepseekV4Config's defaults; a release config.json brings its own layer list).
    "deepseek-v4-flash": DeepseekV4Config(compress_yarn=_FLASH_YARN),
    # Real per-layer shapes (hidden 4096, 64 heads x 512, q_lora 1024, o 8 x 1024, window 128, C4 + C128,
    # indexer 64 x 128 top-512, experts 2048 wide, top-6, vocab 129,280), cut to 4 layers (HCA, CSA, HCA, CSA; one
    # hash-routed) and 16 routed experts (of 256) so that a full-weight trainer and the server fit one H200:
    #   embed + lm_head 2 x 129,280 x 4,096                      1.059 B
    #   attention ~0.115 B x 4 (q_a/q_b, kv, o_a/o_b, compressors, indexer)   0.46 B
    #   experts 4 x (16 + 1) x 25.2 M                            1.71 B
    #   total ~3.2 B: FP32 master + grad + Adam = 16 B/param     ~52 GB, the server's MXFP4 / bf16 copy ~4 GB
    "deepseek-v4-h200": DeepseekV4Config(num_layers=4, layer_types=(HCA, CSA, HCA, CSA),
                                         mlp_layer_types=("hash_moe", "moe", "moe", "moe"), n_routed_experts=16,
                                         compress_yarn=_FLASH_YARN),
}
