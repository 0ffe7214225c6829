"""RMSNorm (plain, fused residual-add, gated): bitwise promises, accuracy, gradients, parity
with transformers' rounding points, and bad input."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from interpreted import run_interpreted

from alignzoo.common.ladder import rel_err, rows_differing, rung1_repeat, rung2_rows
from alignzoo.common.rmsnorm import (
    rmsnorm,
    rmsnorm_bwd,
    rmsnorm_fwd,
    rmsnorm_gated,
    rmsnorm_gated_ref,
    rmsnorm_ref,
    rmsnorm_residual,
    rmsnorm_residual_ref,
)
from alignzoo.common.rmsnorm.cpu import row_tree_sum, silu

EPS = 1e-6
BF, F32 = torch.bfloat16, torch.float32
# ||out - ref|| / ||ref|| vs float64: bf16 output rounds twice (n, then n*w) -> ~2.5e-3 measured.
FWD_BOUND = {BF: 5e-3, F32: 1e-6}
GRAD_BOUND = {BF: 1e-2, F32: 1e-5}
VARIANTS = ["plain", "fused", "gated"]


def _inputs(M, H, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    res = 4 * torch.randn(M, H, generator=g)
    z = 2 * torch.randn(M, H, generator=g)
    w = 1 + 0.1 * torch.randn(H, generator=g)
    return [t.to(device, dtype) for t in (x, res, z, w)]


def _launch_configs(device):
    if device.type == "cuda":
        return [{}, {"block_rows": 1, "num_warps": 2}, {"block_rows": 8, "num_warps": 8}]
    return [{}, {"block_rows": 1}, {"block_rows": 7}]


def _fwd(variant):
    """(row tensors..., w) -> outputs, through the server's launcher."""
    if variant == "plain":
        return lambda x, w, **kw: rmsnorm_fwd(x, w, EPS, **kw)[0]
    if variant == "fused":
        return lambda x, r, w, **kw: rmsnorm_fwd(x, w, EPS, residual=r, **kw)[:2]
    return lambda x, z, w, **kw: rmsnorm_fwd(x, w, EPS, z=z, **kw)[0]


def _rows(variant, x, res, z):
    return {"plain": (x,), "fused": (x, res), "gated": (x, z)}[variant]


# ---------------------------------------------------------------- rungs 1 and 2


