"""matmul: rungs 1-2 (bitwise), accuracy vs float64, gradients, bad input."""
import pytest
import torch
from interpreted import run_interpreted

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.matmul import fixed_order_dot, matmul, matmul_bwd, matmul_fwd, matmul_ref

SHAPES = [  # (M, K, N): odd sizes, K past one 1024-segment, K = 12288 (Qwen3-8B down-proj)
    pytest.param(37, 100, 65, id="M37-K100-N65"),
    pytest.param(63, 1000, 96, id="M63-K1000-N96"),
    pytest.param(9, 12288, 33, id="M9-K12288-N33"),
    # TMA-aligned rows (K = 2100 was not: 4200-byte rows, so every TMA launch was filtered out here):
    # three K segments, the last partial; N not a multiple of 192 or 96
    pytest.param(130, 2112, 200, id="M130-K2112-N200"),
]
FEW_CONFIGS_ABOVE_K = 4096  # the CPU path costs K passes per call: fewer configs for K = 12288


def _launch_configs(device):
    if device.type == "cpu":
        return [{}, {"row_chunk": 4}, {"row_chunk": 1}]
    return [{}, {"block_m": 64, "schedule": "split"}, {"block_m": 64, "block_n": 256, "schedule": "fused"},
            {"block_m": 128, "block_k": 128, "schedule": "split", "num_warps": 4},
            {"block_m": 128, "block_n": 64, "schedule": "fused", "num_stages": 2}, {"schedule": "tma"},
            {"block_m": 128, "block_n": 192, "schedule": "tma"}, {"block_m": 64, "block_n": 96, "schedule": "tma"},
            {"schedule": "gluon"}, {"block_n": 96, "schedule": "gluon"},
            {"block_n": 128, "block_k": 128, "schedule": "gluon"}, {"schedule": "gluon_ws"},
            {"block_n": 96, "schedule": "gluon_ws"}, {"block_n": 128, "block_k": 128, "schedule": "gluon_ws"},
            {"schedule": "tma_split"},
            {"schedule": "tma_split", "block_n": 32, "num_stages": 4}]


_TMA_SCHEDULES = ("tma", "gluon", "gluon_ws", "tma_split")  # TMA descriptors: bf16 with 16-byte aligned rows


def _inputs(M, K, N, device, dtype=torch.bfloat16):
    x = torch.randn(M, K).to(device, dtype)
    w = (torch.randn(N, K) / K**0.5).to(device, dtype)
    return x, w


@pytest.mark.parametrize("M,K,N", SHAPES)
def test_rows_invariant_to_batch_order_padding_and_launch(device, M, K, N):
    x, w = _inputs(M, K, N, device)
    assert rung1_repeat("matmul", matmul_fwd, x, w).passed
    configs = _launch_configs(device)
    if (K * 2) % 16 or (N * 2) % 16:  # TMA needs 16-byte aligned rows
        configs = [c for c in configs if c.get("schedule") not in _TMA_SCHEDULES]
    if device.type == "cpu" and K > FEW_CONFIGS_ABOVE_K:
        configs = configs[::2]
    r = rung2_rows("matmul", matmul_fwd, (x,), shared={"w": w}, configs=configs,
                   batch_sizes=(1, 2, 5, M - 1))
    assert r.passed, r.detail
    # and the plain torch.equal form of the same promise, row by row
    full = matmul_fwd(x, w)
    for i in (0, M // 2, M - 1):
        assert torch.equal(matmul_fwd(x[i:i + 1], w), full[i:i + 1])


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (12288, 4096), (4096, 12288), (1000, 100)], ids=str)
def test_gpu_every_m_gives_the_same_rows(N, K):
    """cuBLAS changes bits for M <= 128 (docs/DESIGN.md, "Facts on the H200"); ours may not, at any M."""
    dev = torch.device("cuda")
    x, w = _inputs(8192, K, N, dev)
    ref = matmul_fwd(x, w)
    for M in (1, 3, 8, 64, 65, 127, 256, 1024, 4096):
        assert torch.equal(matmul_fwd(x[:M], w), ref[:M]), f"M={M}"
        assert torch.equal(matmul_fwd(x[-M:], w), ref[-M:]), f"M={M} (tail rows)"


