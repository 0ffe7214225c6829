"""Programmatic dependent launch (``common/_pdl.py``): a PDL kernel may start
while the kernel before it drains, so it must wait before touching memory."""
from __future__ import annotations

import ast
import importlib
import inspect
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from alignzoo.common._pdl import pdl_options  # noqa: E402

MODULES = ["attention", "kv_cache", "lm_head", "matmul", "qk_norm_rope", "rmsnorm", "rope", "swiglu"]


def _pdl_kernels():
    out = []
    for name in MODULES:
        mod = importlib.import_module(f"alignzoo.common.{name}.kernel")
        for attr, obj in vars(mod).items():
            if "PDL" in getattr(obj, "arg_names", ()) and attr != "wait_prior":
                out.append(pytest.param(obj, id=f"{name}.{attr}"))
    return out


@pytest.mark.parametrize("fn", _pdl_kernels())
def test_pdl_kernel_waits_first(fn):
    """``wait_prior(PDL)`` is the body's first statement (after the docstring):
    no load or store can run before the previous kernel has finished."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn.fn)))
    body = tree.body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    assert ast.unparse(body[0]) == "wait_prior(PDL)", f"{fn.fn.__name__} starts with {ast.unparse(body[0])!r}"


def test_pdl_kernels_are_found():
    assert len(_pdl_kernels()) >= 12


def test_every_pdl_launch_passes_both_options():
    """Launchers spread ``pdl_options``: the PDL constexpr never travels
    without Triton's launch_pdl (or the reverse)."""
    for name in MODULES:
        src = inspect.getsource(importlib.import_module(f"alignzoo.common.{name}.kernel"))
        assert "launch_pdl" not in src and "PDL=" not in src, name


def test_pdl_options(monkeypatch):
    """Off on the CPU; on a PDL-capable GPU (faked here) on up to PDL_MAX_ROWS
    rows unless ALIGNZOO_PDL=0."""
    from alignzoo.common import _pdl

    off, on = {"PDL": False}, {"PDL": True, "launch_pdl": True}
    assert pdl_options(torch.device("cpu"), 1) == off
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ALIGNZOO_PDL", raising=False)
    monkeypatch.setitem(_pdl._ENABLED, 0, True)
    gpu = torch.device("cuda", 0)
    assert pdl_options(gpu, 1) == on and pdl_options(gpu, _pdl.PDL_MAX_ROWS) == on
    assert pdl_options(gpu, _pdl.PDL_MAX_ROWS + 1) == off
    monkeypatch.setenv("ALIGNZOO_PDL", "0")
    assert pdl_options(gpu, 1) == off


def test_pdl_pair(monkeypatch):
    """The split matmul's two kernels: both PDL up to PDL_MAX_ROWS rows; above,
    the merge alone is PDL-launched and the split compiled to trigger it
    (launched plainly); off with ALIGNZOO_PDL=0 and on the CPU."""
    from alignzoo.common import _pdl
    from alignzoo.common._pdl import pdl_pair

    off, on, trigger = {"PDL": False}, {"PDL": True, "launch_pdl": True}, {"PDL": True}
    assert pdl_pair(torch.device("cpu"), 256) == (off, off)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("ALIGNZOO_PDL", raising=False)
    monkeypatch.setitem(_pdl._ENABLED, 0, True)
    gpu = torch.device("cuda", 0)
    assert pdl_pair(gpu, _pdl.PDL_MAX_ROWS) == (on, on)
    assert pdl_pair(gpu, _pdl.PDL_MAX_ROWS + 1) == (trigger, on)
    monkeypatch.setenv("ALIGNZOO_PDL", "0")
    assert pdl_pair(gpu, 256) == (off, off)


_SPLIT_TYPES = {"p_x": "*bf16", "p_w": "*bf16", "p_ws": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                "stride_xm": "i32", "stride_xk": "i32", "stride_wn": "i32", "stride_wk": "i32"}
_SPLIT_CONSTS = {"SEG_K": 1024, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "IEEE": False, "PDL": True}


