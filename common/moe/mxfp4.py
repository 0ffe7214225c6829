"""MXFP4 expert weights (DeepSeek-V4): E2M1 codes two per byte, low nibble first, one E8M0
scale per 32 consecutive K elements (OCP MX).  Pure torch, the same bits on every device.

Layout of a (N, K) weight (K % 32 == 0): ``codes`` (N, K/2) uint8, byte j of a row holding
elements 2j (low nibble) and 2j+1 (high nibble); ``scales`` (N, K/32) uint8, the biased
exponent s of 2^(s - 127) (torch's float8_e8m0fnu bytes are accepted as is).

Decode (exact): a nibble c is sign c >> 3, exponent e = (c >> 1) & 3, mantissa m = c & 1,
|v| = m / 2 if e == 0 else (2 + m) * 2^(e - 2), i.e. {0, .5, 1, 1.5, 2, 3, 4, 6}; the weight is
v * 2^(s - 127), built from the exponent bits (no exp2), so every weight is a power-of-two
multiple of a 2-bit significand: exact in fp32, and in bf16 down to 2^-133.  A scale byte 0
(2^-127, not a normal fp32) decodes as 0: the quantizer never writes it (``MIN_EXP``).

Encode (``quantize_mxfp4``), per group of 32: shared exponent x = floor(log2(amax)) - 2 (amax's
own exponent bits, exact; E2M1's largest exponent is 2, the OCP rule), clamped to
[MIN_EXP, 127]; codes = the nearest E2M1 value of w / 2^x (exact division), ties to the even
code, saturating at 6.  An all-zero group gets x = MIN_EXP and codes 0.
"""
from __future__ import annotations

import torch

GROUP = 32  # K elements per E8M0 scale
MIN_EXP = -126  # smallest shared exponent the encoder writes (a normal fp32 scale)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# midpoints between consecutive magnitudes; a value on one goes to the even code (code c + 1 iff c + 1 is even)
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def check_mx_shape(name: str, K: int) -> None:
    if K % GROUP:
        raise ValueError(f"{name}: MXFP4 needs K % {GROUP} == 0 (one E8M0 scale per {GROUP} along K), got K={K}")


def _bytes(scales: torch.Tensor) -> torch.Tensor:
    return scales.view(torch.uint8) if scales.dtype != torch.uint8 else scales


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles (values 0..15) -> fp32 E2M1 values, exact."""
    c = codes.to(torch.int32)
    e, m = (c >> 1) & 3, c & 1
    twice = torch.where(e == 0, m, (2 + m) << (e - 1).clamp(min=0))  # 2|v|: {0, 1, 2, 3, 4, 6, 8, 12}
    v = twice.to(torch.float32) * 0.5
    return torch.where((c >> 3) == 1, -v, v)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> fp32 2^(s - 127) from the exponent bits (byte 0 -> 0.0)."""
    return (_bytes(scales).to(torch.int32) << 23).view(torch.float32)


_PAIRS: dict[torch.device, torch.Tensor] = {}


def _byte_pairs(device: torch.device) -> torch.Tensor:
    """(256, 2) fp32: byte b's two weights before the scale, the low nibble first (``decode_e2m1``)."""
    if device not in _PAIRS:
        b = torch.arange(256, device=device)
        _PAIRS[device] = torch.stack([decode_e2m1(b & 0x0F), decode_e2m1(b >> 4)], -1)
    return _PAIRS[device]


def dequantize_mxfp4(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(..., N, K/2) codes, (..., N, K/32) scales -> (..., N, K) dtype, exact (module docstring).
    A byte's pair from a 256-entry table, times its group's scale in place: ~10 bytes of temporaries
    a weight (a whole expert stack is decoded in the straight-through backward's groups)."""
    *lead, N, half = codes.shape
    v = _byte_pairs(codes.device)[codes.int()]  # (..., N, K/2, 2): element 2j low nibble, 2j + 1 high
    v = v.view(*lead, N, half * 2 // GROUP, GROUP).mul_(scale_values(scales).unsqueeze(-1))
    v = v.view(*lead, N, half * 2)
    return v if dtype == torch.float32 else v.to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., N, K) float -> (codes (..., N, K/2) uint8, scales (..., N, K/32) uint8) (module docstring).
    Rows go 2^22 elements at a time (each group is its own): the encoder's temporaries take ~40
    bytes an element, 240 GiB for GLM-5's gate/up stack in one go."""
    K = w.shape[-1]
    check_mx_shape("w", K)
    rows = w.reshape(-1, K)
    step = max(1, (1 << 22) // K)
    if rows.shape[0] > step:
        parts = [_quantize_rows(rows[i : i + step]) for i in range(0, rows.shape[0], step)]
        return (torch.cat([p[0] for p in parts]).reshape(*w.shape[:-1], K // 2),
                torch.cat([p[1] for p in parts]).reshape(*w.shape[:-1], K // GROUP))
    codes, scales = _quantize_rows(rows)
    return codes.reshape(*w.shape[:-1], K // 2), scales.reshape(*w.shape[:-1], K // GROUP)


def _quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    K = w.shape[-1]
    g = w.detach().float().reshape(*w.shape[:-1], K // GROUP, GROUP)
    amax = g.abs().amax(-1)
    top = ((amax.view(torch.int32) >> 23) & 0xFF) - 127  # floor(log2(amax)) for normal amax
    x = torch.where(amax > 0, top - 2, torch.full_like(top, MIN_EXP)).clamp(MIN_EXP, 127)
    q = g / ((x + 127) << 23).view(torch.float32).unsqueeze(-1)  # a power of two: exact
    a = q.abs()
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=w.device)
    up_on_tie = torch.tensor([(c + 1) % 2 == 0 for c in range(7)], device=w.device)
    code = ((a.unsqueeze(-1) > mids) | ((a.unsqueeze(-1) == mids) & up_on_tie)).sum(-1).to(torch.uint8)
    code = code | ((q < 0) & (code > 0)).to(torch.uint8) << 3  # -0 encodes as +0
    code = code.reshape(*w.shape[:-1], K)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.contiguous(), (x + 127).to(torch.uint8).contiguous()
