"""LoRA: row invariance of each mode (bitwise), trainer == server, multi ==
separate (stacked or per-adapter lists, CUDA-graph captured), gradients vs
float64, the merged cache, B = 0, bad input, PEFT I/O."""
import json

import pytest
import torch
from safetensors import safe_open

from alignzoo.common.ladder import bitwise_equal, rel_err
from alignzoo.common.lora import (
    LoRAAdapter,
    LoRAConfig,
    MergedLoRACache,
    collect_adapters,
    init_lora_weights,
    load_peft_adapter,
    lora_add,
    lora_add_fwd,
    lora_add_multi,
    lora_add_multi_fwd,
    lora_linear_multi,
    lora_linear_multi_fwd,
    lora_linear_ref,
    lora_linear_separate,
    lora_linear_separate_fwd,
    lora_merge,
    lora_merge_fwd,
    lora_merge_ref,
    save_peft_adapter,
)
from alignzoo.common.lora.adapter import stack_adapters
from alignzoo.common.matmul import matmul, matmul_fwd

K, N = 100, 60
RANKS = [pytest.param(3, id="r3"), pytest.param(8, id="r8")]
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]
SCALES = (2.0, 16 / 3)  # alpha / r: a power of two and a value fp32 rounds


def _adapter(r, device, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(r, K, generator=g) / K**0.5).to(device, dtype)
    b = (torch.randn(N, r, generator=g) / r**0.5).to(device, dtype)  # trained: B != 0
    return a, b


def _setup(r, device, dtype=torch.bfloat16, M=300):
    x = torch.randn(M, K).to(device, dtype)
    w = (torch.randn(N, K) / K**0.5).to(device, dtype)
    return x, w, _adapter(r, device, dtype, 1), _adapter(3 if r != 3 else 8, device, dtype, 2)


def _modes(w, ad0, ad1, device):
    """Each mode as a server-side function of (x, idx) -> (M, N)."""
    (a, b), s = ad0, SCALES[0]
    a_n, b_n = stack_adapters([ad0, ad1])
    w_m = lora_merge_fwd(w, a, b, s)
    return {
        "merged": lambda x, idx: matmul_fwd(x, w_m),
        "separate": lambda x, idx: lora_linear_separate_fwd(x, w, a, b, s),
        "multi": lambda x, idx: lora_linear_multi_fwd(x, w, idx, a_n, b_n, SCALES),
    }


@pytest.mark.parametrize("mode", ["merged", "separate", "multi"])
@pytest.mark.parametrize("r", RANKS)
def test_rows_invariant_to_batch_and_order(device, mode, r):
    x, w, ad0, ad1 = _setup(r, device)
    idx = (torch.arange(300) % 3 - 1).to(device)  # -1, 0, 1, ...
    f = _modes(w, ad0, ad1, device)[mode]
    full = f(x, idx)
    assert bitwise_equal(f(x, idx), full)
    assert bitwise_equal(f(x.flip(0), idx.flip(0)), full.flip(0))
    g = torch.Generator().manual_seed(3)
    for M in (1, 7, 63, 300):
        sub = torch.randperm(300, generator=g)[:M].to(device)
        assert bitwise_equal(f(x[sub], idx[sub]), full[sub]), f"M={M}"
    for i in (0, 1, 2, 299):
        assert bitwise_equal(f(x[i:i + 1], idx[i:i + 1]), full[i:i + 1]), f"row {i} alone"