def test_check_catches_a_batch_dependent_split(device):
    """A split-K whose split count follows M (what cuBLAS does) must be caught.
    fp32 in and out: a bf16 output rounding would hide most one-ulp changes."""
    x, w = _inputs(40, 1000, 48, torch.device("cpu"), torch.float32)

    def split_by_batch(x, w):
        splits = 1 if x.shape[0] < 8 else 4
        parts = [fixed_order_dot(xs, ws) for xs, ws in zip(x.chunk(splits, 1), w.chunk(splits, 1))]
        return torch.stack(parts).sum(0).to(x.dtype)

    r = rung2_rows("bad", split_by_batch, (x,), shared={"w": w})
    assert not r.passed and r.differing > 0


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 5e-3), (torch.float32, 1e-6)], ids=["bf16", "fp32"])
def test_accuracy_against_float64(device, dtype, bound):
    x, w = _inputs(50, 1000, 70, device, dtype)
    # bf16: one output rounding (2^-9 relative); fp32: K=1000 fp32 adds
    assert rel_err(matmul_fwd(x, w), matmul_ref(x, w)) < bound


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)], ids=["bf16", "fp32"])
def test_gradients_against_float64_autograd(device, dtype, bound):
    x, w = _inputs(33, 100, 65, device, dtype)
    x3 = x.reshape(3, 11, 100).requires_grad_()
    wr = w.clone().requires_grad_()
    dy = torch.randn(3, 11, 65).to(device, dtype)
    matmul(x3, wr).backward(dy)
    xd, wd = x3.detach().double().requires_grad_(), w.double().requires_grad_()
    (xd @ wd.t()).backward(dy.double())
    assert rel_err(x3.grad, xd.grad) < bound
    assert rel_err(wr.grad, wd.grad) < bound


def test_backward_is_deterministic_run_to_run(device):
    x, w = _inputs(45, 300, 70, device)
    dy = torch.randn(45, 70).to(device, torch.bfloat16)
    a, b = matmul_bwd(x, w, dy), matmul_bwd(x, w, dy)
    assert bitwise_equal(a[0], b[0]) and bitwise_equal(a[1], b[1])


def test_bad_input_is_named():
    x, w = _inputs(4, 16, 8, torch.device("cpu"))
    with pytest.raises(TypeError, match="w has dtype float32"):
        matmul(x, w.float())
    with pytest.raises(TypeError, match="x has dtype int64"):
        matmul(torch.ones(4, 16, dtype=torch.long), w)
    with pytest.raises(ValueError, match="x has K=16 but w has shape"):
        matmul(x, torch.randn(8, 15).bfloat16())
    with pytest.raises(ValueError, match="must be contiguous"):
        matmul(x.t(), torch.randn(8, 4).bfloat16())


@pytest.mark.gpu
def test_gpu_graph_launches_equal_eager_defaults():
    """Inside ``graph_launches()`` (warm-up, then a captured graph) the default
    launch is the Gluon kernel at qkv / gate/up / gate_up, M = 256 (its
    warp-specialized 96 and 192-wide tiles), ragged M = 200, and q/o at M =
    512 (its one-partition 128-wide tile); outside, Triton's: the rows are the
    same bits."""
    from alignzoo.common.matmul import graph_launches
    from alignzoo.common.matmul.kernel import launch_config

    dev = torch.device("cuda")
    for N, M in ((6144, 256), (12288, 256), (24576, 256), (12288, 200), (4096, 512)):
        x, w = _inputs(M, 4096, N, dev)
        eager = matmul_fwd(x, w)
        with graph_launches():
            warm = matmul_fwd(x, w)  # compiles the Gluon kernel outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = matmul_fwd(x, w)
        graph.replay()
        torch.cuda.synchronize()
        assert launch_config(M, N, 4096)["schedule"] == ("gluon" if N == 4096 else "gluon_ws")
        assert torch.equal(warm, eager) and torch.equal(out, eager), (N, M)


