"""Compile a Triton kernel for sm_90 on this (GPU-less) machine and read the
register layouts of its TTGIR.

Why: the layout Triton's coalescing picks for a loaded block follows what the
JIT knows about the addresses, and the JIT specializes integer and pointer
arguments on divisibility by 16.  A reduction's or a scan's association order
follows that layout, so a kernel whose address arithmetic lets a
batch-dependent stride reach a load feeding a float reduction compiles to
different sums for different batches (the sampler's support kernel read
sorted keys at row stride head + 1, and strides 1025 and 1040 gave different
log Z bits on the H200).  The interpreter has no layouts, so only a
compile shows this.
"""
from __future__ import annotations

import re

from alignzoo.common._launch import FP_FUSION


def sm90_ttgir(fn, types, constexprs, aligned, num_warps: int, num_stages: int = 3) -> str:
    """TTGIR of ``fn`` (a ``triton.jit`` function) for sm_90, through the ttir
    and ttgir stages only (the layouts are final there; LLVM and ptxas would
    take ~4x longer).  ``types``: a Triton type per runtime argument ("*fp32",
    "i32", ...); ``constexprs``: value per constexpr argument; ``aligned``:
    the runtime arguments the JIT would see as divisible by 16 (pointers:
    16-byte aligned).  Mappings may be given as tuples of pairs."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    types, constexprs = dict(types), dict(constexprs)
    names = fn.arg_names
    sig = {n: types.get(n, "constexpr") for n in names}
    src = ASTSource(fn, sig, {(names.index(n),): v for n, v in constexprs.items()},
                    {(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": num_warps, "num_stages": num_stages, "enable_fp_fusion": FP_FUSION,
                                     **src.parse_options()})
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    module = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                         context)
    for ext in ("ttir", "ttgir"):
        module = stages[ext](module, {})
    return str(module)


def layouts(ttgir: str) -> list[str]:
    """The layout definitions of a TTGIR module (``#blocked1 = #ttg.blocked<...>``
    lines, without their names; not the ``#locN = loc(...)`` source locations,
    whose numbering shifts with unrelated IR), sorted."""
    return sorted(d for d in re.findall(r"^#\w+ = (.*)$", ttgir, flags=re.M) if not d.startswith("loc("))


def can_compile_sm90() -> bool:
    """Whether this triton build carries the NVIDIA backend (compiling needs no GPU)."""
    try:
        from triton.backends import backends

        return "nvidia" in backends
    except Exception:
        return False
