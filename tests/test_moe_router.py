"""MoE routers: rungs 1-2, ties, float64 accuracy and gradients, transformers parity, replay, a broken variant."""
from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV4Config, GlmMoeDsaConfig, Qwen3_5MoeTextConfig
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter, DeepseekV4TopKRouter
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

from interpreted import TORCH_MATH, run_interpreted
from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.matmul import matmul
from alignzoo.common.moe import (
    EXPERT_SHAPES,
    hash_route,
    hash_route_fwd,
    hash_route_ref,
    router_replay,
    router_weights,
    router_weights_ref,
    sigmoid_topk,
    sigmoid_topk_fwd,
    sigmoid_topk_ref,
    softmax_topk,
    softmax_topk_fwd,
    softmax_topk_ref,
    sqrtsoftplus_topk,
    sqrtsoftplus_topk_fwd,
    sqrtsoftplus_topk_ref,
)
from alignzoo.common.moe import router as R

BF, F32 = torch.bfloat16, torch.float32
VOCAB = 1000
# ||w - ref|| / ||ref|| vs float64: fp32 weights ~1e-7 measured, bf16 (one cast) ~2e-3
W_BOUND = {F32: 1e-6, BF: 4e-3}
GRAD_BOUND = 1e-5  # fp32 logits: ~1e-7 measured


