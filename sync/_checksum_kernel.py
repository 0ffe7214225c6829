"""The CUDA checksum kernel of ``checksum.py`` (imported only for CUDA tensors).

Program i takes words [i * BLOCK, (i + 1) * BLOCK) and stores the int64 sum of
their images; every int64 op wraps mod 2**64 as torch's do, so the partial sums
added by ``torch.sum`` give the CPU path's value bit for bit (integer addition
is associative).  With ``LANES`` > 0 it also stores how many of the words'
``LANES`` lanes are NaN/Inf (lane & mask == pattern; ``ODD_WORDS``: only the
odd words, float64's high halves): ``checksum.nonfinite_rule``.
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n", "mask", "pattern"])
def checksum_kernel(p_words, p_part, p_bad, n, k0, k1, k2, mask, pattern, BLOCK: tl.constexpr, LANES: tl.constexpr,
                    ODD_WORDS: tl.constexpr):
    i = tl.program_id(0)
    o = i.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    raw = tl.load(p_words + o, mask=m, other=0)
    x = (raw.to(tl.int64) + o * k0) * k1  # sign extension, as the torch path
    x = (x ^ (x.to(tl.uint64, bitcast=True) >> 32).to(tl.int64, bitcast=True)) * k2  # logical x >>> 32
    tl.store(p_part + i, tl.sum(tl.where(m, x, 0), axis=0))
    if LANES > 0:
        u = raw.to(tl.uint32, bitcast=True).to(tl.int64)  # the word's 32 bits, zero-extended
        if ODD_WORDS:
            m = m & (o % 2 == 1)
        bad = tl.zeros([BLOCK], dtype=tl.int64)
        for k in tl.static_range(LANES):
            hit = ((u >> (k * (32 // LANES))) & mask) == pattern
            bad += tl.where(m & hit, 1, 0).to(tl.int64)
        tl.store(p_bad + i, tl.sum(bad, axis=0))
