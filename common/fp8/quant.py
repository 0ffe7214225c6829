"""FP8 e4m3 quantizers: 128×128 weight blocks (the HF / DeepSeek-V3 layout) and
1×128 activation groups.  Pure torch, the same code on every device.

Both quantizers compute, per block B (fp32 throughout):

    amax  = max |w| over B                      exact: max never rounds, so any
                                                reduction order gives these bits
    s     = fl32(max(amax, AMAX_FLOOR) / 448)   stored as ``scale_inv`` / ``scales``
    q     = fl32(w / s)                         IEEE fp32 division, one rounding
    code  = e4m3(clamp(q, -448, 448))           round to nearest, ties to even

and dequantization is ``fl32(code * s)``.  Why CPU and CUDA give identical
codes and scales: ``abs``, ``amax``, ``maximum`` and ``clamp`` are exact; the
two divisions are tensor / tensor (torch's CUDA ``div`` turns a *CPU scalar*
divisor into a reciprocal multiply, which rounds differently, so 448 is a
device tensor here) and IEEE-rounded on both devices; the cast is c10's one
bit-level fp32 -> e4m3fn routine, used by the CPU and the CUDA copy kernels.
The clamp is explicit because older torch casts overflow to NaN (e4m3fn has no
inf); ``q`` can pass 448 by an ulp when the block's amax element is divided by
a rounded-down ``s``.

AMAX_FLOOR = 1e-10 (SGLang's per-token-group eps): an all-zero block gets
``s = fl32(1e-10) / 448`` (not 0, so no 0/0) and codes 0, which dequantize to
exact zeros; any block with amax >= 1e-10 is untouched by the floor.

Error bound (tested): for |q| >= 2^-6 (e4m3 normals) the code is within half an
ulp, 2^-4 |q|; below that the subnormal spacing is 2^-9, so the error is at
most 2^-10.  Hence |deq - w| <= 2^-4 |w| + 2^-10 s (+ two fp32 roundings,
2^-23 relative), and a block's error norm is at most 2^-4 of its norm plus
2^-10 s per element.
"""
from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # weight blocks are BLOCK × BLOCK, activation groups 1 × BLOCK
AMAX_FLOOR = 1e-10


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _scale_and_codes(amax: torch.Tensor, blocks: torch.Tensor, scale_view: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """amax (…) fp32 and blocks (…) fp32 -> (codes like blocks, scales like amax)."""
    s = torch.maximum(amax, torch.full_like(amax, AMAX_FLOOR)) / amax.new_full((), FP8_MAX)
    q = blocks / s.view(scale_view)
    return q.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), s


def _padded(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """x (..., r, c) widened to fp32 (exact for bf16/fp32) and zero-padded to (..., rows, cols)."""
    if x.shape[-2:] == (rows, cols):
        return x.float().contiguous()
    out = torch.zeros(*x.shape[:-2], rows, cols, dtype=torch.float32, device=x.device)
    out[..., : x.shape[-2], : x.shape[-1]] = x
    return out


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) fp32/bf16 -> (codes (N, K) e4m3fn, scale_inv (ceil(N/128), ceil(K/128)) fp32).

    A stack (..., N, K) gives each matrix's own (element-wise and exact max, so the same bits).
    Padding to whole blocks is zeros, which never raise an amax.
    """
    *lead, N, K = w.shape
    NB, KB = cdiv(N, BLOCK), cdiv(K, BLOCK)
    blocks = _padded(w, NB * BLOCK, KB * BLOCK).view(*lead, NB, BLOCK, KB, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # (..., NB, KB)
    codes, s = _scale_and_codes(amax, blocks, (*lead, NB, 1, KB, 1))
    codes = codes.view(*lead, NB * BLOCK, KB * BLOCK)
    if codes.shape[-2:] != (N, K):
        codes = codes[..., :N, :K].contiguous()
    return codes, s


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) fp32/bf16 -> (codes (M, K) e4m3fn, scales (M, ceil(K/128)) fp32).

    Row-local by construction: row i's codes and scales are element-wise
    functions of row i and of its own group maxima.
    """
    M, K = x.shape
    KB = cdiv(K, BLOCK)
    groups = _padded(x, M, KB * BLOCK).view(M, KB, BLOCK)
    amax = groups.abs().amax(dim=2)  # (M, KB)
    codes, s = _scale_and_codes(amax, groups, (M, KB, 1))
    codes = codes.view(M, KB * BLOCK)
    if KB * BLOCK != K:
        codes = codes[:, :K].contiguous()
    return codes, s


def expand_weight_scale(scale_inv: torch.Tensor, N: int, K: int) -> torch.Tensor:
    """(..., ceil(N/128), ceil(K/128)) -> (..., N, K): element (n, k) gets block (n // 128, k // 128)."""
    return scale_inv.repeat_interleave(BLOCK, -2)[..., :N, :].repeat_interleave(BLOCK, -1)[..., :K]


def dequantize_weight(codes: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W = dtype(fl32(code * scale_inv[n // 128, k // 128])), (N, K), or a stack (..., N, K).

    For ``dtype=torch.float32`` this is the exact product rounded once (the
    same bits as transformers' ``_dequantize_fp8_weight``); bf16 rounds that again.
    """
    *lead, N, K = codes.shape
    if N % BLOCK or K % BLOCK:
        w = codes.float() * expand_weight_scale(scale_inv, N, K)
    else:  # the same products, the scale broadcast over its block, not expanded to an (N, K) fp32 copy
        NB, KB = N // BLOCK, K // BLOCK
        w = codes.float().reshape(*lead, NB, BLOCK, KB, BLOCK) * scale_inv[..., :, None, :, None]
        w = w.view(*lead, N, K)
    return w if dtype == torch.float32 else w.to(dtype)


def dequantize_act(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x = dtype(fl32(code * scales[m, k // 128])), (M, K)."""
    K = codes.shape[1]
    x = codes.float() * scales.repeat_interleave(BLOCK, 1)[:, :K]
    return x if dtype == torch.float32 else x.to(dtype)