def _bias(E, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (0.1 * torch.randn(E, generator=g)).to(device)


def _table(E, k, device, seed=2):
    """tid2eid: k distinct experts per token id."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(VOCAB)]).to(device)


# name -> (E, build(device) -> (fwd(logits, input_ids), ref(logits, input_ids), scoring, scale, normalize))
def _softmax(k, normalize=True):
    def build(device):
        return (lambda x, ids: softmax_topk_fwd(x, k, normalize), lambda x, ids: softmax_topk_ref(x, k, normalize),
                "softmax", 1.0, normalize)
    return build


def _sigmoid(E, k, n_group, topk_group, scale=2.5):
    def build(device):
        b = _bias(E, device)
        return (lambda x, ids: sigmoid_topk_fwd(x, b, k, n_group, topk_group, scale),
                lambda x, ids: sigmoid_topk_ref(x, b, k, n_group, topk_group, scale), "sigmoid", scale, True)
    return build


def _sqrtsoftplus(E, k, scale=1.5):
    def build(device):
        b = _bias(E, device)
        return (lambda x, ids: sqrtsoftplus_topk_fwd(x, b, k, scale), lambda x, ids: sqrtsoftplus_topk_ref(x, b, k, scale),
                "sqrtsoftplus", scale, True)
    return build


def _hash(E, k, scale=1.5):
    def build(device):
        t = _table(E, k, device)
        return (lambda x, ids: hash_route_fwd(x, ids, t, scale), lambda x, ids: hash_route_ref(x, ids, t, scale),
                "sqrtsoftplus", scale, True)
    return build


CASES = {
    "softmax-E60-k8": (60, _softmax(8)),
    "softmax-E256-k8-unnormalized": (256, _softmax(8, normalize=False)),
    "sigmoid-E64-g8-top4-k8": (64, _sigmoid(64, 8, 8, 4)),
    "sigmoid-E100-k8": (100, _sigmoid(100, 8, 1, 1)),
    "sqrtsoftplus-E60-k6": (60, _sqrtsoftplus(60, 6)),
    "hash-E60-k6": (60, _hash(60, 6)),
}


def _inputs(T, E, dtype, device, seed=0, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    x = (scale * torch.randn(T, E, generator=g)).to(device, dtype)
    return x, torch.randint(0, VOCAB, (T,), generator=g).to(device)


# ---------------------------------------------------------------- rungs 1 and 2


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("case", list(CASES))
def test_rung1_rung2(device, case, dtype):
    E, build = CASES[case]
    fwd = build(device)[0]
    x, ids = _inputs(300, E, dtype, device)
    r1 = rung1_repeat("router", fwd, x, ids)
    assert r1.passed, r1
    r2 = rung2_rows("router", fwd, (x, ids), batch_sizes=(1, 2, 3, 7, 64, 257))
    assert r2.passed, r2.detail
    w_ref, i_ref = fwd(x, ids)
    for t in range(300):  # each row alone
        w, i = fwd(x[t : t + 1], ids[t : t + 1])
        assert bitwise_equal(w[0], w_ref[t]) and bitwise_equal(i[0], i_ref[t]), t


def test_broken_variant_caught_by_rung2():
    """A softmax whose sum over E runs left to right for batches under 64 rows
    (as an M-dependent split would): rung 2 sees the changed bits."""

    def left_to_right(x):
        acc = x[..., 0]
        for j in range(1, x.shape[-1]):
            acc = acc + x[..., j]
        return acc

    def batch_dependent(x, ids):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(R, "tree_sum", R.tree_sum if x.shape[0] >= 64 else left_to_right)
            return softmax_topk_fwd(x, 8)

    x, ids = _inputs(300, 60, F32, torch.device("cpu"))
    assert rung1_repeat("router", batch_dependent, x, ids).passed  # deterministic: only rung 2 can see it
    r2 = rung2_rows("router", batch_dependent, (x, ids), batch_sizes=(1, 2, 3, 7, 64, 257))
    assert not r2.passed and r2.differing > 0
    assert rung2_rows("router", lambda x, ids: softmax_topk_fwd(x, 8), (x, ids), batch_sizes=(1, 2, 3, 7, 64, 257)).passed


def test_scores_position_free():
    """sigmoid_fp32 and sqrtsoftplus_fp32 (and their backward) give an element the same
    bits wherever it sits (vector body or tail): torch 2.13's CPU torch.sigmoid and
    F.softplus do not, which is why the routers do not call them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20_001, generator=g) * 12
    dy = torch.randn(20_001, generator=g)
    for fn in (R._Sigmoid.apply, R._SqrtSoftplus.apply):
        xr = x.clone().requires_grad_()
        ref = fn(xr)
        (ref_grad,) = torch.autograd.grad(ref, xr, dy)
        for start in range(0, 17):
            for n in (1, 5, 7, 31, 60, 257):
                xs = x[start : start + n].clone().requires_grad_()
                out = fn(xs)
                (grad,) = torch.autograd.grad(out, xs, dy[start : start + n])
                assert bitwise_equal(out, ref[start : start + n].detach()), (fn, start, n)
                assert bitwise_equal(grad, ref_grad[start : start + n]), (fn, start, n)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_cuda_graph_same_bits(case):
    """Captured once, replayed on new inputs: the eager bits (no host read, static shapes)."""
    dev = torch.device("cuda")
    E, build = CASES[case]
    fwd = build(dev)[0]
    sx, sids = _inputs(64, E, BF, dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        fwd(sx, sids)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        out = fwd(sx, sids)
    x, ids = _inputs(64, E, BF, dev, seed=1)
    sx.copy_(x)
    sids.copy_(ids)
    graph.replay()
    torch.cuda.synchronize()
    assert all(bitwise_equal(a, b) for a, b in zip(out, fwd(x, ids)))


def test_empty_batch(device):
    x, ids = _inputs(0, 60, BF, device)
    for E, build in CASES.values():
        w, i = build(device)[0](torch.zeros(0, E, dtype=BF, device=device), ids)
        assert w.shape[0] == 0 and i.shape[0] == 0 and i.dtype == torch.int64


# ---------------------------------------------------------------- ties


def test_softmax_ties_to_smaller_id(device):
    for dtype in (BF, F32):
        w, ids = softmax_topk(torch.zeros(3, 60, dtype=dtype, device=device), 8)
        assert ids.tolist() == [list(range(8))] * 3
        assert w.dtype == dtype and bool((w == w[:, :1]).all())
        x = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]], dtype=dtype, device=device)
        assert softmax_topk(x, 3)[1].tolist() == [[0, 2, 3]]
        assert softmax_topk(x, 5)[1].tolist() == [[0, 2, 3, 4, 1]]


