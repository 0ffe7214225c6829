"""Stored weight formats: low-precision codes with per-block scales, read as float and written back.

A ``WeightFormat`` describes how a (..., N, K) weight is stored as two tensors, its codes and
its scales (one per ``block`` of weight elements), and converts both ways:

=====================  =========================  ===============================  =============
format                 codes                      scales                           block (N, K)
=====================  =========================  ===============================  =============
``FP8_BLOCK128``       e4m3fn (..., N, K)         fp32 ``weight_scale_inv``        128 x 128
                                                  (..., ceil(N/128), ceil(K/128))
``FP8_BLOCK128_E8M0``  e4m3fn (..., N, K)         E8M0 bytes, same grid            128 x 128
``MXFP4``              E2M1 x2: uint8/int8        E8M0 bytes (..., N, K/32)        1 x 32
                       (..., N, K/2), low nibble
                       = even K index
=====================  =========================  ===============================  =============

E8M0 is one exponent byte ``e`` worth ``2**(e - 127)`` (0 is 2**-127, 255 is NaN), stored as uint8
or ``torch.float8_e8m0fnu``.  ``MXFP4`` is ``common/moe/mxfp4.py``'s codec, the one the experts'
kernels and the trainer use (its docstring gives its rules).  For the FP8 formats dequantization is
``code * scale`` in fp32: exact for E8M0 scales (a power of two times a short code), one rounding
for fp32 ones.  The E8M0 FP8 quantizer picks the smallest power of two that brings the block's amax
within 448, then rounds to nearest, ties to even; a weight that some codes and scales of the
format represent comes back bit for bit (an exponent below the stored one only doubles codes up to
half the largest, which stay codes), and canonical codes (each block reaching above 224) come back
byte for byte.  Every step is exact or one IEEE rounding, so every device gives the same bytes.

``QuantRule`` says which checkpoint tensors are stored how (their scale's name, a name pattern);
``DequantizedSource`` reads a checkpoint through rules so a name map sees float weights of their
logical shapes, and records, per tensor, how it was stored (``Stored``) so that
``quantize_for_save`` writes it back the same way.
"""
from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..common._host import cdiv
from ..common.moe.mxfp4 import (E2M1X2_DTYPES, E8M0_BIAS, E8M0_DTYPES, dequantize_mxfp4, e8m0_to_float,
                                quantize_mxfp4)
from ..sync.checksum import dtype_name
from .checkpoint import CheckpointError
from .name_map import _DictSource


def _e8m0_exponents(amax: torch.Tensor, max_code: float) -> torch.Tensor:
    """uint8 ``e``: the smallest ``2**(e - 127)`` with amax <= max_code * 2**(e - 127); 127 for amax 0."""
    mc, ec = math.frexp(max_code)  # max_code = mc * 2**ec
    m, ex = torch.frexp(amax)  # amax = m * 2**ex, m in [0.5, 1): exact, so any device agrees
    k = ex.to(torch.int32) - ec + (m > mc).to(torch.int32)
    k = torch.where(amax == 0, 0, k).clamp_(-E8M0_BIAS, E8M0_BIAS)
    return (k + E8M0_BIAS).to(torch.uint8)


def _expand(scales: torch.Tensor, block: tuple[int, int], N: int, K: int) -> torch.Tensor:
    """(..., ceil(N/br), ceil(K/bc)) -> (..., N, K): element (n, k) gets scale (n // br, k // bc)."""
    br, bc = block
    if br > 1:
        scales = scales.repeat_interleave(br, dim=-2)[..., :N, :]
    if bc > 1:
        scales = scales.repeat_interleave(bc, dim=-1)[..., :K]
    return scales


