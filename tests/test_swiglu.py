"""SwiGLU: bitwise promises, one rounding, DeepSeek-V4's clamp, accuracy, gradients, bad input."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from alignzoo.common.ladder import rel_err, rung1_repeat, rung2_rows
from alignzoo.common.swiglu import swiglu, swiglu_bwd, swiglu_fwd, swiglu_gate_up, swiglu_ref

BF, F32 = torch.bfloat16, torch.float32
# ||out - ref|| / ||ref|| vs float64: one bf16 rounding -> ~1.7e-3 measured.
FWD_BOUND = {BF: 4e-3, F32: 1e-6}
GRAD_BOUND = {BF: 1e-2, F32: 1e-5}
LIMITS = [None, 10.0, 2.3]  # 10.0: DeepSeek-V4's swiglu_limit; 2.3: not a bf16 value


def _gate_up(M, I, dtype, device, scale=4.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(M, 2 * I, generator=g)).to(device, dtype)


def _launch_configs(device):
    if device.type == "cuda":
        return [{}, {"block_rows": 1, "block_cols": 64, "num_warps": 1}, {"block_rows": 8, "block_cols": 1024, "num_warps": 8}]
    return [{}, {"block_rows": 1}, {"block_rows": 7}]


def _packed_fwd(gu, limit=None, **kw):
    return swiglu_fwd(*gu.chunk(2, dim=-1), limit, **kw)


# ---------------------------------------------------------------- rungs 1 and 2


@pytest.mark.parametrize("limit", LIMITS, ids=lambda v: f"limit{v}")
@pytest.mark.parametrize("I", [63, 593, 1000, 12288], ids=lambda i: f"I{i}")
def test_rung1_rung2(device, I, limit):
    gu = _gate_up(37, I, BF, device, scale=6.0)
    r1 = rung1_repeat("swiglu", _packed_fwd, gu, limit)
    assert r1.passed, r1
    r2 = rung2_rows("swiglu", _packed_fwd, (gu,), shared={"limit": limit}, configs=_launch_configs(device), batch_sizes=(1, 2, 3, 7, 36))
    assert r2.passed, r2.detail


def test_bwd_deterministic_and_rows_invariant(device):
    gu = _gate_up(100, 593, BF, device, scale=6.0)
    dy = torch.randn(100, 593).to(device, BF)

    def bwd(dy, gu, limit=None):
        return swiglu_bwd(dy, *gu.chunk(2, dim=-1), limit)

    assert rung1_repeat("swiglu", bwd, dy, gu, 10.0).passed
    r2 = rung2_rows("swiglu", bwd, (dy, gu), shared={"limit": 10.0})
    assert r2.passed, r2.detail


@pytest.mark.parametrize("limit", [None, 10.0], ids=lambda v: f"limit{v}")
def test_packed_form_equals_separate(device, limit):
    gu = _gate_up(37, 593, BF, device, scale=6.0).requires_grad_()
    gate, up = (t.detach().clone().requires_grad_() for t in gu.detach().chunk(2, dim=-1))
    y_packed, y_sep = swiglu_gate_up(gu, limit), swiglu(gate, up, limit)
    assert torch.equal(y_packed, y_sep)
    dy = torch.randn_like(y_sep)
    y_packed.backward(dy)
    y_sep.backward(dy)
    assert torch.equal(gu.grad, torch.cat([gate.grad, up.grad], dim=-1))


def test_leading_dims_and_empty(device):
    gu = _gate_up(12, 100, BF, device)
    flat = swiglu_gate_up(gu)
    assert torch.equal(swiglu_gate_up(gu.view(3, 4, 200)), flat.view(3, 4, 100))
    assert torch.equal(swiglu_gate_up(gu[5]), flat[5])
    assert swiglu_gate_up(gu[:0]).shape == (0, 100)


# ---------------------------------------------------------------- rounding points


def test_one_rounding_and_more_accurate_than_two():
    """y = bf16(fp32 SiLU(g) * u); transformers' MLP rounds SiLU(g) to bf16 first."""
    gu = _gate_up(64, 1000, BF, torch.device("cpu"))
    gate, up = (t.contiguous() for t in gu.chunk(2, dim=-1))
    g, u = gate.float(), up.float()
    y = swiglu(gate, up)
    assert torch.equal(y, (g / (1 + torch.exp(-g)) * u).to(BF))
    two_roundings = F.silu(gate) * up
    assert not torch.equal(y, two_roundings)
    ref = swiglu_ref(gate, up)
    assert rel_err(y, ref) < rel_err(two_roundings, ref)


@pytest.mark.parametrize("limit", [10.0, 2.3, 2.31, 0.7], ids=lambda v: f"limit{v}")  # bf16(2.31) = 2.3125 > 2.31
def test_clamp_matches_deepseek_v4(device, limit):
    """DeepseekV4MLP / _apply_gate: gate.clamp(max=L), up.clamp(min=-L, max=L) on the
    bf16 projections, so L acts as its bf16 value.  Clamping those tensors first
    and calling without a limit must give the same bits, forward and backward."""
    gu = _gate_up(37, 593, BF, device, scale=6.0)
    gate, up = gu.chunk(2, dim=-1)
    hf_gate, hf_up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    assert torch.equal(swiglu_gate_up(gu, limit), swiglu(hf_gate.contiguous(), hf_up.contiguous()))
    # gradients: torch's clamp backward passes where the value is within the bound
    a = gu.clone().requires_grad_()
    b = gu.clone().requires_grad_()
    dy = torch.randn(37, 593).to(device, BF)
    swiglu_gate_up(a, limit).backward(dy)
    bg, bu = b.chunk(2, dim=-1)
    swiglu(bg.clamp(max=limit).contiguous(), bu.clamp(min=-limit, max=limit).contiguous()).backward(dy)
    assert torch.equal(a.grad, b.grad)