def test_sigmoid_group_ties(device):
    """Logits 0 give s = 0.5 exactly, so dyadic biases give exactly tied group scores:
    group 1 (0.5+0.25 over s: 1.0 + 0.75) and group 3 (a doubled max: 0.875 + 0.875)
    both score 1.75; with topk_group 2 after group 0 (2.0) the smaller group id, 1, wins."""
    b = torch.tensor([0.5, 0.5, 0.0, 0.0,  # group 0: 2.0
                      0.25, 0.5, 0.0, 0.0,  # group 1: 1.0 + 0.75
                      0.25, 0.25, 0.0, 0.0,  # group 2: 1.5
                      0.375, 0.0, 0.375, 0.0], device=device)  # group 3: 0.875 + 0.875
    x = torch.zeros(2, 16, device=device)
    w, ids = sigmoid_topk(x, b, 4, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert ids.tolist() == [[0, 1, 4, 5]] * 2  # top 4 by choice within groups {0, 1}; equal s: ascending id
    assert bool((w == w[:, :1]).all())
    # Group 3 first among the tied when the order of the groups is swapped
    perm = torch.tensor([0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11, 4, 5, 6, 7], device=device)
    _, ids = sigmoid_topk(x, b[perm], 8, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    assert ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]] * 2  # groups {0, 1}: group 1 now holds the doubled max
    # Equal choice scores: smaller id
    _, ids = sqrtsoftplus_topk(torch.zeros(1, 10, device=device), torch.zeros(10, device=device), 3)
    assert ids.tolist() == [[0, 1, 2]]


def test_slots_in_probability_order(device):
    """Selection by s + bias, slots ordered by the unbiased s (descending, ties to the smaller id)."""
    x = torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.0, 0.0]], device=device)
    b = torch.tensor([0.0, 0.0, 5.0, 0.0, 5.0, 0.0], device=device)  # 2 and 4 chosen by bias, lowest s
    for fn in (lambda: sigmoid_topk(x, b, 4), lambda: sqrtsoftplus_topk(x, b, 4)):
        w, ids = fn()
        assert ids.tolist() == [[3, 1, 2, 4]]
        assert bool((w[:, :-1] >= w[:, 1:]).all())
    t = torch.tensor([[5, 2, 7], [7, 5, 2]], device=device)
    _, ids = hash_route(torch.zeros(2, 8, device=device), torch.tensor([0, 1], device=device), t)
    assert ids.tolist() == [[2, 5, 7], [2, 5, 7]]


# ---------------------------------------------------------------- accuracy and gradients vs float64


@pytest.mark.parametrize("case", list(CASES))
def test_accuracy_and_gradients(device, case):
    E, build = CASES[case]
    fwd, ref, *_ = build(device)
    x, ids = _inputs(63, E, F32, device, seed=3)
    x = x.requires_grad_()
    w, i = fwd(x, ids)
    x64 = x.detach().double().requires_grad_()
    w_ref, i_ref = ref(x64, ids)
    assert torch.equal(i, i_ref)
    assert w.dtype == F32 and rel_err(w, w_ref) <= W_BOUND[F32]
    dy = torch.randn(w.shape, generator=torch.Generator().manual_seed(4)).to(device)
    (g,) = torch.autograd.grad(w, x, dy)
    (g_ref,) = torch.autograd.grad(w_ref, x64, dy.double())
    assert rel_err(g, g_ref) <= GRAD_BOUND, rel_err(g, g_ref)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("softmax")])
def test_bf16_logits_fp32_weights(device, case):
    E, build = CASES[case]
    fwd, ref, *_ = build(device)
    x, ids = _inputs(63, E, BF, device, seed=5)
    w, i = fwd(x, ids)
    w_ref, i_ref = ref(x, ids)
    assert w.dtype == F32 and torch.equal(i, i_ref) and rel_err(w, w_ref) <= W_BOUND[F32]


def test_softmax_bf16_accuracy(device):
    x, _ = _inputs(63, 256, BF, device, seed=6)
    w, i = softmax_topk(x.requires_grad_(), 8)
    x64 = x.detach().double().requires_grad_()
    w_ref, i_ref = softmax_topk_ref(x64, 8)
    assert w.dtype == BF and torch.equal(i, i_ref) and rel_err(w, w_ref) <= W_BOUND[BF]
    dy = torch.randn(w.shape, generator=torch.Generator().manual_seed(7)).to(device, BF)
    (g,) = torch.autograd.grad(w, x, dy)
    (g_ref,) = torch.autograd.grad(w_ref, x64, dy.double())
    assert g.dtype == BF and rel_err(g, g_ref) <= W_BOUND[BF]


