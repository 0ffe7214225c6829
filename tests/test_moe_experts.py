"""Routed experts (``common/moe``): a token's bits do not depend on how many
tokens its experts got or which tokens share the batch (alone, in batches of
1..4096 tokens, skewed routing, experts with no token); the Triton kernels'
source keeps the tile map, gathers and slot order (interpreted on the CPU);
accuracy and gradients against float64; the combine's FP64 tree."""
from __future__ import annotations

import pytest
import torch
from interpreted import TORCH_MATH, run_interpreted

from alignzoo.common._launch import FP_FUSION
from alignzoo.common.ladder import bitwise_equal, rel_err
from alignzoo.common.moe.checks import make_experts
from alignzoo.common.moe.cpu import experts_fwd_cpu
from alignzoo.common.moe.lora import ExpertLoRA
from alignzoo.common.moe.naive import experts_ref
from alignzoo.common.moe.op import experts_fwd, moe_combine, moe_experts


def _alone_vs_batches(device, T, H, I, E, k, sizes, skew, limit=None, seed=0, fp8=False):
    """The same tokens alone, in random subsets of ``sizes`` and one by one: the full batch's bits
    (bf16 experts, or with ``fp8`` the same weights as FP8 experts)."""
    from alignzoo.common.moe.op import experts_fp8_fwd, quantize_experts_fp8

    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, skew=skew, seed=seed)
    if limit is not None:
        x = x * 4  # gate/up values past the clamp
    fwd, weights = (experts_fp8_fwd, quantize_experts_fp8(w_gu, w_d)) if fp8 else (experts_fwd, (w_gu, w_d))
    full = fwd(x, ids, w, *weights, limit)
    g = torch.Generator().manual_seed(seed + 1)
    for n in sizes:
        idx = torch.randperm(T, generator=g)[:n].to(device)
        got = fwd(x[idx], ids[idx], w[idx], *weights, limit)
        assert bitwise_equal(got, full[idx]), (n, skew)
    one = fwd(x[5:6], ids[5:6], w[5:6], *weights, limit)
    assert bitwise_equal(one, full[5:6])


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("limit", [None, 10.0], ids=["plain", "clamp"])
def test_cpu_rows_do_not_depend_on_the_batch(skew, limit):
    _alone_vs_batches(torch.device("cpu"), 300, 72, 40, 9, 3, (1, 2, 17, 64, 299), skew, limit)


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_gpu_rows_do_not_depend_on_the_batch(skew):
    """Qwen3.5-35B-A3B's expert shapes (hidden 2048, width 512, 256 experts, top-8)."""
    _alone_vs_batches(torch.device("cuda"), 4096, 2048, 512, 256, 8, (1, 2, 7, 64, 300, 1000), skew)


def _replays_from_a_cuda_graph(fn, x, ids, w, *weights):
    """16 tokens captured once, replayed on three other slices: the bits of the eager full batch."""
    sx, sids, sw = x[:16].clone(), ids[:16].clone(), w[:16].clone()
    fn(sx, sids, sw, *weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(sx, sids, sw, *weights)
    full = fn(x, ids, w, *weights)
    for lo in (0, 16, 48):
        sx.copy_(x[lo:lo + 16])
        sids.copy_(ids[lo:lo + 16])
        sw.copy_(w[lo:lo + 16])
        graph.replay()
        assert bitwise_equal(out, full[lo:lo + 16])
    return full


@pytest.mark.gpu
def test_gpu_experts_replay_from_a_cuda_graph():
    _replays_from_a_cuda_graph(experts_fwd, *make_experts(64, 2048, 512, 64, 8, device="cuda"))


def test_accuracy_and_gradients_against_float64(device):
    x, ids, w, w_gu, w_d = make_experts(50, 72, 40, 6, 3, device=device, dtype=torch.float32, seed=3)
    for limit in (None, 1.5):
        xs = (x * 2).requires_grad_()
        ws, gus, ds = w.clone().requires_grad_(), w_gu.clone().requires_grad_(), w_d.clone().requires_grad_()
        out = moe_experts(xs, ids, ws, gus, ds, limit=limit)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad((out * dy).sum(), (xs, ws, gus, ds))
        xr, wr, gur, dr = (t.detach().double().requires_grad_() for t in (xs, ws, gus, ds))
        ref = experts_ref(xr, ids, wr, gur, dr, limit)
        assert rel_err(out, ref) < 1e-5, limit
        refs = torch.autograd.grad((ref * dy.double()).sum(), (xr, wr, gur, dr))
        for name, a, b in zip(("x", "weights", "w_gate_up", "w_down"), grads, refs):
            assert rel_err(a, b) < 1e-4, (name, limit, rel_err(a, b))


def test_backward_groups_pad_under_twice_within_the_budget():
    """Every expert with rows in exactly one group; a group's P is its largest count and under twice
    each of its counts; a group of two or more experts stays within the byte budget."""
    from alignzoo.common.moe.op import _bwd_groups

    counts = [0, 1, 2, 3, 5, 8, 100, 64, 65, 0, 4000, 7, 120, 127, 128, 1]
    for budget in (1, 5_000, 30_000, 1 << 40):
        groups = _bwd_groups(counts, 1000, 10, budget)
        assert sorted(e for es, _ in groups for e in es) == [e for e, c in enumerate(counts) if c]
        for es, P in groups:
            assert P == max(counts[e] for e in es) and all(P < 2 * counts[e] or P == 1 for e in es), (es, P)
            assert len(es) == 1 or len(es) * (1000 + 10 * P) <= budget, (budget, es, P)
    assert len(_bwd_groups(counts, 1000, 10, 1 << 40)) == 7  # one a class: 1, 2, 3, 5..8, 64, 65..128, 4000


def test_backward_is_the_same_gradient_in_any_grouping(monkeypatch):
    """The experts' backward batched over experts: skewed routing (slot 0 always expert 0), idle
    experts, counts over several classes, LoRA; every expert its own group gives the default
    grouping's gradients to fp32 rounding, and a rerun repeats them bit for bit."""
    from alignzoo.common.moe import op

    x, ids, w, w_gu, w_d = make_experts(90, 40, 24, 9, 3, device="cpu", dtype=torch.float32, seed=5, skew=True)
    ids[:20, 1] = 1  # expert 1 gets more rows than the rest, expert 0 all 90
    ids[:20, 2] = torch.where(ids[:20, 0] == 2, 3, 2)
    g = torch.Generator().manual_seed(6)
    shapes = ((9, 4, 40), (9, 48, 4), (9, 4, 24), (9, 40, 4))
    lora = ExpertLoRA(*(torch.randn(*sh, generator=g) * 0.2 for sh in shapes), 2.0)
    dy = torch.randn(90, 40, generator=g)
    counts = torch.bincount(ids.reshape(-1), minlength=9).tolist()
    assert counts[0] == 90 and counts[7] == counts[8] == 0 and len({(c - 1).bit_length() for c in counts if c}) >= 3
    stacks = op._plain_stacks(w_gu, w_d)
    default = op._experts_bwd(x, ids, w, stacks, dy, 1.5, lora)
    again = op._experts_bwd(x, ids, w, stacks, dy, 1.5, lora)
    monkeypatch.setattr(op, "_BWD_GROUP_BYTES", 1)
    alone = op._experts_bwd(x, ids, w, stacks, dy, 1.5, lora)
    flat = lambda out: [*out[:4], *out[4]]
    for a, b, c in zip(flat(default), flat(again), flat(alone)):
        assert torch.equal(a, b) and rel_err(c, a) < 1e-6


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_quantized_backward_decodes_a_group_at_a_time(fmt, monkeypatch):
    """The FP8 / MXFP4 experts' backward decodes only each group's experts: the same gradients, bit
    for bit, as the same grouping at the whole stack decoded first (bf16 weights, skewed routing,
    idle experts), with groups of several experts or of one."""
    from alignzoo.common.moe import op

    x, ids, w, w_gu, w_d = make_experts(70, 64, 32, 9, 3, device="cpu", seed=8, skew=True)
    codes = {"fp8": op.quantize_experts_fp8, "mxfp4": op.quantize_experts_mxfp4}[fmt](w_gu, w_d)
    whole = op._plain_stacks(*op._FORMATS[fmt][1](*codes, dtype=torch.bfloat16))
    dy = torch.randn(70, 64, generator=torch.Generator().manual_seed(9))
    for budget in (op._BWD_GROUP_BYTES, 1):
        monkeypatch.setattr(op, "_BWD_GROUP_BYTES", budget)
        want = op._experts_bwd(x, ids, w, whole, dy, None)
        got = op._experts_bwd(x, ids, w, op._quantized_stacks(fmt, codes, torch.bfloat16), dy, None)
        assert all(bitwise_equal(a, b) for a, b in zip(got[:4], want[:4])), (fmt, budget)


def test_bf16_accuracy_and_the_combine():
    x, ids, w, w_gu, w_d = make_experts(40, 72, 40, 6, 3, device="cpu")
    routed = experts_fwd(x, ids, w, w_gu, w_d)
    assert routed.dtype == torch.float32 and rel_err(routed, experts_ref(x, ids, w, w_gu, w_d)) < 8e-3
    shared = torch.randn(40, 72)
    y = moe_combine([routed, shared], torch.bfloat16)
    assert torch.equal(y, (routed.double() + shared.double()).bfloat16())


def test_a_batch_dependent_slot_order_is_caught(monkeypatch):
    """Adding the slots in another order when the batch is large changes bits."""
    from alignzoo.common.moe import cpu

    real = cpu.slot_sum

    def by_batch(c):
        return real(c) if c.shape[0] < 64 else real(c.flip(1))

    monkeypatch.setattr(cpu, "slot_sum", by_batch)
    x, ids, w, w_gu, w_d = make_experts(100, 72, 40, 6, 3, device="cpu")
    full = experts_fwd_cpu(x, ids, w, w_gu, w_d)
    assert not bitwise_equal(experts_fwd_cpu(x[:7], ids[:7], w[:7], w_gu, w_d), full[:7])


def test_bad_inputs():
    x, ids, w, w_gu, w_d = make_experts(10, 72, 40, 6, 3, device="cpu")
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 6\)"):
        moe_experts(x, ids + 6, w, w_gu, w_d)
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        moe_experts(x, ids, w, w_gu[:, :, :10].contiguous(), w_d)
    with pytest.raises(ValueError, match=r"must both be \(T=10, k\)"):
        moe_experts(x, ids, w[:, :2].contiguous(), w_gu, w_d)