@pytest.mark.parametrize("name, types, consts, aligned", [
    pytest.param("_mm_merge_kernel", {"p_ws": "*fp32", "p_y": "*bf16", "M": "i32", "N": "i32", "stride_ym": "i32",
                                      "stride_yn": "i32", "N_SEG": "i32"},
                 {"BLOCK": 1024, "PDL": True}, {"p_ws", "p_y"}, id="matmul-merge"),
    pytest.param("_mm_split_kernel", _SPLIT_TYPES, _SPLIT_CONSTS, {"p_x", "p_w", "p_ws"}, id="matmul-split"),
])
def test_pdl_wait_precedes_memory_in_the_compiled_kernel(name, types, consts, aligned):
    """sm_90 TTGIR with PDL on: the grid-dependency wait comes before the
    first load and store."""
    from sm90_layouts import can_compile_sm90, sm90_ttgir

    from alignzoo.common.matmul import kernel as mm

    if not can_compile_sm90():
        pytest.skip("this triton build has no NVIDIA backend")
    lines = sm90_ttgir(getattr(mm, name), types, consts, aligned, 4).splitlines()
    at = lambda op: [i for i, ln in enumerate(lines) if op in ln]  # noqa: E731
    memory = at("tt.load") + at("tt.store") + at("tt.atomic_rmw") + at("async_copy_global_to_local")
    wait, = at("tt.grid_dependency_wait")
    assert memory and wait < min(memory)


def test_pdl_wait_precedes_memory_in_the_fused_qk_norm_rope_kernel():
    """sm_90 TTGIR of the fused q/k norm + RoPE + KV write with PDL on: the
    wait comes before every load and store of both branches (q heads, k/v heads)."""
    from sm90_layouts import can_compile_sm90, sm90_ttgir

    from alignzoo.common.qk_norm_rope import kernel as qkr

    if not can_compile_sm90():
        pytest.skip("this triton build has no NVIDIA backend")
    types = {"p_qkv": "*bf16", "p_qw": "*bf16", "p_kw": "*bf16", "p_pos": "*i64", "p_cos": "*fp32", "p_sin": "*fp32",
             "p_slot": "*i32", "p_q": "*bf16", "p_kc": "*bf16", "p_vc": "*bf16", "stride_t": "i32", "eps": "fp32",
             "P": "i32"}
    consts = {"HQ": 32, "HKV": 8, "NQB": 8, "D": 128, "CHUNK": 128, "LOG2_CHUNK": 7, "HALF": 64, "HALF_PAD": 64,
              "BH": 4, "PDL": True}
    lines = sm90_ttgir(qkr._qk_norm_rope_kv_kernel, types, consts, set(types) - {"eps"}, 1).splitlines()
    at = lambda op: [i for i, ln in enumerate(lines) if op in ln]  # noqa: E731
    wait, = at("tt.grid_dependency_wait")
    memory = at("tt.load") + at("tt.store")
    assert len(memory) == 20 and wait < min(memory)


@pytest.mark.gpu
def test_gpu_pdl_levels_give_the_same_bits(monkeypatch):
    """A chain of dependent forward kernels (rmsnorm -> split-K and TMA
    matmuls -> swiglu -> matmul), eager and in a CUDA graph, with PDL off and
    on: the same bytes."""
    from alignzoo.common.matmul import matmul_fwd
    from alignzoo.common.rmsnorm import rmsnorm_fwd
    from alignzoo.common.swiglu import swiglu_fwd

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    H, I = 1024, 3072
    wn = torch.rand(H, device=dev, generator=g).bfloat16() + 0.5
    w1 = (torch.randn(2 * I, H, device=dev, generator=g) / H**0.5).bfloat16()
    w2 = (torch.randn(H, I, device=dev, generator=g) / I**0.5).bfloat16()

    def chain(x):
        h = rmsnorm_fwd(x, wn, 1e-6)[0]
        gu = matmul_fwd(h, w1)
        return matmul_fwd(swiglu_fwd(gu[:, :I], gu[:, I:]), w2)

    outs = {}
    for level in ("0", "1"):
        monkeypatch.setenv("ALIGNZOO_PDL", level)
        for M in (1, 37, 300):
            x = torch.randn(M, H, device=dev, generator=torch.Generator(device=dev).manual_seed(M)).bfloat16()
            eager = chain(x)
            static = x.clone()
            chain(static)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = chain(static)
            graph.replay()
            torch.cuda.synchronize()
            outs[level, M] = (eager, out.clone())
    for (level, M), (eager, graphed) in outs.items():
        ref = outs["0", M][0]
        assert torch.equal(eager, ref) and torch.equal(graphed, ref), (level, M)
