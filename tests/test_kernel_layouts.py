"""Batch composition must not reach a kernel's register layouts (sm_90 compiles, no GPU).

The JIT specializes every integer argument that is not ``do_not_specialize``'d
on ``% 16 == 0`` (and on ``== 1``, which makes it a constexpr 1), and the
coalescing pass lays a loaded block out by what it then knows of the
addresses.  A reduction or a scan associates in the order of its operand's
layout, so an integer that follows the batch (a row count, the width of a
batch-dependent view, the block table's width, ...) and reaches the address
arithmetic of a load feeding a float reduction would give one row different
bits in different batches (as the sampler's support kernel did on the H200,
``tests/test_sampling.py``).  Here each kernel with a float reduction (or a
pointer-load ``tl.dot`` chain) is compiled for sm_90 with each of its
batch-dependent integer arguments specialized as the JIT would for an aligned
value, an unaligned one and 1, at Qwen3-8B shapes (hidden 4096, 32 / 8 heads,
head_dim 128, vocab 151936) and its launcher's constants; the layout
definitions must not change.  Model-fixed integers are aligned as they are at
those shapes; ``do_not_specialize``'d arguments never carry the attribute
(``test_row_counts_are_not_specialized`` keeps them so).

Compiled to TTGIR only (``sm90_layouts.sm90_ttgir``).
"""
from __future__ import annotations

import functools
import re

import pytest

pytest.importorskip("triton")

from sm90_layouts import can_compile_sm90, layouts, sm90_ttgir  # noqa: E402

from alignzoo.common.attention import kernel as attn  # noqa: E402
from alignzoo.common.fp8 import kernel as fp8  # noqa: E402
from alignzoo.common.lm_head import kernel as lmh  # noqa: E402
from alignzoo.common.matmul import kernel as mm  # noqa: E402
from alignzoo.common.qk_norm_rope import kernel as qkr  # noqa: E402
from alignzoo.common.rmsnorm import cpu as rms_cpu  # noqa: E402
from alignzoo.common.rmsnorm import kernel as rms  # noqa: E402
from alignzoo.common.rope import kernel as rope  # noqa: E402
from alignzoo.common.sampling import kernel as smp  # noqa: E402
from alignzoo.common.swiglu import kernel as swiglu  # noqa: E402
from alignzoo.common.tree import kernel as tree  # noqa: E402

pytestmark = pytest.mark.skipif(not can_compile_sm90(), reason="this triton build has no NVIDIA backend")

# Qwen3-8B
HQ, HKV, HEAD_DIM, HIDDEN = 32, 8, 128, 4096
G = HQ // HKV


def _reduce_operand_layouts(ttgir: str) -> list[tuple[str, str, str]]:
    """(op, tensor type, layout) of every ``tt.reduce`` / ``tt.scan`` operand."""
    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    ops = re.findall(r'"tt\.(reduce|scan)"\(.*?\}\)\s*:\s*\(([^)]*)\)', ttgir, flags=re.S)
    return [(op, shape, defs.get(enc, enc))
            for op, operands in ops for shape, enc in re.findall(r"tensor<([^,>]*)(?:, (#\w+))?>", operands)]


# ------------------------------------------------------------------ the kernels
# name -> (kernel, {runtime arg: type}, {constexpr: value}, num_warps, num_stages, batch-dependent int args)
_ATT = {"q": "*bf16", "k": "*bf16", "v": "*bf16", "o": "*bf16", "lse": "*fp32"}
_STRIDES = {n: "i32" for n in ("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_kp", "stride_vt",
                               "stride_vh", "stride_vp", "stride_ot", "stride_oh", "stride_lt", "stride_bt")}
_FWD, _DEC, _BWD = attn.fwd_config(HEAD_DIM), attn.decode_config(HEAD_DIM), attn.bwd_config(HEAD_DIM)["dq"]
_HPT, _NHC, _TPT = attn._tiling(G, _FWD["block_m"])
_BHPT, _BNHC, _BTPT = attn._tiling(G, _BWD["block_m"])
_ATT_C = {"D": HEAD_DIM, "BLOCK_D": HEAD_DIM, "G": G, "N_HC": _NHC, "WINDOW": 0, "PRECISION": None,
          "BLOCK_N": attn.BLOCK_N}