_EXACT_INPUTS = r"""
import torch

# values whose dots are exact in fp32 in any order: small integers over 8, and matrices with one nonzero a row
g = torch.Generator().manual_seed(0)
ri = lambda lo, hi, *shape: torch.randint(lo, hi, shape, generator=g).float()


def one_per_row(E, rows, cols):
    m = torch.zeros(E, rows, cols)
    m[:, torch.arange(rows), torch.arange(rows) % cols] = ri(1, 4, E, rows) / 8
    return m


def routes(T, E, k, skew):  # top-k ids, an expert with no token (skew: every token to expert 0), weights not dyadic
    scores = torch.rand(T, E, generator=g)
    scores[:, E - 1] = -1
    if skew:
        scores[:, 0] = 2
    return scores.topk(k, -1).indices, torch.rand(T, k, generator=g) + 0.1
"""

_INTERPRETED = _EXACT_INPUTS + r"""
import numpy as np
from alignzoo.common.moe.kernel import experts_fwd_triton, tile_map

# Under the interpreter tl.dot is the host's np.matmul and tl.exp numpy's exp, so the reference is numpy too, on
# inputs whose dots are exact: small integers with power-of-two scales for gate/up, and a down weight with one
# nonzero per output row (each output one product).  The test then sees the kernels' structure: the tile map,
# the gathers, masks and the scatter, the SwiGLU epilogue and the slot order (the routing weights are not
# dyadic, so the slot sums round: the slots added in another order fail it).
for T, H, I, E, k, skew in ((37, 40, 24, 5, 3, False), (70, 72, 40, 7, 2, True), (1, 40, 24, 5, 3, False)):
    x = ri(-3, 4, T, H)
    ids, w = routes(T, E, k, skew)
    w_gu, w_d = ri(-2, 3, E, 2 * I, H) / 8, one_per_row(E, H, I)
    got = experts_fwd_triton(x, ids, w, w_gu, w_d)
    want = np.zeros((T, H), np.float32)
    for t in range(T):
        acc = None
        for j in range(k):
            e = int(ids[t, j])
            gu = (x[t].double() @ w_gu[e].double().T).float().numpy()  # exact
            gg, uu = gu[:I], gu[I:]
            a = gg / (np.float32(1) + np.exp(-gg)) * uu
            c = (a[np.arange(H) % I] * w_d[e, np.arange(H), np.arange(H) % I].numpy()) * np.float32(w[t, j])
            acc = c if acc is None else acc + c
        want[t] = acc
    assert torch.equal(got, torch.from_numpy(want)), (T, H, I, E, k, skew, (got - torch.from_numpy(want)).abs().max())
    from alignzoo.common.moe import kernel
    kernel.row_tile_map, real = (lambda ids: kernel.tile_map(ids, E, 64)), kernel.row_tile_map
    assert torch.equal(experts_fwd_triton(x, ids, w, w_gu, w_d), got)  # the sorted map where the row map ran
    kernel.row_tile_map = real
    order, te, r0, r1 = tile_map(ids, E, 64)
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    assert int((te >= 0).sum()) == int(((counts + 63) // 64).sum())
# the sorted map's kernel against tile_map (torch): rows past one 1024-row block, odd E, skew, idle experts
for T, E, k, bm, skew in ((300, 9, 8, 64, False), (129, 256, 8, 64, True), (1000, 33, 3, 128, False)):
    scores = torch.rand(T, E, generator=g)
    scores[:, 1] = -1
    if skew:
        scores[: T // 2, 5] = 2
    ids = scores.topk(k, -1).indices
    w = torch.rand(T, k, generator=g).to(torch.bfloat16)
    got = kernel.sorted_map_triton(ids, w, E, bm)
    order, te, r0, r1 = tile_map(ids, E, bm)
    want = (order, (order // k).int(), order.int(), w.reshape(-1).float()[order], te, r0, r1)
    for a, b in zip(got, want):
        assert torch.equal(a, b), (T, E, k, bm)
print("ok")
"""


def test_triton_kernels_keep_the_structure_interpreted():
    """The grouped kernels' source under Triton's interpreter on CPU tensors
    equals a numpy reference of the contract on inputs whose dots are exact:
    skewed routing, an expert with no token, one token, ragged H and I."""
    run_interpreted(_INTERPRETED, expect="ok")


