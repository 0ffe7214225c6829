"""Drop the CTA barriers Triton 3.6 places between one k-step's TMA issues.

Triton's shared-memory hazard analysis (run while lowering to LLVM) puts a
``bar.sync 0`` before every ``mbarrier.arrive.expect_tx`` and before every
TMA load it issues, because each touches shared memory (the mbarrier object,
the destination tile).  A k-step of our TMA GEMMs issues one expect and two
or three loads from one thread, so the PTX holds four or five CTA barriers a
k-step where one is needed: the barrier before the expect, after which every
warp has finished reading the stage being refilled (the wgmma wait before
it).  The barriers *between* the expect and the loads order nothing: in that
stretch the other threads touch no memory, and what the loads write is
guarded by the stage's mbarrier, which the readers wait on.  ncu on the H200
(session 9) had the Gluon GEMM's warps stalled at CTA barriers for ~35% of
their issue gaps.

``drop_barriers_between_tma_issues(ptx)`` removes a ``bar.sync 0`` only when
the code since the previous barrier (no label in between) issued TMA loads or
expects and no other memory, barrier, fence or wgmma instruction, and the
next memory instruction after it, before any label, is another TMA issue.  ``install()`` registers it as a
Triton compile-stage hook for the kernels named in ``KERNELS`` (chaining any
hook already set).  Those kernels take a ``LEAN_BARRIERS`` constexpr that the
launchers set to ``active()`` (the pass's version, a hash of this file, or 0):
Triton 3.6's compile cache key does not see the hook, so the constexpr keeps
patched, unpatched and differently patched binaries apart.  The patch moves
no arithmetic; the GPU bit tests compare the patched kernels with the
pointer-load kernels, which carry no TMA and are never patched.
``ALIGNZOO_LEAN_BARRIERS=0`` turns it off (read at import).
"""
from __future__ import annotations

import hashlib
import os
import re

KERNELS = {"_mm_pipe_kernel", "_mm_tma_persistent_kernel", "_mm_tma_split_kernel"}

_BAR = re.compile(r"^\s*bar\.sync\s+0;\s*$")
_LABEL = re.compile(r"^\s*\$L__\w+:")
_TMA_ISSUE = re.compile(r"mbarrier\.arrive\.expect_tx|cp\.async\.bulk\.tensor\.\dd\.shared::(cluster|cta)\.global\.mbarrier")
_MEMORY = re.compile(r"\b(ld|st|atom|red)\.|wgmma|cp\.async|mbarrier|fence|\bbar\.|barrier|\bret\b|\bcall\b|\bexit\b")
_STATE = {"installed": False}


def _code(lines: list[str]) -> list[str]:
    return [ln for ln in lines if ln.strip() and not ln.strip().startswith("//")]


def _only_tma_issue(lines: list[str]) -> bool:
    code = _code(lines)
    if any(_LABEL.match(ln) for ln in code):
        return False
    return (any(_TMA_ISSUE.search(ln) for ln in code)
            and not any(_MEMORY.search(ln) and not _TMA_ISSUE.search(ln) for ln in code))


def _tma_issue_next(lines: list[str]) -> bool:
    """The next memory instruction is a TMA issue, with no label before it."""
    for ln in _code(lines):
        if _LABEL.match(ln) or _BAR.match(ln):
            return False
        if _TMA_ISSUE.search(ln):
            return True
        if _MEMORY.search(ln):
            return False
    return False


def drop_barriers_between_tma_issues(ptx: str) -> tuple[str, int]:
    """-> (the PTX without the redundant barriers, how many were dropped)."""
    lines = ptx.split("\n")
    bars = [i for i, ln in enumerate(lines) if _BAR.match(ln)]
    drop = set()
    for j in range(1, len(bars)):
        if _only_tma_issue(lines[bars[j - 1] + 1:bars[j]]) and _tma_issue_next(lines[bars[j] + 1:]):
            drop.add(bars[j])
    return "\n".join(ln for i, ln in enumerate(lines) if i not in drop), len(drop)


def _pass_version() -> int:
    """A hash of this module's source: a changed pass must not reuse binaries the old one made."""
    with open(__file__, "rb") as f:
        return int(hashlib.sha256(f.read()).hexdigest()[:8], 16)


VERSION = _pass_version()
_KEY = f"-alignzoo-lean-barriers-{VERSION:08x}"


def _hook(previous):
    """Triton's stage hook: called with the backend's stages to edit them; Triton
    >= 3.7 also calls it with no arguments for a (key, hash) added to the
    compile cache key (3.6 does not: hence the kernels' constexpr)."""
    def add_stages(*args):
        if not args:
            key, digest = previous() if previous is not None else ("", "")
            return key + _KEY, f"{digest}{_KEY}"
        if previous is not None:
            previous(*args)
        stages = args[1]
        make_ptx = stages.get("ptx")
        if make_ptx is None:
            return None

        def ptx_stage(src, metadata):
            ptx = make_ptx(src, metadata)
            if metadata.get("name") in KERNELS:
                ptx = drop_barriers_between_tma_issues(ptx)[0]
            return ptx
        stages["ptx"] = ptx_stage
        return None
    return add_stages


def install() -> bool:
    """Register the PTX pass (once); False where this Triton has no stage hook or it is turned off."""
    if _STATE["installed"]:
        return True
    if os.environ.get("ALIGNZOO_LEAN_BARRIERS", "1") == "0":
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        return False
    runtime.add_stages_inspection_hook = _hook(runtime.add_stages_inspection_hook)
    _STATE["installed"] = True
    return True


def active() -> int:
    """The ``LEAN_BARRIERS`` constexpr of kernels compiled from now on: the
    pass's ``VERSION`` where it is installed, else 0."""
    return VERSION if _STATE["installed"] else 0