# ---------------------------------------------------------------- parity with transformers' routers


def _same_routing(w, ids, w_hf, ids_hf, bound):
    """Ids as sets per row; weights matched by id."""
    ids_s, perm = ids.sort(dim=-1)
    ids_hf_s, perm_hf = ids_hf.sort(dim=-1)
    assert torch.equal(ids_s, ids_hf_s)
    e = rel_err(w.gather(1, perm), w_hf.gather(1, perm_hf))
    assert e <= bound, e


def _filled(module, gen, bias=False):
    with torch.no_grad():
        module.weight.copy_(torch.randn(module.weight.shape, generator=gen) / module.hidden_dim ** 0.5 * 3)
        if bias:
            module.e_score_correction_bias.copy_(0.1 * torch.randn(module.num_experts, generator=gen))
    return module


def test_parity_qwen3_5():
    gen = torch.Generator().manual_seed(10)
    hf = _filled(Qwen3_5MoeTopKRouter(Qwen3_5MoeTextConfig(hidden_size=48, num_experts=60, num_experts_per_tok=8)), gen)
    h = torch.randn(97, 48, generator=gen)
    _, w_hf, ids_hf = hf(h)
    w, ids = softmax_topk(matmul(h, hf.weight.detach()), 8)
    assert torch.equal(ids, ids_hf)  # transformers' topk is sorted: the same slot order
    _same_routing(w, ids, w_hf, ids_hf, 1e-6)
    # bf16 model: bf16 logits in, bf16 weights out; rows with a bf16 tie at slot k set aside
    hf = hf.to(BF)
    logits, w_hf, ids_hf = hf(h.to(BF))
    w, ids = softmax_topk(logits.detach(), 8)
    assert w.dtype == w_hf.dtype == BF
    p = torch.softmax(logits.float(), -1).sort(dim=-1, descending=True).values
    clear = p[:, 7] != p[:, 8]
    assert int(clear.sum()) > 80
    _same_routing(w[clear], ids[clear], w_hf.detach()[clear], ids_hf[clear], W_BOUND[BF])


def test_parity_glm5():
    gen = torch.Generator().manual_seed(11)
    cfg = GlmMoeDsaConfig(hidden_size=48, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4)
    hf = _filled(GlmMoeDsaTopkRouter(cfg), gen, bias=True)
    h = torch.randn(97, 48, generator=gen)
    _, w_hf, ids_hf = hf(h)
    w, ids = sigmoid_topk(matmul(h, hf.weight.detach()), hf.e_score_correction_bias, 8, n_group=8, topk_group=4,
                          routed_scaling_factor=cfg.routed_scaling_factor)
    assert cfg.routed_scaling_factor == 2.5 and w.dtype == w_hf.dtype == F32
    _same_routing(w, ids, w_hf.detach(), ids_hf, 1e-6)


def test_parity_deepseek_v4():
    gen = torch.Generator().manual_seed(12)
    cfg = DeepseekV4Config(hidden_size=48, n_routed_experts=64, num_experts_per_tok=6, vocab_size=VOCAB)
    hf = _filled(DeepseekV4TopKRouter(cfg), gen, bias=True)
    h = torch.randn(97, 48, generator=gen) * 2
    _, w_hf, ids_hf = hf(h)
    w, ids = sqrtsoftplus_topk(matmul(h, hf.weight.detach()), hf.e_score_correction_bias, 6,
                               routed_scaling_factor=cfg.routed_scaling_factor)
    assert cfg.routed_scaling_factor == 1.5
    _same_routing(w, ids, w_hf.detach(), ids_hf, 1e-6)

    hr = _filled(DeepseekV4HashRouter(cfg), gen)
    hr.tid2eid.copy_(_table(64, 6, torch.device("cpu")))
    input_ids = torch.randint(0, VOCAB, (97,), generator=gen)
    _, w_hf, ids_hf = hr(h, input_ids)
    w, ids = hash_route(matmul(h, hr.weight.detach()), input_ids, hr.tid2eid, routed_scaling_factor=1.5)
    _same_routing(w, ids, w_hf.detach(), ids_hf, 1e-6)