def test_launch_resolution_fits_the_h200_and_keeps_wgmma():
    """CPU check of the CUDA launcher's knob resolution (``resolve_launch``):
    for Qwen3-8B and odd shapes, every M bucket, and each hand-picked knob set
    the GPU tests use, the default pipeline fits the H200's shared memory,
    BLOCK_M stays >= 64 and BLOCK_K divides SEG_K.  (A hand-picked
    block_n=256 over a BLOCK_K=128 default once needed 320 KB on the H200.)"""
    from alignzoo.common.matmul.kernel import launch_config, reduction_config, resolve_launch

    knobs = [{}, *(dict(c) for c in _launch_configs(torch.device("cuda"))[1:])]
    for N, K in [(4096, 4096), (1024, 4096), (6144, 4096), (24576, 4096), (4096, 12288), (151936, 4096),
                 (33, 12288), (65, 100), (96, 1000)]:
        seg = reduction_config(N, K)["SEG_K"]
        for M in (1, 8, 9, 37, 63, 64, 65, 128, 256, 512, 1024, 8192):
            for elem, tma in ((2, True), (2, False), (4, False)):
                for kn in knobs:  # hand-picked knobs as the GPU tests use them: bf16
                    if (kn.get("schedule") in _TMA_SCHEDULES and not tma) or (kn and elem != 2):
                        continue
                    sched, BM, BN, BK, nw, ns = resolve_launch(M, N, K, elem, 132, tma, seg_k=seg, **kn)
                    assert BM >= 64 and seg % BK == 0 and nw in (4, 8), (N, K, M, kn)
                    if "num_stages" not in kn:
                        assert (BM + BN) * BK * elem * ns <= 224 << 10, (N, K, M, elem, kn, BM, BN, BK, ns)
                    if sched in _TMA_SCHEDULES:
                        assert tma and elem == 2
    # the sweep's decode picks: k/v streams through 64x32 tiles split over K segments
    assert launch_config(1, 1024, 4096)["schedule"] == "split"
    # k/v above 64 rows: the TMA split, 64x64 tiles on a 3-stage ring at M = 256
    kv = launch_config(256, 1024, 4096)
    assert (kv["schedule"], kv["BLOCK_N"], kv["BLOCK_K"], kv["num_stages"]) == ("tma_split", 64, 128, 3)
    assert launch_config(256, 1024, 4096, tma=False)["schedule"] == "split"
    kv = launch_config(320, 1024, 4096)  # 64x64x128 would need two waves there: 64x64x64, three programs an SM
    assert (kv["schedule"], kv["BLOCK_N"], kv["BLOCK_K"], kv["num_stages"]) == ("tma_split", 64, 64, 4)
    # ... and where 64x64 tiles leave SMs idle but the split makes at most four programs an SM: q/o at
    # M = 128 (128x64), k/v at 448 (64x128: pads no rows) and 512 (128x64); not down at 128 (12 segments)
    for (M, N, K), tile in (((128, 4096, 4096), (128, 64)), ((448, 1024, 4096), (64, 128)),
                            ((512, 1024, 4096), (128, 64))):
        c = launch_config(M, N, K)
        assert (c["schedule"], c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]) == ("tma_split", *tile, 64), (M, N, c)
    assert launch_config(128, 4096, 12288)["schedule"] == "tma"
    # decode from 32 rows up: the TMA split, 128 wide at N > 2048; the pointer split below
    for M, sched in ((31, "split"), (32, "tma_split"), (64, "tma_split")):
        assert launch_config(M, 4096, 12288)["schedule"] == sched, M
    assert launch_config(64, 4096, 12288)["BLOCK_N"] == 128 and launch_config(64, 1024, 4096)["BLOCK_N"] == 32
    assert (launch_config(1, 1024, 4096)["BLOCK_N"], launch_config(1, 1024, 4096)["BLOCK_K"]) == (32, 128)
    with pytest.raises(ValueError, match="schedule must be"):
        resolve_launch(8, 64, 64, 2, 132, True, seg_k=1024, schedule="bogus")
    with pytest.raises(ValueError, match="block_m below 64"):
        resolve_launch(8, 64, 64, 2, 132, True, seg_k=1024, block_m=32)
    with pytest.raises(ValueError, match="block_n=160 must be a power of two or 1.5 times one"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=160, schedule="tma")
    with pytest.raises(ValueError, match="block_n=192 .* needs schedule='tma'"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=192, schedule="fused")


