"""FP8: quantizers (HF layout, rounding, error bound), the block-scaled GEMM's
rungs 1-2 (bitwise), accuracy vs float64, STE gradients, the weight cache, bad input."""
import pytest
import torch

from alignzoo.common.fp8 import (
    AMAX_FLOOR,
    Fp8WeightCache,
    dequantize_weight_fp8,
    e4m3_round_ref,
    fp8_linear,
    fp8_linear_ref,
    fp8_matmul,
    fp8_matmul_bwd,
    fp8_matmul_fwd,
    fp8_matmul_ref,
    quantize_act_fp8,
    quantize_weight_fp8,
)
from alignzoo.common.fp8.checks import launch_configs
from alignzoo.common.fp8.cpu import fp8_gemm_cpu
from alignzoo.common.fp8.quant import FP8_DTYPE, expand_weight_scale
from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows

E4M3 = torch.float8_e4m3fn
WEIGHT_SHAPES = [pytest.param(300, 200, id="N300-K200"), pytest.param(129, 1000, id="N129-K1000"),
                 pytest.param(128, 128, id="N128-K128"), pytest.param(1, 5, id="N1-K5")]


def _weight(N, K, device):
    return (torch.randn(N, K) / K**0.5).to(device)


def _cdiv(a, b):
    return -(-a // b)


@pytest.mark.parametrize("N,K", WEIGHT_SHAPES)
def test_weight_roundtrip_error_bound_and_hf_layout(device, N, K):
    """Per element |deq - w| <= 2^-4 |w| + 2^-10 s (half an e4m3 ulp for normals,
    half the 2^-9 subnormal step below 2^-6; quant.py), plus 2^-22 |w| for the
    fp32 division and product.  So a block's relative error norm is <= 2^-4
    unless the block is mostly tiny subnormal values: 2^-3 holds with room."""
    w = _weight(N, K, device)
    w[0, 0] = 0.0
    codes, s = quantize_weight_fp8(w)
    assert codes.dtype == E4M3 and codes.shape == (N, K) and codes.device == w.device
    assert s.dtype == torch.float32 and s.shape == (_cdiv(N, 128), _cdiv(K, 128))
    deq = dequantize_weight_fp8(codes, s).double()
    w64, s_el = w.double(), expand_weight_scale(s, N, K).double()
    assert ((deq - w64).abs() <= (2**-4 + 2**-22) * w64.abs() + 2**-10 * (1 + 2**-20) * s_el).all()
    NB, KB = s.shape
    for i in range(NB):
        for j in range(KB):
            blk = (slice(128 * i, 128 * i + 128), slice(128 * j, 128 * j + 128))
            assert (deq[blk] - w64[blk]).norm() <= 2**-3 * w64[blk].norm()
            # the block's amax element lands on ±448: the scale uses the whole range
            assert codes[blk].float().abs().max() == 448.0
    assert (deq == 0).sum() >= 1 and deq[0, 0] == 0  # zeros stay exact
    assert bitwise_equal(dequantize_weight_fp8(codes, s, torch.bfloat16), deq.float().bfloat16())


def test_zero_block_gets_the_floor_scale(device):
    w = _weight(200, 300, device)
    w[128:, :128] = 0.0  # block (1, 0) all zero
    codes, s = quantize_weight_fp8(w)
    floor = torch.tensor(AMAX_FLOOR, dtype=torch.float32) / torch.tensor(448.0)
    assert bitwise_equal(s[1, 0].cpu(), floor)
    assert (codes[128:, :128].float() == 0).all()
    assert (dequantize_weight_fp8(codes, s)[128:, :128] == 0).all()


def test_codes_are_round_to_nearest_even_on_the_e4m3_grid():
    """A block whose amax is 448 has s = 1 exactly, so its codes are e4m3(w):
    fill blocks with grid midpoints (ties) and random values, compare with a
    brute-force float64 RNE that does not use torch's cast."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3).float()
    grid = grid[~grid.isnan()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact in fp32 (<= 5 significant bits)
    vals = torch.cat([mids, grid, torch.randn(40000) * 30, torch.rand(4000) * 2**-6])
    vals = vals[torch.randperm(len(vals))]
    B = _cdiv(len(vals), 128 * 128)
    w = vals.repeat(2)[: 128 * 128 * B].view(128, 128 * B)  # one row of B blocks
    w[0, ::128] = 448.0  # every block's amax: s = 448 / 448 = 1
    codes, s = quantize_weight_fp8(w)
    assert (s == 1.0).all()
    assert torch.equal(codes.double(), e4m3_round_ref(w))
    assert len(mids) > 200 and (codes.double() != w.double()).sum() > 0


@pytest.mark.parametrize("M,K", [pytest.param(333, 1000, id="M333-K1000"), pytest.param(7, 128, id="M7-K128")])
def test_act_quant_is_per_token_and_row_local(device, M, K):
    x = torch.randn(M, K).to(device, torch.bfloat16)
    x[3] *= 1000.0  # an outlier row must not move the others' scales
    codes, scales = quantize_act_fp8(x)
    assert codes.dtype == E4M3 and codes.shape == (M, K)
    assert scales.dtype == torch.float32 and scales.shape == (M, _cdiv(K, 128))
    for i in (0, 3, M - 1):
        c1, s1 = quantize_act_fp8(x[i : i + 1])
        assert bitwise_equal(c1, codes[i : i + 1]) and bitwise_equal(s1, scales[i : i + 1])
    r = rung2_rows("act quant", quantize_act_fp8, (x,))
    assert r.passed, r.detail
    c3, s3 = quantize_act_fp8(x.view(M, 1, K))  # leading dims are kept
    assert c3.shape == (M, 1, K) and s3.shape == (M, 1, scales.shape[1])


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", WEIGHT_SHAPES)
def test_gpu_quantizers_give_the_cpu_bytes(N, K):
    """Trainer and server read one set of bytes; they may come from either device."""
    w = _weight(N, K, torch.device("cpu")) * 3
    x = torch.randn(77, K).bfloat16()
    for a, b in zip(quantize_weight_fp8(w.cuda()), quantize_weight_fp8(w)):
        assert bitwise_equal(a.cpu(), b)
    for a, b in zip(quantize_act_fp8(x.cuda()), quantize_act_fp8(x)):
        assert bitwise_equal(a.cpu(), b)


def test_transformers_dequantizes_our_layout_to_the_same_bits():
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    deq = getattr(fp8, "_dequantize_fp8_weight", None)
    if deq is None:
        pytest.skip("transformers has no _dequantize_fp8_weight")
    for N, K in ((300, 200), (129, 1000)):
        codes, s = quantize_weight_fp8(_weight(N, K, torch.device("cpu")))
        assert bitwise_equal(deq(codes, s, [128, 128], torch.float32), dequantize_weight_fp8(codes, s))


def test_safetensors_roundtrip_keeps_the_bytes(tmp_path):
    from safetensors.torch import load_file, save_file

    codes, s = quantize_weight_fp8(_weight(129, 1000, torch.device("cpu")))
    name = "model.layers.0.mlp.down_proj"
    path = tmp_path / "model.safetensors"
    save_file({f"{name}.weight": codes, f"{name}.weight_scale_inv": s}, str(path))
    back = load_file(str(path))
    assert back[f"{name}.weight"].dtype == E4M3 and back[f"{name}.weight_scale_inv"].dtype == torch.float32
    assert torch.equal(back[f"{name}.weight"].view(torch.uint8), codes.view(torch.uint8))
    assert bitwise_equal(back[f"{name}.weight_scale_inv"], s)
    x = torch.randn(5, 1000).bfloat16()
    assert bitwise_equal(fp8_matmul_fwd(x, back[f"{name}.weight"], back[f"{name}.weight_scale_inv"]),
                         fp8_matmul_fwd(x, codes, s))


def test_cpu_block_dot_is_exact_in_any_order():
    """cpu.py's claim: a 128-long float64 sum of e4m3 products never rounds, so
    BLAS's mm, a left-to-right loop and a right-to-left loop agree bit for bit."""
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(0, 256, (2, 37, 128), generator=g, dtype=torch.int32).to(torch.uint8)
    bits[(bits & 0x7F) == 0x7F] = 0x7E  # no NaN codes; ±448 kept
    a, b = bits.view(E4M3).double()
    mm = a @ b.t()
    fwd = torch.zeros(37, 37, dtype=torch.float64)
    rev = torch.zeros(37, 37, dtype=torch.float64)
    for k in range(128):
        fwd += a[:, k : k + 1] * b[:, k].unsqueeze(0)
        rev += a[:, 127 - k : 128 - k] * b[:, 127 - k].unsqueeze(0)
    exact = ((a * 512).long() @ (b * 512).long().t()).double() / 2**18  # integers: exact
    assert torch.equal(mm, fwd) and torch.equal(mm, rev) and torch.equal(mm, exact)


GEMM_SHAPES = [  # (K, N): K and N off the 128 grid, K = 128 (one block), K past 8 blocks
    pytest.param(1000, 300, id="K1000-N300"),
    pytest.param(128, 129, id="K128-N129"),
    pytest.param(1100, 65, id="K1100-N65"),
]


@pytest.mark.parametrize("K,N", GEMM_SHAPES)
def test_gemm_rows_invariant_to_batch_and_order(device, K, N):
    x = torch.randn(333, K).to(device, torch.bfloat16)
    x[17] *= 300.0  # an outlier row: its scale must stay its own
    codes, s = quantize_weight_fp8(_weight(N, K, device))
    full = fp8_matmul_fwd(x, codes, s)
    assert bitwise_equal(fp8_matmul_fwd(x, codes, s), full)  # run to run
    assert torch.equal(fp8_matmul_fwd(x.flip(0), codes, s), full.flip(0))
    g = torch.Generator().manual_seed(0)
    for M in (1, 7, 64, 333):
        idx = torch.randperm(333, generator=g)[:M].to(device)
        assert torch.equal(fp8_matmul_fwd(x[idx], codes, s), full[idx]), f"M={M}"
        assert torch.equal(fp8_matmul_fwd(x[:M], codes, s), full[:M]), f"M={M} (head rows)"
    for i in (0, 17, 332):  # a row alone
        assert torch.equal(fp8_matmul_fwd(x[i : i + 1], codes, s), full[i : i + 1])
    r = rung2_rows("fp8", fp8_matmul_fwd, (x[:64],), shared={"w_codes": codes, "w_scale_inv": s},
                   configs=launch_configs(device), batch_sizes=(1, 2, 7, 63))
    assert r.passed, r.detail


@pytest.mark.gpu
@pytest.mark.parametrize("N,K", [(4096, 4096), (1000, 4000), (12288, 4096)], ids=str)
def test_gpu_every_m_gives_the_same_rows(N, K):
    dev = torch.device("cuda")
    x = torch.randn(8192, K, device=dev).bfloat16()
    codes, s = quantize_weight_fp8(_weight(N, K, dev))
    ref = fp8_matmul_fwd(x, codes, s)
    for M in (1, 3, 8, 64, 65, 127, 256, 1024, 4096):
        assert torch.equal(fp8_matmul_fwd(x[:M], codes, s), ref[:M]), f"M={M}"
        assert torch.equal(fp8_matmul_fwd(x[-M:], codes, s), ref[-M:]), f"M={M} (tail rows)"
    for cfg in launch_configs(dev)[1:]:
        assert torch.equal(fp8_matmul_fwd(x[:300], codes, s, **cfg), ref[:300]), cfg


def test_check_catches_a_per_tensor_activation_scale():
    """Per-tensor activation scaling (amax over the whole batch) ties every row
    to the batch's largest value: rung 2 must flag it, and pass the per-token one."""
    x = torch.randn(40, 300).bfloat16()
    x[5] *= 50.0
    codes, s = quantize_weight_fp8(_weight(70, 300, torch.device("cpu")))

    def per_tensor(x, w_codes, w_scale_inv):
        amax = x.float().abs().amax()
        scale = amax / torch.tensor(448.0)
        xq = (x.float() / scale).clamp(-448, 448).to(FP8_DTYPE)
        xs = scale.expand(x.shape[0], w_scale_inv.shape[1]).contiguous()
        return fp8_gemm_cpu(xq, xs, w_codes, w_scale_inv, x.dtype)

    shared = {"w_codes": codes, "w_scale_inv": s}
    bad = rung2_rows("bad", per_tensor, (x,), shared=shared)
    assert not bad.passed and bad.differing > 0
    assert rung2_rows("fp8", fp8_matmul_fwd, (x,), shared=shared).passed


def _accuracy_bound(device, dtype):
    if dtype == torch.bfloat16:
        return 5e-3  # one bf16 output rounding, 2^-9 relative at most
    # fp32 out: CPU rounds the exact block dot once (~KB * 2^-24); Hopper's fp8
    # accumulator keeps ~22 bits inside each 128-block (DeepSeek-V3 §3.3.2)
    return 1e-6 if device.type == "cpu" else 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_accuracy_against_float64(device, dtype):
    x = torch.randn(50, 1000).to(device, dtype)
    w = _weight(300, 1000, device)
    codes, s = quantize_weight_fp8(w)
    y = fp8_matmul_fwd(x, codes, s)
    assert y.dtype == dtype and y.shape == (50, 300)
    assert rel_err(y, fp8_matmul_ref(x, codes, s)) < _accuracy_bound(device, dtype)
    # the quantization's own error: e4m3 keeps 2^-4 per element (measured ~0.04)
    assert rel_err(y, x.double() @ w.double().t()) < 0.1


def test_gradients_against_float64_autograd(device):
    """STE: dX = dY · dequant(W), dW_master = dYᵀ · X (fp8_linear_ref's autograd)."""
    K, N = 200, 129
    x = torch.randn(3, 11, K).to(device, torch.bfloat16).requires_grad_()
    master = torch.nn.Parameter(_weight(N, K, device))
    codes, s = quantize_weight_fp8(master)
    dy = torch.randn(3, 11, N).to(device, torch.bfloat16)
    fp8_linear(x, master, codes, s).backward(dy)
    assert master.grad.dtype == torch.float32 and master.grad.shape == (N, K)

    xd = x.detach().reshape(33, K).requires_grad_()
    md = master.detach().clone().requires_grad_()
    y_ref = fp8_linear_ref(xd, md, codes, s)
    assert torch.equal(y_ref, fp8_matmul_ref(xd, codes, s))
    y_ref.backward(dy.reshape(33, N).double())
    # bf16: dequantized weight and the matmul output each round once (2^-9)
    assert rel_err(x.grad.reshape(33, K), xd.grad) < 1e-2
    assert rel_err(master.grad, md.grad) < 1e-2

    x.grad = None  # a frozen FP8 weight: gradient to x only, the same bits
    fp8_matmul(x, codes, s).backward(dy)
    dx, _ = fp8_matmul_bwd(x.detach().reshape(33, K), codes, s, dy.reshape(33, N), need_dw=False)
    assert torch.equal(x.grad.reshape(33, K), dx)


def test_backward_is_deterministic_and_dx_rows_invariant(device):
    x = torch.randn(45, 300).to(device, torch.bfloat16)
    codes, s = quantize_weight_fp8(_weight(70, 300, device))
    dy = torch.randn(45, 70).to(device, torch.bfloat16)
    assert rung1_repeat("fp8 bwd", fp8_matmul_bwd, x, codes, s, dy).passed
    r = rung2_rows("fp8 dx", lambda dy, x: fp8_matmul_bwd(x, codes, s, dy, need_dw=False)[0], (dy, x))
    assert r.passed, r.detail


def test_weight_cache_requantizes_once_per_in_place_update(device):
    master = torch.nn.Parameter(_weight(129, 200, device))
    cache = Fp8WeightCache(master)
    c0, s0 = cache.get()
    assert cache.get()[0] is c0 and cache.quantizations == 1
    x = torch.randn(9, 200).to(device, torch.bfloat16)
    opt = torch.optim.Adam([master], lr=1e-2)
    for step in range(2):
        cache.linear(x).float().square().sum().backward()
        opt.step()  # several in-place ops on master, one requantization
        opt.zero_grad()
        c1, s1 = cache.get()
        cache.get()
        assert cache.quantizations == 2 + step
        ref = quantize_weight_fp8(master)
        assert bitwise_equal(c1, ref[0]) and bitwise_equal(s1, ref[1])
    assert not bitwise_equal(c1, c0)
    with torch.no_grad():
        master.copy_(master * 2)  # e.g. a weight load
    cache.get()
    assert cache.quantizations == 4
    with torch.no_grad():
        master.data.mul_(0.5)  # .data has its own version counter: invisible ...
    assert cache.get()[0] is cache.get()[0] and cache.quantizations == 4
    cache.invalidate()  # ... until invalidated
    assert bitwise_equal(cache.get()[0], quantize_weight_fp8(master)[0]) and cache.quantizations == 5


def test_weight_cache_follows_a_fused_optimizer_through_its_hook(device):
    """fused=True optimizers update params without bumping ``_version``."""
    master = torch.nn.Parameter(_weight(129, 200, device))
    cache = Fp8WeightCache(master)
    opt = torch.optim.Adam([master], lr=1e-2, fused=True)
    x = torch.randn(9, 200).to(device, torch.bfloat16)
    cache.linear(x).float().sum().backward()
    opt.step()
    if device.type == "cpu":  # measured on torch 2.13 CPU: the step goes unseen
        assert cache.get()[0] is cache.get()[0] and cache.quantizations == 1
        assert not bitwise_equal(cache.get()[0], quantize_weight_fp8(master)[0])
    q0 = cache.quantizations
    cache.invalidate_after(opt)
    for step in range(2):
        cache.linear(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
        cache.get()
        cache.get()
        assert cache.quantizations == q0 + 1 + step
        assert bitwise_equal(cache.get()[0], quantize_weight_fp8(master)[0])


def test_bad_input_is_named():
    x = torch.randn(4, 200).bfloat16()
    codes, s = quantize_weight_fp8(_weight(129, 200, torch.device("cpu")))
    with pytest.raises(TypeError, match="w_codes has dtype bfloat16"):
        fp8_matmul(x, codes.bfloat16(), s)
    with pytest.raises(TypeError, match="w_scale_inv has dtype bfloat16"):
        fp8_matmul(x, codes, s.bfloat16())
    with pytest.raises(ValueError, match=r"w_scale_inv has shape \(2, 1\); codes of shape \(129, 200\) need \(2, 2\)"):
        fp8_matmul(x, codes, s[:, :1].contiguous())
    with pytest.raises(ValueError, match="x has K=199 but w_codes has shape"):
        fp8_matmul(torch.randn(4, 199).bfloat16(), codes, s)
    with pytest.raises(TypeError, match="x has dtype int64"):
        fp8_matmul(torch.ones(4, 200, dtype=torch.long), codes, s)
    with pytest.raises(ValueError, match=r"master_w has shape \(128, 200\)"):
        fp8_linear(x, torch.zeros(128, 200), codes, s)
    with pytest.raises(ValueError, match="w must have 2 dimensions"):
        quantize_weight_fp8(torch.randn(200))
    with pytest.raises(TypeError, match="w has dtype float16"):
        quantize_weight_fp8(torch.randn(3, 4).half())
    with pytest.raises(TypeError, match="dtype must be bfloat16 or float32"):
        dequantize_weight_fp8(codes, s, torch.float16)


def test_weight_quantizer_takes_a_stack():
    """quantize_weight / dequantize_weight on a (3, N, K) stack: each matrix's own codes, scales and
    weights, bit for bit (ragged and whole blocks, an all-zero block, a block of one large value)."""
    from alignzoo.common.fp8.quant import dequantize_weight, quantize_weight

    from alignzoo.common.fp8.quant import expand_weight_scale

    for N, K in ((200, 300), (256, 384)):  # ragged blocks (the scales expanded), whole ones (broadcast)
        w = torch.randn(3, N, K, generator=torch.Generator().manual_seed(4))
        w[1, :128, 128:256] = 0
        w[2, 150, 290] = 1e6
        codes, scales = quantize_weight(w)
        assert codes.shape == (3, N, K) and scales.shape == (3, -(-N // 128), -(-K // 128))
        deq = dequantize_weight(codes, scales, torch.bfloat16)
        for i in range(3):
            c, s = quantize_weight(w[i])
            assert bitwise_equal(codes[i].view(torch.uint8), c.view(torch.uint8)) and bitwise_equal(scales[i], s)
            assert bitwise_equal(deq[i], dequantize_weight(c, s, torch.bfloat16))
            assert bitwise_equal(deq[i], (c.float() * expand_weight_scale(s, N, K)).bfloat16())