def test_expert_shapes_are_the_configs_defaults():
    configs = {"Qwen3_5MoeTextConfig": Qwen3_5MoeTextConfig(), "GlmMoeDsaConfig": GlmMoeDsaConfig(),
               "DeepseekV4Config": DeepseekV4Config()}
    assert set(EXPERT_SHAPES) == {"Qwen3.5-35B-A3B", "GLM-5", "DeepSeek-V4-Flash"}
    for name, s in EXPERT_SHAPES.items():
        c = configs[s.config]
        shared = getattr(c, "shared_expert_intermediate_size", None) or c.moe_intermediate_size * c.n_shared_experts
        want = {
            "scoring": getattr(c, "scoring_func", "sigmoid" if s.config == "GlmMoeDsaConfig" else "softmax"),
            "num_experts": getattr(c, "num_local_experts", None) or c.num_experts,
            "top_k": c.num_experts_per_tok,
            "n_group": getattr(c, "n_group", 1),
            "topk_group": getattr(c, "topk_group", 1),
            "routed_scaling_factor": getattr(c, "routed_scaling_factor", 1.0),
            "hidden_size": c.hidden_size,
            "moe_intermediate_size": c.moe_intermediate_size,
            "n_shared_experts": getattr(c, "n_shared_experts", 1),
            "shared_intermediate_size": shared,
            "hash_layers": list(getattr(c, "mlp_layer_types", None) or []).count("hash_moe"),
        }
        assert {f: getattr(s, f) for f in want} == want, name


# ---------------------------------------------------------------- router replay


REPLAY = [("softmax", BF, 1.0), ("sigmoid", F32, 2.5), ("sqrtsoftplus", F32, 1.5)]


def _server_routing(scoring, x, scale):
    if scoring == "softmax":
        return softmax_topk_fwd(x, 8)
    b = _bias(x.shape[1], x.device)
    return sigmoid_topk_fwd(x, b, 8, 1, 1, scale) if scoring == "sigmoid" else sqrtsoftplus_topk_fwd(x, b, 8, scale)


@pytest.mark.parametrize("scoring,dtype,scale", REPLAY, ids=[r[0] for r in REPLAY])
def test_replay_frozen(device, scoring, dtype, scale):
    x, _ = _inputs(63, 64, dtype, device, seed=8)
    w_star, ids_star = _server_routing(scoring, x + 0.5 * torch.randn_like(x), scale)  # stale server weights
    ids32 = ids_star.to(torch.int32)  # as the server emits them
    w, ids = router_replay(x.requires_grad_(), ids32, w_star.float(), mode="frozen", scoring=scoring,
                           routed_scaling_factor=scale)
    assert bitwise_equal(w, w_star) and torch.equal(ids, ids_star) and ids.dtype == torch.int64
    assert not w.requires_grad  # no gradient reaches the router


@pytest.mark.parametrize("scoring,dtype,scale", REPLAY, ids=[r[0] for r in REPLAY])
def test_replay_straight_through(device, scoring, dtype, scale):
    x, _ = _inputs(63, 64, dtype, device, seed=9)
    w_star, ids_star = _server_routing(scoring, x + 0.5 * torch.randn_like(x), scale)
    x = x.requires_grad_()
    w, ids = router_replay(x, ids_star.to(torch.int32), w_star.float(), mode="straight-through", scoring=scoring,
                           routed_scaling_factor=scale)
    assert bitwise_equal(w, w_star) and torch.equal(ids, ids_star)  # the value: w* bitwise
    dy = torch.randn(w.shape, generator=torch.Generator().manual_seed(1)).to(device, w.dtype)
    (g,) = torch.autograd.grad(w, x, dy)
    own = router_weights(x, ids_star, scoring, routed_scaling_factor=scale)
    (g_own,) = torch.autograd.grad(own, x, dy)
    assert bitwise_equal(g, g_own)  # the gradient: that of the trainer's renormalized weights at ids*
    x64 = x.detach().double().requires_grad_()
    (g_ref,) = torch.autograd.grad(router_weights_ref(x64, ids_star, scoring, scale), x64, dy.double())
    assert rel_err(g, g_ref) <= (GRAD_BOUND if dtype == F32 else W_BOUND[BF])
    # same weights on both sides: the router's own weights at its own ids are w* bitwise
    w_same, ids_same = _server_routing(scoring, x.detach(), scale)
    assert bitwise_equal(router_weights(x.detach(), ids_same, scoring, routed_scaling_factor=scale), w_same)


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs():
    x = torch.randn(4, 16)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk(x, 17)
    with pytest.raises(TypeError, match="logits"):
        softmax_topk(x.double(), 2)
    with pytest.raises(ValueError, match="n_group"):
        sigmoid_topk(x, None, 2, n_group=3)
    with pytest.raises(ValueError, match="top_k"):
        sigmoid_topk(x, None, 5, n_group=4, topk_group=1)
    with pytest.raises(ValueError, match="bias"):
        sqrtsoftplus_topk(x, torch.zeros(15), 2)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        sqrtsoftplus_topk(x, None, 2, routed_scaling_factor=float("nan"))
    with pytest.raises(ValueError, match="input_ids"):
        hash_route(x, torch.zeros(3, dtype=torch.int64), torch.zeros(10, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="mode"):
        router_replay(x, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 2), mode="soft", scoring="softmax")
    with pytest.raises(ValueError, match="replay_weights"):
        router_replay(x, torch.zeros(4, 2, dtype=torch.int64), torch.zeros(4, 3), mode="frozen", scoring="sigmoid")