def test_the_backward_clamps_where_the_forward_does():
    """A bf16 expert clamps at limit_in(bf16, 7.3) = 7.3125, so a gate of 7.31
    passes: its gradient is the true one, not the zero of a clamp at 7.3."""
    from alignzoo.common.moe.op import _swiglu_bwd
    from alignzoo.common.swiglu.cpu import limit_in

    lim = limit_in(torch.bfloat16, 7.3)
    assert lim == 7.3125
    gu = torch.tensor([[7.31, -7.31, 7.31, 8.0]], dtype=torch.float64, requires_grad=True)
    g, u = gu[:, :2].clamp(max=lim), gu[:, 2:].clamp(min=-lim, max=lim)
    da = torch.tensor([[1.0, 0.5]], dtype=torch.float64)
    (ref,) = torch.autograd.grad((g * torch.sigmoid(g) * u * da).sum(), gu)
    got = _swiglu_bwd(gu.detach().float(), da.float(), 7.3, torch.bfloat16)
    assert got[0, 0] != 0 and rel_err(got, ref) < 1e-6


# ------------------------------------------------------------------ FP8 experts (GLM-5)
def _fp8_experts(T, H, I, E, k, *, device, dtype=torch.bfloat16, skew=False, seed=0):
    from alignzoo.common.moe.op import quantize_experts_fp8

    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, dtype=dtype, skew=skew, seed=seed)
    return x, ids, w, w_gu, w_d, quantize_experts_fp8(w_gu, w_d)


def test_fp8_expert_layout_is_each_checkpoint_matrix_quantized_alone():
    """gate, up and down of every expert as ``quantize_weight_fp8`` makes them (an FP8 checkpoint's
    gate_proj / up_proj / down_proj ``weight`` and ``weight_scale_inv``), at I = 40: one 128-row block
    each, so a fused quantization would have mixed gate and up rows."""
    from alignzoo.common.fp8.op import dequantize_weight_fp8, quantize_weight_fp8
    from alignzoo.common.moe.op import dequantize_experts_fp8

    _, _, _, w_gu, w_d, (gc, gs, dc, ds) = _fp8_experts(5, 200, 40, 3, 2, device="cpu")
    assert gs.shape == (3, 2, 2) and ds.shape == (3, 2, 1)
    for e in range(3):
        for rows, (c, s) in ((slice(0, 40), (gc[e, :40], gs[e, :1])), (slice(40, 80), (gc[e, 40:], gs[e, 1:]))):
            want_c, want_s = quantize_weight_fp8(w_gu[e, rows])
            assert bitwise_equal(c.view(torch.uint8), want_c.view(torch.uint8)) and bitwise_equal(s, want_s)
        want_c, want_s = quantize_weight_fp8(w_d[e])
        assert bitwise_equal(dc[e].view(torch.uint8), want_c.view(torch.uint8)) and bitwise_equal(ds[e], want_s)
    gu, d = dequantize_experts_fp8(gc, gs, dc, ds)
    assert bitwise_equal(gu[1, 40:], dequantize_weight_fp8(gc[1, 40:], gs[1, 1:]))
    assert bitwise_equal(d[2], dequantize_weight_fp8(dc[2], ds[2]))


