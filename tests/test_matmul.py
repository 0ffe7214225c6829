"""matmul: rungs 1-2 (bitwise), accuracy vs float64, gradients, bad input."""
import pytest
import torch

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.matmul import fixed_order_dot, matmul, matmul_bwd, matmul_fwd, matmul_ref

SHAPES = [  # (M, K, N): odd sizes, K past one 1024-segment, K = 12288 (Qwen3-8B down-proj)
    pytest.param(37, 100, 65, id="M37-K100-N65"),
    pytest.param(63, 1000, 96, id="M63-K1000-N96"),
    pytest.param(9, 12288, 33, id="M9-K12288-N33"),
    # TMA-aligned rows: three K segments, the last partial; N not a multiple of 192 or 96
    pytest.param(130, 2100, 200, id="M130-K2100-N200"),
]
FEW_CONFIGS_ABOVE_K = 4096  # the CPU path costs K passes per call: fewer configs for K = 12288


def _launch_configs(device):
    if device.type == "cpu":
        return [{}, {"row_chunk": 4}, {"row_chunk": 1}]
    return [{}, {"block_m": 64, "schedule": "split"}, {"block_m": 64, "schedule": "split2"},
            {"block_m": 64, "block_n": 256, "schedule": "fused"},
            {"block_m": 128, "block_k": 128, "schedule": "split", "num_warps": 4},
            {"block_m": 128, "block_n": 64, "schedule": "fused", "num_stages": 2}, {"schedule": "tma"},
            {"block_m": 128, "block_n": 192, "schedule": "tma"}, {"block_m": 64, "block_n": 96, "schedule": "tma"}]


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
        configs = [c for c in configs if c.get("schedule") != "tma"]
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
    """cuBLAS changes bits for M <= 128 (DESIGN §5); ours may not, at any M."""
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
                    if (kn.get("schedule") == "tma" and not tma) or (kn and elem != 2):
                        continue
                    sched, BM, BN, BK, nw, ns = resolve_launch(M, N, K, elem, 132, tma, seg_k=seg, **kn)
                    assert BM >= 64 and seg % BK == 0 and nw in (4, 8), (N, K, M, kn)
                    if "num_stages" not in kn:
                        assert (BM + BN) * BK * elem * ns <= 224 << 10, (N, K, M, elem, kn, BM, BN, BK, ns)
                    if sched == "tma":
                        assert tma and elem == 2
    # split2 (the two-kernel split) runs on split's tile, default or explicit, so the two compare side by side
    for M, N, K in ((1, 4096, 4096), (64, 6144, 4096), (8, 24576, 4096), (256, 1024, 4096)):
        split = resolve_launch(M, N, K, 2, 132, True, seg_k=1024, schedule="split")
        assert resolve_launch(M, N, K, 2, 132, True, seg_k=1024, schedule="split2") == ("split2", *split[1:])
    # the sweep's decode picks: k/v streams through 64x32 tiles split over K segments
    assert launch_config(1, 1024, 4096)["schedule"] == "split"
    assert (launch_config(1, 1024, 4096)["BLOCK_N"], launch_config(1, 1024, 4096)["BLOCK_K"]) == (32, 128)
    with pytest.raises(ValueError, match="schedule must be"):
        resolve_launch(8, 64, 64, 2, 132, True, seg_k=1024, schedule="bogus")
    with pytest.raises(ValueError, match="block_m below 64"):
        resolve_launch(8, 64, 64, 2, 132, True, seg_k=1024, block_m=32)
    with pytest.raises(ValueError, match="block_n=160 must be a power of two or 1.5 times one"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=160, schedule="tma")
    with pytest.raises(ValueError, match="block_n=192 .* needs schedule='tma'"):
        resolve_launch(256, 4096, 4096, 2, 132, True, seg_k=1024, block_n=192, schedule="fused")


