"""MXFP4 (DeepSeek-V4's experts): the package's one codec.  Checkpoint load and save
(``weights.formats.MXFP4``), the experts' CPU path and straight-through backward, and the
trainer's requantization go through it; the Triton kernels decode the same values in registers.

Layout of a (..., N, K) weight, K % 32 == 0: ``codes`` (..., N, K/2), byte j of a row holding
elements 2j (low nibble) and 2j + 1 (high nibble), stored as uint8, int8 (DeepSeek-V4's
checkpoints) or float4_e2m1fn_x2; ``scales`` (..., N, K/32), one E8M0 byte s per 32 along K
worth 2^(s - 127), stored as uint8 or float8_e8m0fnu.

Decode (transformers 5.25's ``Fp8Dequantize`` bit for bit): a nibble is E2M1, a sign bit over
{0, 0.5, 1, 1.5, 2, 3, 4, 6} (code 8 is -0.0); the weight is value x scale in fp32, then one cast.
Scale byte 0 is 2^-127 (a subnormal fp32, as torch's float8_e8m0fnu reads it), 255 is E8M0's NaN:
its 32 weights decode as NaN.  The scale is built from its bits (no pow), and every product is a
2-bit significand times a power of two: exact in fp32 and in bf16, the same bits on every device.

Encode (``quantize_mxfp4``), per group of 32: the exponent e is OCP's floor(log2 amax) - 2 taken
of amax rounded to E2M1's two significant bits (so +1 when amax's mantissa is 1.75 or more), at
least -127; codes are the nearest E2M1 value of w / 2^e (exact), ties to the even code, |q| > 6
saturating, the sign bit kept (-0.0 and negatives that round to 0 give code 8).  An all-zero
group gets scale 1 (byte 127).  Why this rule: amax / 2^e lands in [3.5, 7), so every group's
largest code is 4 or 6 -- encode(decode(codes, scales)) gives those codes and scales back, the
encoder's output included, so a weight sync of unchanged blocks ships nothing -- and no weight is
off by more than its scale (half the 4 -> 6 step), where OCP's rule clips (7, 8) to 6 (two scales)
and the smallest scale that fits 6 doubles the step of groups topping in (6, 7): on Gaussian
weights ~3% less error than either (``tests/test_mxfp4_codec.py``).  Any codes, canonical or not,
decode to values that encode back to the same values.
"""
from __future__ import annotations

import torch

GROUP = 32  # K elements per E8M0 scale
E8M0_BIAS = 127
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# |q| above threshold i rounds up from code i; on a tie (==) it goes to the even code, so '>=' where i + 1 is even
_E2M1_UP = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
_FP4_DTYPE = getattr(torch, "float4_e2m1fn_x2", None)
_E8M0_DTYPE = getattr(torch, "float8_e8m0fnu", None)
E2M1X2_DTYPES = tuple(d for d in (torch.uint8, torch.int8, _FP4_DTYPE) if d is not None)
E8M0_DTYPES = tuple(d for d in (torch.uint8, _E8M0_DTYPE) if d is not None)
_ROWS_STEP = 1 << 22  # elements an encoder pass takes: its temporaries are ~12 bytes an element


def _names(dtypes) -> str:
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def check_mx_shape(name: str, K: int) -> None:
    if K % GROUP:
        raise ValueError(f"{name}: MXFP4 needs K % {GROUP} == 0 (one E8M0 scale per {GROUP} along K), got K={K}")


