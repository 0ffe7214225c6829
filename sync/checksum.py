"""Hashes of tensor bytes: an exact host-side digest and a fast device-side checksum.

``weights_digest`` is sha256 over every byte (host side: GPU tensors are
copied to the host first, seconds for an 8B model) -- the check a test or a
user runs to prove ``server == trainer``.

``tensor_checksum`` / ``weights_checksum`` run where the tensor lives, in
int64 torch ops: every 32-bit word ``w`` at word position ``p`` maps to
``f(w + p * K0)`` with ``f(x) = K2 * xorshift32(K1 * x)`` (odd multipliers
and a logical xor-shift, each a bijection mod 2**64, so a single changed word
always changes the sum) and the words' images are summed modulo 2**64.
On the CPU that is about 10 element-wise int64 passes; on CUDA one Triton
kernel (``_checksum_kernel``) does the same arithmetic in registers, one read
of the bytes (there the torch passes would dominate a publish + apply).

``checksums_and_nonfinite`` also counts the NaN/Inf elements of float
tensors (integer tensors -- uint8 E2M1 codes and E8M0 scales, int32 tables --
have none to count; E8M0 stored as float8_e8m0fnu counts its NaN byte 0xFF)
on the same words: an element is non-finite when its exponent bits
are all ones (``nonfinite_rule``: a mask and pattern per lane of the 32-bit
word), so the CUDA kernel finds them in the pass that reads the bytes, and
the CPU path in the same loop over the words.
Integer addition is associative, so the value does not depend on the
reduction order: CPU and CUDA give the same checksum.  It is a 64-bit
checksum against torn and corrupted payloads, not a cryptographic hash.
The payload carries these; before it writes, the receiver checks with them
that the weights as the payload would leave them are the publisher's.
"""
from __future__ import annotations

import hashlib
import json

import torch

from ..common._host import cdiv
from ..common._launch import FP_FUSION

_MASK64 = (1 << 64) - 1
_CHUNK_WORDS = 1 << 25  # 128 MiB of input; bounds the int64 temporaries to 256 MiB each; even (float64's rule)