_RMS_BLOCK = min(128, rms_cpu.tree_width(HIDDEN))
_TREE_N = 8  # contributors: top-k experts of a Qwen3 MoE combine
_QKR_BH = qkr.default_heads_per_program(HKV, 1)  # decode's heads per program
_TREE_P2 = _TREE_N
_TREE_BLOCK = max(16, min(1024, 4096 // _TREE_P2))

_SMP_SUPPORT_TYPES = {
    "p_skeys": "*i64", "p_svals": "*fp32", "p_sids": "*i64", "p_csum": "*fp32", "p_cmax": "*fp32", "p_cfirst": "*i32",
    "p_logits": "*fp32", "p_temp": "*fp32", "p_topk": "*i64", "p_topp": "*fp32", "p_minp": "*fp32", "p_seed": "*i64",
    "p_step": "*i64", "p_tok_in": "*i64", "p_tok": "*i64", "p_lp": "*fp32", "p_v0": "*fp32", "p_logz": "*fp32",
    "p_last": "*i64", "V": "i32", "SV16": "i32", "SV2": "i32", "SI": "i32", "NC": "i32"}

KERNELS = {
    # paged prefill / chunked prefill: block_table.stride(0) = the batch's most blocks per sequence
    "attn_fwd_paged": (
        attn._attn_fwd_kernel,
        {**_ATT, "cu_q": "*i32", "seq_lens": "*i32", "block_table": "*i32", **_STRIDES, "qk_scale": "fp32",
         "n_m_tiles": "i32"},
        {**_ATT_C, "HPT": _HPT, "TPT": _TPT, "PAGED": True, "MASK_ALL": False, "BLOCK_M": _FWD["block_m"],
         "SEG_BLOCKS": attn.SEG_BLOCKS},
        _FWD["num_warps"], _FWD["num_stages"], ("stride_bt",)),
    # decode, several segments (the table is wider than 16 blocks): stride_bt as above
    "attn_decode_split": (
        attn._attn_decode_split_kernel,
        {**_ATT, "ws_m": "*fp32", "ws_l": "*fp32", "ws_acc": "*fp32", "cu_q": "*i32", "seq_lens": "*i32",
         "block_table": "*i32", **_STRIDES, "qk_scale": "fp32", "n_tok": "i32", "n_heads": "i32", "n_prog": "i32"},
        {**_ATT_C, "HPT": attn._tiling(G, _DEC["block_m"])[0], "MASK_ALL": False, "BLOCK_M": _DEC["block_m"],
         "SEG_BLOCKS": attn.SEG_BLOCKS},
        _DEC["num_warps"], _DEC["num_stages"], ("stride_bt",)),
    # delta = sum_d(o * do) (tl.sum): n_rows = T * Hq
    "attn_bwd_preprocess": (
        attn._bwd_preprocess_kernel,
        {"o": "*bf16", "do": "*bf16", "delta": "*fp32", "n_rows": "i32"},
        {"D": HEAD_DIM, "BLOCK_D": HEAD_DIM, "BLOCK_R": 64},
        4, 3, ("n_rows",)),
    # dq: n_m_tiles = cdiv(max_seqlen, TPT), the batch's longest sequence
    "attn_bwd_dq": (
        attn._attn_bwd_dq_kernel,
        {"q": "*bf16", "k": "*bf16", "v": "*bf16", "do": "*bf16", "lse": "*fp32", "delta": "*fp32", "dq": "*bf16",
         "cu": "*i32", "stride_qt": "i32", "stride_qh": "i32", "stride_kt": "i32", "stride_kh": "i32",
         "stride_vt": "i32", "stride_vh": "i32", "stride_lt": "i32", "qk_scale": "fp32", "scale": "fp32",
         "n_m_tiles": "i32"},
        {**_ATT_C, "N_HC": _BNHC, "HPT": _BHPT, "TPT": _BTPT, "BLOCK_M": _BWD["block_m"], "BLOCK_N": _BWD["block_n"]},
        _BWD["num_warps"], _BWD["num_stages"], ("n_m_tiles",)),
    # dz: g0 = first group of the vocabulary chunk, chunk = _DZ_BYTES // (T * 256 * 2) groups.
    # n_cols = chunk * 256 also follows T but is always a multiple of 256 (aligned, never 1).
    "lm_head_dz": (
        lmh._lm_head_dz_kernel,
        {"h": "*bf16", "w": "*bf16", "tgt": "*i64", "lse": "*fp32", "grad": "*fp32", "dz": "*bf16",
         "T": "i32", "V": "i32", "K": "i32", "g0": "i32", "n_cols": "i32"},
        {"BM": lmh.DEFAULT_BLOCK_M, "BV": lmh.VOCAB_GROUP, "BK": 64, "IEEE": False},
        lmh.DEFAULT_BLOCK_M // 16, lmh._FWD_STAGES, ("g0",)),
    # dh (T, K) += dz (T, Vc) . W_c: M = T, L = Vc (the chunk's width, follows T); unit strides are constexpr 1
    "lm_head_gemm_dh": (
        lmh._gemm_kernel,
        {"a": "*bf16", "b": "*bf16", "c": "*fp32", "M": "i32", "N": "i32", "L": "i32",
         "s_am": "i32", "s_bl": "i32", "s_cm": "i32"},
        {"s_al": 1, "s_bn": 1, "s_cn": 1, "BM": 64, "BN": 128, "BL": lmh._GEMM_BL, "IEEE": False, "ACCUMULATE": True},
        lmh._GEMM_WARPS, 3, ("M", "L")),
    # dW_c (Vc, K) = dz^T (Vc, T) . h: M = Vc, L = T
    "lm_head_gemm_dw": (
        lmh._gemm_kernel,
        {"a": "*bf16", "b": "*bf16", "c": "*bf16", "M": "i32", "N": "i32", "L": "i32",
         "s_al": "i32", "s_bl": "i32", "s_cm": "i32"},
        {"s_am": 1, "s_bn": 1, "s_cn": 1, "BM": 64, "BN": 128, "BL": lmh._GEMM_BL, "IEEE": False, "ACCUMULATE": False},
        lmh._GEMM_WARPS, 3, ("M", "L")),
    # rmsnorm dw over NB = cdiv(M, S * DW_TILES) block partials
    "rmsnorm_dw_sum": (
        rms._dw_sum_kernel,
        {"p_part": "*fp32", "p_dw": "*bf16", "NB": "i32", "H": "i32"},
        {"S2": rms_cpu.DW_SLOTS2, "LOG2_S2": rms_cpu.DW_SLOTS2.bit_length() - 1, "BLOCK": _RMS_BLOCK},
        4, 3, ("NB",)),
    # split-K matmul at decode: M is do_not_specialize'd and every other int is model-fixed (x may
    # be a column slice: stride_xm is then the wider row, fixed too); listed for PDL
    "matmul_split": (
        mm._mm_split_kernel,
        {"p_x": "*bf16", "p_w": "*bf16", "p_ws": "*fp32", "M": "i32", "N": "i32", "K": "i32",
         "stride_xm": "i32", "stride_wn": "i32"},
        {"stride_xk": 1, "stride_wk": 1, "SEG_K": 1024, "BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64,
         "IEEE": False},
        4, 4, ()),
    # q/k RMSNorm + RoPE + KV write: the token count is the grid's, no argument follows the batch
    # (test_qk_norm_rope_kv_reads_no_batch_integer); its row sum is reshape/split adds; listed for PDL
    "qk_norm_rope_kv": (
        qkr._qk_norm_rope_kv_kernel,
        {"p_qkv": "*bf16", "p_qw": "*bf16", "p_kw": "*bf16", "p_pos": "*i64", "p_cos": "*fp32", "p_sin": "*fp32",
         "p_slot": "*i32", "p_q": "*bf16", "p_kc": "*bf16", "p_vc": "*bf16", "stride_t": "i32", "eps": "fp32",
         "P": "i32"},
        {"HQ": HQ, "HKV": HKV, "NQB": HQ // _QKR_BH, "D": HEAD_DIM, "CHUNK": HEAD_DIM,
         "LOG2_CHUNK": HEAD_DIM.bit_length() - 1, "HALF": HEAD_DIM // 2, "HALF_PAD": HEAD_DIM // 2, "BH": _QKR_BH},
        1, 3, ()),
    # sampling support kernel, full sort: sorted values (row stride 2 * SV2, do_not_specialize'd) and
    # ids (stride SI) with chunk partials (rows of NC); SV16, SI and NC follow the batch's head width
    "sampling_support": (
        smp._support_kernel, _SMP_SUPPORT_TYPES,
        {"BLOCK": smp.BLOCK_V, "DRAW": True, "VALUES": True, "PRE": True, "FOLD": smp.FOLD},
        smp.NUM_WARPS, 3, ("SV16", "SI", "NC")),
    # ... and on int64 keys of row stride 16 * SV16 (the head path: SV16 = key_row_stride(head + 1) / 16)
    "sampling_support_keys": (
        smp._support_kernel, _SMP_SUPPORT_TYPES,
        {"BLOCK": smp.BLOCK_V, "DRAW": True, "VALUES": False, "PRE": False, "FOLD": smp.FOLD},
        smp.NUM_WARPS, 3, ("SV16", "SI", "NC")),
    # the support kernel's pass 1 per (row, chunk): the same _chunk scan
    "sampling_chunk_partials": (
        smp._chunk_partials_kernel,
        {"p_skeys": "*i64", "p_svals": "*fp32", "p_temp": "*fp32", "p_topk": "*i64", "p_minp": "*fp32",
         "p_csum": "*fp32", "p_cmax": "*fp32", "p_cfirst": "*i32", "V": "i32", "SV16": "i32", "SV2": "i32",
         "NC": "i32"},
        {"BLOCK": smp.BLOCK_V, "VALUES": True},
        smp.NUM_WARPS, 3, ("SV16", "NC")),
    # MoE combine of (N, T, H) parts: numel = T * H (always % 16 at H = 4096)
    "tree": (
        tree._tree_kernel,
        {"p_in": "*bf16", "p_out": "*bf16", "N": "i32", "numel": "i32"},
        {"N_POW2": _TREE_P2, "LOG2_N": _TREE_P2.bit_length() - 1, "BLOCK": _TREE_BLOCK},
        4, 3, ("numel",)),
}

_TREE_XFAIL = pytest.mark.xfail(strict=True, reason=(
    "numel % 16 (or == 1) changes the (BLOCK, N_POW2) load's layout: aligned #blocked<sizePerThread [4, 1], "
    "order [1, 0]> (and [4, 1, 2] / [8, 1] for the split tree), unaligned #blocked<sizePerThread [1, 1], "
    "order [0, 1]> and different linear layouts.  Bit-harmless: the tree is reshape/split + element-wise adds, "
    "no tt.reduce (test_tree_kernel_has_no_layout_ordered_reduction), and T * H is % 16 at H = 4096"))


def _compile(name: str, drop: str | None = None, mode: str = "aligned", **overrides) -> list[str]:
    """Layout definitions of kernel ``name`` with every pointer and model-fixed
    int aligned; ``drop`` specialized as ``mode``: "unaligned" (% 16 != 0) or
    "one" (== 1: the JIT makes it a constexpr 1)."""
    fn, types, consts, nw, ns, _ = KERNELS[name]
    types, consts = dict(types), {**consts, **overrides}
    dns = {p.name for p in fn.params if p.do_not_specialize}
    aligned = {n for n, t in types.items() if n not in dns and not t.startswith("fp")}
    if drop is not None:
        aligned.discard(drop)
        if mode == "one":
            del types[drop]
            consts[drop] = 1
    return layouts(_cached_ttgir(fn, tuple(sorted(types.items())), tuple(sorted(consts.items(), key=str)),
                               frozenset(aligned), nw, ns))


@functools.lru_cache(maxsize=None)
def _cached_ttgir(fn, types, consts, aligned, nw, ns):
    return sm90_ttgir(fn, types, consts, aligned, nw, ns)


_CASES = [
    pytest.param(name, arg, mode, id=f"{name}-{arg}-{mode}", marks=[_TREE_XFAIL] if name == "tree" else [])
    for name, (*_, args) in KERNELS.items() for arg in args for mode in ("unaligned", "one")
]


@pytest.mark.parametrize("name, arg, mode", _CASES)
def test_layouts_ignore_batch_dependent_ints(name, arg, mode):
    """The kernel's layouts with ``arg`` unaligned (or 1) equal those with it aligned."""
    base, got = _compile(name), _compile(name, arg, mode)
    assert got == base, (f"{name}: {arg} {mode} changes the layouts: only aligned {sorted(set(base) - set(got))}, "
                         f"only {mode} {sorted(set(got) - set(base))}")


@pytest.mark.parametrize("name", [n for n, (fn, *_) in KERNELS.items() if "PDL" in fn.arg_names])
def test_layouts_ignore_pdl(name):
    """PDL (programmatic dependent launch, on for launches of <= 64 rows only:
    a batch-dependent constexpr) adds a wait and changes no layout."""
    assert _compile(name, PDL=True) == _compile(name, PDL=False)


def test_tree_kernel_has_no_layout_ordered_reduction():
    """Why the tree kernel's numel-dependent layout (xfail above) cannot change
    bits: it has no tt.reduce / tt.scan, only element-wise adds."""
    for mode in ("aligned", "unaligned"):
        fn, types, consts, nw, ns, _ = KERNELS["tree"]
        aligned = frozenset(n for n in types if n != "numel" or mode == "aligned")
        ttgir = _cached_ttgir(fn, tuple(sorted(types.items())), tuple(sorted(consts.items(), key=str)), aligned, nw, ns)
        assert "tt.dot" not in ttgir and not _reduce_operand_layouts(ttgir) and '"tt.reduce"' not in ttgir


def test_qk_norm_rope_kv_reads_no_batch_integer():
    """The fused q/k norm kernel takes its token count from the grid: its only
    integer arguments are the qkv row stride and the RoPE table's rows (both
    fixed by the model), and its per-head row sum is ``_row_tree_sum``
    (reshape/split adds), no tt.reduce or tt.scan whose order a layout could set."""
    fn, types, consts, nw, ns, _ = KERNELS["qk_norm_rope_kv"]
    assert {n for n, t in types.items() if t.startswith("i")} == {"stride_t", "P"}
    assert set(types) | set(consts) | {"PDL"} == set(fn.arg_names)
    aligned = frozenset(n for n, t in types.items() if not t.startswith("fp"))
    ttgir = _cached_ttgir(fn, tuple(sorted(types.items())), tuple(sorted(consts.items(), key=str)), aligned, nw, ns)
    assert "tt.dot" not in ttgir and not _reduce_operand_layouts(ttgir) and '"tt.reduce"' not in ttgir


# Row counts that follow the batch in kernels with a float reduction (or pointer-load dots),
# kept out of specialization by do_not_specialize: % 16 and == 1 never reach the compile.
_DNS = [
    (attn._attn_fwd_kernel, "n_m_tiles"), (attn._attn_decode_split_kernel, "n_tok"),
    (attn._attn_decode_merge_kernel, "n_tok"),
    (lmh._lm_head_fwd_kernel, "T"), (lmh._lm_head_merge_kernel, "T"), (lmh._lm_head_dz_kernel, "T"),
    (rms._rmsnorm_fwd_kernel, "M"), (rms._rmsnorm_bwd_kernel, "M"),
    (fp8._fp8_gemm_kernel, "M"),
    (mm._mm_fused_kernel, "M"), (mm._mm_split_kernel, "M"), (mm._mm_merge_kernel, "M"),
    (mm._mm_tma_persistent_kernel, "M"), (mm._mm_tma_split_kernel, "M"),
    (swiglu._swiglu_fwd_kernel, "M"), (swiglu._swiglu_bwd_kernel, "M"), (rope.rope_kernel, "N"),
    # not a row count: the sorted values' row stride / 2, never specialized so the value loads keep
    # the keys' layout (tests/test_sampling.py::test_value_row_stride_is_never_specialized)
    (smp._support_kernel, "SV2"), (smp._chunk_partials_kernel, "SV2"),
]


@pytest.mark.parametrize("fn, arg", _DNS, ids=[f"{f.fn.__name__}-{a}" for f, a in _DNS])
def test_row_counts_are_not_specialized(fn, arg):
    assert arg in {p.name for p in fn.params if p.do_not_specialize}
