"""RoPE specification and its FP32 cos/sin table, built once on the CPU.

The table is a pure function of ``(rotary_dim, base, max_position, yarn)``:

    inv_freq[i] = the fp32 inverse frequencies exactly as transformers computes
                  them (``_compute_yarn_parameters`` / ``compute_default_rope_parameters``,
                  same torch fp32 ops, so the same bits; tests check it)
    cos[p, i]   = RN_fp32(attention_factor * cos(p * inv_freq[i]))      # exact reals
    sin[p, i]   = RN_fp32(attention_factor * sin(p * inv_freq[i]))

``p * inv_freq[i]`` is exact in float64 (p < 2**24, inv_freq has 24 significand
bits, so the product fits in 48).  cos/sin are evaluated in float64 (error of a
few float64 ulps) and rounded to fp32; an entry whose float64 value lies so near
an fp32 rounding boundary that a few ulps could flip it (about 1 in 2**21) is
recomputed with mpmath at 160 bits.  So every entry is the correctly rounded
fp32 value, independent of the machine, its vector ISA and libm: trainer and
server build the same bits anywhere.  It is never computed on the GPU (CUDA and
CPU sin/cos differ; the seeds saw tables diverge at position 593); the CPU table
is copied to each device once and cached there.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

PAIRINGS = ("half", "interleaved", "interleaved_to_half")
SLICES = ("first", "last")
MAX_TABLE_POSITIONS = 1 << 24  # keeps p * inv_freq exact in float64

# (pairing, rotary_slice) per transformers model_type; see RopeSpec.from_hf.
_MODEL_LAYOUT = {
    "qwen3": ("half", "first"),
    "qwen3_moe": ("half", "first"),
    "qwen3_5_moe": ("half", "first"),
    "qwen3_5_moe_text": ("half", "first"),
    "qwen3_5": ("half", "first"),
    "qwen3_5_text": ("half", "first"),
    "glm_moe_dsa": ("interleaved_to_half", "last"),
    "deepseek_v4": ("interleaved", "last"),
}


@dataclass(frozen=True)
class Yarn:
    """YaRN parameters, named as in transformers' ``rope_parameters``."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if not self.factor > 0:
            raise ValueError(f"Yarn.factor must be > 0, got {self.factor}")
        if not self.original_max_position_embeddings > 0:
            raise ValueError(f"Yarn.original_max_position_embeddings must be > 0, got {self.original_max_position_embeddings}")

    def resolved_attention_factor(self) -> float:
        """The cos/sin multiplier, as ``_compute_yarn_parameters`` derives it."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def get_mscale(scale, mscale=1):
            return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return float(get_mscale(self.factor, self.mscale) / get_mscale(self.factor, self.mscale_all_dim))
        return float(get_mscale(self.factor))


@dataclass(frozen=True)
class RopeSpec:
    """How to rotate: the table parameters plus the pairing and where the
    rotary slice sits in the head.

    rotary_dim:   channels rotated (even, <= head_dim); the rest pass through.
    base:         rope_theta.
    max_position: table rows; positions must lie in [0, max_position).
    pairing:      "half"                pairs (i, i + r/2), written back in place
                                         (Qwen ``rotate_half``);
                  "interleaved"         pairs (2i, 2i + 1), written back in place
                                         (DeepSeek-V4);
                  "interleaved_to_half" pairs (2i, 2i + 1) read, results written
                                         to (i, i + r/2) (GLM-5 / DeepSeek-V3 MLA,
                                         transformers' ``apply_rotary_pos_emb_interleave``).
    rotary_slice: "first" rotates x[..., :r] (Qwen3.5, GLM indexer);
                  "last"  rotates x[..., D - r:] (DeepSeek-V4, a [nope | rope] head).
    yarn:         YaRN scaling, or None for the plain ("default") RoPE.
    """

    rotary_dim: int
    base: float
    max_position: int
    pairing: str = "half"
    rotary_slice: str = "first"
    yarn: Yarn | None = None

    def __post_init__(self):
        if not isinstance(self.rotary_dim, int) or self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"RopeSpec.rotary_dim must be a positive even int, got {self.rotary_dim!r}")
        if not (isinstance(self.base, (int, float)) and self.base > 1):
            raise ValueError(f"RopeSpec.base (rope_theta) must be > 1, got {self.base!r}")
        if not isinstance(self.max_position, int) or not 0 < self.max_position <= MAX_TABLE_POSITIONS:
            raise ValueError(f"RopeSpec.max_position must be an int in [1, {MAX_TABLE_POSITIONS}], got {self.max_position!r}")
        if self.pairing not in PAIRINGS:
            raise ValueError(f"RopeSpec.pairing must be one of {PAIRINGS}, got {self.pairing!r}")
        if self.rotary_slice not in SLICES:
            raise ValueError(f"RopeSpec.rotary_slice must be one of {SLICES}, got {self.rotary_slice!r}")
        if self.yarn is not None and not isinstance(self.yarn, Yarn):
            raise TypeError(f"RopeSpec.yarn must be a Yarn or None, got {type(self.yarn).__name__}")
        object.__setattr__(self, "base", float(self.base))

    @property
    def table_key(self) -> tuple:
        """What the cos/sin table depends on (pairing and slice do not)."""
        return (self.rotary_dim, self.base, self.max_position, self.yarn)

    def rotary_offset(self, head_dim: int) -> int:
        return 0 if self.rotary_slice == "first" else head_dim - self.rotary_dim

    def replace(self, **changes) -> "RopeSpec":
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_hf(
        cls,
        config: Any,
        *,
        rope_key: str | None = None,
        max_position: int | None = None,
        pairing: str | None = None,
        rotary_slice: str | None = None,
    ) -> "RopeSpec":
        """Build a spec from a transformers config (object, or a config.json dict).

        A dict is first turned into its transformers config class
        (``AutoConfig.for_model``), so legacy ``rope_scaling`` / ``rope_theta`` /
        ``partial_rotary_factor`` keys are normalised exactly as transformers
        does.  ``rope_key`` picks one entry of a nested ``rope_parameters``
        (DeepSeek-V4: "main" for sliding layers, "compress" for CSA/HCA).
        ``rotary_dim = int(head_dim * partial_rotary_factor)`` as in transformers.
        Pairing and slice default per model_type (qwen3*/qwen3_5*: half, first;
        glm_moe_dsa: interleaved_to_half, last — the main attention's
        [nope | rope] query; pass rotary_slice="first" for its indexer;
        deepseek_v4: interleaved, last).  Qwen3.5's mRoPE sections collapse to
        plain RoPE for text, whose three position axes are equal.
        ``max_position`` defaults to ``max_position_embeddings``.
        """
        if isinstance(config, Mapping):
            config = _config_from_dict(dict(config))
        if hasattr(config, "get_text_config"):
            config = config.get_text_config()
        rp = getattr(config, "rope_parameters", None) or {}
        nested = {k: v for k, v in rp.items() if isinstance(v, Mapping)}
        if rope_key is not None:
            if rope_key not in nested:
                raise ValueError(f"rope_key={rope_key!r} not in the config's rope_parameters (keys: {sorted(nested) or 'none, flat'})")
            rp = nested[rope_key]
        elif nested:
            raise ValueError(f"config has per-type rope_parameters {sorted(nested)}; pass rope_key=")
        rope_type = rp.get("rope_type", rp.get("type", "default"))
        if rope_type not in ("default", "yarn"):
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, yarn are)")
        base = rp.get("rope_theta", getattr(config, "rope_theta", None))
        if base is None:
            raise ValueError("config has no rope_theta")
        partial = rp.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None)) or 1.0
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        max_pos_emb = getattr(config, "max_position_embeddings", None)
        yarn = None
        if rope_type == "yarn":
            orig = rp["original_max_position_embeddings"]
            factor = rp.get("factor")
            if factor is None:  # DeepSeek-V3 style: the ratio of the two lengths
                factor = max_pos_emb / orig
            yarn = Yarn(
                factor=float(factor),
                original_max_position_embeddings=int(orig),
                beta_fast=float(rp.get("beta_fast") or 32),
                beta_slow=float(rp.get("beta_slow") or 1),
                mscale=rp.get("mscale"),
                mscale_all_dim=rp.get("mscale_all_dim"),
                attention_factor=rp.get("attention_factor"),
                # transformers reads `truncate` from the top-level dict even when nested
                truncate=bool(rp.get("truncate", (getattr(config, "rope_parameters", None) or {}).get("truncate", True))),
            )
        default_pairing, default_slice = _MODEL_LAYOUT.get(getattr(config, "model_type", ""), ("half", "first"))
        return cls(
            rotary_dim=int(head_dim * partial),
            base=float(base),
            max_position=int(max_position if max_position is not None else max_pos_emb),
            pairing=pairing or default_pairing,
            rotary_slice=rotary_slice or default_slice,
            yarn=yarn,
        )


def rope_parameters_hf(base: float, yarn: Yarn | None) -> dict[str, Any]:
    """The ``rope_parameters`` dict of a transformers config.json for plain or YaRN RoPE: what
    ``RopeSpec.from_hf`` reads back into the same ``base`` and ``yarn``."""
    if yarn is None:
        return {"rope_type": "default", "rope_theta": base}
    rope = {"rope_type": "yarn", "rope_theta": base, "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast, "beta_slow": yarn.beta_slow}
    rope.update({k: getattr(yarn, k) for k in ("mscale", "mscale_all_dim", "attention_factor")
                 if getattr(yarn, k) is not None})
    if not yarn.truncate:
        rope["truncate"] = False
    return rope


def _config_from_dict(d: dict):
    from transformers import AutoConfig

    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ValueError("config dict has no model_type; pass a transformers config object instead")
    return AutoConfig.for_model(model_type, **d)


def inv_freq_and_attention_factor(rotary_dim: int, base: float, yarn: Yarn | None) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies (rotary_dim // 2,) and the cos/sin multiplier.

    The same torch fp32 operations, in the same order, as transformers'
    ``compute_default_rope_parameters`` and ``_compute_yarn_parameters``: the
    same bits (tests compare with ``torch.equal``).
    """
    dim = rotary_dim
    if yarn is None:
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0

    factor = yarn.factor

    def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
        return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings, truncate):
        low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
        high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
        if truncate:
            low = math.floor(low)
            high = math.ceil(high)
        return max(low, 0), min(high, dim - 1)

    def linear_ramp_factor(lo, hi, dim):
        if lo == hi:
            hi += 0.001
        return torch.clamp((torch.arange(dim, dtype=torch.float32) - lo) / (hi - lo), 0, 1)

    pos_freqs = base ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_freq_extrapolation = 1.0 / pos_freqs
    inv_freq_interpolation = 1.0 / (factor * pos_freqs)
    low, high = find_correction_range(
        yarn.beta_fast, yarn.beta_slow, dim, base, yarn.original_max_position_embeddings, yarn.truncate
    )
    extrapolation = 1 - linear_ramp_factor(low, high, dim // 2).to(dtype=torch.float)
    inv_freq = inv_freq_interpolation * (1 - extrapolation) + inv_freq_extrapolation * extrapolation
    return inv_freq, yarn.resolved_attention_factor()


# Relative half-width of the band around an fp32 rounding boundary inside which
# the float64 value is not trusted: 2**-45 is 128 float64 ulps, far above the
# few-ulp error of float64 cos/sin and the one rounding of the multiply.
_TRUST_REL = 2.0**-45
_TRUST_ABS = 2.0**-62
_CHUNK_POSITIONS = 1 << 15


def _exact_fp32(fn_name: str, angle: float, scale: float) -> float:
    import mpmath

    with mpmath.workprec(160):
        v = getattr(mpmath, fn_name)(mpmath.mpf(angle)) * mpmath.mpf(scale)
    with mpmath.workprec(24):  # fp32's 24-bit significand, round to nearest even
        return float(+v)


def _round_fp32(v64: torch.Tensor, angle: torch.Tensor, scale: float, fn_name: str, trust_rel: float) -> torch.Tensor:
    out = v64.to(torch.float32)
    margin = torch.clamp(v64.abs() * trust_rel, min=_TRUST_ABS)
    unsure = ((v64 - margin).to(torch.float32) != (v64 + margin).to(torch.float32)) & (angle != 0)  # sin(0) = 0 exactly
    unsure = unsure.nonzero()
    for idx in unsure.tolist():
        out[tuple(idx)] = _exact_fp32(fn_name, angle[tuple(idx)].item(), scale)
    return out


def build_table(spec_or_key, *, trust_rel: float = _TRUST_REL) -> tuple[torch.Tensor, torch.Tensor]:
    """Build (uncached) the CPU fp32 (cos, sin) tables, each (max_position, rotary_dim // 2).

    ``trust_rel`` widens the band sent to the exact path (tests use it to drive
    many entries through mpmath); it never changes the result.
    """
    rotary_dim, base, max_position, yarn = spec_or_key.table_key if isinstance(spec_or_key, RopeSpec) else spec_or_key
    inv_freq, scale = inv_freq_and_attention_factor(rotary_dim, base, yarn)
    inv64 = inv_freq.double()  # (R/2,), exact
    half = rotary_dim // 2
    cos = torch.empty(max_position, half, dtype=torch.float32)
    sin = torch.empty(max_position, half, dtype=torch.float32)
    for p0 in range(0, max_position, _CHUNK_POSITIONS):
        p1 = min(p0 + _CHUNK_POSITIONS, max_position)
        angle = torch.arange(p0, p1, dtype=torch.float64)[:, None] * inv64[None, :]  # (P, R/2), exact
        cos[p0:p1] = _round_fp32(torch.cos(angle) * scale, angle, scale, "cos", trust_rel)
        sin[p0:p1] = _round_fp32(torch.sin(angle) * scale, angle, scale, "sin", trust_rel)
    return cos, sin


_CPU_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_DEVICE_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rope_table(spec: RopeSpec, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """The cached fp32 (cos, sin) tables of ``spec`` on ``device``.

    Built once per table key on the CPU, copied once per device.  Warm it up
    before CUDA-graph capture (the first call allocates and copies).
    """
    key = spec.table_key
    if key not in _CPU_TABLES:
        _CPU_TABLES[key] = build_table(key)
    device = torch.device(device)
    if device.type == "cpu":
        return _CPU_TABLES[key]
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    dkey = (key, str(device))
    if dkey not in _DEVICE_TABLES:
        cos, sin = _CPU_TABLES[key]
        _DEVICE_TABLES[dkey] = (cos.to(device), sin.to(device))
    return _DEVICE_TABLES[dkey]


def clear_rope_tables() -> None:
    _CPU_TABLES.clear()
    _DEVICE_TABLES.clear()
