"""LM-head log-probabilities: batch invariance (rungs 1-2), the sampler's
logits/LSE agreeing bitwise with the log-probabilities, accuracy and gradients
against float64, bad input, and a deliberately T-dependent variant that the
checks must catch."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.lm_head import (
    VOCAB_GROUP,
    lm_head_bwd,
    lm_head_fwd,
    lm_head_logits,
    lm_head_logits_ref,
    lm_head_logprobs,
    lm_head_logprobs_ref,
    lm_head_lse_ref,
)
from alignzoo.common.lm_head import cpu as lm_cpu

# FP32 projection (K summed in order) and FP32 LSE vs float64 on the same
# inputs: measured 4e-8 .. 1e-7 on CPU; 1e-5 leaves room for the GPU's MMA order.
LP_BOUND = 1e-5
# dz is rounded to the input dtype before the products and dh/dW once at the
# end: for bf16 that is 2^-9 relative per element (measured ~2.5e-3).
GRAD_BOUND = {torch.bfloat16: 1e-2, torch.float32: 1e-5}
# Launch knobs that must not change bits (the first one is the reference).
KNOBS = {
    "cpu": ({}, {"block_m": 3, "vocab_chunk": 1}, {"block_m": 50, "vocab_chunk": 2}),
    "cuda": ({"block_m": 64}, {"block_m": 128, "vocab_chunk": 1}),
}
BF16, FP32 = torch.bfloat16, torch.float32


def make(T, K, V, dtype, device, scale=3.0, seed=0, centered=False):
    """Hidden states ~N(0, 1), weight scaled so logits have std ~scale; targets
    include the group edges 0, 255, 256 and the last id V - 1.

    ``centered``: feature 0 becomes a bias that shifts every logit so the LSE
    sits near 0, where an FP32 LSE has its finest ulp and a regrouped sum
    shows in its bits (with LSE ~ 7 most regroupings round away)."""
    on = torch.device(device)  # generate where the test runs: V = 151936 is slow to build on the CPU
    g = torch.Generator(device=on).manual_seed(seed)
    h = torch.randn(T, K, generator=g, device=on)
    w = torch.randn(V, K, generator=g, device=on) * (scale / K**0.5)
    if centered and T:
        h[:, 0], w[:, 0] = 1.0, 0.0
        w[:, 0] = -lm_head_lse_ref(h[:16], w).mean().float()
    h, w = h.to(dtype), w.to(dtype)
    y = torch.randint(0, V, (T,), generator=g, device=on)
    edges = torch.tensor([0, 255, 256, V - 1], device=on).clamp(max=V - 1)[:T]
    y[: len(edges)] = edges
    return h, w, y


def _fwd(h, y, *, weight, **knobs):
    return lm_head_fwd(h, weight, y, **knobs)


def _logits(h, *, weight, **knobs):
    return lm_head_logits(h, weight, return_lse=True, **knobs)


def _dh(h, y, grad, *, weight, **knobs):
    _, lse = lm_head_fwd(h, weight, y, **knobs)
    return lm_head_bwd(h, weight, y, lse, grad, **knobs)[0]


ACC_CASES = [
    pytest.param(63, 100, 1000, BF16, 3.0, id="T63-K100-V1000-bf16"),
    pytest.param(33, 100, 1000, FP32, 3.0, id="T33-K100-V1000-fp32"),
    pytest.param(7, 1000, 1000, BF16, 3.0, id="T7-K1000-V1000-bf16"),
    pytest.param(5, 100, 32001, BF16, 3.0, id="T5-K100-V32001-bf16"),
    pytest.param(593, 12, 300, BF16, 3.0, id="T593-K12-V300-bf16"),
    pytest.param(1, 64, 256, BF16, 3.0, id="T1-K64-V256-one-group"),
    pytest.param(9, 100, 1000, BF16, 30.0, id="T9-K100-V1000-peaked"),
    pytest.param(3, 64, 151936, BF16, 3.0, id="T3-K64-V151936-qwen-vocab"),
]


@pytest.mark.parametrize("T, K, V, dtype, scale", ACC_CASES)
def test_matches_float64(device, T, K, V, dtype, scale):
    h, w, y = make(T, K, V, dtype, device, scale=scale)
    lp, lse = lm_head_fwd(h, w, y)
    assert lp.dtype == lse.dtype == torch.float32 and lp.shape == lse.shape == (T,)
    assert rel_err(lp, lm_head_logprobs_ref(h, w, y)) <= LP_BOUND
    assert rel_err(lse, lm_head_lse_ref(h, w)) <= LP_BOUND
    assert bool((lp <= 0).all())


@pytest.mark.parametrize("T, K, V", [(37, 100, 1000), (4, 64, 32001)], ids=["T37-K100-V1000", "T4-K64-V32001"])
def test_sampler_logits_agree_bitwise(device, T, K, V):
    """The server's decode path (logits, then logprob = logit - lse) gives the
    trainer's bits."""
    h, w, y = make(T, K, V, BF16, device)
    for knobs in KNOBS[device.type]:
        lp, lse = lm_head_fwd(h, w, y, **knobs)
        logits = lm_head_logits(h, w, **knobs)
        logits2, lse2 = lm_head_logits(h, w, return_lse=True, **knobs)
        assert logits.dtype == torch.float32 and logits.shape == (T, V)
        assert bitwise_equal(logits, logits2) and bitwise_equal(lse, lse2)
        assert bitwise_equal(logits.gather(1, y[:, None])[:, 0] - lse, lp)
        assert rel_err(logits, lm_head_logits_ref(h, w)) <= LP_BOUND