def test_host_integer_helpers_equal_tritons():
    """The launchers' plain-Python cdiv / next_power_of_2 (``common._host``:
    triton's are ConstexprFunction wrappers, ~12 µs a call from Python) give
    triton's values, so no grid or block size moves."""
    import triton

    from alignzoo.common._host import cdiv, next_power_of_2

    assert all(cdiv(a, b) == triton.cdiv(a, b) for a in range(0, 5000, 7) for b in (1, 3, 64, 100, 1024, 4096))
    assert all(next_power_of_2(n) == triton.next_power_of_2(n) for n in range(0, 1 << 17))


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
    x, w = (torch.randn(r, K, generator=g).bfloat16().float() for r in (M, N))  # bf16 values: exact in tf32
    y = torch.full((M, N), float("nan"))
    bn, bn2 = column_blocks(BN)
    dw, dy = D.from_tensor(w, [bn, BK]), D.from_tensor(y, [BM, bn])
    dw2, dy2 = (D.from_tensor(w, [bn2, BK]), D.from_tensor(y, [BM, bn2])) if bn2 else (dw, dy)
    _mm_tma_persistent_kernel[(3,)](D.from_tensor(x, [BM, BK]), dw, dw2, dy, dy2, M, N, K, triton.cdiv(K, SEG),
                                    SEG_K=SEG, BLOCK_M=BM, BLOCK_N=bn, BLOCK_N2=bn2, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=3)
    assert torch.equal(y, reference(x, w, SEG, BK, BM, bn, bn2)), (M, N, K, BN)
print("ok")
"""


def test_tma_kernel_keeps_the_segment_order_interpreted():
    """The TMA kernel's source (one k-loop restarting the chain after each
    segment's last step; 96- and 192-wide tiles of two column blocks with a
    loop per segment) run by Triton's interpreter on fp32 CPU tensors equals a
    numpy reference of the contract's order: p_s chains from zero, added left
    to right.  K not a multiple of SEG_K, M and N not multiples of the tile.
    (Carrying the chain across a segment end fails this test.)"""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _TMA_INTERPRETED], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


# ---------------------------------------------------------------- split schedule: the in-place merge
_SPLIT_INTERPRETED = """
import torch, triton
from alignzoo.common.matmul import kernel as mm

g = torch.Generator().manual_seed(0)
cpu = torch.device("cpu")
# (M, N, K, SEG_K, (BM, BN, BK), y dtype): odd N; K = 1000 / 12288 / 100 / 300 with a short last segment or
# none; S = 8, 12, 4, 1, 5; 3 x 2 tiles in the last case (the counter index); bf16 y: the one rounding.
# (The interpreter takes ~5 s a launch at K = 12288: that case runs once.)
CASES = [(1, 33, 1000, 128, (64, 16, 64), torch.float32), (7, 65, 12288, 1024, (64, 64, 1024), torch.float32),
         (64, 33, 100, 32, (64, 16, 16), torch.float32), (64, 100, 1000, 1024, (64, 64, 64), torch.float32),
         (130, 40, 300, 64, (64, 32, 64), torch.bfloat16)]
for M, N, K, seg, (BM, BN, BK), ydt in CASES:
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) / K**0.5  # fp32: the interpreter's bf16 dot is wrong
    S = triton.cdiv(K, seg)
    kw = dict(seg_k=seg, BM=BM, BN=BN, BK=BK, num_warps=4, num_stages=1)
    ref = torch.full((M, N), float("nan"), dtype=ydt)
    mm.split_launch(x, w, ref, S, merge=False, **kw)  # the two-kernel path
    for _ in range(1 if K > 4096 else 3):  # the counters come back to zero and serve the next launch
        y = torch.full((M, N), float("nan"), dtype=ydt)
        mm.split_launch(x, w, y, S, **kw)
        assert torch.equal(y, ref), (M, N, K)
        assert mm.split_counters(cpu, 1).count_nonzero() == 0, (M, N, K)
    # the partials merged in torch: left to right is the kernels' order; reversed differs
    ws = torch.full((S, M, N), float("nan"))
    mm._mm_split_kernel[(triton.cdiv(M, BM), triton.cdiv(N, BN), S)](
        x, w, ws, y, ws, M, N, K, K, 1, K, 1, N, 1, S, SEG_K=seg, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, IEEE=True,
        MERGE=False)
    fwd, rev = torch.zeros(M, N), torch.zeros(M, N)
    for s in range(S):
        fwd += ws[s]
        rev += ws[S - 1 - s]
    if ydt == torch.float32:  # (the interpreter truncates fp32 -> bf16; the GPU and torch round to nearest)
        assert torch.equal(fwd, ref), (M, N, K)
        assert S < 3 or not torch.equal(rev, ref), (M, N, K)
    assert (fwd - x.double() @ w.double().T).abs().max() < 1e-5
