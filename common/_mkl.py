"""Resolve oneMKL's VML kernels once, on one thread, before any CPU path runs.

ATen sends contiguous fp32 / fp64 ``exp``, ``log``, ``sqrt``, ``tanh`` (the list below) to
MKL VML, each intra-op thread calling it on its own chunk.  oneMKL 2024.2, the one torch's
CPU wheels link, picks a function's kernel on that function's first call; when the first
call comes from several threads at once, one of them can run a low-accuracy kernel on its
whole chunk (pytorch/pytorch#188792: errors of ~1000 ulp, on that one call only).  The CPU paths
hold their bits only if every call uses the same kernel, so importing ``alignzoo.common``
makes a 1-element call of each, in each precision: below ATen's 2048-element grain it runs
on the calling thread alone, and the choice it leaves behind is the one later calls use.
"""
from __future__ import annotations

import torch

# ATen's IMPLEMENT_VML_MKL list (aten/src/ATen/cpu/vml.h) and its direct vsLn call: the functions
# whose first call picks an MKL kernel.
VML_OPS = ("acos", "asin", "atan", "cos", "erf", "erfc", "erfinv", "exp", "log", "log10", "log2",
           "sin", "sqrt", "tan", "tanh", "trunc")

WARMED: tuple[str, ...] = ()


def warm_vml() -> tuple[str, ...]:
    """Call each of ``VML_OPS`` once on a 1-element fp32 and fp64 tensor; -> the names called."""
    global WARMED
    one = {dt: torch.full((1,), 0.5, dtype=dt) for dt in (torch.float32, torch.float64)}
    with torch.no_grad():
        for name in VML_OPS:
            for x in one.values():
                getattr(torch, name)(x)
    WARMED = VML_OPS
    return WARMED