# (T, K, V, dtype, subset sizes); index 2 is the long batch (CPU) / Qwen3-8B head (CUDA)
RUNG_CASES = {
    "cpu": [(47, 100, 1000, BF16, (1, 2, 3, 7, 40)), (23, 100, 1000, FP32, (1, 2, 7)), (593, 12, 300, BF16, (1, 64, 300))],
    "cuda": [
        (300, 1000, 32001, BF16, (1, 2, 3, 7, 64, 129)),
        (97, 100, 1000, FP32, (1, 2, 7, 65)),
        (600, 4096, 151936, BF16, (1, 8, 64, 257)),
    ],
}


@pytest.mark.parametrize("case", range(3), ids=["bf16", "fp32", "long-or-qwen-vocab"])
def test_rung1_rung2(device, case):
    T, K, V, dtype, sizes = RUNG_CASES[device.type][case]
    h, w, y = make(T, K, V, dtype, device, scale=1.0, centered=True)
    knobs = KNOBS[device.type]
    r1 = rung1_repeat("lm_head", _fwd, h, y, weight=w)
    assert r1.passed, r1
    for fn, rows in ((_fwd, [h, y]), (_logits, [h])):
        r2 = rung2_rows("lm_head", fn, rows, shared={"weight": w}, configs=knobs, batch_sizes=sizes)
        assert r2.passed and r2.compared > 0, r2


@pytest.mark.parametrize(
    "T, K, V, dtype",
    [
        pytest.param(63, 100, 1000, BF16, id="T63-K100-V1000-bf16"),
        pytest.param(33, 100, 1000, FP32, id="T33-K100-V1000-fp32"),
        pytest.param(5, 1000, 300, BF16, id="T5-K1000-V300-bf16"),
        pytest.param(3, 64, 32001, BF16, id="T3-K64-V32001-bf16"),
    ],
)
def test_gradients_vs_float64(device, T, K, V, dtype):
    h, w, y = make(T, K, V, dtype, device)
    g = torch.randn(T, generator=torch.Generator().manual_seed(1)).to(device)
    g[::4] = 0.0
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lm_head_logprobs(hh, ww, y).backward(g)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    lm_head_logprobs_ref(h64, w64, y).backward(g.double())
    assert hh.grad.dtype == dtype and ww.grad.dtype == dtype
    assert rel_err(hh.grad, h64.grad) <= GRAD_BOUND[dtype]
    assert rel_err(ww.grad, w64.grad) <= GRAD_BOUND[dtype]


def test_backward_deterministic_and_knob_free(device):
    """dh and dW: same bits run to run and for every launch knob (the vocabulary
    chunk only cuts a sequential sum where it would continue anyway)."""
    T, K, V = (40, 100, 1000) if device.type == "cpu" else (300, 1000, 32001)
    h, w, y = make(T, K, V, BF16, device)
    _, lse = lm_head_fwd(h, w, y)
    grad = torch.linspace(-1.0, 1.0, T, device=device)
    ref = lm_head_bwd(h, w, y, lse, grad, **KNOBS[device.type][0])
    for knobs in KNOBS[device.type]:
        got = lm_head_bwd(h, w, y, lse, grad, **knobs)
        assert bitwise_equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1]), knobs


def test_dh_rows_batch_invariant(device):
    T, K, V = (23, 100, 1000) if device.type == "cpu" else (200, 1000, 32001)
    h, w, y = make(T, K, V, BF16, device, scale=1.0, centered=True)
    grad = torch.linspace(-1.0, 2.0, T, device=device)  # one upstream gradient per row
    r2 = rung2_rows("lm_head", _dh, [h, y, grad], shared={"weight": w}, configs=KNOBS[device.type], batch_sizes=(1, 7))
    assert r2.passed, r2