@pytest.mark.parametrize("H", [63, 128, 593, 1000, 4096], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_rung1_rung2(device, variant, H):
    x, res, z, w = _inputs(37, H, BF, device)
    fn = _fwd(variant)
    rows = _rows(variant, x, res, z)
    r1 = rung1_repeat("rmsnorm", fn, *rows, w)
    assert r1.passed, r1
    r2 = rung2_rows("rmsnorm", fn, rows, shared={"w": w}, configs=_launch_configs(device), batch_sizes=(1, 2, 3, 7, 36))
    assert r2.passed, r2.detail


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H", [100, 593, 1000, 4096], ids=lambda h: f"H{h}")
def test_fused_normed_equals_plain_of_new_residual(device, H, dtype):
    """The seeds' bug: an extra bf16 store changed tl.sum's layout and so its order."""
    x, res, _, w = _inputs(61, H, dtype, device)
    for cfg in _launch_configs(device):
        normed, new_res, rstd_f = rmsnorm_fwd(x, w, EPS, residual=res, **cfg)
        assert torch.equal(new_res, (x.float() + res.float()).to(dtype))
        y, _, rstd_p = rmsnorm_fwd(new_res, w, EPS)
        assert torch.equal(rstd_f, rstd_p)
        assert torch.equal(normed, y)
    normed, new_res = rmsnorm_residual(x, res, w, EPS)
    assert torch.equal(normed, rmsnorm(new_res, w, EPS))


def test_gated_norm_part_is_plain(device):
    """With z = 32: SiLU(z) = 32 exactly, so gated = 32 * plain, bit for bit."""
    x, _, _, w = _inputs(29, 128, BF, device)
    z = torch.full_like(x, 32.0)
    assert torch.equal(rmsnorm_gated(x, z, w, EPS), rmsnorm(x, w, EPS) * 32)


def test_leading_dims_and_empty(device):
    x, _, z, w = _inputs(3 * 5, 128, BF, device)
    flat = rmsnorm_gated(x, z, w, EPS)
    assert torch.equal(rmsnorm_gated(x.view(3, 5, 128), z.view(3, 5, 128), w, EPS), flat.view(3, 5, 128))
    assert torch.equal(rmsnorm(x[0], w, EPS), rmsnorm(x, w, EPS)[0])
    empty = x[:0]
    assert rmsnorm(empty, w, EPS).shape == (0, 128)
    _, _, rstd = rmsnorm_fwd(x.view(3, 5, 128), w, EPS)
    assert rstd.shape == (3, 5)


def test_bwd_deterministic_and_rows_invariant(device):
    x, res, z, w = _inputs(100, 593, BF, device)
    dy = torch.randn_like(x)

    def bwd(dy, x, z, w):
        return rmsnorm_bwd(dy, x, w, rmsnorm_fwd(x, w, EPS, z=z)[2], z=z)

    r1 = rung1_repeat("rmsnorm", bwd, dy, x, z, w)
    assert r1.passed, r1
    # dx and dz of a row depend on that row only (dw sums the batch, so is left out)
    r2 = rung2_rows("rmsnorm", lambda dy, x, z, w: bwd(dy, x, z, w)[:2], (dy, x, z), shared={"w": w})
    assert r2.passed, r2.detail


# ---------------------------------------------------------------- accuracy and gradients


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H", [100, 593, 1000], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_accuracy_vs_float64(device, variant, H, dtype):
    x, res, z, w = _inputs(63, H, dtype, device)
    if variant == "plain":
        pairs = [(rmsnorm(x, w, EPS), rmsnorm_ref(x, w, EPS))]
    elif variant == "fused":
        normed, new_res = rmsnorm_residual(x, res, w, EPS)
        ref_n, ref_s = rmsnorm_residual_ref(x, res, w, EPS)
        pairs = [(normed, ref_n), (new_res, ref_s)]
    else:
        pairs = [(rmsnorm_gated(x, z, w, EPS), rmsnorm_gated_ref(x, z, w, EPS))]
    for out, ref in pairs:
        assert out.dtype == dtype
        assert rel_err(out, ref) <= FWD_BOUND[dtype]


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("H", [100, 593], ids=lambda h: f"H{h}")
@pytest.mark.parametrize("variant", VARIANTS)
def test_gradients_vs_float64_autograd(device, variant, H, dtype):
    x, res, z, w = _inputs(37, H, dtype, device)
    leaves = {"plain": [x, w], "fused": [x, res, w], "gated": [x, z, w]}[variant]
    ours = [t.clone().requires_grad_() for t in leaves]
    refs = [t.detach().double().requires_grad_() for t in leaves]
    if variant == "plain":
        outs, routs = [rmsnorm(*ours, EPS)], [rmsnorm_ref(*refs, EPS)]
    elif variant == "fused":
        outs, routs = list(rmsnorm_residual(*ours, EPS)), list(rmsnorm_residual_ref(*refs, EPS))
    else:
        outs, routs = [rmsnorm_gated(*ours, EPS)], [rmsnorm_gated_ref(*refs, EPS)]
    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(o.shape, generator=g).to(device, dtype) for o in outs]
    torch.autograd.backward(outs, grads)
    torch.autograd.backward(routs, [d.double() for d in grads])
    for name, a, b in zip(["first", "second", "third"], ours, refs):
        assert a.grad.dtype == dtype
        err = rel_err(a.grad, b.grad)
        assert err <= GRAD_BOUND[dtype], f"{variant} grad of {name} input: rel err {err:.2e}"


# ---------------------------------------------------------------- transformers' rounding points


