"""The definitions the CPU path and the CUDA path share, written once in torch.

Everything here is element-wise integer or IEEE arithmetic on tensors, so it
gives the same bits on any device and for any batch shape:

* ``order_keys``: the sort key of a scaled logit.  One int64 per token,
  ``key = -ord(s) * 2**32 + id`` with ``ord`` the monotone integer image of the
  fp32 bits of ``s`` (``-0.0`` folded onto ``+0.0``).  Ascending keys are
  "value descending, then id ascending": ties go to the smaller token id.  The
  keys of a row are all distinct, so every correct sort (stable or not, any
  algorithm, any batch) returns the same permutation.  The key also carries
  the exact fp32 value, recovered by ``key_values``.
* ``uniform01``: the draw's uniform in [0, 1), a pure function of the
  request's ``(seed, step)`` through a counter-based 32-bit integer hash, on
  24 bits so that it is exact in fp32.  Same bits on CPU and CUDA.
* ``chosen_logprob``: the FP32 log-probability of a token under the
  transformed distribution, from that token's key and three per-row numbers.
  The sampler and the trainer's replay both call it, on the same bits.

``kernel.py`` mirrors ``order_keys``, ``key_values``, ``uniform01`` and
``chosen_logprob`` operation for operation inside its Triton kernels (the gpu
tests hold the keys and the uniforms to these bits).
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_SIGN_FLIP = 0x7FFFFFFF
_TWO32 = 1 << 32


def order_keys(s: torch.Tensor) -> torch.Tensor:
    """s: (B, V) fp32 scaled logits (finite or -inf) -> (B, V) int64 keys."""
    return token_keys(s, torch.arange(s.shape[-1], device=s.device, dtype=torch.int64))


def token_keys(s: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The keys of scaled logits ``s`` at token ids ``ids`` (broadcast): ``order_keys`` of one token each."""
    bits = s.view(torch.int32)
    bits = torch.where(s == 0, torch.zeros_like(bits), bits)  # -0.0 -> +0.0: one key per value
    ordv = torch.where(bits >= 0, bits, bits ^ _SIGN_FLIP).to(torch.int64)
    return (-ordv) * _TWO32 + ids.to(torch.int64)


def key_values(keys: torch.Tensor) -> torch.Tensor:
    """Inverse of ``order_keys`` on the value: int64 keys -> fp32 scaled logits."""
    ordv = (-(keys >> 32)).to(torch.int32)
    return torch.where(ordv >= 0, ordv, ordv ^ _SIGN_FLIP).view(torch.float32)


def key_ids(keys: torch.Tensor) -> torch.Tensor:
    """Token ids carried in the low 32 bits of the keys."""
    return keys & _M32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, in int64 without overflow:
    split c into 16-bit halves so that no product exceeds 2**48."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit avalanche mixer (xor-shift / multiply, 'lowbias32')."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def uniform01(seed: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """seed, step: (B,) int64 -> (B,) fp32 in [0, 1), multiples of 2**-24.

    Depends on nothing but the row's own (seed, step): no generator state,
    no batch slot.  Identical on CPU and CUDA (integer ops only)."""
    seed = seed.to(torch.int64)
    step = step.to(torch.int64)
    h = _mix32((seed & _M32) ^ 0x9E3779B9)
    h = _mix32(h ^ ((seed >> 32) & _M32))
    h = _mix32(h ^ (step & _M32))
    h = _mix32(h ^ ((step >> 32) & _M32))
    h = _mix32(h ^ 0x632BE5AB)
    return (h >> 8).to(torch.float32) * (2.0 ** -24)


def chosen_logprob(
    key_tok: torch.Tensor,  # (B,) int64 key of the token
    v0: torch.Tensor,  # (B,) fp32 largest scaled logit of the row
    logz: torch.Tensor,  # (B,) fp32 log of the support's fixed-order sum
    last_key: torch.Tensor,  # (B,) int64 key of the support's last token
    greedy: torch.Tensor,  # (B,) bool temperature == 0
) -> torch.Tensor:
    """lp = (s_tok - v0) - logz in fp32 (two roundings, in this order) for a
    token inside the support, -inf outside it; exactly 0.0 for the argmax of
    a greedy row (a point mass)."""
    lp = (key_values(key_tok) - v0) - logz
    lp = torch.where(greedy, torch.zeros_like(lp), lp)
    return torch.where(key_tok <= last_key, lp, torch.full_like(lp, float("-inf")))