print("ok")
"""


def test_split_merge_in_place_equals_two_kernels_interpreted():
    """The one-launch split (the last program of a tile merges) against the
    two-kernel split (``_mm_merge_kernel``), run by Triton's interpreter on
    fp32 CPU tensors: the same bits at M = 1, 7, 64, 130, odd N, K = 1000,
    12288, 100 and 300 (a short last segment, or a single segment), three
    calls in a row (one at K = 12288), the counters back at zero after each.  The
    check can fail: the same partials merged right to left give other bits
    (a kernel that merged in any other order than left to right fails here)."""
    import os
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _SPLIT_INTERPRETED], env={**os.environ, "TRITON_INTERPRET": "1"},
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout[-2000:] + run.stderr[-4000:]


def _split_ptx(merge: bool = True) -> list[str]:
    """sm_90 PTX of ``_mm_split_kernel`` with PDL at the decode tile (compiled here, no GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from alignzoo.common.matmul import kernel as mm

    fn = mm._mm_split_kernel
    types = {"p_x": "*bf16", "p_w": "*bf16", "p_ws": "*fp32", "p_y": "*bf16", "p_cnt": "*i32", "M": "i32",
             "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32", "N_SEG": "i32"}
    consts = {"SEG_K": 1024, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False, "MERGE": merge,
              "PDL": True, "stride_xk": 1, "stride_wk": 1, "stride_yn": 1}
    names = fn.arg_names
    src = ASTSource(fn, {n: types.get(n, "constexpr") for n in names},
                    {(names.index(n),): v for n, v in consts.items()},
                    {(names.index(n),): [["tt.divisibility", 16]] for n in types if n not in ("M", "N_SEG")})
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    return [ln.strip() for ln in k.asm["ptx"].splitlines()]


def test_split_merge_orders_memory_in_the_compiled_kernel():
    """The ordering argument of ``_mm_split_kernel``'s docstring, read off its
    sm_90 PTX: the grid-dependency wait before any global access; the
    partial's stores, a CTA barrier, then the one acq_rel gpu-scope arrival
    atomic; a barrier before the merge's loads, which all bypass L1 (.cg);
    y's stores, then the counter's reset."""
    import re

    from sm90_layouts import can_compile_sm90

    if not can_compile_sm90():
        pytest.skip("this triton build has no NVIDIA backend")
    lines = _split_ptx()
    at = lambda pat: [i for i, ln in enumerate(lines) if re.search(pat, ln)]  # noqa: E731
    glob = at(r"^(@%p\d+ )?(ld|st|atom|red)\.global|cp\.async\.\w+\.shared\.global")
    wait, = at(r"griddepcontrol\.wait")
    assert wait < min(glob)
    arrive, = at(r"atom\.global\.gpu\.acq_rel\.add")
    reset, = at(r"atom\.global\.gpu\.relaxed\.exch")
    bars = at(r"^(bar|barrier)\.sync")
    stores = at(r"st\.global")
    partial = [i for i in stores if i < arrive]
    merged = [i for i in stores if arrive < i < reset]
    loads = [i for i in at(r"ld\.global|cp\.async\.\w+\.shared\.global") if i > arrive]
    assert partial and merged and loads and max(merged) < reset
    assert any(max(partial) < b < arrive for b in bars), "no CTA barrier between the partial's stores and the release"
    assert any(arrive < b < min(loads) for b in bars), "no CTA barrier between the acquire and the merge's loads"
    assert all(".cg" in lines[i] for i in loads), [lines[i] for i in loads if ".cg" not in lines[i]]
    assert len(at(r"atom\.global")) == 2  # the arrival and the reset, nothing else
    assert not any("atom.global" in ln for ln in _split_ptx(merge=False))  # the two-kernel split: no counter


DECODE_SHAPES = [  # Qwen3-8B (N, K): qkv, o, down, gate_up
    pytest.param(6144, 4096, id="N6144-K4096"), pytest.param(4096, 4096, id="N4096-K4096"),
    pytest.param(4096, 12288, id="N4096-K12288"), pytest.param(24576, 4096, id="N24576-K4096")]


def _counters_all_zero() -> bool:
    from alignzoo.common.matmul import kernel as mm

    torch.cuda.synchronize()
    return all(int(b.count_nonzero()) == 0 for b in (*mm._COUNTERS.values(), *mm._SPARE.values()))


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", DECODE_SHAPES)
def test_gpu_split_merge_in_place_equals_two_kernels(N, K):
    """One-launch split == two-kernel split (``split2``) at Qwen3-8B decode
    shapes, 50 calls back to back (PDL on at M <= 64) at each M and tile,
    three inputs in turn: a merge that read a stale partial (the previous
    call's workspace has the same address) or a stale y would give the
    previous input's bits.  Also == the default schedule."""
    from alignzoo.common.matmul.kernel import matmul_fwd_triton

    dev = torch.device("cuda")
    w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
    for M in (1, 8, 64):
        xs = [torch.randn(M, K, device=dev).bfloat16() for _ in range(3)]
        for knobs in ({}, {"block_n": 32, "block_k": 128}, {"block_n": 128}):
            refs = [matmul_fwd_triton(x, w, schedule="split2", **knobs) for x in xs]
            outs = [matmul_fwd_triton(xs[i % 3], w, schedule="split", **knobs) for i in range(50)]
            bad = [i for i, y in enumerate(outs) if not torch.equal(y, refs[i % 3])]
            assert not bad, (M, knobs, bad)
            assert all(torch.equal(r, matmul_fwd_triton(x, w)) for r, x in zip(refs, xs)), (M, knobs)
        assert _counters_all_zero(), M


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64])
def test_gpu_split_merge_in_place_in_a_cuda_graph_with_pdl(monkeypatch, M):
    """Four layers of Qwen3-8B's decode matmuls (qkv -> o -> gate_up -> down,
    all on the split schedule: 16 split launches a replay, each one's input
    the previous one's output, PDL edges between them) captured once and
    replayed 100 times, a new input each replay and every output set to NaN
    before it: each replay equals the eager two-kernel chain, and the
    counters are back at zero."""
    from alignzoo.common._pdl import pdl_options
    from alignzoo.common.matmul.kernel import matmul_fwd_triton

    monkeypatch.setenv("ALIGNZOO_PDL", "1")
    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev)[0] >= 9:
        assert pdl_options(dev, M)["PDL"], "PDL is off: this test would not exercise it"
    H, I = 4096, 12288
    ws = [(torch.randn(n, k, device=dev) / k**0.5).bfloat16() for n, k in ((6144, H), (H, H), (2 * I, H), (H, I))]

    def chain(x, schedule):
        outs, h = [], x
        for _ in range(4):
            qkv = matmul_fwd_triton(h, ws[0], schedule=schedule)
            o = matmul_fwd_triton(qkv[:, :H], ws[1], schedule=schedule)
            gu = matmul_fwd_triton(o, ws[2], schedule=schedule)
            h = matmul_fwd_triton(gu[:, :I], ws[3], schedule=schedule)
            outs += [qkv, o, gu, h]
        return outs

    xs = [torch.randn(M, H, device=dev).bfloat16() for _ in range(3)]
    refs = [chain(x, "split2") for x in xs]
    static = xs[0].clone()
    eager = chain(static, "split")  # also the warm-up: compiles outside the capture
    assert all(torch.equal(a, b) for a, b in zip(eager, refs[0]))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(static, "split")
    for r in range(100):
        static.copy_(xs[r % 3])
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        bad = [i for i, (a, b) in enumerate(zip(outs, refs[r % 3])) if not torch.equal(a, b)]
        assert not bad, (r, bad)
    assert _counters_all_zero()