# ---------------------------------------------------------------- accuracy and gradients


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("limit", [None, 10.0], ids=lambda v: f"limit{v}")
@pytest.mark.parametrize("I", [100, 593, 1000], ids=lambda i: f"I{i}")
def test_accuracy_vs_float64(device, I, limit, dtype):
    gu = _gate_up(63, I, dtype, device, scale=6.0)
    gate, up = gu.chunk(2, dim=-1)
    y = swiglu_gate_up(gu, limit)
    assert y.dtype == dtype
    assert rel_err(y, swiglu_ref(gate, up, limit)) <= FWD_BOUND[dtype]


@pytest.mark.parametrize("dtype", [BF, F32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("limit", [None, 10.0], ids=lambda v: f"limit{v}")
@pytest.mark.parametrize("packed", [False, True], ids=["separate", "packed"])
def test_gradients_vs_float64_autograd(device, packed, limit, dtype):
    gu = _gate_up(37, 593, dtype, device, scale=6.0)
    dy = torch.randn(37, 593).to(device, dtype)
    ref_g, ref_u = (t.double().requires_grad_() for t in gu.chunk(2, dim=-1))
    swiglu_ref(ref_g, ref_u, limit).backward(dy.double())
    if packed:
        a = gu.clone().requires_grad_()
        swiglu_gate_up(a, limit).backward(dy)
        dg, du = a.grad.chunk(2, dim=-1)
    else:
        g, u = (t.contiguous().requires_grad_() for t in gu.chunk(2, dim=-1))
        swiglu(g, u, limit).backward(dy)
        dg, du = g.grad, u.grad
    assert dg.dtype == dtype
    assert rel_err(dg, ref_g.grad) <= GRAD_BOUND[dtype]
    assert rel_err(du, ref_u.grad) <= GRAD_BOUND[dtype]


def test_cpu_exp_is_elementwise_invariant():
    """The CPU paths' premise (cpu.py docstrings): fp32 torch.exp gives an element
    the same bits whatever the length, alignment, stride or thread split around it."""
    x = 10 * torch.randn(20000, generator=torch.Generator().manual_seed(0))
    full = torch.exp(x)
    for n in [*range(1, 40), 63, 1000, 2049, 4097, 16385]:
        for off in (0, 3, 8):
            assert torch.equal(torch.exp(x[off : off + n]), full[off : off + n])  # unaligned view
    assert torch.equal(torch.exp(x[::3]), full[::3])



def test_importing_alignzoo_resolves_the_mkl_vml_kernels_first():
    """oneMKL picks a VML function's kernel on its first call, and a first call from several threads
    at once can run a low-accuracy kernel on one thread's chunk (common/_mkl.py).  In a fresh process,
    ``import alignzoo`` alone has already called every such function, fp32 and fp64, on one thread."""
    code = ("import sys, alignzoo; m = sys.modules.get('alignzoo.common._mkl');"
            "print(','.join(m.WARMED) if m else 'not imported')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    from alignzoo.common._mkl import VML_OPS

    assert run.stdout.strip() == ",".join(VML_OPS)
    assert {"exp", "log", "sqrt", "sin", "cos"} <= set(VML_OPS)  # those the package calls (RoPE's tables: sin, cos)

# ---------------------------------------------------------------- the checks can fail


def _bad_fwd(gu, limit=None, **_):
    """Batch-dependent rounding: SiLU rounded to bf16 first when the batch is small."""
    gate, up = gu.chunk(2, dim=-1)
    if gu.shape[0] < 8:
        return (F.silu(gate) * up).to(gu.dtype)
    return swiglu_fwd(gate, up)


def test_rung2_catches_a_batch_dependent_rounding():
    gu = _gate_up(37, 593, BF, torch.device("cpu"))
    r2 = rung2_rows("swiglu", _bad_fwd, (gu,))
    assert not r2.passed and r2.differing > 0


# ---------------------------------------------------------------- bad input


def test_bad_input():
    gu = _gate_up(4, 64, BF, torch.device("cpu"))
    gate, up = (t.contiguous() for t in gu.chunk(2, dim=-1))
    with pytest.raises(TypeError, match="gate has dtype float16"):
        swiglu(gate.half(), up.half())
    with pytest.raises(TypeError, match="up has dtype float32"):
        swiglu(gate, up.float())
    with pytest.raises(ValueError, match="up must have the shape of gate"):
        swiglu(gate, up[:3])
    with pytest.raises(ValueError, match="gate must be contiguous"):
        swiglu(gu[:, :64], up)
    with pytest.raises(ValueError, match="even last dim"):
        swiglu_gate_up(gu[:, :127].contiguous())
    with pytest.raises(ValueError, match="limit must be None or a finite real number > 0"):
        swiglu(gate, up, limit=-1.0)
    with pytest.raises(ValueError, match="limit must be None or a finite real number > 0"):
        swiglu_gate_up(gu, limit=float("inf"))
    with pytest.raises(TypeError, match="gate_up must be a torch.Tensor"):
        swiglu_gate_up(None)
    with pytest.raises(ValueError, match="I >= 1"):
        swiglu(torch.zeros(3, 0, dtype=BF), torch.zeros(3, 0, dtype=BF))