def _s64(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


_K0 = _s64(0x9E3779B97F4A7C15)
_K1 = _s64(0xBF58476D1CE4E5B9)
_K2 = _s64(0x94D049BB133111EB)


def _lsr_xor_(x: torch.Tensor, s: int) -> torch.Tensor:
    """x ^= x >>> s (logical shift; torch's >> on int64 is arithmetic)."""
    return x.bitwise_xor_(torch.bitwise_and(x >> s, (1 << (64 - s)) - 1))


def _mix64(h: int) -> int:
    h &= _MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & _MASK64
    return h ^ (h >> 31)


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in row-major order as a 1-D uint8 tensor on ``t.device``."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8)


_BLOCK_WORDS = 4096  # words per program of the CUDA kernel

# dtype -> (lanes per 32-bit word, lane mask, pattern, only odd words): a lane is
# NaN/Inf iff lane & mask == pattern (little-endian lanes; float64's exponent is
# in the high word of each pair).  float8 e4m3fn has NaN but no Inf; the fnuz
# formats' one NaN is the negative-zero code 0x80.
_NONFINITE = {torch.float32: (1, 0x7F800000, 0x7F800000, False), torch.float64: (1, 0x7FF00000, 0x7FF00000, True),
              torch.bfloat16: (2, 0x7F80, 0x7F80, False), torch.float16: (2, 0x7C00, 0x7C00, False)}
for _name, _rule in (("float8_e4m3fn", (4, 0x7F, 0x7F, False)), ("float8_e5m2", (4, 0x7C, 0x7C, False)),
                     ("float8_e4m3fnuz", (4, 0xFF, 0x80, False)), ("float8_e5m2fnuz", (4, 0xFF, 0x80, False)),
                     ("float8_e8m0fnu", (4, 0xFF, 0xFF, False))):
    if hasattr(torch, _name):
        _NONFINITE[getattr(torch, _name)] = _rule
# Float dtypes with no NaN/Inf encoding (E2M1 codes): nothing to count, and torch.isfinite refuses them.
_ALWAYS_FINITE = tuple(getattr(torch, n) for n in ("float4_e2m1fn_x2",) if hasattr(torch, n))


def nonfinite_rule(dtype: torch.dtype) -> tuple[int, int, int, bool] | None:
    """(lanes per word, lane mask, pattern, only odd words) of a float dtype
    (NaN/Inf: lane & mask == pattern); None for other dtypes."""
    return _NONFINITE.get(dtype)


def _word_sums_triton(words: torch.Tensor, rule) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(sum over i of f(words[i] + i * K0) mod 2**64, the non-finite lanes
    under ``rule`` or None) as int64 CUDA scalars: one kernel + torch sums."""
    from ._checksum_kernel import checksum_kernel

    n = words.numel()
    part = torch.empty(cdiv(n, _BLOCK_WORDS), dtype=torch.int64, device=words.device)
    bad = torch.empty(part.numel() if rule is not None else 1, dtype=torch.int64, device=words.device)
    lanes, mask, pattern, odd = rule if rule is not None else (0, 0, 0, False)
    checksum_kernel[(part.numel(),)](words, part, bad, n, _K0, _K1, _K2, mask, pattern, BLOCK=_BLOCK_WORDS,
                                     LANES=lanes, ODD_WORDS=odd, enable_fp_fusion=FP_FUSION, num_warps=4)
    return part.sum(), (bad.sum() if rule is not None else None)


def _word_sums_torch(words: torch.Tensor, rule) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``_word_sums_triton`` in torch ops, chunk by chunk (int64 scalars on ``words.device``)."""
    acc = torch.zeros((), dtype=torch.int64, device=words.device)
    bad = torch.zeros_like(acc) if rule is not None else None
    for s in range(0, words.numel(), _CHUNK_WORDS):
        w = words[s: s + _CHUNK_WORDS]
        acc += _word_sum_torch(w, s)
        if rule is not None:
            bad += _nonfinite_torch(w, rule)
    return acc, bad


def _word_sum_torch(w: torch.Tensor, start: int = 0) -> torch.Tensor:
    """sum over i of f(w[i] + (start + i) * K0) mod 2**64 as an int64 scalar (``w``: a tensor's words
    from word ``start`` on)."""
    x = w.to(torch.int64)  # sign extension: still one int64 per int32
    x.add_(torch.arange(start, start + w.numel(), dtype=torch.int64, device=w.device).mul_(_K0))
    _lsr_xor_(x.mul_(_K1), 32).mul_(_K2)
    return x.sum()


def _nonfinite_torch(w: torch.Tensor, rule) -> torch.Tensor:
    """The lanes of ``w`` (a tensor's words from an even word on) that are NaN/Inf under ``rule``, an
    int64 scalar (the kernel's count)."""
    lanes, mask, pattern, odd = rule
    bits = 32 // lanes
    u = (w[1::2] if odd else w).to(torch.int64) & 0xFFFFFFFF
    return sum(((u >> (k * bits)) & mask).eq_(pattern).sum() for k in range(lanes))


def _word_acc(t: torch.Tensor, nonfinite: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(the 0-d int64 word sum of ``t``'s bytes on its device, its NaN/Inf
    count (with ``nonfinite``, for float dtypes; else None), the byte count)."""
    rule = nonfinite_rule(t.dtype) if nonfinite else None
    b = tensor_bytes(t)
    n = b.numel()
    if n % 4 or b.storage_offset() % 4:  # int32 words need a 4-byte multiple at a 4-byte offset
        b = torch.cat([b, b.new_zeros(-n % 4)])  # zero lanes are finite under every rule
    words = b.view(torch.int32)
    acc, bad = (_word_sums_triton if words.is_cuda and words.numel() else _word_sums_torch)(words, rule)
    if nonfinite and rule is None and (t.dtype.is_floating_point or t.dtype.is_complex) and \
            t.dtype not in _ALWAYS_FINITE:
        bad = (~torch.isfinite(t.detach())).sum()  # a float dtype without a bit rule: one more pass
    return acc, bad, n


def checksums_and_nonfinite(ts, *, nonfinite: bool = True) -> list[tuple[int, int]]:
    """(``tensor_checksum``, NaN/Inf element count) of each tensor (the count
    is 0 for integer dtypes), from one read of its bytes on its device and
    one host read per device."""
    accs = [_word_acc(t, nonfinite) for t in ts]
    vals: list[tuple[int, int]] = [(0, 0)] * len(accs)
    by_device: dict[torch.device, list[int]] = {}
    for i, (acc, _, _) in enumerate(accs):
        by_device.setdefault(acc.device, []).append(i)
    for idx in by_device.values():
        counted = [i for i in idx if accs[i][1] is not None]
        flat = torch.stack([accs[i][0] for i in idx] + [accs[i][1] for i in counted]).tolist()
        bad = dict(zip(counted, flat[len(idx):]))
        for i, v in zip(idx, flat):
            vals[i] = (v, bad.get(i, 0))
    return [(_mix64((v & _MASK64) ^ _mix64(n)), bad) for (v, bad), (_, _, n) in zip(vals, accs)]


def tensor_checksums(ts) -> list[int]:
    """``tensor_checksum`` of each tensor, with one host read per device
    rather than one per tensor (a weights dict of an 8B model has ~400)."""
    return [cs for cs, _ in checksums_and_nonfinite(ts, nonfinite=False)]


def tensor_checksum(t: torch.Tensor) -> int:
    """A 64-bit checksum of ``t``'s bytes (row-major), computed on ``t.device``;
    equal on CPU and CUDA for equal bytes.  dtype and shape are not part of it."""
    return tensor_checksums([t])[0]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how the hashes and the manifest name a dtype."""
    return str(dtype).removeprefix("torch.")


def _header(name: str, t: torch.Tensor) -> str:
    return json.dumps([name, dtype_name(t.dtype), list(t.shape)])


def combine_checksums(entries: dict[str, tuple[torch.dtype, tuple[int, ...], int]]) -> str:
    """sha256 hex over ``(name, dtype, shape, tensor_checksum)`` in name order."""
    h = hashlib.sha256()
    for name in sorted(entries):
        dtype, shape, cs = entries[name]
        h.update(json.dumps([name, dtype_name(dtype), list(shape), f"{cs:016x}"]).encode())
        h.update(b"\n")
    return h.hexdigest()


def weights_checksum(weights: dict[str, torch.Tensor]) -> str:
    """Fast device-side checksum of a weights dict (names, dtypes, shapes and
    every byte); equal for equal weights on any device.  See the module docstring."""
    sums = tensor_checksums(list(weights.values()))
    return combine_checksums({n: (t.dtype, tuple(t.shape), cs) for (n, t), cs in zip(weights.items(), sums)})


def weights_digest(weights: dict[str, torch.Tensor]) -> str:
    """sha256 hex of a weights dict: for each name in sorted order, its name,
    dtype and shape, then all its bytes (row-major).  Exact and host-side:
    GPU tensors are copied to the host (for an 8B model prefer
    ``weights_checksum``, which stays on the device)."""
    h = hashlib.sha256()
    for name in sorted(weights):
        t = weights[name]
        b = tensor_bytes(t).cpu()
        h.update(_header(name, t).encode())
        h.update(b"\n%d\n" % b.numel())
        h.update(b.numpy().data)
    return h.hexdigest()