def test_gluon_schedule_routing(monkeypatch):
    """128-row TMA tiles up to 192 wide go to the Gluon kernel where Triton
    has Gluon (on the H200 0.81-0.82x cuBLAS at M = 256 where Triton's
    kernel gave 0.73-0.80x), the 96-wide tile only there; its
    two-column-block tiles (192, 96) run warp-specialized (1.00-1.29x the
    one-partition form), 128 x 128 one-partition; 128 x 256 and 64-row
    tiles stay on Triton's; without Gluon the routing is the old one.  The
    schedule never changes a bit (GPU tests)."""
    from alignzoo.common.matmul import gluon_kernel
    from alignzoo.common.matmul.kernel import launch_config, resolve_launch

    if not gluon_kernel.available():
        pytest.skip("this Triton has no Gluon")
    pick = {(M, N): launch_config(M, N, 4096) for M in (256, 4096) for N in (6144, 12288, 24576)}
    assert [(c["schedule"], c["BLOCK_N"]) for c in pick.values()] == [
        ("gluon_ws", 96), ("gluon_ws", 192), ("gluon_ws", 192), ("tma", 256), ("tma", 256), ("tma", 256)]
    # the warp-specialized tiles where 128-row tiles fill whole waves: q/o and down at M = 384 (129 tiles
    # 96 wide), q/o at 768 (132 tiles 192 wide); 128 x 128 where it fills them better (q/o at 512)
    for (M, N, K), tile in (((384, 4096, 4096), ("gluon_ws", 96)), ((384, 4096, 12288), ("gluon_ws", 96)),
                            ((768, 4096, 4096), ("gluon_ws", 192)), ((512, 4096, 4096), ("gluon", 128))):
        c = launch_config(M, N, K)
        assert (c["schedule"], c["BLOCK_N"]) == tile, (M, N, K, c)
    q = launch_config(512, 4096, 4096)
    assert (q["BLOCK_K"], q["num_stages"]) == (128, 3)  # ring + output tile fit
    assert launch_config(256, 4096, 4096)["BLOCK_M"] == 64 and launch_config(256, 4096, 4096)["schedule"] == "tma"
    for bn, bk in ((192, 64), (96, 64), (128, 128), (64, 64)):
        ns = gluon_kernel.pipeline_stages(bn, bk)
        assert ns >= 3 and (128 + bn) * bk * 2 * ns + 128 * bn * 2 <= 224 << 10  # the ring + the output tile
    with pytest.raises(ValueError, match="128-row tiles at most 192 wide"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=256, schedule="gluon")
    with pytest.raises(ValueError, match="128-row tiles at most 192 wide"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_m=64, schedule="gluon")
    with pytest.raises(ValueError, match="'gluon_ws' runs 128-row tiles"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=256, schedule="gluon_ws")
    # an explicit form keeps its kernel at the other form's default tile
    assert resolve_launch(256, 24576, 4096, 2, 132, True, seg_k=1024, schedule="gluon")[:3] == ("gluon", 128, 192)
    assert resolve_launch(512, 4096, 4096, 2, 132, True, seg_k=1024, schedule="gluon_ws")[:3] == ("gluon_ws", 128, 192)
    monkeypatch.setattr(gluon_kernel, "available", lambda: False)
    assert [(c["schedule"], c["BLOCK_N"]) for c in (launch_config(256, N, 4096) for N in (6144, 12288, 24576))] == [
        ("tma", 128), ("tma", 192), ("tma", 128)]
    with pytest.raises(ValueError, match="needs triton.experimental.gluon"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, schedule="gluon")