def test_fp8_expert_stacks_quantize_in_chunks_of_experts(monkeypatch):
    """The stacked (de)quantizers take the experts a chunk at a time: one expert a chunk, two, or
    all seven give the same codes, scales and weights."""
    from alignzoo.common.moe import op

    _, _, _, w_gu, w_d = make_experts(5, 200, 136, 7, 2, device="cpu")
    w_gu[3, 10:20] = 0  # a block's rows of zeros, one expert's
    outs = []
    monkeypatch.setitem(op._QUANT_CHUNK_BYTES, "cpu", 1 << 30)
    for chunk in (None, 1, 2):
        if chunk is not None:
            monkeypatch.setitem(op._QUANT_CHUNK_BYTES, "cpu", chunk * 4 * 3 * 136 * 200)
        assert len(op._expert_chunks(w_gu)) == (-(-7 // chunk) if chunk else 1)
        q = op.quantize_experts_fp8(w_gu, w_d)
        outs.append([t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                     for t in (*q, *op.dequantize_experts_fp8(*q, dtype=torch.bfloat16))])
    assert all(bitwise_equal(a, b) for other in outs[1:] for a, b in zip(outs[0], other))
    with pytest.raises(ValueError, match="must stack the same experts"):
        op.quantize_experts_fp8(w_gu, w_d[:3])


@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
@pytest.mark.parametrize("limit", [None, 1.0], ids=["plain", "clamp"])
def test_fp8_cpu_rows_do_not_depend_on_the_batch(skew, limit):
    _alone_vs_batches(torch.device("cpu"), 300, 200, 136, 9, 3, (1, 2, 17, 64, 299), skew, limit, fp8=True)


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_fp8_gpu_rows_do_not_depend_on_the_batch(skew):
    """GLM-5's expert shapes (hidden 6144, width 2048, top-8), 16 of its 256 experts."""
    _alone_vs_batches(torch.device("cuda"), 2048, 6144, 2048, 16, 8, (1, 2, 7, 64, 300, 1000), skew, fp8=True)


@pytest.mark.gpu
def test_fp8_gpu_experts_replay_from_a_cuda_graph_and_match_float64():
    from alignzoo.common.moe.naive import experts_fp8_ref
    from alignzoo.common.moe.op import experts_fp8_fwd

    x, ids, w, _, _, q = _fp8_experts(64, 6144, 2048, 16, 8, device="cuda")
    full = _replays_from_a_cuda_graph(experts_fp8_fwd, x, ids, w, *q)
    assert rel_err(full, experts_fp8_ref(x, ids, w, *q)) < _fp8_bound(x.device)


def _fp8_bound(device) -> float:
    # CPU: exact block dots, fp32 accumulation only (measured 6e-8).  H200: the fp8 wgmma keeps ~13
    # bits inside each 128-block (DeepSeek-V3 says ~14), which moves ~10% of the bf16 SwiGLU outputs
    # by an ulp and some of those across an e4m3 step of the down projection's input (measured 4.7e-3)
    return 2e-3 if device.type == "cpu" else 1e-2


def test_fp8_accuracy_against_float64(device):
    """Against float64 at the FP8 path's own quantization points (exactly dequantized codes and
    activation groups).  Against the unquantized bf16 experts: what FP8 costs (e4m3 keeps 3
    mantissa bits)."""
    from alignzoo.common.moe.naive import experts_fp8_ref
    from alignzoo.common.moe.op import experts_fp8_fwd

    for limit in (None, 1.0):
        x, ids, w, w_gu, w_d, q = _fp8_experts(120, 200, 136, 6, 3, device=device, seed=4)
        got = experts_fp8_fwd(x, ids, w, *q, limit)
        assert rel_err(got, experts_fp8_ref(x, ids, w, *q, limit)) < _fp8_bound(x.device), limit
        assert rel_err(got, experts_ref(x, ids, w, w_gu, w_d, limit)) < 8e-2, limit


def test_fp8_gradients_are_straight_through_to_the_masters(device):
    """The backward is the float64 gradient of the experts at the dequantized weights (the
    quantizers as identity), to x, the routing weights and both masters; frozen masters get none."""
    from alignzoo.common.moe.op import dequantize_experts_fp8, moe_experts_fp8

    x, ids, w, w_gu, w_d, q = _fp8_experts(50, 200, 136, 6, 3, device=device, dtype=torch.float32, seed=5)
    for limit in (None, 1.5):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        mgu, md = w_gu.clone().requires_grad_(), w_d.clone().requires_grad_()
        out = moe_experts_fp8(xs, ids, ws, *q, master_gate_up=mgu, master_down=md, limit=limit)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad((out * dy).sum(), (xs, ws, mgu, md))
        gu_deq, d_deq = dequantize_experts_fp8(*q)
        xr, wr, gur, dr = (t.detach().double().requires_grad_() for t in (xs, ws, gu_deq, d_deq))
        ref = experts_ref(xr, ids, wr, gur, dr, limit)
        refs = torch.autograd.grad((ref * dy.double()).sum(), (xr, wr, gur, dr))
        for name, a, b in zip(("x", "weights", "master_gate_up", "master_down"), grads, refs):
            assert rel_err(a, b) < 1e-4, (name, limit, rel_err(a, b))
    xs = x.clone().requires_grad_()
    (dx,) = torch.autograd.grad(moe_experts_fp8(xs, ids, w, *q).sum(), (xs,))  # frozen experts: x still gets one
    assert dx.abs().sum() > 0


def test_fp8_bad_inputs():
    from alignzoo.common.moe.op import moe_experts_fp8

    x, ids, w, w_gu, _, (gc, gs, dc, ds) = _fp8_experts(10, 200, 40, 3, 2, device="cpu")
    with pytest.raises(ValueError, match=r"gu_scale \(3, 1, 2\) \(want \(3, 2, 2\)"):
        moe_experts_fp8(x, ids, w, gc, gs[:, :1].contiguous(), dc, ds)
    with pytest.raises(ValueError, match="master_gate_up has shape"):
        moe_experts_fp8(x, ids, w, gc, gs, dc, ds, master_gate_up=w_gu[:, :40])
    with pytest.raises(TypeError, match="gu_codes"):
        moe_experts_fp8(x, ids, w, w_gu, gs, dc, ds)
    with pytest.raises(ValueError, match=r"expert ids must be in \[0, 3\)"):
        moe_experts_fp8(x, ids + 3, w, gc, gs, dc, ds)


_EXACT_DOT = TORCH_MATH + r"""
# The interpreter's dot is numpy's fp32 matmul, whose sums follow the host's BLAS: one differently rounded
# gate / up value can move the SwiGLU output across an FP8 step.  Products of two e4m3 values are multiples of
# 2^-18 below 2^18, so a 128-wide block's sum is exact in float64 in any order: the CPU path's exact block dot.
def _exact_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    x, y = a.data, b.data
    if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
        x = _it._convert_float(x, a.dtype, tl.float16, None).view(np.float16)
    if b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
        y = _it._convert_float(y, b.dtype, tl.float16, None).view(np.float16)
    p = np.matmul(x.astype(np.float64), y.astype(np.float64)).astype(np.float32)
    return _it.TensorHandle((p + d.data).astype(np.float32), d.dtype.scalar)


_it.InterpreterBuilder.create_dot = _exact_dot
"""

_INTERPRETED_FP8 = _EXACT_DOT + r"""
from alignzoo.common.moe.checks import make_experts
from alignzoo.common.moe.cpu import experts_fwd_fp8_cpu
from alignzoo.common.moe.kernel import experts_fwd_fp8_triton
from alignzoo.common.moe.op import quantize_experts_fp8

# fp32 activations (the path the test covers is the FP8 one: x and the SwiGLU output are quantized in the kernel)
for T, H, I, E, k, skew, lim in ((37, 200, 136, 5, 3, False, None), (70, 72, 40, 7, 2, True, 1.0),
                                 (1, 130, 24, 5, 3, False, None)):
    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device="cpu", skew=skew, seed=1, dtype=torch.float32)
    q = quantize_experts_fp8(w_gu, w_d)
    got, want = experts_fwd_fp8_triton(x, ids, w, *q, lim), experts_fwd_fp8_cpu(x, ids, w, *q, lim)
    assert torch.equal(got, want), (T, H, I, (got - want).abs().max())
print("ok")
"""


def test_fp8_triton_kernels_keep_the_structure_interpreted():
    run_interpreted(_INTERPRETED_FP8, expect="ok")


# ------------------------------------------------------------------ MXFP4 experts (DeepSeek-V4)
def _mx_experts(T, H, I, E, k, *, device, dtype=torch.bfloat16, skew=False, seed=0):
    from alignzoo.common.moe.op import quantize_experts_mxfp4

    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, dtype=dtype, skew=skew, seed=seed)
    return x, ids, w, w_gu, w_d, quantize_experts_mxfp4(w_gu, w_d)


def test_mxfp4_codes_decode_as_the_ocp_table_and_round_to_nearest_even():
    """E2M1 per the OCP MX spec (transformers' FP4_VALUES), low nibble first, E8M0 = 2^(s - 127);
    the encoder picks the nearest code, ties to the even one, saturates at 6, keeps zeros exact
    (``tests/test_mxfp4_codec.py`` checks the codec against transformers and a float64 encoder)."""
    from alignzoo.common.moe.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    table = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    codes = torch.arange(256, dtype=torch.uint8).view(8, 32)  # every byte: every (low, high) pair
    scales = torch.tensor([[127, 128], [1, 254], [120, 127], [130, 100]] * 2, dtype=torch.uint8)
    got = dequantize_mxfp4(codes, scales)
    lut = torch.tensor(table, dtype=torch.float64)
    want = torch.stack([lut[(codes & 15).long()], lut[(codes >> 4).long()]], -1).flatten(-2)
    want = torch.ldexp(want, scales.long().repeat_interleave(32, 1) - 127).float()
    assert bitwise_equal(got, want)
    # group max 6 * 2^3 -> scale 2^3; the midpoints 0.25, 0.75, ..., 5 (times 8) go to the even code
    row = torch.tensor([48.0, 2.0, 6.0, 10.0, 14.0, 20.0, 28.0, 40.0, -2.0, -6.0, 0.0, -0.0, 100.0, 1.0] + [0.0] * 18)
    c, s = quantize_mxfp4(row[None].clone())
    assert int(s) == 127 + 4  # amax 100 = 1.5625 * 2^6: floor(log2 100) - 2 = 4
    c, s = quantize_mxfp4(torch.cat([row[:12], torch.tensor([120.0] + [0.0] * 19)])[None])
    assert int(s) == 127 + 5  # amax 120 = 1.875 * 2^6 rounds up to 2^7 on E2M1's grid: 5, codes <= 4
    c, s = quantize_mxfp4(row[None, :12].repeat(1, 3)[:, :32].clone())
    assert int(s) == 127 + 3
    assert dequantize_mxfp4(c, s)[0, :12].tolist() == [48.0, 0.0, 8.0, 8.0, 16.0, 16.0, 32.0, 32.0, -0.0, -8.0, 0.0,
                                                        0.0]
    w = torch.randn(6, 64) * 3
    cw, sw = quantize_mxfp4(w)
    assert torch.equal(quantize_mxfp4(dequantize_mxfp4(cw, sw))[0], cw)  # decoded values encode to themselves
    err = (dequantize_mxfp4(cw, sw) - w).abs()
    # amax / scale lands in [3.5, 7): no weight is off by more than one scale (half the 4 -> 6 step)
    bound = sw.float().sub(127).exp2().repeat_interleave(32, 1)
    assert bool((err <= bound).all())


def test_mxfp4_decode_is_the_nibble_formula_for_every_byte_and_scale():
    """dequantize_mxfp4 (a byte-pair table, the scale multiplied in place) against the element-wise
    formula, E2M1(nibble) * e8m0_to_float(s): every code byte under every scale byte, bit patterns
    (signed zeros, the 2^-127 scale, overflow to inf, NaN under 255), in fp32 and bf16, and on a
    (2, 3, N, K) stack."""
    from alignzoo.common.moe.mxfp4 import E2M1_VALUES, GROUP, dequantize_mxfp4, e8m0_to_float

    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1)  # row r: every byte, under scale byte r
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 2 * 256 // GROUP)
    lut = torch.tensor(E2M1_VALUES + tuple(-x for x in E2M1_VALUES))
    v = torch.stack([lut[codes.long() & 15], lut[codes.long() >> 4]], -1).flatten(-2)
    want = v * e8m0_to_float(scales).repeat_interleave(GROUP, -1)
    for dt, bits in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        got = dequantize_mxfp4(codes, scales, dt)
        assert torch.equal(got[:255].view(bits), want[:255].to(dt).view(bits)), dt
        assert bool(got[255].isnan().all()), dt  # E8M0's NaN
    stack = dequantize_mxfp4(codes.view(2, 4, 32, 256)[:, :3], scales.view(2, 4, 32, 16)[:, :3])
    assert torch.equal(stack.view(torch.int32), want.view(2, 4, 32, 512)[:, :3].view(torch.int32))