def _exactly_summable(M, H, seed=0):
    """bf16 multiples of 1/8 in [-15/8, 15/8]: every partial sum of squares is a
    multiple of 1/64 below 2^24/64, so any summation order gives the same fp32."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(-15, 16, (M, H), generator=g).float() / 8).to(BF)


@pytest.mark.parametrize("H", [100, 593, 4096], ids=lambda h: f"H{h}")
def test_matches_transformers_bitwise_when_sum_is_exact(H, monkeypatch):
    """With the row sum exact in any order, only the rounding points are left:
    ours must equal Qwen3RMSNorm / Qwen3_5MoeRMSNormGated bit for bit (CPU)."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeRMSNormGated

    x, r = _exactly_summable(37, H), _exactly_summable(37, H, seed=1)
    _, _, z, w = _inputs(37, H, BF, torch.device("cpu"))
    hf = Qwen3RMSNorm(H, EPS).to(BF)
    hf.weight.data.copy_(w)
    hf_gated = Qwen3_5MoeRMSNormGated(H, EPS).to(BF)
    hf_gated.weight.data.copy_(w)
    with torch.no_grad():
        assert torch.equal(rmsnorm(x, w, EPS), hf(x))
        normed, new_res = rmsnorm_residual(x, r, w, EPS)
        assert torch.equal(new_res, r + x)  # the decoder layer's `residual + hidden_states`
        assert torch.equal(normed, hf(r + x))
        # F.silu on the CPU differs from exp-based SiLU in the last fp32 bit now and then
        monkeypatch.setattr(F, "silu", lambda t, inplace=False: silu(t))
        assert torch.equal(rmsnorm_gated(x, z, w, EPS), hf_gated(x, z))


@pytest.mark.parametrize("H", [593, 4096], ids=lambda h: f"H{h}")
def test_close_to_transformers_on_random_rows(H):
    """Random rows: only the sum order differs from torch's mean, which moves rstd
    by an ulp now and then; a bf16 output flips by one ulp in < 1e-4 of elements."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    x, _, _, w = _inputs(64, H, BF, torch.device("cpu"))
    hf = Qwen3RMSNorm(H, EPS).to(BF)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        ours, ref = rmsnorm(x, w, EPS), hf(x)
    diff = (ours.float() - ref.float()).abs()
    assert (diff > 0).float().mean().item() <= 1e-4
    assert (diff <= ref.float().abs() * 2**-7).all()


# ---------------------------------------------------------------- cross-device (documents the order)


@pytest.mark.gpu
@pytest.mark.parametrize("H", [100, 1000, 4096], ids=lambda h: f"H{h}")
def test_cuda_and_cpu_add_in_the_same_order(H):
    """Not a contract (trainer and server share a device), but the documented
    order is the same on both devices and plain/fused use no exp or FMA, so the
    bits should agree; a failure here means kernel.py's order is not cpu.py's."""
    x, res, _, w = _inputs(300, H, BF, torch.device("cpu"))
    dy = torch.randn_like(x)
    cpu = rmsnorm_fwd(x, w, EPS, residual=res)
    gpu = rmsnorm_fwd(x.cuda(), w.cuda(), EPS, residual=res.cuda())
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())
    # backward of the fused variant: dx (+ dres) and the two-level dw order
    cpu_b = rmsnorm_bwd(dy, cpu[1], w, cpu[2], dres=dy)
    gpu_b = rmsnorm_bwd(dy.cuda(), gpu[1], w.cuda(), gpu[2], dres=dy.cuda())
    for a, b in zip(cpu_b, gpu_b):
        assert a is None or torch.equal(a, b.cpu())


_INTERPRETED_ORDER = """
import torch
from alignzoo.common.rmsnorm.cpu import rmsnorm_bwd_cpu, rmsnorm_fwd_cpu
from alignzoo.common.rmsnorm.kernel import rmsnorm_bwd_triton, rmsnorm_fwd_triton
g = torch.Generator().manual_seed(0)
for H in (100, 1000, 4097):
    x, r, dy = (torch.randn(7, H, generator=g) * 3 for _ in range(3))
    w = torch.randn(H, generator=g)
    fwd = rmsnorm_fwd_triton(x, w, 1e-6, r)
    assert all(torch.equal(a, b) for a, b in zip(fwd, rmsnorm_fwd_cpu(x, w, 1e-6, r))), H
    bwd = rmsnorm_bwd_triton(dy, fwd[1], w, fwd[2], dres=dy)
    ref = rmsnorm_bwd_cpu(dy, fwd[1], w, fwd[2], dres=dy)
    assert all(a is None or torch.equal(a, b) for a, b in zip(bwd, ref)), H