def test_gluon_is_picked_only_inside_graph_launches():
    """``matmul_fwd_triton`` lets ``launch_config`` pick the Gluon kernel only
    inside ``graph_launches()`` (its launch costs more Python: eager batch-1
    prefill halved on the H200 when it ran there); outside, the routing is the
    one before it (pinned here at the shapes where they differ).  Same bits
    either way (GPU tests)."""
    import inspect

    from alignzoo.common.matmul import graph_launches, kernel
    from alignzoo.common.matmul.kernel import launch_config
    from alignzoo.common.matmul.launches import graph_launches_active

    assert "gluon=graph_launches_active()" in inspect.getsource(kernel.matmul_fwd_triton)
    assert not graph_launches_active()
    with graph_launches():
        with graph_launches():
            assert graph_launches_active()
        assert graph_launches_active()
    assert not graph_launches_active()
    eager = {(M, N): launch_config(M, N, 4096, gluon=False) for M in (128, 256, 512) for N in (6144, 12288, 24576)}
    assert [(c["schedule"], c["BLOCK_M"], c["BLOCK_N"]) for c in eager.values()] == [
        ("tma", 64, 128), ("tma", 128, 128), ("tma", 128, 192),
        ("tma", 128, 128), ("tma", 128, 192), ("tma", 128, 128),
        ("tma", 128, 192), ("tma", 128, 128), ("tma", 128, 256)]


@pytest.mark.parametrize("ws,bn,bk,stages", [(True, 192, 64, 4), (True, 96, 64, 7), (False, 128, 128, 3),
                                             (False, 192, 64, 4)])
def test_gluon_kernel_compiles_for_sm90_without_spills(ws, bn, bk, stages):
    """The Gluon kernel in each form at each tile the router picks compiles
    for sm_90 with this Triton, uses no local memory (spills), and fits the
    H200's 227 KB of shared memory; its chain restarts with use_acc=False (a
    predicated wgmma).  The warp-specialized form launches at
    ``WS_MAXNREG`` registers and hands its producer warps' share to the MMA
    warps (setmaxnreg)."""
    import os
    import re
    import shutil
    import subprocess

    from alignzoo.common.matmul import gluon_kernel

    if not gluon_kernel.available():
        pytest.skip("this Triton has no Gluon")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def desc(box):
        return f"tensordesc<bf16[{box[0]}, {box[1]}],{gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16)!r}>"

    bn1 = 1 << (bn.bit_length() - 1)
    bn2 = bn - bn1
    fn = gluon_kernel._mm_ws_kernel if ws else gluon_kernel._mm_pipe_kernel
    opts = {"num_warps": 8, **({"maxnreg": gluon_kernel.WS_MAXNREG} if ws else {})}
    sig = {"d_x": desc([128, bk]), "d_w": desc([bn1, bk]), "d_w2": desc([bn2 or 16, bk]), "d_y": desc([128, bn1]),
           "d_y2": desc([128, bn2 or 16]), "M": "i32", "N": "i32", "N_K": "i32", "NUM_PROGS": "i32"}
    consts = {"SEG_STEPS": 1024 // bk, "BN2": bn2, "GROUP_M": 8, "NUM_BUF": stages, "num_warps": 8}
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(GluonASTSource(fn, sig, {(fn.arg_names.index(n),): v for n, v in consts.items()}),
                       target=GPUTarget("cuda", 90, 32), options=opts)
    assert k.metadata.shared <= 227 << 10
    if ws:
        assert "setmaxnreg.inc" in k.asm["ptx"] and "setmaxnreg.dec" in k.asm["ptx"]
    assert "ld.local" not in k.asm["ptx"] and "st.local" not in k.asm["ptx"]
    assert re.search(r"wgmma\.mma_async\.sync\.aligned\.m64n%dk16" % bn1, k.asm["ptx"])
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if shutil.which(cuobjdump) or os.path.exists(cuobjdump):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"alignzoo_gluon_{os.getpid()}_{bn}_{ws}.cubin")
        with open(path, "wb") as f:
            f.write(k.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", path], capture_output=True, text=True).stdout
        os.remove(path)
        assert "STACK:0" in usage and "LOCAL:0" in usage, usage


def test_host_integer_helpers_equal_tritons():
    """The launchers' plain-Python cdiv / next_power_of_2 (``common._host``:
    triton's are ConstexprFunction wrappers, ~12 µs a call from Python) give
    triton's values, so no grid or block size moves."""
    import triton

    from alignzoo.common._host import cdiv, next_power_of_2

    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 5000, 7) for b in (1, 3, 64, 100, 1024, 4096))
    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 1 << 17))