def test_empty_batch(device):
    h, w, y = make(0, 64, 300, BF16, device)
    lp, lse = lm_head_fwd(h, w, y)
    assert lp.shape == lse.shape == (0,)
    assert lm_head_logits(h, w).shape == (0, 300)


def test_backward_never_builds_T_by_V_on_cpu(monkeypatch):
    """Every FP32 projection the CPU backward makes is one vocabulary chunk wide."""
    T, K, V = 9, 32, 1000
    h, w, y = make(T, K, V, BF16, "cpu")
    shapes = []
    real = lm_cpu.fixed_order_dot

    def spy(a, b):
        out = real(a, b)
        shapes.append(tuple(out.shape))
        return out

    _, lse = lm_head_fwd(h, w, y)
    monkeypatch.setattr(lm_cpu, "fixed_order_dot", spy)
    lm_head_bwd(h, w, y, lse, torch.ones(T), vocab_chunk=1)
    assert shapes and all(V not in s and s[0] * s[1] < T * V for s in shapes), shapes


@pytest.mark.gpu
def test_backward_memory_gpu():
    T, K, V = 1024, 256, 151936
    h, w, y = make(T, K, V, BF16, "cuda")
    _, lse = lm_head_fwd(h, w, y)
    grad = torch.ones(T, device="cuda")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    dh, dw = lm_head_bwd(h, w, y, lse, grad, vocab_chunk=8)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    outputs = dh.numel() * dh.element_size() + dw.numel() * dw.element_size()
    # dW, dh, an FP32 (T, K) accumulator and a (T, 2048) bf16 dz buffer
    assert extra - outputs < T * V * 4 // 8, (extra, outputs)


def test_merge_tree_equals_padded_tree():
    """kernel.py pads the groups to a power of two with the identity (-inf, 0)
    and merges pairwise; that must be the CPU tree (odd one carried up) bit
    for bit, for every group count."""

    def padded(m, l):
        n = 1 << (m.shape[1] - 1).bit_length()
        m = torch.cat([m, m.new_full((m.shape[0], n - m.shape[1]), float("-inf"))], 1)
        l = torch.cat([l, l.new_zeros((l.shape[0], n - l.shape[1]))], 1)
        while m.shape[1] > 1:
            m_a, m_b, l_a, l_b = m[:, 0::2], m[:, 1::2], l[:, 0::2], l[:, 1::2]
            big = torch.maximum(m_a, m_b)
            pad = big == float("-inf")
            e_a = torch.exp(torch.where(pad, 0.0, m_a - big))
            e_b = torch.exp(torch.where(pad, 0.0, m_b - big))
            m, l = big, l_a * e_a + l_b * e_b
        return m[:, 0], l[:, 0]

    g = torch.Generator().manual_seed(0)
    for G in (1, 2, 3, 5, 7, 126, 594):
        m = torch.randn(17, G, generator=g) * 8
        l = torch.rand(17, G, generator=g) * 255 + 1
        got, want = lm_cpu.merge_groups(m, l), padded(m, l)
        assert bitwise_equal(got[0], want[0]) and bitwise_equal(got[1], want[1]), G