@pytest.mark.parametrize("dtype", DTYPES)
def test_trainer_path_equals_server_path(device, dtype):
    x, w, (a, b), ad1 = _setup(8, device, dtype, M=63)
    a, b = a.requires_grad_(), b.requires_grad_()
    s = SCALES[1]
    # merged: cache and plain function, with and without grad
    cache = MergedLoRACache()
    with torch.no_grad():
        w_serve = cache.weight(w, a, b, s)
        y_serve = matmul_fwd(x, w_serve)
    w_train = cache.weight(w, a, b, s)
    assert w_train.requires_grad and bitwise_equal(w_train, w_serve)
    assert bitwise_equal(matmul(x, w_train), y_serve)
    assert bitwise_equal(lora_merge(w, a, b, s), w_serve)
    with torch.no_grad():
        assert bitwise_equal(lora_merge(w, a, b, s), w_serve)
    # separate and multi
    assert bitwise_equal(lora_linear_separate(x, w, a, b, s), lora_linear_separate_fwd(x, w, a, b, s))
    a_n, b_n = stack_adapters([(a, b), ad1])
    a_n, b_n = a_n.requires_grad_(), b_n.requires_grad_()
    idx = torch.randint(-1, 2, (63,)).to(device)
    assert bitwise_equal(lora_linear_multi(x, w, idx, a_n, b_n, [s, 1.0]),
                         lora_linear_multi_fwd(x, w, idx, a_n, b_n, [s, 1.0]))
    base = matmul(x.clone().requires_grad_(), w)  # the add-only forms, as a fused qkv layer would call them
    assert bitwise_equal(lora_add(base, x, a, b, s), lora_add_fwd(base, x, a, b, s))
    assert bitwise_equal(lora_add_multi(base, x, idx, a_n, b_n, [s, 1.0]),
                         lora_add_multi_fwd(base, x, idx, a_n, b_n, [s, 1.0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_multi_equals_separate_row_by_row(device, dtype):
    """Mixed adapters of ranks 3 and 8 (the rank-3 one zero-padded) in one batch."""
    x, w, ad0, ad1 = _setup(8, device, dtype, M=63)
    a_n, b_n = stack_adapters([ad0, ad1])
    assert a_n.shape == (2, 8, K) and b_n.shape == (2, N, 8)
    idx = torch.tensor([(i * 7) % 3 - 1 for i in range(63)]).to(device)
    out = lora_linear_multi_fwd(x, w, idx, a_n, b_n, torch.tensor(SCALES))
    ads = [ad0, ad1]
    for j in (0, 1):  # the whole batch through separate mode with adapter j
        rows = (idx == j).nonzero().squeeze(1)
        sep = lora_linear_separate_fwd(x, w, *ads[j], SCALES[j])
        assert bitwise_equal(out[rows], sep[rows]), f"adapter {j}"
    for i in range(0, 63, 5):  # each row alone with its own (unpadded) adapter
        j = int(idx[i])
        alone = matmul_fwd(x[i:i + 1], w) if j < 0 else lora_linear_separate_fwd(x[i:i + 1], w, *ads[j], SCALES[j])
        assert bitwise_equal(out[i:i + 1], alone), f"row {i} adapter {j}"
    # the add-only forms on a precomputed base give the same rows
    base = matmul_fwd(x, w)
    assert bitwise_equal(lora_add_multi_fwd(base, x, idx, a_n, b_n, SCALES), out)
    assert bitwise_equal(lora_add_fwd(base, x, *ad0, SCALES[0]), lora_linear_separate_fwd(x, w, *ad0, SCALES[0]))


def test_multi_adapter_lists_of_own_ranks(device):
    """Adapters as lists, each of its own rank (no padding), None where an
    adapter has no branch on this layer (its rows keep the base): each row is
    the separate mode with its own adapter, trainer == server."""
    x, w, ad0, ad1 = _setup(8, device, M=93)
    base = matmul_fwd(x, w)
    idx = torch.tensor([(i * 5) % 4 - 1 for i in range(93)]).to(device)  # -1, 0, 1, 2
    a_n, b_n, scales = [ad0[0], None, ad1[0]], [ad0[1], None, ad1[1]], [SCALES[0], 7.0, SCALES[1]]
    out = lora_add_multi_fwd(base, x, idx, a_n, b_n, scales)
    assert bitwise_equal(lora_add_multi(base, x, idx, a_n, b_n, scales), out)
    for j, want in ((-1, base), (1, base), (0, lora_add_fwd(base, x, *ad0, SCALES[0])),
                    (2, lora_add_fwd(base, x, *ad1, SCALES[1]))):
        rows = (idx == j).nonzero().squeeze(1)
        assert rows.numel() and bitwise_equal(out[rows], want[rows]), f"adapter {j}"


@pytest.mark.gpu
def test_multi_adapter_captured_in_a_cuda_graph():
    """The server launcher reads no index on the host: captured once, replayed
    with other per-row adapters written into the same idx tensor."""
    dev = torch.device("cuda")
    x, w, ad0, ad1 = _setup(8, dev, M=37)
    a_n, b_n = [ad0[0], ad1[0]], [ad0[1], ad1[1]]
    idx = torch.full((37,), -1, dtype=torch.int64, device=dev)
    lora_linear_multi_fwd(x, w, idx, a_n, b_n, SCALES)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_linear_multi_fwd(x, w, idx, a_n, b_n, SCALES)
    for seed in range(3):
        idx.copy_(torch.randint(-1, 2, (37,), generator=torch.Generator().manual_seed(seed)).to(dev))
        graph.replay()
        assert bitwise_equal(out, lora_linear_multi_fwd(x, w, idx, a_n, b_n, SCALES)), seed


def test_lora_add_on_a_fused_projection_slice(device):
    """What a fused qkv layer does: base = columns of one wide matmul, a LoRA
    branch per slice.  Equals separate mode on the sliced weight, bit for bit."""
    x, w, ad0, _ = _setup(8, device, M=63)
    w_fused = torch.cat([torch.randn(40, K).to(device, w.dtype), w])  # [other | ours]
    base = matmul_fwd(x, w_fused)[:, 40:]
    assert bitwise_equal(lora_add_fwd(base, x, *ad0, 2.0), lora_linear_separate_fwd(x, w, *ad0, 2.0))


@pytest.mark.gpu
def test_gpu_real_sizes_multi_equals_separate_and_merge_matches_cpu():
    """K = 4096 takes the split schedule at small M and the fused one at large
    M: a gathered group of rows must still get its batch bits."""
    dev, bf = torch.device("cuda"), torch.bfloat16
    Kr, Nr, M = 4096, 1024, 600
    x = torch.randn(M, Kr).to(dev, bf)
    w = (torch.randn(Nr, Kr) / Kr**0.5).to(dev, bf)
    ads = [((torch.randn(rj, Kr) / Kr**0.5).to(dev, bf), (torch.randn(Nr, rj) / rj**0.5).to(dev, bf)) for rj in (16, 8, 64)]
    scales = [2.0, 0.5, 1 / 3]
    a_n, b_n = stack_adapters(ads)
    idx = torch.randint(-1, 3, (M,)).to(dev)
    idx[:5] = 1  # a group of 5 rows among hundreds
    out = lora_linear_multi_fwd(x, w, idx, a_n, b_n, scales)
    for j, (a, b) in enumerate(ads):
        rows = (idx == j).nonzero().squeeze(1)
        assert bitwise_equal(out[rows], lora_linear_separate_fwd(x, w, a, b, scales[j])[rows]), f"adapter {j}"
    assert bitwise_equal(out[:1], lora_linear_separate_fwd(x[:1], w, *ads[1], scales[1]))
    a, b = ads[0]
    assert bitwise_equal(lora_merge_fwd(w, a, b, 2.0).cpu(), lora_merge_fwd(w.cpu(), a.cpu(), b.cpu(), 2.0))


def _grads(fn, params, dy):
    for p in params:
        p.grad = None
    fn().backward(dy)
    return [p.grad for p in params]


@pytest.mark.parametrize("dtype,bound", [(torch.bfloat16, 1e-2), (torch.float32, 1e-6)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("mode", ["merged", "separate", "multi"])
def test_gradients_against_float64_autograd(device, dtype, bound, mode):
    """Relative error bound: bf16 1e-2 (measured ~3e-3 on the CPU: a few bf16
    roundings of 2^-9), fp32 1e-6 (measured ~2.5e-7)."""
    x, w, (a, b), (a1, b1) = _setup(3, device, dtype, M=63)
    s = SCALES[1]
    dy = torch.randn(63, N).to(device, dtype)
    xg = x.clone().requires_grad_()
    if mode == "multi":
        a_n, b_n = stack_adapters([(a, b), (a1, b1)])
        a_n, b_n = a_n.requires_grad_(), b_n.requires_grad_()
        idx = torch.randint(-1, 2, (63,)).to(device)
        got = _grads(lambda: lora_linear_multi(xg, w, idx, a_n, b_n, [s, 0.5]), [xg, a_n, b_n], dy)
        xd, a_d, b_d = (t.detach().double().requires_grad_() for t in (x, a_n, b_n))
        sel = idx.clamp(min=0)
        on = (idx >= 0).double()[:, None]
        sc = torch.tensor([s, 0.5], dtype=torch.float64, device=device)[sel][:, None]
        t = torch.einsum("mk,mrk->mr", xd, a_d[sel])
        ref = xd @ w.double().t() + on * sc * torch.einsum("mr,mnr->mn", t, b_d[sel])
        params_d = [xd, a_d, b_d]
    else:
        a, b = a.requires_grad_(), b.requires_grad_()
        if mode == "merged":
            got = _grads(lambda: matmul(xg, MergedLoRACache().weight(w, a, b, s)), [xg, a, b], dy)
        else:
            got = _grads(lambda: lora_linear_separate(xg, w, a, b, s), [xg, a, b], dy)
        params_d = [t.detach().double().requires_grad_() for t in (x, a, b)]
        ref = lora_linear_ref(params_d[0], w, params_d[1], params_d[2], s)
    ref.backward(dy.double())
    for name, g, gd in zip(("x", "A", "B"), got, params_d):
        assert g.dtype == dtype
        assert rel_err(g, gd.grad) < bound, f"d{name}: {rel_err(g, gd.grad):.2e}"
    assert w.grad is None


@pytest.mark.parametrize("mode", ["merged", "separate", "multi"])
def test_backward_is_deterministic_run_to_run(device, mode):
    x, w, (a, b), ad1 = _setup(8, device, M=63)
    dy = torch.randn(63, N).to(device, torch.bfloat16)
    a, b = a.requires_grad_(), b.requires_grad_()
    a_n, b_n = (t.requires_grad_() for t in stack_adapters([(a, b), ad1]))
    idx = torch.randint(-1, 2, (63,)).to(device)
    fn, params = {
        "merged": (lambda: matmul(x, lora_merge(w, a, b, 2.0)), [a, b]),
        "separate": (lambda: lora_linear_separate(x, w, a, b, 2.0), [a, b]),
        "multi": (lambda: lora_linear_multi(x, w, idx, a_n, b_n, SCALES), [a_n, b_n]),
    }[mode]
    first = [g.clone() for g in _grads(fn, params, dy)]
    second = _grads(fn, params, dy)
    assert all(bitwise_equal(p, q) for p, q in zip(first, second))


def test_merged_weight_routes_to_trainable_base(device):
    """A base weight that does require grad gets dW' (straight through)."""
    x, w, (a, b), _ = _setup(3, device, torch.float32, M=20)
    w = w.requires_grad_()
    dy = torch.randn(20, N).to(device)
    matmul(x, lora_merge(w, a, b, 2.0)).backward(dy)
    w_ref = w.detach().double().requires_grad_()
    (x.double() @ lora_merge_ref(w_ref, a, b, 2.0).t()).backward(dy.double())
    assert rel_err(w.grad, w_ref.grad) < 1e-5


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_cache_rebuilds_exactly_when_weights_change(device, foreach):
    x, w, (a, b), _ = _setup(8, device, M=20)
    a, b = torch.nn.Parameter(a), torch.nn.Parameter(b)
    cache = MergedLoRACache()
    opt = torch.optim.AdamW([a, b], lr=1e-2, foreach=foreach)
    for step in range(3):
        w_m = cache.weight(w, a, b, 2.0)
        assert cache.rebuilds == step + 1
        for _ in range(2):  # micro-batches in one step: no rebuild, and backward through it twice
            matmul(x, cache.weight(w, a, b, 2.0)).float().square().mean().backward()
            assert cache.rebuilds == step + 1
        with torch.no_grad():
            assert cache.weight(w, a, b, 2.0) is cache.weight(w, a, b, 2.0)
        assert bitwise_equal(w_m, lora_merge_fwd(w, a, b, 2.0))
        opt.step()
        opt.zero_grad()
        assert not bitwise_equal(lora_merge_fwd(w, a, b, 2.0), w_m)  # the step did change W'
    n = cache.rebuilds
    cache.weight(w, a, b, 4.0)
    assert cache.rebuilds == n + 1, "scale change"
    cache.weight(w.clone(), a, b, 4.0)
    assert cache.rebuilds == n + 2, "another base tensor"
    w2 = w.clone()
    cache.weight(w2, a, b, 4.0)
    with torch.no_grad():
        w2.mul_(2)
    assert bitwise_equal(cache.weight(w2, a, b, 4.0), lora_merge_fwd(w2, a, b, 4.0)) and cache.rebuilds == n + 4
    a.data.add_(1.0)  # invisible to _version: the documented escape hatch
    cache.invalidate()
    assert bitwise_equal(cache.weight(w2, a, b, 4.0), lora_merge_fwd(w2, a, b, 4.0))


def test_untrained_adapter_is_a_bitwise_no_op(device):
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(N, K).to(device, dtype)
        w[0, :7] = -0.0  # signed zeros must survive too
        w[1, :5] = 0.0
        assert bitwise_equal((w.float() + 0.0).to(dtype)[1:], w[1:])  # fp32 round trip of W is exact
        a, b = init_lora_weights(N, K, 8, seed=5, dtype=dtype, device=device)
        assert not a.eq(0).all() and b.eq(0).all()
        assert bitwise_equal(lora_merge_fwd(w, a, b, 2.0), w)
        assert bitwise_equal(MergedLoRACache().weight(w, a, b, 2.0), w)
        x = torch.randn(30, K).to(device, dtype)
        assert torch.equal(lora_linear_separate_fwd(x, w, a, b, 2.0), matmul_fwd(x, w))  # +0 vs -0 only


def test_init_is_seeded_and_bounded():
    a1, b1 = init_lora_weights(N, K, 8, seed=7, dtype=torch.float32)
    a2, _ = init_lora_weights(N, K, 8, seed=7, dtype=torch.float32)
    a3, _ = init_lora_weights(N, K, 8, seed=8, dtype=torch.float32)
    assert bitwise_equal(a1, a2) and not torch.equal(a1, a3)
    assert a1.abs().max() <= 1 / K**0.5 and a1.shape == (8, K) and b1.shape == (N, 8)
    m = LoRAAdapter(K, N, 8, 16, seed=7)
    assert m.scale == 2.0 and bitwise_equal(m.lora_A.data, a1.bfloat16())


def test_bad_input_is_named():
    x, w, (a, b), _ = _setup(3, "cpu", M=8)
    with pytest.raises(ValueError, match=r"lora_B has shape \(60, 4\), expected \(60, 3\)"):
        lora_linear_separate(x, w, a, torch.zeros(N, 4, dtype=w.dtype), 2.0)
    with pytest.raises(ValueError, match=r"lora_A has shape \(3, 99\)"):
        lora_merge(w, a[:, :99].contiguous(), b, 2.0)
    with pytest.raises(TypeError, match="lora_A has dtype float32; expected one of: bfloat16"):
        lora_merge(w, a.float(), b, 2.0)
    with pytest.raises(TypeError, match="x has dtype float32"):
        lora_linear_separate(x.float(), w, a, b, 2.0)
    with pytest.raises(ValueError, match="scale must be a finite"):
        lora_linear_separate(x, w, a, b, float("nan"))
    with pytest.raises(ValueError, match=r"x has K=100 but w has shape \(60, 99\)"):
        lora_linear_separate(x, w[:, :99].contiguous(), a[:, :99].contiguous(), b, 2.0)
    with pytest.raises(ValueError, match=r"base has shape \(7, 60\), expected \(8, 60\)"):
        lora_add_multi(torch.zeros(7, 60, dtype=x.dtype), x, torch.zeros(8, dtype=torch.long),
                       a[None], b[None], [1.0])
    with pytest.raises(ValueError, match=r"lora_B has shape \(60, 3\), expected \(59, 3\)"):
        lora_add(torch.zeros(8, 59, dtype=x.dtype), x, a, b, 1.0)
    a_n, b_n = stack_adapters([(a, b), (a, b)])
    for bad in (2, -2):
        idx = torch.tensor([0, 1, bad, 0, -1, 1, 0, 0])
        with pytest.raises(IndexError, match=f"adapter index {bad} out of range: 2 adapters"):
            lora_linear_multi(x, w, idx, a_n, b_n, [1.0, 1.0])
        # the server launcher reads nothing on the host (graph capture): such a row keeps the base
        got = lora_linear_multi_fwd(x, w, idx, a_n, b_n, [1.0, 1.0])
        assert bitwise_equal(got[2:3], matmul_fwd(x[2:3], w))
    with pytest.raises(ValueError, match="adapter 1: lora_A and lora_B must both be tensors or both None"):
        lora_linear_multi(x, w, torch.zeros(8, dtype=torch.long), [a, a], [b, None], [1.0, 1.0])
    with pytest.raises(ValueError, match=r"adapter 1: lora_B has shape \(60, 2\), expected \(60, 3\)"):
        lora_linear_multi(x, w, torch.zeros(8, dtype=torch.long), [a, a], [b, b[:, :2].contiguous()], [1.0, 1.0])
    with pytest.raises(TypeError, match="idx has dtype int32"):
        lora_linear_multi(x, w, torch.zeros(8, dtype=torch.int32), a_n, b_n, [1.0, 1.0])
    with pytest.raises(ValueError, match="idx has 7 entries, expected one per row of x"):
        lora_linear_multi(x, w, torch.zeros(7, dtype=torch.long), a_n, b_n, [1.0, 1.0])
    with pytest.raises(ValueError, match="scales has 1 entries"):
        lora_linear_multi(x, w, torch.zeros(8, dtype=torch.long), a_n, b_n, [1.0])
    with pytest.raises(ValueError, match="same rank r"):
        lora_linear_multi(x, w, torch.zeros(8, dtype=torch.long), a_n, b_n[:, :, :2].contiguous(), [1.0, 1.0])
    with pytest.raises(ValueError, match="adapter 1"):
        stack_adapters([(a, b), (a.float(), b.float())])


def _to_hf(name):  # "layers.3.q" -> "model.layers.3.self_attn.q_proj"
    _, i, p = name.split(".")
    return f"model.layers.{i}.self_attn.{p}_proj"


def _from_hf(name):
    parts = name.split(".")
    return f"layers.{parts[2]}.{parts[4].removesuffix('_proj')}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_peft_save_load_round_trip(tmp_path, dtype):
    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList(
        torch.nn.ModuleDict({p: LoRAAdapter(K, N, 8, 16, seed=10 * i + j, dtype=dtype) for j, p in enumerate("qv")})
        for i in range(2))
    adapters = collect_adapters(model)
    assert sorted(adapters) == ["layers.0.q", "layers.0.v", "layers.1.q", "layers.1.v"]
    for _, b in adapters.values():
        torch.nn.init.normal_(b)
    save_peft_adapter(tmp_path, adapters, LoRAConfig(r=8, lora_alpha=16, base_model_name_or_path="Qwen/Qwen3-0.6B"),
                      to_hf=_to_hf)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 8 and cfg["lora_alpha"] == 16
    assert cfg["target_modules"] == ["q_proj", "v_proj"]
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight" in keys and len(keys) == 8
    loaded, config = load_peft_adapter(tmp_path, from_hf=_from_hf)
    assert config.scale == 2.0 and config.base_model_name_or_path == "Qwen/Qwen3-0.6B"
    assert set(loaded) == set(adapters)
    for name, (a, b) in adapters.items():
        la, lb = loaded[name]
        assert la.dtype == dtype and torch.equal(la, a.detach()) and torch.equal(lb, b.detach())


def test_peft_load_refuses_what_it_cannot_serve(tmp_path):
    a, b = init_lora_weights(N, K, 4, seed=0, dtype=torch.float32)
    save_peft_adapter(tmp_path, {"m": (a, b)}, LoRAConfig(r=4, lora_alpha=8), to_hf=lambda n: "model.m")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="unsupported LoRA settings: use_dora=True"):
        load_peft_adapter(tmp_path)
    (tmp_path / "adapter_config.json").write_text(json.dumps({**cfg, "r": 5}))
    with pytest.raises(ValueError, match="config says r=5"):
        load_peft_adapter(tmp_path)
    with pytest.raises(ValueError, match="do not have rank r=8"):
        save_peft_adapter(tmp_path, {"m": (a, b)}, LoRAConfig(r=8, lora_alpha=8))
    (tmp_path / "adapter_model.safetensors").rename(tmp_path / "adapter_model.bin")
    with pytest.raises(ValueError, match="pickled adapters are refused"):
        load_peft_adapter(tmp_path)


def test_peft_library_reads_and_writes_the_same_layout(tmp_path):
    """Where peft is installed (the H200 image has it; CI does not)."""
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    pm = get_peft_model(Qwen3ForCausalLM(cfg), LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    for n, p in pm.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p)
    pm.save_pretrained(tmp_path / "theirs")
    ours, config = load_peft_adapter(tmp_path / "theirs")
    assert len(ours) == 4 and config.r == 8 and config.scale == 2.0
    theirs = dict(pm.named_parameters())
    for m, (a, b) in ours.items():
        assert torch.equal(a, theirs[f"base_model.model.{m}.lora_A.default.weight"])
        assert torch.equal(b, theirs[f"base_model.model.{m}.lora_B.default.weight"])
    q = pm.base_model.model.model.layers[1].self_attn.q_proj  # same orientation and scale as peft's forward
    x = torch.randn(5, 64)
    with torch.no_grad():
        a, b = ours["model.layers.1.self_attn.q_proj"]
        assert rel_err(lora_linear_separate_fwd(x, q.base_layer.weight, a, b, config.scale), q(x)) < 1e-6
    doubled = {m: (2 * a, 3 * b) for m, (a, b) in ours.items()}
    save_peft_adapter(tmp_path / "ours", doubled, LoRAConfig(r=8, lora_alpha=16))
    back = dict(PeftModel.from_pretrained(Qwen3ForCausalLM(cfg), tmp_path / "ours").named_parameters())
    for m, (a, b) in doubled.items():
        assert torch.equal(a, back[f"base_model.model.{m}.lora_A.default.weight"])
        assert torch.equal(b, back[f"base_model.model.{m}.lora_B.default.weight"])
