"""Compile a Triton kernel for sm_90 on this (GPU-less) machine and read the
register layouts of its TTGIR.

Why: the layout Triton's coalescing picks for a loaded block follows what the
JIT knows about the addresses, and the JIT specializes integer and pointer
arguments on divisibility by 16.  A reduction's or a scan's association order
follows that layout, so a kernel whose address arithmetic lets a
batch-dependent stride reach a load feeding a float reduction compiles to
different sums for different batches (session 6: the sampler's support kernel
read sorted keys at row stride head + 1, and strides 1025 and 1040 gave
different log Z bits on the H200).  The interpreter has no layouts, so only a
compile shows this.
"""
from __future__ import annotations

import re


def sm90_ttgir(fn, types: dict, constexprs: dict, aligned: set, num_warps: int) -> str:
    """TTGIR of ``fn`` (a ``triton.jit`` function) for sm_90.  ``types``: a
    Triton type per runtime argument ("*fp32", "i32", ...); ``constexprs``:
    value per constexpr argument; ``aligned``: the runtime arguments the JIT
    would see as divisible by 16 (pointers: 16-byte aligned)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = fn.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    consts = {(names.index(n),): v for n, v in constexprs.items()}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    src = ASTSource(fn, sig, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "enable_fp_fusion": False})
    return compiled.asm["ttgir"]


def layouts(ttgir: str) -> list[str]:
    """The layout definitions of a TTGIR module (``#blocked1 = #ttg.blocked<...>``
    lines, without their names), sorted."""
    return sorted(re.findall(r"^#\w+ = (.*)$", ttgir, flags=re.M))


def can_compile_sm90() -> bool:
    """Whether this triton build carries the NVIDIA backend (compiling needs no GPU)."""
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:
        return False
