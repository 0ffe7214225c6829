"""The PTX pass that drops CTA barriers between one k-step's TMA issues (common/_ptx_barriers.py)."""
import re

import pytest

from alignzoo.common._ptx_barriers import drop_barriers_between_tma_issues

EXPECT = "\t@%p1 mbarrier.arrive.expect_tx.shared.b64 _, [%r1], 40960;"
LOAD = "\t@%p2 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%r2], [%rd1, {%r3, %r4}], [%r1];"
BAR = "\tbar.sync \t0;"


def _ptx(*lines):
    return "\n".join(lines)


def test_drops_only_barriers_between_tma_issues():
    """A k-step as Triton 3.6 lowers it: barrier, expect, barrier, load, barrier, load.
    The barrier before the expect stays (it follows the wgmma wait); the two
    between the issues go."""
    step = [BAR, "\twgmma.wait_group.sync.aligned 1;", BAR, EXPECT, "\tadd.s32 %r5, %r6, 64;", BAR, LOAD,
            "\t// begin inline asm", BAR, LOAD, "\tmov.u32 %r7, 0;", BAR, "\tld.shared.b32 %r8, [%r9];", BAR]
    out, n = drop_barriers_between_tma_issues(_ptx(*step))
    assert n == 2
    assert out.split("\n") == [BAR, "\twgmma.wait_group.sync.aligned 1;", BAR, EXPECT, "\tadd.s32 %r5, %r6, 64;",
                               LOAD, "\t// begin inline asm", LOAD, "\tmov.u32 %r7, 0;", BAR,
                               "\tld.shared.b32 %r8, [%r9];", BAR]


@pytest.mark.parametrize("between", [
    "\tst.shared.b32 [%r1], %r2;",              # a generic shared store before the barrier
    "\tld.global.b32 %r1, [%rd1];",
    "\twgmma.wait_group.sync.aligned 0;",
    "\tfence.proxy.async.shared::cta;",
    "\tmbarrier.try_wait.parity.shared.b64 complete, [%r1], %r2;",
    "\tcp.async.bulk.wait_group.read 0;",       # a TMA store's wait
    "$L__BB0_3:",                               # another path joins here
])
def test_keeps_barriers_that_may_order_something(between):
    """A barrier whose stretch before it holds any other memory operation,
    fence, wait or a label stays, even between two TMA issues."""
    lines = [BAR, EXPECT, between, BAR, LOAD, BAR]
    out, n = drop_barriers_between_tma_issues(_ptx(*lines))
    assert n == 0 and out == _ptx(*lines)


def test_triton_39_spelling():
    """Newer Triton issues the same loads as ``shared::cta`` copies behind an ``elect.sync``."""
    load = LOAD.replace("shared::cluster", "shared::cta")
    lines = [BAR, EXPECT.replace(".shared.b64", ".shared::cta.b64"), BAR, "\telect.sync %r1|%p1, -1;", load, BAR,
             "\telect.sync %r2|%p2, -1;", load, BAR]
    assert drop_barriers_between_tma_issues(_ptx(*lines))[1] == 2


def test_keeps_a_barrier_with_no_tma_issue_after_it():
    lines = [BAR, EXPECT, LOAD, BAR, "\tadd.s32 %r1, %r1, 1;", BAR]
    assert drop_barriers_between_tma_issues(_ptx(*lines))[1] == 0


def test_the_gluon_gemm_compiles_with_one_barrier_per_refill():
    """The Gluon GEMM compiled for sm_90 with the pass installed: no CTA
    barrier between a refill's expect and its loads, one before each expect,
    and ptxas assembles it."""
    from alignzoo.common import _ptx_barriers
    from alignzoo.common.matmul import gluon_kernel

    if not gluon_kernel.available() or not _ptx_barriers.active():
        pytest.skip("this Triton has no Gluon or no stage hook")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(box):
        return f"tensordesc<bf16[{box[0]}, {box[1]}],{gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)!r}>"

    fn = gluon_kernel._mm_pipe_kernel
    sig = {"d_x": desc([128, 64]), "d_w": desc([128, 64]), "d_w2": desc([64, 64]), "d_y": desc([128, 128]),
           "d_y2": desc([128, 64]), "M": "i32", "N": "i32", "N_K": "i32", "NUM_PROGS": "i32"}
    consts = {"SEG_STEPS": 16, "BN2": 64, "GROUP_M": 8, "NUM_BUF": 4, "LEAN_BARRIERS": _ptx_barriers.active(),
              "num_warps": 8}
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(GluonASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})
    lines = k.asm["ptx"].split("\n")
    expects = [i for i, ln in enumerate(lines) if "mbarrier.arrive.expect_tx" in ln]
    assert len(expects) >= 2 and k.asm["cubin"]
    for i in expects:
        loads = [j for j in range(i, min(i + 60, len(lines))) if "cp.async.bulk.tensor" in lines[j]][:3]
        assert len(loads) == 3 and not any(re.match(r"\s*bar\.sync", ln) for ln in lines[i:loads[-1]]), i
        before = [ln for ln in lines[max(0, i - 12):i] if re.match(r"\s*bar\.sync", ln)]
        assert before, f"no barrier before the expect at line {i}"