"""


def test_triton_kernels_add_in_the_cpu_order_interpreted():
    """The Triton kernels' source, run by Triton's interpreter on the CPU in
    fp32 (its bf16 casts are not the GPU's), gives the CPU path's bits,
    forward and backward, at widths of one chunk and of several (256-lane
    chunks, a padded last one): the row tree's order in kernel.py is cpu.py's
    in CI too, not only on the GPU (``test_cuda_and_cpu_add_in_the_same_order``)."""
    run_interpreted(_INTERPRETED_ORDER)


# ---------------------------------------------------------------- the checks can fail


def _bad_plain(x, w, **_):
    """Batch-dependent reduction: torch's sum for small batches, the tree otherwise."""
    xf = x.float()
    ss = xf.pow(2).sum(-1) if x.shape[0] < 8 else row_tree_sum(xf * xf)
    n = (xf * torch.rsqrt(ss / x.shape[1] + EPS)[:, None]).to(x.dtype)
    return (n.float() * w.float()).to(x.dtype)


def test_rung2_catches_a_batch_dependent_reduction():
    x, _, _, w = _inputs(37, 1000, F32, torch.device("cpu"))
    assert rung2_rows("rmsnorm", _fwd("plain"), (x,), shared={"w": w}).passed
    r2 = rung2_rows("rmsnorm", _bad_plain, (x,), shared={"w": w})
    assert not r2.passed and r2.differing > 0


def test_fused_check_catches_a_different_order():
    """A fused variant whose sum runs left to right (the seeds' layout change)."""
    x, res, _, w = _inputs(61, 1000, F32, torch.device("cpu"))
    s = x + res
    sf = s.float()
    ss = torch.zeros(s.shape[0])
    for j in range(s.shape[1]):
        ss = ss + sf[:, j] * sf[:, j]
    bad = (sf * torch.rsqrt(ss / s.shape[1] + EPS)[:, None]) * w
    assert rows_differing(bad, rmsnorm(s, w, EPS)).any()


# ---------------------------------------------------------------- bad input


def test_bad_input():
    x, res, z, w = _inputs(4, 64, BF, torch.device("cpu"))
    with pytest.raises(TypeError, match="x has dtype float16"):
        rmsnorm(x.half(), w)
    with pytest.raises(TypeError, match="w has dtype float16"):
        rmsnorm(x, w.half())  # x's dtype, or fp32 (DeepSeek-V4's norms)
    with pytest.raises(ValueError, match="w must have shape \\(64,\\)"):
        rmsnorm(x, w[:63])
    with pytest.raises(ValueError, match="w must have 1 dimensions"):
        rmsnorm(x, w[None])
    with pytest.raises(ValueError, match="x must be contiguous"):
        rmsnorm(x.t(), w[:4])
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rmsnorm(x.tolist(), w)
    with pytest.raises(ValueError, match="residual must have the shape of x"):
        rmsnorm_residual(x, res[:3], w)
    with pytest.raises(TypeError, match="z has dtype float32"):
        rmsnorm_gated(x, z.float(), w)
    with pytest.raises(ValueError, match="eps must be a finite real number >= 0"):
        rmsnorm(x, w, -1e-6)
    with pytest.raises(ValueError, match="eps must be a finite real number >= 0"):
        rmsnorm(x, w, float("nan"))
    with pytest.raises(ValueError, match="above the supported maximum"):
        rmsnorm(torch.zeros(1, 40000, dtype=BF), torch.zeros(40000, dtype=BF))
    with pytest.raises(ValueError, match="H >= 1"):
        rmsnorm(torch.zeros(3, 0, dtype=BF), torch.zeros(0, dtype=BF))


# ---------------------------------------------------------------- DeepSeek-V4's two norms


@pytest.mark.parametrize("H", [100, 512, 4096], ids=lambda h: f"H{h}")
def test_deepseek_v4_norms_match_transformers_bitwise_when_sum_is_exact(H):
    """With the row sum exact, ours equals DeepseekV4RMSNorm (fp32 weight, bf16 rows: one rounding) and
    DeepseekV4UnweightedRMSNorm (dtype(x * dtype(rstd))) bit for bit; the rows are batch-invariant."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RMSNorm, DeepseekV4UnweightedRMSNorm

    from alignzoo.common.rmsnorm import rmsnorm_unweighted

    x = _exactly_summable(37, H)
    w = torch.randn(H, generator=torch.Generator().manual_seed(H))
    hf = DeepseekV4RMSNorm(H, EPS)
    hf.weight.data.copy_(w)
    with torch.no_grad():
        y = rmsnorm(x, w, EPS)
        assert y.dtype == BF and torch.equal(y, hf(x))
        assert not torch.equal(y, rmsnorm(x, w.to(BF), EPS))  # the Qwen rounding points differ
        u = rmsnorm_unweighted(x, EPS)
        assert torch.equal(u, DeepseekV4UnweightedRMSNorm(EPS)(x))
        assert torch.equal(u[5:6], rmsnorm_unweighted(x[5:6], EPS)) and torch.equal(y[5:6], rmsnorm(x[5:6], w, EPS))


def test_deepseek_v4_norm_gradients_vs_float64():
    """dx of both norms and the fp32 dw against float64 autograd of the same formulas."""
    from alignzoo.common.rmsnorm import rmsnorm_unweighted

    g = torch.Generator().manual_seed(3)
    x = torch.randn(63, 100, generator=g)
    w = torch.randn(100, generator=g)
    dy = torch.randn(63, 100, generator=g)
    for fn, ref, args in ((rmsnorm, lambda a, b: a * torch.rsqrt(a.square().mean(-1, keepdim=True) + EPS) * b, (w,)),
                          (rmsnorm_unweighted, lambda a: a * torch.rsqrt(a.square().mean(-1, keepdim=True) + EPS), ())):
        xs = [x.clone().requires_grad_()] + [a.clone().requires_grad_() for a in args]
        fn(xs[0], *xs[1:], EPS).backward(dy)
        x64 = [t.detach().double().requires_grad_() for t in xs]
        ref(*x64).backward(dy.double())
        for ours, theirs in zip(xs, x64):
            assert ours.grad.dtype == torch.float32
            assert ((ours.grad.double() - theirs.grad).norm() / theirs.grad.norm()).item() < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("H", [512, 4096], ids=lambda h: f"H{h}")
def test_deepseek_v4_norms_cuda_equal_cpu(H):
    """The kernel's ROUND_N / HAS_W modes: the CPU bits on the GPU, forward and backward."""
    from alignzoo.common.rmsnorm import rmsnorm_unweighted

    x, _, _, _ = _inputs(300, H, BF, torch.device("cpu"))
    w = torch.randn(H)
    dy = torch.randn_like(x)
    for fn, args in ((rmsnorm, (w,)), (rmsnorm_unweighted, ())):
        xs = [x.clone().requires_grad_()] + [a.clone().requires_grad_() for a in args]
        xg = [t.detach().cuda().requires_grad_() for t in xs]
        yc, yg = fn(xs[0], *xs[1:], EPS), fn(xg[0], *xg[1:], EPS)
        assert torch.equal(yc, yg.cpu())
        yc.backward(dy)
        yg.backward(dy.cuda())
        for a, b in zip(xs, xg):
            assert torch.equal(a.grad, b.grad.cpu())