# The interpreter's tl.dot is the host's np.matmul, whose BLAS may sum a (BM, BK) x (BK, BN) step in any order
# (it picks kernels by shape and CPU).  So every step's dot is made exact: small integers (|v| <= 8, <= 32 terms
# of <= 64: far inside fp32's 24 bits) sharing one power-of-two scale per BK-wide step of K.  Any BLAS then gives
# each step's bits, while the scales (2^-12 .. 2^12 across steps) make the adds *between* steps round, so the
# order of the chain across steps and segments is still what the test sees.
_EXACT_STEPS = """
def exact_step_inputs(M, N, K, BK, g):
    x = torch.randint(-8, 9, (M, K), generator=g).float()
    w = torch.randint(-8, 9, (N, K), generator=g).float()
    scale = 2.0 ** torch.randint(-12, 13, (-(-K // BK),), generator=g).float()
    return x * scale.repeat_interleave(BK)[:K], w
"""

# Another host's BLAS, stood in for: the interpreter's dots sum K in reverse, one rank-1 update at a time.
_REVERSED_BLAS = """
import numpy as np
import triton.runtime.interpreter as _interp


def _reversed_matmul(a, b, dtype=None, **kw):
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for k in range(a.shape[1] - 1, -1, -1):
        out = out + np.outer(a[:, k], b[k, :]).astype(np.float32)
    return out.astype(dtype or np.float32)


class _Numpy:
    matmul = staticmethod(_reversed_matmul)

    def __getattr__(self, name):
        return getattr(np, name)


_interp.np = _Numpy()
"""
_BLAS = {"host": "", "reversed": _REVERSED_BLAS}