def _block_amax(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """max |w| over each (br, bc) block of (..., N, K), zero-padded at the edges: (..., nbr, nbc) fp32."""
    *lead, N, K = w.shape
    br, bc = block
    nbr, nbc = cdiv(N, br), cdiv(K, bc)
    a = w.float().abs()
    if (nbr * br, nbc * bc) != (N, K):
        a = torch.nn.functional.pad(a, (0, nbc * bc - K, 0, nbr * br - N))
    return a.reshape(*lead, nbr, br, nbc, bc).amax(dim=(-3, -1))


@dataclass(frozen=True)
class WeightFormat:
    """How a (..., N, K) weight is stored: ``codes`` "e4m3" (float8_e4m3fn) or "e2m1x2" (two E2M1
    per byte along K), ``scales`` "fp32" (HF ``weight_scale_inv``) or "e8m0" (exponent bytes), one
    scale per ``block`` = (rows, cols) of weight elements."""
    name: str
    codes: str
    scales: str
    block: tuple[int, int]

    @property
    def pack(self) -> int:
        """Weight elements per code element along K."""
        return 2 if self.codes == "e2m1x2" else 1

    @property
    def max_code(self) -> float:
        return 6.0 if self.codes == "e2m1x2" else 448.0

    @property
    def code_dtypes(self) -> tuple[torch.dtype, ...]:
        return E2M1X2_DTYPES if self.codes == "e2m1x2" else (torch.float8_e4m3fn,)

    @property
    def scale_dtypes(self) -> tuple[torch.dtype, ...]:
        return E8M0_DTYPES if self.scales == "e8m0" else (torch.float32,)

    def codes_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        *lead, N, K = shape
        return (*lead, N, K // self.pack)

    def scales_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
        *lead, N, K = shape
        return (*lead, cdiv(N, self.block[0]), cdiv(K, self.block[1]))

    def weight_shape(self, codes_shape: Sequence[int]) -> tuple[int, ...]:
        *lead, N, Kc = codes_shape
        return (*lead, N, Kc * self.pack)

    def check_shapes(self, name: str, codes_shape: Sequence[int], scale_name: str, scales_shape: Sequence[int],
                     ) -> tuple[int, ...]:
        """The weight's shape; CheckpointError naming both tensors if they do not fit this format."""
        codes_shape, scales_shape = tuple(codes_shape), tuple(scales_shape)
        if len(codes_shape) < 2:
            raise CheckpointError(f"{name}: {self.name} codes must have >= 2 dims, found {codes_shape}")
        shape = self.weight_shape(codes_shape)
        if shape[-1] % self.block[1] and self.codes == "e2m1x2":
            raise CheckpointError(f"{name}: {self.name} needs K = {shape[-1]} to be a multiple of {self.block[1]}")
        want = self.scales_shape(shape)
        if scales_shape != want:
            raise CheckpointError(f"{scale_name}: expected {want} for {self.name} codes {name} {codes_shape} "
                                  f"(weight {shape}, one scale per {self.block[0]}x{self.block[1]}), "
                                  f"found {scales_shape}")
        return shape

    def check_dtypes(self, name: str, codes_dtype: torch.dtype, scale_name: str, scales_dtype: torch.dtype) -> None:
        for what, dtype, allowed in ((name, codes_dtype, self.code_dtypes), (scale_name, scales_dtype, self.scale_dtypes)):
            if dtype not in allowed:
                raise CheckpointError(f"{what}: stored as {dtype_name(dtype)}; {self.name} "
                                      f"{'codes' if what == name else 'scales'} are "
                                      f"{' or '.join(map(dtype_name, allowed))}")

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                   name: str = "weight", scale_name: str | None = None) -> torch.Tensor:
        """(codes, scales) -> the (..., N, K) weight in ``dtype`` (fp32 product, then one cast)."""
        scale_name = scale_name or f"{name} scales"
        self.check_dtypes(name, codes.dtype, scale_name, scales.dtype)
        shape = self.check_shapes(name, codes.shape, scale_name, scales.shape)
        if self.codes == "e2m1x2":
            return dequantize_mxfp4(codes, scales, dtype, name=name, scale_name=scale_name)
        *_, N, K = shape
        w = codes.float() * _expand(scales if self.scales == "fp32" else e8m0_to_float(scales), self.block, N, K)
        return w if dtype == torch.float32 else w.to(dtype)

    def quantize(self, w: torch.Tensor, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
        """(..., N, K) float weight -> (codes, scales): float8_e4m3fn or packed uint8 codes, fp32 or
        uint8 E8M0 scales (view them as another allowed dtype to store them so); MXFP4 by
        ``quantize_mxfp4``."""
        if not w.dtype.is_floating_point or w.dim() < 2:
            raise TypeError(f"{name}: {self.name} quantizes a float tensor of >= 2 dims, got "
                            f"{dtype_name(w.dtype)} {tuple(w.shape)}")
        if self.codes == "e2m1x2":
            return quantize_mxfp4(w, name=name)
        N, K = w.shape[-2:]
        bad = int((~torch.isfinite(w)).sum())
        if bad:
            raise ValueError(f"{name}: holds {bad} NaN/Inf value(s), which {self.name} cannot encode")
        w = w.detach()
        if self.scales == "fp32":
            from ..common.fp8 import quantize_weight_fp8

            pairs = [quantize_weight_fp8(m) for m in w.reshape(-1, N, K)]
            codes = torch.stack([c for c, _ in pairs]).reshape(w.shape)
            return codes, torch.stack([s for _, s in pairs]).reshape(self.scales_shape(w.shape))
        e = _e8m0_exponents(_block_amax(w, self.block), self.max_code)
        q = w.float() / _expand(e8m0_to_float(e), self.block, N, K)  # a power of two: exact for normals
        return q.clamp_(-self.max_code, self.max_code).to(torch.float8_e4m3fn), e


FP8_BLOCK128 = WeightFormat("fp8_block128", "e4m3", "fp32", (128, 128))
FP8_BLOCK128_E8M0 = WeightFormat("fp8_block128_e8m0", "e4m3", "e8m0", (128, 128))
MXFP4 = WeightFormat("mxfp4", "e2m1x2", "e8m0", (1, 32))
FORMATS = {f.name: f for f in (FP8_BLOCK128, FP8_BLOCK128_E8M0, MXFP4)}


@dataclass(frozen=True)
class QuantRule:
    """Checkpoint tensors stored in ``format``: a weight ``name`` ending in ``suffix`` has its scales
    at ``name[:-len(suffix)] + scale_suffix`` (HF FP8: ``X.weight`` -> ``X.weight_scale_inv``;
    DeepSeek: ``suffix="weight", scale_suffix="scale"``).  ``pattern`` (re.search) limits the rule to
    matching names: reading, a name needs its scale present too; saving (``plan_quantization``),
    the pattern alone picks the names.  ``codes_dtype`` / ``scales_dtype``: how to store on save."""
    format: WeightFormat
    scale_suffix: str = "_scale_inv"
    suffix: str = ""
    pattern: str | None = None
    codes_dtype: torch.dtype | None = None
    scales_dtype: torch.dtype | None = None

    def scale_name(self, name: str) -> str | None:
        """The scale tensor's name for weight ``name``, or None if the rule does not apply to it."""
        if not name.endswith(self.suffix) or (self.pattern is not None and not re.search(self.pattern, name)):
            return None
        return name[: len(name) - len(self.suffix)] + self.scale_suffix


FP8_RULE = QuantRule(FP8_BLOCK128)


@dataclass(frozen=True)
class Stored:
    """How one checkpoint weight is stored: its format, its scale tensor's name and both dtypes."""
    format: WeightFormat
    scale_name: str
    codes_dtype: torch.dtype
    scales_dtype: torch.dtype


def _source_dtype(source, name: str) -> torch.dtype | None:
    get = getattr(source, "dtype", None)
    return get(name) if get is not None else None


class DequantizedSource:
    """A source (``HFCheckpoint``, a ``{name: tensor}`` dict, anything with keys/shape/get) whose quantized
    weights read as fp32 of their logical shape; their scale tensors are consumed, not listed.

    ``rules`` (first match wins) say which names are quantized how; the default reads HF FP8
    (``X`` with ``X_scale_inv``, 128x128 fp32 scales).  ``stored`` maps each quantized name to its
    ``Stored``, for ``quantize_for_save``.  A pair that does not fit its format raises
    ``CheckpointError`` naming both tensors, from the headers (``shape``) where they tell."""

    def __init__(self, source, rules: Sequence[QuantRule] = (FP8_RULE,)):
        self.source = source = _DictSource(source) if isinstance(source, Mapping) else source
        names = list(source.keys())
        present = set(names)
        self.stored: dict[str, Stored] = {}
        self._rule: dict[str, tuple[QuantRule, str]] = {}
        for n in names:
            for rule in rules:
                s = rule.scale_name(n)
                if s is not None and s != n and s in present:
                    self._rule[n] = (rule, s)
                    break
        scales = {s for _, s in self._rule.values()}
        both = sorted(scales & set(self._rule))
        if both:
            raise CheckpointError(f"{source!r}: {both[0]} is both a quantized weight and another's scales")
        self._keys = [n for n in names if n not in scales]
        self._listed = set(self._keys)
        for n, (rule, s) in self._rule.items():
            cd, sd = _source_dtype(source, n), _source_dtype(source, s)
            if cd is not None and sd is not None:
                rule.format.check_dtypes(n, cd, s, sd)
                self.stored[n] = Stored(rule.format, s, cd, sd)

    def keys(self):
        return list(self._keys)

    def __contains__(self, name):
        return name in self._listed

    def shape(self, name):
        found = self._rule.get(name)
        if found is None:
            return self.source.shape(name)
        rule, s = found
        return rule.format.check_shapes(name, self.source.shape(name), s, self.source.shape(s))

    def is_float(self, name):
        return name in self._rule or self.source.is_float(name)

    def dtype(self, name):
        return torch.float32 if name in self._rule else _source_dtype(self.source, name)

    def get(self, name):
        found = self._rule.get(name)
        if found is None:
            return self.source.get(name)
        rule, s = found
        codes, scales = self.source.get(name), self.source.get(s)
        self.stored[name] = Stored(rule.format, s, codes.dtype, scales.dtype)
        return rule.format.dequantize(codes, scales, torch.float32, name=name, scale_name=s)

    def __repr__(self):
        kinds = {}
        for rule, _ in self._rule.values():
            kinds[rule.format.name] = kinds.get(rule.format.name, 0) + 1
        listed = ", ".join(f"{k}: {v}" for k, v in kinds.items()) or "none"
        return f"{self.source!r} (quantized weights dequantized: {listed})"


def plan_quantization(names, rules: Sequence[QuantRule]) -> dict[str, Stored]:
    """{name: Stored} for the ``names`` that a rule's ``pattern`` picks (first match wins), to save
    a model that was not read through ``DequantizedSource``.  Rules need a pattern here: without
    one every tensor, norms included, would be quantized."""
    plan = {}
    for rule in rules:
        if rule.pattern is None:
            raise ValueError(f"a {rule.format.name} rule without a pattern would quantize every tensor; give one")
    for n in names:
        for rule in rules:
            s = rule.scale_name(n)
            if s is not None:
                f = rule.format
                plan[n] = Stored(f, s, rule.codes_dtype or f.code_dtypes[0], rule.scales_dtype or f.scale_dtypes[0])
                break
    return plan


def quantize_for_save(tensors: Mapping[str, torch.Tensor], plan: Mapping[str, Stored]) -> dict[str, torch.Tensor]:
    """HF ``{name: tensor}`` with each name of ``plan`` replaced by its codes (same name) and scales
    (``Stored.scale_name``), in its stored dtypes; the other tensors pass through.  The inverse of
    ``DequantizedSource``: weights it read come back byte for byte when unchanged and canonical."""
    out = {}
    for name, t in tensors.items():
        how = plan.get(name)
        if how is None:
            out[name] = t
            continue
        if how.scale_name in tensors:
            raise ValueError(f"{name}: its scale name {how.scale_name} is also a tensor to save")
        codes, scales = how.format.quantize(t, name=name)
        out[name] = codes.view(how.codes_dtype)
        out[how.scale_name] = scales.view(how.scales_dtype)
    return out