def test_mxfp4_encoder_goes_by_row_blocks_with_the_same_codes():
    """A stack past the encoder's 2^22-element step (here 3 x 50,000 x 64) gets each row's codes."""
    from alignzoo.common.moe.mxfp4 import quantize_mxfp4

    w = torch.randn(3, 50_000, 64, generator=torch.Generator().manual_seed(3))
    c, s = quantize_mxfp4(w)
    assert c.shape == (3, 50_000, 32) and s.shape == (3, 50_000, 2)
    for i in (0, 2):
        ci, si = quantize_mxfp4(w[i, 49_990:])
        assert torch.equal(c[i, 49_990:], ci) and torch.equal(s[i, 49_990:], si)


def test_mxfp4_experts_are_the_bf16_experts_at_the_decoded_weights(device):
    """The contract: bit for bit ``experts_fwd`` on the exactly decoded weights, and so batch-invariant."""
    from alignzoo.common.moe.op import dequantize_experts_mxfp4, experts_mxfp4_fwd

    for skew, limit in ((False, None), (True, 1.0)):
        x, ids, w, _, _, q = _mx_experts(150, 96, 64, 7, 3, device=device, skew=skew, seed=2)
        gu, d = dequantize_experts_mxfp4(*q, dtype=x.dtype)
        got = experts_mxfp4_fwd(x, ids, w, *q, limit)
        assert bitwise_equal(got, experts_fwd(x, ids, w, gu, d, limit)), (skew, limit)
        for n in (1, 5, 64):
            assert bitwise_equal(experts_mxfp4_fwd(x[:n], ids[:n], w[:n], *q, limit), got[:n])


@pytest.mark.gpu
@pytest.mark.parametrize("skew", [False, True], ids=["spread", "skewed"])
def test_mxfp4_gpu_at_deepseek_v4_shapes(skew):
    """DeepSeek-V4-Flash's expert shapes (hidden 4096, width 2048, top-6), 16 of its 256 experts:
    packed == bf16 at the decoded weights, rows alone == in batches, a CUDA graph replays it."""
    from alignzoo.common.moe.op import dequantize_experts_mxfp4, experts_mxfp4_fwd

    x, ids, w, _, _, q = _mx_experts(1024, 4096, 2048, 16, 6, device="cuda", skew=skew)
    gu, d = dequantize_experts_mxfp4(*q, dtype=x.dtype)
    full = experts_mxfp4_fwd(x, ids, w, *q, 10.0)
    assert bitwise_equal(full, experts_fwd(x, ids, w, gu, d, 10.0))
    g = torch.Generator().manual_seed(1)
    for n in (1, 2, 7, 64, 300):
        idx = torch.randperm(1024, generator=g)[:n].cuda()
        assert bitwise_equal(experts_mxfp4_fwd(x[idx], ids[idx], w[idx], *q, 10.0), full[idx])
    _replays_from_a_cuda_graph(experts_mxfp4_fwd, x[:64], ids[:64], w[:64], *q)
    from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton

    for knobs in (dict(swap=False), dict(swap=True, block_m=128, block_n=128, num_warps=8), dict(block_m=128),
                  dict(block_m=256), dict(block_m=256, block_n=128, num_warps=8),
                  dict(bf16x2=False), dict(bf16x2=False, swap=False)):
        assert bitwise_equal(experts_fwd_mxfp4_triton(x, ids, w, *q, 10.0, **knobs), full), knobs


# experts_fwd_mxfp4_triton's launch configs that a repeat run compares with the default (also the probe's)
MX_LAUNCH_CONFIGS = (dict(), dict(swap=False), dict(block_m=128, block_n=128, num_warps=8), dict(block_m=128),
                     dict(block_m=256), dict(block_m=256, block_n=128, num_warps=8), dict(bf16x2=False))


@pytest.mark.gpu
def test_mxfp4_gpu_launch_configs_repeat_their_bits():
    """Each launch config 20 times at DeepSeek-V4-Flash's shapes, every output against the default's:
    a race or an uninitialised read changes the bits of some runs and not others, so one run a config
    (the test above) can miss it.  ``benchmarks/experiments/probe_mx_repeat.py`` does the same beside a busy
    stream."""
    from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton as fwd

    x, ids, w, _, _, q = _mx_experts(1024, 4096, 2048, 16, 6, device="cuda", skew=False)
    want = fwd(x, ids, w, *q, 10.0)
    for knobs in MX_LAUNCH_CONFIGS:
        outs = [fwd(x, ids, w, *q, 10.0, **knobs) for _ in range(20)]
        differ = [i for i, o in enumerate(outs) if not bitwise_equal(o, want)]
        assert not differ, (knobs, differ)