_TMA_INTERPRETED = """
import numpy as np, torch, triton
from triton.tools.tensor_descriptor import TensorDescriptor as D
from alignzoo.common.matmul.kernel import _mm_tma_persistent_kernel, column_blocks

def reference(x, w, seg, bk, bm, bn, bn2):
    # the contract's order with the interpreter's dot (np.matmul of one (BM, BK) x (BK, bn) step, tile by
    # tile, zero-padded as TMA pads): p_s chains from 0 per K segment, added left to right
    M, K = x.shape
    N, W = w.shape[0], bn + bn2
    Kp, Mp, Np = -(-K // seg) * seg, -(-M // bm) * bm, -(-N // W) * W + W
    xp = np.zeros((Mp, Kp), np.float32); xp[:M, :K] = x.numpy()
    wp = np.zeros((Np, Kp), np.float32); wp[:N, :K] = w.numpy()
    y = np.zeros((Mp, Np), np.float32)
    for m0 in range(0, Mp, bm):
        for n0 in range(0, Np - W, W):
            for c0, c1 in ((n0, n0 + bn), (n0 + bn, n0 + W)) if bn2 else ((n0, n0 + bn),):
                total = np.zeros((bm, c1 - c0), np.float32)
                for s in range(0, Kp, seg):
                    acc = np.zeros_like(total)
                    for k in range(s, s + seg, bk):
                        acc = np.matmul(xp[m0:m0 + bm, k:k + bk], wp[c0:c1, k:k + bk].T, dtype=np.float32) + acc
                    total = total + acc
                y[m0:m0 + bm, c0:c1] = total
    return torch.from_numpy(y[:M, :N].copy())


g = torch.Generator().manual_seed(0)
for M, N, K, BM, BN, BK, SEG in [(70, 200, 160, 32, 96, 16, 64), (33, 100, 100, 16, 32, 16, 32), (40, 64, 96, 16, 64, 32, 32)]:
    x, w = exact_step_inputs(M, N, K, BK, g)
    y = torch.full((M, N), float("nan"))
    bn, bn2 = column_blocks(BN)
    dw, dy = D.from_tensor(w, [bn, BK]), D.from_tensor(y, [BM, bn])
    dw2, dy2 = (D.from_tensor(w, [bn2, BK]), D.from_tensor(y, [BM, bn2])) if bn2 else (dw, dy)
    _mm_tma_persistent_kernel[(3,)](D.from_tensor(x, [BM, BK]), dw, dw2, dy, dy2, M, N, K, triton.cdiv(K, SEG),
                                    SEG_K=SEG, BLOCK_M=BM, BLOCK_N=bn, BLOCK_N2=bn2, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=3)
    assert torch.equal(y, reference(x, w, SEG, BK, BM, bn, bn2)), (M, N, K, BN)
print("ok")
"""


@pytest.mark.parametrize("blas", list(_BLAS))
def test_tma_kernel_keeps_the_segment_order_interpreted(blas):
    """The TMA kernel's source (one k-loop restarting the chain after each
    segment's last step; 96- and 192-wide tiles of two column blocks with a
    loop per segment) run by Triton's interpreter on fp32 CPU tensors equals a
    numpy reference of the contract's order: p_s chains from zero, added left
    to right.  K not a multiple of SEG_K, M and N not multiples of the tile.
    (Carrying the chain across a segment end fails this test.)"""
    run_interpreted(_BLAS[blas] + _EXACT_STEPS + _TMA_INTERPRETED, expect="ok")


_TMA_SPLIT_INTERPRETED = """
import torch, triton
from triton.tools.tensor_descriptor import TensorDescriptor as D
from alignzoo.common.matmul.kernel import _mm_tma_split_kernel, _mm_split_kernel

g = torch.Generator().manual_seed(0)
for M, N, K, BM, BN, BK, SEG in [(37, 100, 100, 16, 32, 16, 32), (70, 64, 160, 32, 16, 32, 64), (5, 40, 96, 16, 16, 16, 16)]:
    x, w = exact_step_inputs(M, N, K, BK, g)
    S, grid = triton.cdiv(K, SEG), (triton.cdiv(M, BM), triton.cdiv(N, BN))
    a, b = torch.full((S, M, N), float("nan")), torch.full((S, M, N), float("nan"))
    _mm_tma_split_kernel[(*grid, S)](D.from_tensor(x, [BM, BK]), D.from_tensor(w, [BN, BK]), a, M, N, SEG_K=SEG,
                                     BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK)
    _mm_split_kernel[(*grid, S)](x, w, b, M, N, K, K, 1, K, 1, SEG_K=SEG, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, IEEE=True)
    assert torch.equal(a, b) and not a.isnan().any(), (M, N, K)
print("ok")
"""


@pytest.mark.parametrize("blas", list(_BLAS))
def test_tma_split_kernel_writes_the_split_kernels_partials_interpreted(blas):
    """The TMA split kernel (TMA loads, zero past the edges) writes the
    pointer-load split kernel's fp32 segment partials, byte for byte, for the
    merge kernel: Triton's interpreter, fp32 CPU tensors, ragged M, N and K.
    (A chain carried across segments, or a segment's steps started anywhere
    but its first, fails this test.)"""
    run_interpreted(_BLAS[blas] + _EXACT_STEPS + _TMA_SPLIT_INTERPRETED, expect="ok")