def test_cpu_exp_log_position_free():
    """The CPU path relies on torch's float32 exp/log giving an element the same
    bits wherever it sits in a tensor (vector body or tail) and for any
    thread count; a torch upgrade that breaks this must fail here."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70_001, generator=g) * 20
    y = torch.rand(70_001, generator=g) * 1e4 + 1
    ref_e, ref_l = torch.exp(x), torch.log(y)
    for start, n in ((0, 1), (3, 5), (17, 31), (100, 257), (999, 40_000), (1, 70_000)):
        assert bitwise_equal(torch.exp(x[start : start + n]), ref_e[start : start + n])
        assert bitwise_equal(torch.log(y[start : start + n]), ref_l[start : start + n])
    n_threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert bitwise_equal(torch.exp(x), ref_e) and bitwise_equal(torch.log(y), ref_l)
    finally:
        torch.set_num_threads(n_threads)


def test_checks_catch_T_dependent_group_size():
    """A variant whose vocabulary group shrinks to 128 logits for batches under
    64 rows: rung 2 must see the changed bits.  (The two group sizes nest, so
    only ~5-10% of rows change even with the LSE near 0: hence 58 rows tried.)"""

    def group_by_batch(h, y, *, weight):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(lm_cpu, "VOCAB_GROUP", VOCAB_GROUP // 2 if h.shape[0] < 64 else VOCAB_GROUP)
            return lm_cpu.lm_head_fwd_cpu(h, weight, y)

    def fixed(h, y, *, weight):
        return lm_cpu.lm_head_fwd_cpu(h, weight, y)

    h, w, y = make(200, 64, 1000, BF16, "cpu", scale=0.5, centered=True)
    sizes = (1, 7, 50)
    good = rung2_rows("lm_head", fixed, [h, y], shared={"weight": w}, batch_sizes=sizes)
    bad = rung2_rows("lm_head", group_by_batch, [h, y], shared={"weight": w}, batch_sizes=sizes)
    assert good.passed
    assert not bad.passed and bad.differing > 0, bad


def _bad_inputs(device):
    h, w, y = make(6, 64, 300, BF16, device)
    return {
        "target-too-large": ((h, w, torch.full_like(y, 300)), {}, ValueError, r"targets must lie in \[0, 300\).*max 300"),
        "target-negative": ((h, w, torch.full_like(y, -1)), {}, ValueError, r"targets must lie in \[0, 300\).*min -1"),
        "weight-K-mismatch": ((h, w[:, :32].contiguous(), y), {}, ValueError, r"weight: hidden size .* is 32, expected 64"),
        "weight-1d": ((h, w[0], y), {}, ValueError, r"weight must have 2 dimensions"),
        "weight-empty-vocab": ((h, w[:0], y), {}, ValueError, r"vocabulary size \(dim 0\) is 0"),
        "h-fp16": ((h.half(), w, y), {}, TypeError, r"h has dtype float16"),
        "weight-dtype-mismatch": ((h, w.float(), y), {}, TypeError, r"weight has dtype float32 but h has bfloat16"),
        "targets-int32": ((h, w, y.int()), {}, TypeError, r"targets has dtype int32"),
        "targets-length": ((h, w, y[:5]), {}, ValueError, r"targets: length .* is 5, expected 6"),
        "h-non-contiguous": ((h.t().contiguous().t(), w, y), {}, ValueError, r"h must be contiguous"),
        "h-3d": ((h[None], w, y), {}, ValueError, r"h must have 2 dimensions"),
        "bad-block-m": ((h, w, y), {"block_m": 32 if device.type == "cuda" else 0}, ValueError, r"block_m"),
        "bad-vocab-chunk": ((h, w, y), {"vocab_chunk": 0}, ValueError, r"vocab_chunk"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs(torch.device("cpu"))))
def test_bad_input(device, case):
    args, knobs, exc, match = _bad_inputs(device)[case]
    with pytest.raises(exc, match=match):
        lm_head_logprobs(*args, **knobs)
    with pytest.raises(exc, match=match):
        lm_head_fwd(*args, **knobs)


@pytest.mark.gpu
def test_logits_backward_split_keeps_fp32_accuracy_and_repeats():
    """The trainer's logits backward on CUDA with bf16 weights: g = hi + lo in
    bf16 (one fused pass, the bits of torch's two roundings), two tensor-core
    GEMMs with fp32 output.  The fp32 products are as accurate as an fp32 mm
    (a bf16 g alone is ~2^-9 off and fails the bound), and the same bits every run."""
    from alignzoo.common.lm_head.op import _logits_bwd_mm, _split_parts

    g0 = torch.Generator(device="cuda").manual_seed(3)
    g = torch.randn(333, 2051, device="cuda", generator=g0) * 1e-3
    g[0, :4] = torch.tensor([0.0, -0.0, 1e-3 + 2**-30, -3.0e38])  # zeros, a lo part, near the top
    w = torch.randn(2051, 96, device="cuda", generator=g0).bfloat16()
    hi, lo = _split_parts(g, True)
    assert bitwise_equal(hi, g.bfloat16()) and bitwise_equal(lo, (g - g.bfloat16().float()).bfloat16())
    g[0, 3] = 0.0
    ref = g.double() @ w.double()
    parts = _split_parts(g, True)
    got = _logits_bwd_mm(parts, w)
    assert got.dtype == torch.float32 and rel_err(got, ref) < 1e-5
    assert rel_err(torch.mm(g.bfloat16(), w).float(), ref) > 1e-4  # what the lo part buys
    assert bitwise_equal(got, _logits_bwd_mm(_split_parts(g, True), w))
    ref_t = g.double().t() @ w.double()[:333]  # the dW side takes the transposed parts
    assert rel_err(_logits_bwd_mm([p.t() for p in parts], w[:333]), ref_t) < 1e-5