@pytest.mark.gpu
@pytest.mark.parametrize("mx", [1, 2], ids=["fp32", "bf16x2"])
def test_mxfp4_gpu_decode_every_code_under_every_scale(mx):
    """The kernels' in-register decode (``kernel._mx_rows``; MX 2 is the bf16x2 inline PTX) gives
    ``mxfp4.dequantize_mxfp4``'s bf16 weights for all 256 code bytes under all 256 scale bytes:
    subnormal products (scale 1), zero and infinite scales, signed zeros."""
    import triton
    import triton.language as tl

    from alignzoo.common.moe.kernel import _mx_rows
    from alignzoo.common.moe.mxfp4 import dequantize_mxfp4

    @triton.jit
    def decode(p_w, p_s, p_out, K: tl.constexpr, MX: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * 64 + tl.arange(0, 64)
        for k0 in tl.static_range(0, K, 64):
            b = _mx_rows(p_w, p_s, rows, rows >= 0, k0, K, tl.bfloat16, 64, 64, MX)
            tl.store(p_out + rows[:, None] * K + k0 + tl.arange(0, 64)[None, :], b)

    K = 512  # 256 code bytes a row, each scale byte on one row
    codes = torch.arange(256, dtype=torch.uint8).repeat(256, 1).cuda()
    scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, K // 32).cuda()
    out = torch.empty(256, K, dtype=torch.bfloat16, device="cuda")
    decode[(4,)](codes, scales, out, K, mx, num_warps=4, enable_fp_fusion=FP_FUSION)
    want = dequantize_mxfp4(codes, scales).bfloat16()
    same = (out.view(torch.int16) == want.view(torch.int16)) | (out.isnan() & want.isnan())
    assert bool(same.all()), (~same).nonzero()[:8].tolist()


def test_mxfp4_gradients(device):
    """Frozen experts: gradients to x and the routing weights only, the float64 gradient at the decoded
    weights; with masters, the straight-through weight gradients too."""
    from alignzoo.common.moe.op import dequantize_experts_mxfp4, moe_experts_mxfp4

    x, ids, w, w_gu, w_d, q = _mx_experts(50, 96, 64, 6, 3, device=device, dtype=torch.float32, seed=5)
    gu_deq, d_deq = dequantize_experts_mxfp4(*q)
    xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
    mgu, md = w_gu.clone().requires_grad_(), w_d.clone().requires_grad_()
    out = moe_experts_mxfp4(xs, ids, ws, *q, master_gate_up=mgu, master_down=md, limit=1.5)
    dy = torch.randn_like(out)
    grads = torch.autograd.grad((out * dy).sum(), (xs, ws, mgu, md))
    xr, wr, gur, dr = (t.detach().double().requires_grad_() for t in (xs, ws, gu_deq, d_deq))
    ref = experts_ref(xr, ids, wr, gur, dr, 1.5)
    assert rel_err(out, ref) < 1e-5
    refs = torch.autograd.grad((ref * dy.double()).sum(), (xr, wr, gur, dr))
    for name, a, b in zip(("x", "weights", "master_gate_up", "master_down"), grads, refs):
        assert rel_err(a, b) < 1e-4, (name, rel_err(a, b))
    frozen = moe_experts_mxfp4(xs, ids, ws, *q)
    assert frozen.requires_grad and len(torch.autograd.grad(frozen.sum(), (xs, ws))) == 2


def test_mxfp4_bad_inputs():
    from alignzoo.common.moe.op import moe_experts_mxfp4, quantize_experts_mxfp4

    x, ids, w, w_gu, w_d, (gc, gs, dc, ds) = _mx_experts(10, 96, 64, 3, 2, device="cpu")
    with pytest.raises(ValueError, match=r"K % 32 == 0"):
        quantize_experts_mxfp4(w_gu[:, :, :40], w_d)
    with pytest.raises(ValueError, match=r"gu_scales \(3, 128, 2\) \(want \(3, 128, 3\)\)"):
        moe_experts_mxfp4(x, ids, w, gc, gs[:, :, :2].contiguous(), dc, ds)
    with pytest.raises(ValueError, match="expert shapes do not fit"):
        moe_experts_mxfp4(x, ids, w, gc[:, :, :40].contiguous(), gs, dc, ds)
    with pytest.raises(TypeError, match="gu_codes"):
        moe_experts_mxfp4(x, ids, w, gc.view(torch.int8), gs, dc, ds)
    if hasattr(torch, "float8_e8m0fnu"):  # E8M0 bytes as checkpoints type them are accepted
        out = moe_experts_mxfp4(x, ids, w, gc, gs.view(torch.float8_e8m0fnu), dc, ds.view(torch.float8_e8m0fnu))
        assert bitwise_equal(out, moe_experts_mxfp4(x, ids, w, gc, gs, dc, ds))


_INTERPRETED_MX = """
import torch
from alignzoo.common.moe.checks import make_experts
from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton, experts_fwd_triton
from alignzoo.common.moe.op import dequantize_experts_mxfp4, quantize_experts_mxfp4

# The packed kernels decode each tile in registers; under the interpreter both paths' dots are numpy's, so the
# packed run must equal the bf16 kernels' run at the decoded weights bit for bit (fp32 activations: exact inputs).
for T, H, I, E, k, skew in ((37, 96, 64, 5, 3, False), (70, 160, 96, 7, 2, True), (1, 64, 32, 5, 3, False)):
    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device="cpu", skew=skew, seed=1, dtype=torch.float32)
    q = quantize_experts_mxfp4(w_gu, w_d)
    gu, d = dequantize_experts_mxfp4(*q)
    got = experts_fwd_mxfp4_triton(x, ids, w, *q)
    assert torch.equal(got, experts_fwd_triton(x, ids, w, gu, d)), (T, H, I)
print("ok")
"""

_INTERPRETED_MX_SWAP = TORCH_MATH + _EXACT_INPUTS + r"""
from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton, experts_fwd_triton
from alignzoo.common.moe.op import dequantize_experts_mxfp4

# The swapped chain (accᵀ = W · xᵀ): its dots are numpy's other product here, so the inputs make every dot
# exact: small integers, gate/up codes under scales of 2^-3..2^0, and a down weight with one nonzero code a
# row.  Then every tile and grid must give the unswapped kernel's bits, and the bf16 path's at the decoded
# weights.
def codes_scales(E, N, K, one_per_row):
    if one_per_row:
        c = torch.zeros(E, N, K // 2, dtype=torch.uint8)
        n = torch.arange(N)
        c[:, n, n % (K // 2)] = ri(1, 8, E, N).to(torch.uint8)  # a low nibble: column 2 (n % (K / 2))
        return c, torch.full((E, N, K // 32), 127, dtype=torch.uint8)
    return ri(0, 256, E, N, K // 2).to(torch.uint8), ri(124, 128, E, N, K // 32).to(torch.uint8)

# (even H and I; a ragged H; a ragged I, a 128-wide tile's gate rows ending inside it); expert 0 has T rows
for T, H, I, E, k in ((300, 128, 64, 5, 2), (70, 96, 128, 7, 3), (37, 192, 96, 5, 3)):
    x = ri(-3, 4, T, H)
    ids, w = routes(T, E, k, skew=True)
    q = (*codes_scales(E, 2 * I, H, False), *codes_scales(E, H, I, True))
    want = experts_fwd_mxfp4_triton(x, ids, w, *q, swap=False)
    assert torch.equal(want, experts_fwd_triton(x, ids, w, *dequantize_experts_mxfp4(*q))), (T, H, I)
    for knobs in (dict(block_m=64), dict(block_m=128, block_n=128), dict(block_m=256)):
        got = experts_fwd_mxfp4_triton(x, ids, w, *q, swap=True, **knobs)
        assert torch.equal(got, want), (T, H, I, knobs, (got - want).abs().max())
print("ok")
"""

_INTERPRETED_MX_TILE = """
import os, torch, triton, triton.language as tl
from alignzoo.common.moe.kernel import _w_tile
from alignzoo.common.moe.mxfp4 import dequantize_mxfp4

@triton.jit
def tile(p_w, p_s, p_o, K: tl.constexpr, N: tl.constexpr, DT: tl.constexpr):
    rows = tl.arange(0, N).to(tl.int64)
    t = _w_tile(p_w, p_s, rows, rows < N, 0, K, DT, True, N, K)  # (K, N): W transposed
    o_k = tl.arange(0, K)
    tl.store(p_o + rows[None, :] * K + o_k[:, None], t)

interpreted = os.environ.get("TRITON_INTERPRET") == "1"
dev = "cpu" if interpreted else "cuda"
# every nibble pair under every scale byte (255 is E8M0's NaN): row n has scale n in both groups
codes = torch.arange(256, dtype=torch.int32).repeat(256, 1)[:, :32].clone()
codes = ((codes + torch.arange(256)[:, None] * 7) % 256).to(torch.uint8).to(dev)
scales = torch.arange(256, dtype=torch.uint8)[:, None].repeat(1, 2).to(dev)
for dt, tdt in ((torch.float32, tl.float32), (torch.bfloat16, tl.bfloat16)):
    want = dequantize_mxfp4(codes, scales, dtype=dt)
    out = torch.empty(256, 64, dtype=dt, device=dev)
    tile[(1,)](codes, scales, out, 64, 256, tdt)
    # the fp32 -> bf16 cast flushes rows 0-1's 2^-128..2^-126 under the interpreter (numpy's cast), not on the GPU
    rows = slice(2, 256) if dt == torch.bfloat16 and interpreted else slice(0, 256)
    got, ref = out[rows], want[rows]
    bits = (lambda t: t.view(torch.int16) if dt == torch.bfloat16 else t.view(torch.int32))
    bad = ((bits(got) != bits(ref)) & ~(got.isnan() & ref.isnan())).nonzero()
    assert bad.numel() == 0, (dt, bad[:4].tolist(), got[bad[0, 0], bad[0, 1]], ref[bad[0, 0], bad[0, 1]])
print("ok")
"""


def test_mxfp4_triton_kernels_decode_in_registers_interpreted():
    run_interpreted(_INTERPRETED_MX, expect="ok")


def test_mxfp4_swapped_chain_gives_the_unswapped_bits_interpreted():
    run_interpreted(_INTERPRETED_MX_SWAP, expect="ok")


def test_mxfp4_tile_decodes_give_dequantize_bits_interpreted():
    """``_w_tile``'s MXFP4 decode gives ``dequantize_mxfp4``'s bits (fp32 and bf16, -0.0 and
    subnormals included) for every code under every scale byte, NaN under 255."""
    run_interpreted(_INTERPRETED_MX_TILE, expect="ok")


@pytest.mark.gpu
def test_gpu_mxfp4_tile_decodes_give_dequantize_bits():
    """The same on the GPU, compiled (subnormals, the fp32 -> bf16 cast and the products as sm_90 runs them)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    run_interpreted(_INTERPRETED_MX_TILE, expect="ok", interpret=False)


# ------------------------------------------------------------------ LoRA inside the experts
def _expert_lora(E, H, I, r, *, device, dtype=torch.bfloat16, scale=2.0, seed=7, zero_b=False):
    from alignzoo.common.moe.lora import ExpertLoRA

    g = torch.Generator().manual_seed(seed)

    def m(*shape, std):
        return (torch.zeros(shape) if zero_b and std < 0 else torch.randn(*shape, generator=g) * abs(std)).to(device, dtype)

    return ExpertLoRA(m(E, r, H, std=H ** -0.5), m(E, 2 * I, r, std=-0.3), m(E, r, I, std=I ** -0.5),
                      m(E, H, r, std=-0.3), scale)


def _formats(w_gu, w_d):
    """(name, forward(x, ids, w, limit, lora)) for bf16, FP8 and MXFP4 experts of the same weights."""
    from alignzoo.common.moe.op import experts_fp8_fwd, experts_mxfp4_fwd, quantize_experts_fp8, quantize_experts_mxfp4

    q8, q4 = quantize_experts_fp8(w_gu, w_d), quantize_experts_mxfp4(w_gu, w_d)
    return (("bf16", lambda x, ids, w, lim, lora: experts_fwd(x, ids, w, w_gu, w_d, lim, lora)),
            ("fp8", lambda x, ids, w, lim, lora: experts_fp8_fwd(x, ids, w, *q8, lim, lora)),
            ("mxfp4", lambda x, ids, w, lim, lora: experts_mxfp4_fwd(x, ids, w, *q4, lim, lora)))


def _lora_rows_do_not_depend_on_the_batch(device, T, H, I, E, k, r, sizes):
    x, ids, w, w_gu, w_d = make_experts(T, H, I, E, k, device=device, skew=True, seed=3)
    lora = _expert_lora(E, H, I, r, device=device)
    zero = _expert_lora(E, H, I, r, device=device, zero_b=True)
    g = torch.Generator().manual_seed(2)
    for name, fwd in _formats(w_gu, w_d):
        for lim in (None, 1.0):
            full = fwd(x, ids, w, lim, lora)
            assert not bitwise_equal(full, fwd(x, ids, w, lim, None)), name  # the adapter is there
            assert bitwise_equal(fwd(x, ids, w, lim, zero), fwd(x, ids, w, lim, None)), name  # B = 0: the base's bits
            for n in sizes:
                idx = torch.randperm(T, generator=g)[:n].to(device)
                assert bitwise_equal(fwd(x[idx], ids[idx], w[idx], lim, lora), full[idx]), (name, lim, n)


def test_lora_in_experts_rows_do_not_depend_on_the_batch():
    """bf16, FP8 and MXFP4 experts with an adapter inside: a token alone or in batches, skewed routing;
    an adapter whose B is zero leaves the base's bits."""
    _lora_rows_do_not_depend_on_the_batch(torch.device("cpu"), 160, 96, 64, 7, 3, 4, (1, 2, 17, 64))


@pytest.mark.gpu
def test_lora_in_experts_gpu_rows_do_not_depend_on_the_batch():
    _lora_rows_do_not_depend_on_the_batch(torch.device("cuda"), 1024, 2048, 512, 32, 8, 16, (1, 2, 7, 64, 300))


@pytest.mark.gpu
def test_lora_in_experts_gpu_replays_from_a_cuda_graph():
    x, ids, w, w_gu, w_d = make_experts(64, 2048, 512, 32, 8, device="cuda")
    lora = _expert_lora(32, 2048, 512, 16, device="cuda")
    for _, fwd in _formats(w_gu, w_d):
        _replays_from_a_cuda_graph(lambda x, ids, w, fwd=fwd: fwd(x, ids, w, None, lora), x, ids, w)


def test_lora_in_experts_accuracy_and_gradients_against_float64(device):
    """fp32 experts with an adapter: the forward against float64, and the backward against float64
    autograd w.r.t. x, the routing weights, the base stacks and all four adapter stacks."""
    from alignzoo.common.moe.lora import ExpertLoRA

    x, ids, w, w_gu, w_d = make_experts(50, 72, 40, 6, 3, device=device, dtype=torch.float32, seed=3)
    lora = _expert_lora(6, 72, 40, 4, device=device, dtype=torch.float32)
    for limit in (None, 1.5):
        leaves = [t.clone().requires_grad_() for t in (x * 2, w, w_gu, w_d, *lora.tensors())]
        lo = ExpertLoRA(*leaves[4:], lora.scale)
        out = moe_experts(leaves[0], ids, leaves[1], leaves[2], leaves[3], limit=limit, lora=lo)
        dy = torch.randn_like(out)
        grads = torch.autograd.grad((out * dy).sum(), leaves)
        refs_in = [t.detach().double().requires_grad_() for t in leaves]
        ref = experts_ref(refs_in[0], ids, refs_in[1], refs_in[2], refs_in[3], limit,
                          ExpertLoRA(*refs_in[4:], lora.scale))
        assert rel_err(out, ref) < 1e-5, limit
        refs = torch.autograd.grad((ref * dy.double()).sum(), refs_in)
        for name, a, b in zip(("x", "weights", "w_gate_up", "w_down", "a_gu", "b_gu", "a_d", "b_d"), grads, refs):
            assert rel_err(a, b) < 1e-4, (name, limit, rel_err(a, b))


def test_lora_on_frozen_quantized_experts_trains_the_adapters_only(device):
    """FP8 and MXFP4 experts frozen (no masters), an adapter inside: gradients reach the adapter and x,
    the float64 gradient at the dequantized weights."""
    from alignzoo.common.moe.lora import ExpertLoRA
    from alignzoo.common.moe.op import (dequantize_experts_fp8, dequantize_experts_mxfp4, moe_experts_fp8,
                                        moe_experts_mxfp4, quantize_experts_fp8, quantize_experts_mxfp4)

    x, ids, w, w_gu, w_d = make_experts(40, 96, 64, 5, 2, device=device, dtype=torch.float32, seed=6)
    lora = _expert_lora(5, 96, 64, 4, device=device, dtype=torch.float32)
    for op, quant, deq in ((moe_experts_fp8, quantize_experts_fp8, dequantize_experts_fp8),
                           (moe_experts_mxfp4, quantize_experts_mxfp4, dequantize_experts_mxfp4)):
        q = quant(w_gu, w_d)
        leaves = [t.clone().requires_grad_() for t in (x, *lora.tensors())]
        out = op(leaves[0], ids, w, *q, lora=ExpertLoRA(*leaves[1:], lora.scale))
        dy = torch.randn_like(out)
        grads = torch.autograd.grad((out * dy).sum(), leaves)
        gu, d = deq(*q)
        refs_in = [t.detach().double().requires_grad_() for t in leaves]
        ref = experts_ref(refs_in[0], ids, w.double(), gu.double(), d.double(), None, ExpertLoRA(*refs_in[1:], lora.scale))
        refs = torch.autograd.grad((ref * dy.double()).sum(), refs_in)
        for name, a, b in zip(("x", "a_gu", "b_gu", "a_d", "b_d"), grads, refs):
            assert rel_err(a, b) < 1e-4, (op.__name__, name, rel_err(a, b))


def test_lora_in_experts_bad_inputs():
    from alignzoo.common.moe.lora import ExpertLoRA

    x, ids, w, w_gu, w_d = make_experts(10, 72, 40, 3, 2, device="cpu")
    lora = _expert_lora(3, 72, 40, 4, device="cpu")
    with pytest.raises(ValueError, match=r"lora.b_down has shape \(3, 72, 5\)"):
        moe_experts(x, ids, w, w_gu, w_d, lora=ExpertLoRA(*lora.tensors()[:3], torch.zeros(3, 72, 5).bfloat16(), 1.0))
    with pytest.raises(ValueError, match="lora.a_gate_up is torch.float32"):
        moe_experts(x, ids, w, w_gu, w_d, lora=ExpertLoRA(lora.a_gate_up.float(), *lora.tensors()[1:], 1.0))
    with pytest.raises(TypeError, match="lora must be an ExpertLoRA"):
        moe_experts(x, ids, w, w_gu, w_d, lora=lora.tensors())


_INTERPRETED_LORA = _EXACT_DOT + _EXACT_INPUTS + r"""
from alignzoo.common.moe import cpu, kernel
from alignzoo.common.moe.lora import ExpertLoRA
from alignzoo.common.moe.op import quantize_experts_fp8, quantize_experts_mxfp4

# Every dot exact (the CPU path adds left to right, the kernels by blocks): x, gate / up and their adapter small
# integers over 8, the down weight and adapter one nonzero a row.  The SwiGLU, the FP8 quantizations, the slot
# sums and base + delta still round, so the kernels must equal the CPU path bit for bit: the adapters' grouped
# products, and the delta added to the base kernels' accumulators after the base, on every format.
for T, H, I, E, k, r, skew in ((37, 96, 64, 5, 3, 4, False), (70, 160, 96, 7, 2, 8, True), (1, 64, 32, 5, 3, 4, False)):
    x = ri(-3, 4, T, H)
    ids, w = routes(T, E, k, skew)
    w_gu, w_d = ri(-2, 3, E, 2 * I, H) / 8, one_per_row(E, H, I)
    lora = ExpertLoRA(ri(-2, 3, E, r, H) / 8, ri(-2, 3, E, 2 * I, r) / 8, one_per_row(E, r, I), one_per_row(E, H, r),
                      2.0)
    q8, q4 = quantize_experts_fp8(w_gu, w_d), quantize_experts_mxfp4(w_gu, w_d)
    for name, got, want in (("bf16", kernel.experts_fwd_triton(x, ids, w, w_gu, w_d, lora=lora),
                             cpu.experts_fwd_cpu(x, ids, w, w_gu, w_d, lora=lora)),
                            ("fp8", kernel.experts_fwd_fp8_triton(x, ids, w, *q8, lora=lora),
                             cpu.experts_fwd_fp8_cpu(x, ids, w, *q8, lora=lora)),
                            ("mxfp4", kernel.experts_fwd_mxfp4_triton(x, ids, w, *q4, lora=lora),
                             cpu.experts_fwd_mxfp4_cpu(x, ids, w, *q4, lora=lora))):
        assert torch.equal(got, want), (name, T, H, I, (got - want).abs().max())
print("ok")
"""


def test_lora_in_experts_triton_kernels_interpreted():
    run_interpreted(_INTERPRETED_LORA, expect="ok")


def test_fp8_experts_cache_requantizes_once_per_optimizer_step():
    """FP32 expert masters: the codes are made once and reused until a step changes a master; the
    straight-through gradients reach the masters; a write through .data is seen after invalidate()."""
    from alignzoo.common.moe.op import Fp8ExpertsCache, quantize_experts_fp8

    x, ids, w, w_gu, w_d = make_experts(30, 200, 136, 5, 2, device="cpu", seed=8)
    mgu, md = torch.nn.Parameter(w_gu.float()), torch.nn.Parameter(w_d.float())
    cache = Fp8ExpertsCache(mgu, md)
    opt = torch.optim.SGD([mgu, md], lr=1e-2)
    for step in range(2):
        y1 = cache.experts(x, ids, w)
        y2 = cache.experts(x, ids, w)
        assert bitwise_equal(y1, y2) and cache.quantizations == step + 1
        want = quantize_experts_fp8(mgu.detach(), md.detach())
        assert all(bitwise_equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                 b.view(torch.uint8) if b.dtype != torch.float32 else b)
                   for a, b in zip(cache.get(), want))
        y1.sum().backward()
        assert mgu.grad is not None and md.grad.abs().sum() > 0
        opt.step()
        opt.zero_grad()
    cache.get()
    assert cache.quantizations == 3  # the last step's
    mgu.data.mul_(2)  # a write through .data: invisible to the version counter
    cache.get()
    assert cache.quantizations == 3
    cache.invalidate()
    cache.get()
    assert cache.quantizations == 4