def check_mxfp4(codes: torch.Tensor, scales: torch.Tensor, name: str = "weight",
                scale_name: str | None = None) -> tuple[int, ...]:
    """The (..., N, K) weight shape of ``codes`` and ``scales``; ValueError naming the tensor whose dtype
    or shape does not fit (``scale_name`` defaults to "<name> scales")."""
    scale_name = scale_name or f"{name} scales"
    if codes.dtype not in E2M1X2_DTYPES:
        raise ValueError(f"{name}: MXFP4 codes are {_names(E2M1X2_DTYPES)} (two E2M1 a byte), got "
                         f"{str(codes.dtype).removeprefix('torch.')}")
    if scales.dtype not in E8M0_DTYPES:
        raise ValueError(f"{scale_name}: MXFP4 scales are {_names(E8M0_DTYPES)} (E8M0), got "
                         f"{str(scales.dtype).removeprefix('torch.')}")
    if codes.dim() < 1:
        raise ValueError(f"{name}: MXFP4 codes need a K/2 dim, got a scalar")
    *lead, half = codes.shape
    check_mx_shape(name, 2 * half)
    want = (*lead, 2 * half // GROUP)
    if tuple(scales.shape) != want:
        raise ValueError(f"{scale_name}: expected {want} for MXFP4 codes {name} {tuple(codes.shape)} (one scale "
                         f"per {GROUP} along K = {2 * half}), found {tuple(scales.shape)}")
    return (*lead, 2 * half)


def e8m0_to_float(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8 or float8_e8m0fnu) -> fp32 2^(s - 127) from its bits (no pow): 0 is the
    subnormal 2^-127, 255 is NaN (torch's float8_e8m0fnu cast gives the same values)."""
    i = scales.view(torch.uint8).to(torch.int32)
    return torch.where(i == 0, 0x00400000, torch.where(i == 255, 0x7FC00000, i << 23)).view(torch.float32)


_PAIRS: dict[torch.device, torch.Tensor] = {}


def _byte_pairs(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: byte b's two E2M1 values, the low nibble first."""
    if device not in _PAIRS:
        lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=device)
        b = torch.arange(256, device=device)
        _PAIRS[device] = torch.stack([lut[b & 15], lut[b >> 4]], -1)
    return _PAIRS[device]


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 (..., K/2) bytes -> fp32 (..., K), unscaled; the low nibble is the even K index."""
    return _byte_pairs(codes.device)[codes.view(torch.uint8).int()].flatten(-2)


def e2m1_encode(q: torch.Tensor) -> torch.Tensor:
    """fp32 (..., K) -> packed E2M1 uint8 (..., K/2): the nearest code, ties to the even one, |q| > 6
    saturating, the sign bit kept."""
    a = q.abs()
    idx = torch.zeros(q.shape, dtype=torch.uint8, device=q.device)
    for t, on_tie in _E2M1_UP:
        idx += (a >= t) if on_tie else (a > t)
    idx |= torch.signbit(q).to(torch.uint8) << 3
    return idx[..., 0::2] | (idx[..., 1::2] << 4)


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32, *,
                     name: str = "weight", scale_name: str | None = None) -> torch.Tensor:
    """(..., N, K/2) codes, (..., N, K/32) scales -> (..., N, K) ``dtype`` (module docstring: exact, the
    fp32 product then one cast).  A byte's pair from a 256-entry table, times its group's scale in place:
    ~10 bytes of temporaries a weight (the straight-through backward decodes whole expert groups)."""
    shape = check_mxfp4(codes, scales, name, scale_name)
    v = _byte_pairs(codes.device)[codes.view(torch.uint8).int()]  # (..., K/2, 2)
    v = v.view(*shape[:-1], shape[-1] // GROUP, GROUP).mul_(e8m0_to_float(scales).unsqueeze(-1)).view(shape)
    return v if dtype == torch.float32 else v.to(dtype)


def quantize_mxfp4(w: torch.Tensor, *, name: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) float -> (codes (..., N, K/2) uint8, scales (..., N, K/32) uint8), the module
    docstring's rule (view them as int8 / float8_e8m0fnu to store them so).  NaN/Inf refused."""
    if not w.dtype.is_floating_point:
        raise ValueError(f"{name}: MXFP4 encodes a float tensor, got {str(w.dtype).removeprefix('torch.')}")
    if w.dim() < 1:
        raise ValueError(f"{name}: MXFP4 encodes a tensor with a K dim, got a scalar")
    K = w.shape[-1]
    check_mx_shape(name, K)
    bad = int((~torch.isfinite(w)).sum())
    if bad:
        raise ValueError(f"{name}: holds {bad} NaN/Inf value(s), which MXFP4 cannot encode")
    rows = w.detach().reshape(-1, K)
    step = max(1, _ROWS_STEP // K)
    parts = [_quantize_rows(rows[i : i + step]) for i in range(0, rows.shape[0], step)] or [_quantize_rows(rows)]
    codes = parts[0][0] if len(parts) == 1 else torch.cat([p[0] for p in parts])
    scales = parts[0][1] if len(parts) == 1 else torch.cat([p[1] for p in parts])
    return codes.reshape(*w.shape[:-1], K // 2), scales.reshape(*w.shape[:-1], K // GROUP)


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    g = w.float().reshape(w.shape[0], w.shape[1] // GROUP, GROUP)
    amax = g.abs().amax(-1)
    m, ex = torch.frexp(amax)  # amax = m 2^ex, m in [0.5, 1), subnormals too: exact, so any device agrees
    e = ex - 3 + (m >= 0.875).to(torch.int32)  # floor(log2 amax) - 2, +1 when amax rounds up to 2^ex
    e = torch.where(amax == 0, 0, e).clamp_(min=-E8M0_BIAS)  # finite amax < 2^128: e <= 126
    s = (e + E8M0_BIAS).to(torch.uint8)
    q = g / e8m0_to_float(s).unsqueeze(-1)  # a power of two: exact wherever |q| >= 2^-126
    return e2m1_encode(q.view(w.shape)).contiguous(), s
