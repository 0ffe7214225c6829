"""The CUDA checksum kernel of ``checksum.py`` (imported only for CUDA tensors).

Program i takes words [i * BLOCK, (i + 1) * BLOCK) and stores the int64 sum of
their images; every int64 op wraps mod 2**64 as torch's do, so the partial sums
added by ``torch.sum`` give the CPU path's value bit for bit (integer addition
is associative).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["n"])
def checksum_kernel(p_words, p_part, n, k0, k1, k2, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    o = i.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(p_words + o, mask=m, other=0).to(tl.int64)  # sign extension, as the torch path
    x = (x + o * k0) * k1
    x = (x ^ (x.to(tl.uint64, bitcast=True) >> 32).to(tl.int64, bitcast=True)) * k2  # logical x >>> 32
    tl.store(p_part + i, tl.sum(tl.where(m, x, 0), axis=0))