# ------------------------------------------------------------------ the server's softmax router kernel

_INTERPRETED_ROUTER = TORCH_MATH + r"""
from alignzoo.common.moe.router import softmax_topk_torch
from alignzoo.common.moe.router_kernel import softmax_topk_triton

g = torch.Generator().manual_seed(0)
for T, E, k in ((37, 256, 8), (9, 7, 3), (5, 33, 1)):
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(T, E, generator=g) * 3).to(dt)
        x[0] = 0.5  # a row of ties: the smaller ids first
        x[1, : E // 2] = x[1, E // 2 : 2 * (E // 2)]  # pairs of equal logits
        x[2, -1] = -1e30  # an expert whose probability underflows to +0.0
        if T > 5:  # NaN rows: the ids stay in range
            x[3, 1], x[4], x[5, 0] = float("nan"), float("nan"), float("inf")
        for norm in (True, False):
            want, got = softmax_topk_torch(x, k, norm), softmax_topk_triton(x, k, norm)
            same_w = torch.equal(want[0].isnan(), got[0].isnan()) and torch.equal(want[0].nan_to_num(), got[0].nan_to_num())
            assert torch.equal(want[1], got[1]) and same_w, (T, E, k, dt, norm)
print("ok")
"""


def test_softmax_router_kernel_interpreted():
    """The server's softmax top-k kernel under the interpreter gives the CPU path's ids and weights:
    E = 256 / 7 / 33 (padded lanes), ties, an underflowing expert, rows with NaN or inf logits (the
    ids stay in [0, E): an out-of-range id faulted the experts' kernel on a pad row's stale state),
    fp32 and bf16, with and without normalization."""
    run_interpreted(_INTERPRETED_ROUTER, expect="ok")


@pytest.mark.gpu
def test_gpu_softmax_router_kernel_equals_torch_path():
    """On CUDA at Qwen3.5's 256 experts and top-8: the kernel (the server's and the trainer's forward)
    gives the bits of the torch path (the CPU's), 3,000 rows; with a gradient to form, the same."""
    from alignzoo.common.moe.router import softmax_topk_torch

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3000, 256, generator=g) * 2).to(torch.bfloat16).cuda()
    x[0] = 1.0
    w_k, ids_k = softmax_topk_fwd(x, 8)
    w_t, ids_t = softmax_topk_torch(x, 8)
    assert torch.equal(ids_k, ids_t) and torch.equal(w_k, w_t)
    w_g, ids_g = softmax_topk_fwd(x.clone().requires_grad_(), 8)
    assert torch.equal(ids_g, ids_t) and torch.equal(w_g.detach(), w_t)
    x[1], x[2, 7] = float("nan"), float("nan")  # a pad row's stale state: ids in range, as the torch path's
    assert torch.equal(softmax_topk_fwd(x, 8)[1], softmax_topk_torch(x, 8)[1])
