"""Exact attention: every row has the same bits on the training path (packed),
server prefill, token-by-token decode and chunked prefill, whatever the batch
and page placement; accuracy and gradients against float64."""
from __future__ import annotations

import math

import pytest
import torch

from alignzoo.common.attention import attention, attention_bwd, attention_fwd, attention_ref, decode_attention, paged_attention
from alignzoo.common.attention.checks import (
    chunked_schedule,
    compare_rows,
    decode_schedule,
    ladder,
    make_inputs,
    prefill_schedule,
    serve,
    split_kv_decode,
)
from alignzoo.common.kv_cache import allocate_kv_cache
from alignzoo.common.ladder import bitwise_equal, rel_err


@pytest.fixture(autouse=True, scope="module")
def _one_cpu_thread():
    # torch's 2-thread CPU loops ran ~100x slower than 1 thread on the 2-core CI box
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _all_paths(q, k, v, cu, *, window=0, scale=None, join_step=3, seeds=(1, 2)):
    """{path: (o, lse)} for train, prefill, decode (late joins) and chunked prefill."""
    lens = torch.diff(cu).tolist()
    out = {"train": attention_fwd(q, k, v, cu, window=window, scale=scale)}
    kw = dict(window=window, scale=scale)
    out["prefill"] = serve(q, k, v, cu, prefill_schedule(lens), shuffle_seed=seeds[0], check=True, **kw)
    join = [join_step * b for b in range(len(lens))]
    out["decode"] = serve(q, k, v, cu, decode_schedule(lens, join), shuffle_seed=seeds[1], **kw)
    for s in seeds:
        out[f"chunked-{s}"] = serve(q, k, v, cu, chunked_schedule(lens, seed=s), shuffle_seed=s + 10, **kw)
    return out


def _assert_paths_equal(paths):
    o_ref, lse_ref = paths["train"]
    for name, (o, lse) in paths.items():
        assert torch.equal(o, o_ref), f"{name}: {compare_rows('attention', name, o, o_ref).detail}"
        assert torch.equal(lse, lse_ref), f"{name}: lse differs"


CASES = {
    # id: (lens, hq, hkv, d, dtype, window, scale)
    "gqa2-bf16": ([300, 1, 64, 65, 129, 17], 4, 2, 16, torch.bfloat16, 0, None),
    "mha-fp32-d24": ([150, 63, 2], 2, 2, 24, torch.float32, 0, None),
    "mqa4-window128": ([400, 90, 1, 130], 4, 1, 16, torch.bfloat16, 128, None),
    "gqa3-window7-scale0.3": ([200, 5, 70], 3, 1, 12, torch.bfloat16, 7, 0.3),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_train_prefill_decode_chunked_same_bits(device, case):
    lens, hq, hkv, d, dtype, window, scale = CASES[case]
    q, k, v, cu = make_inputs(lens, hq, hkv, d, dtype=dtype, device=device)
    _assert_paths_equal(_all_paths(q, k, v, cu, window=window, scale=scale))


def test_long_sequences_cpu():
    """Lengths to 1500 on the CPU: prefill in chunks at odd split points, then
    decode token by token past position 1400, a second sequence alongside."""
    lens = [1500, 700]
    q, k, v, cu = make_inputs(lens, 2, 1, 16, seed=7)
    o, lse = attention_fwd(q, k, v, cu)
    steps = [{0: 517, 1: 700}, {0: 507}, {0: 376}] + [{0: 1}] * 100
    o_s, lse_s = serve(q, k, v, cu, steps, shuffle_seed=5)
    assert torch.equal(o_s, o) and torch.equal(lse_s, lse)
    o_p, _ = serve(q, k, v, cu, prefill_schedule(lens), shuffle_seed=6)
    assert torch.equal(o_p, o)
    ref = attention_ref(q, k, v, cu)
    assert rel_err(o, ref) < 4e-3
    # a 128-token sliding window over the same sequences
    ow, _ = attention_fwd(q, k, v, cu, window=128)
    steps = [{0: 1000, 1: 333}, {0: 1, 1: 367}] + [{0: 1}] * 80 + [{0: 419}]
    assert torch.equal(serve(q, k, v, cu, steps, window=128, shuffle_seed=8)[0], ow)
    assert rel_err(ow, attention_ref(q, k, v, cu, window=128)) < 4e-3


@pytest.mark.gpu
@pytest.mark.parametrize("d,window", [(128, 0), (128, 128), (256, 0), (64, 0)], ids=["d128", "d128-window128", "d256", "d64"])
def test_long_sequences_gpu(d, window):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [8192, 3001, 1, 700]
    q, k, v, cu = make_inputs(lens, 8, 2, d, device="cuda", seed=11)
    o, lse = attention_fwd(q, k, v, cu, window=window)
    assert rel_err(o, attention_ref(q, k, v, cu, window=window)) < 1e-2
    o_p, lse_p = serve(q, k, v, cu, prefill_schedule(lens), window=window, shuffle_seed=1)
    assert torch.equal(o_p, o) and torch.equal(lse_p, lse)
    o_c, _ = serve(q, k, v, cu, chunked_schedule(lens, seed=3, max_chunk=3000), window=window, shuffle_seed=2)
    assert torch.equal(o_c, o)
    # decode the last 300 tokens of every sequence token by token
    steps = [{b: n - min(n, 300) for b, n in enumerate(lens) if n > 300}]
    steps += decode_schedule([min(n, 300) for n in lens])
    assert torch.equal(serve(q, k, v, cu, steps, window=window, shuffle_seed=3)[0], o)


def test_page_placement_and_padding(device):
    """Shuffled free lists, an unwritten NaN cache, zero-length (paused)
    sequences in the batch and CUDA-graph padding tokens (slot -1)."""
    q, k, v, cu = make_inputs([150, 40, 3], 4, 2, 16, device=device)
    o, _ = attention_fwd(q, k, v, cu)
    for seed in (0, 1, 2):
        assert torch.equal(serve(q, k, v, cu, chunked_schedule([150, 40, 3], seed=seed), shuffle_seed=seed)[0], o)
    # packed training with empty sequences between the real ones
    cu_pad = torch.tensor([0, 0, 150, 150, 190, 193, 193], dtype=torch.int32, device=device)
    assert torch.equal(attention_fwd(q, k, v, cu_pad)[0], o)
    # paged: a zero-length sequence in the middle of a decode batch
    from alignzoo.common.kv_cache import BlockManager, write_kv

    kc, vc = allocate_kv_cache(8, 2, 16, device=device)
    bm = BlockManager(8, shuffle_seed=4)
    slots = bm.append(0, 150) + bm.append(1, 40)
    idx = torch.cat([torch.arange(0, 150), torch.arange(150, 190)]).to(device)
    pad = torch.tensor([-1, -1], dtype=torch.int32, device=device)  # padding rows write nothing
    write_kv(torch.cat([k[idx], k[:2]]), torch.cat([v[idx], v[:2]]), kc, vc,
             torch.cat([torch.tensor(slots, dtype=torch.int32, device=device), pad]))
    bm.add(2)
    bm.append(2, 1)
    cu_q = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device=device)  # seq 2 idles this step
    seqs = [0, 2, 1]
    lens = torch.tensor([150, 1, 40], dtype=torch.int32, device=device)
    got = paged_attention(q[[149, 189]], kc, vc, cu_q, lens, bm.block_tables(seqs, device=device))
    assert torch.equal(got, o[[149, 189]])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [0, 128], ids=["causal", "window128"])
def test_accuracy_vs_float64(device, dtype, window):
    q, k, v, cu = make_inputs([593, 100, 7, 1], 4, 2, 60, dtype=dtype, device=device)
    o, lse = attention_fwd(q, k, v, cu, window=window)
    ref, lse_ref = attention_ref(q, k, v, cu, window=window, return_lse=True)
    # bf16: one output rounding (2^-9 relative) — on the GPU also p rounded to bf16 for the MMA
    bound = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if device.type == "cuda" else 4e-3}[dtype]
    assert rel_err(o, ref) < bound
    assert (lse.double() - lse_ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("window", [0, 50], ids=["causal", "window50"])
def test_gradients_vs_float64(device, dtype, window):
    q, k, v, cu = make_inputs([200, 63, 1, 130], 4, 2, 20, dtype=dtype, device=device, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, cu, window=window)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(9)).to(device=device, dtype=dtype)
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    attention_ref(q64, k64, v64, cu, window=window).backward(do.double())
    # bf16: inputs, outputs and the grads are bf16-rounded (and, on the GPU, p/ds fed to the MMA as bf16)
    bound = {torch.float32: 1e-5, torch.bfloat16: 2e-2 if device.type == "cuda" else 6e-3}[dtype]
    for name, got, ref in (("dq", q.grad, q64.grad), ("dk", k.grad, k64.grad), ("dv", v.grad, v64.grad)):
        assert rel_err(got, ref) < bound, name


def test_backward_deterministic(device):
    q, k, v, cu = make_inputs([333, 64, 65], 4, 1, 32, device=device, seed=4)
    o, lse = attention_fwd(q, k, v, cu)
    do = torch.randn_like(o)
    first = attention_bwd(q, k, v, o, lse, do, cu)
    second = attention_bwd(q, k, v, o, lse, do, cu)
    assert all(bitwise_equal(a, b) for a, b in zip(first, second))


def test_ladder_passes(device):
    """Rung 1 (twice), rung 2 (sequences as rows: batch sizes, shuffled,
    padding sequences, launch knobs) and rung 3 (train == server paths)."""
    results = ladder(device)
    assert all(r.passed for r in results), [(r.check, r.detail) for r in results if not r.passed]
    assert {r.rung for r in results} >= {1, 2, 3, 0}


def test_split_kv_decode_is_caught(device):
    """A decode that splits KV at a page boundary and merges the halves by LSE
    — the second reduction we forbid — differs from training and is caught."""
    lens = [200, 130, 70]
    q, k, v, cu = make_inputs(lens, 4, 2, 16, device=device, seed=5)
    o, _ = attention_fwd(q, k, v, cu)
    honest = serve(q, k, v, cu, decode_schedule(lens))[0]
    assert compare_rows("attention", "honest decode", honest, o).passed
    split = serve(q, k, v, cu, decode_schedule(lens), attn=split_kv_decode)[0]
    caught = compare_rows("attention", "split-KV decode", split, o)
    assert not caught.passed and caught.differing > 0
    assert rel_err(split, attention_ref(q, k, v, cu)) < 2e-2  # it is accurate, just not the same bits


def test_row_chunk_and_threads_do_not_change_bits():
    q, k, v, cu = make_inputs([190, 3], 4, 2, 16, seed=6)
    o, lse = attention_fwd(q, k, v, cu)
    for rc in (1, 7, 64):
        assert torch.equal(attention_fwd(q, k, v, cu, row_chunk=rc)[0], o)
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(attention_fwd(q, k, v, cu)[0], o)
    finally:
        torch.set_num_threads(n)


def test_cpu_exp_log_are_elementwise():
    """The CPU path relies on torch.exp/log giving an element the same bits in
    a vectorised body, a scalar tail or a strided view (measured on the CI
    CPU; torch.exp2 fails this and is not used)."""
    g = torch.Generator().manual_seed(0)
    x = -torch.rand(210_000, generator=g) * 90
    y = torch.rand(210_000, generator=g) * 100 + 1e-3
    for fn, a in ((torch.exp, x), (torch.log, y)):
        full = fn(a)
        assert bitwise_equal(fn(a.view(-1, 7)[:, 3].contiguous()), full.view(-1, 7)[:, 3].contiguous())
        assert bitwise_equal(fn(a.view(-1, 7)[:, 3]), full.view(-1, 7)[:, 3].contiguous())
        assert bitwise_equal(torch.cat([fn(r) for r in a[:3000].view(-1, 3)]), full[:3000])


@pytest.mark.gpu
def test_gpu_free_launch_knobs_same_bits():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, cu = make_inputs([1000, 64, 65, 1], 8, 2, 128, device="cuda")
    o, lse = attention_fwd(q, k, v, cu)
    for knobs in ({"num_stages": 1}, {"num_stages": 2}, {"mask_all": True}):
        o2, lse2 = attention_fwd(q, k, v, cu, **knobs)
        assert torch.equal(o2, o) and torch.equal(lse2, lse), knobs
        assert torch.equal(serve(q, k, v, cu, chunked_schedule([1000, 64, 65, 1], seed=1), **knobs)[0], o), knobs


@pytest.mark.gpu
def test_gpu_tile_shape_probe():
    """Probe, not a contract: do BLOCK_M = 64 (4 warps) and 128 (8 warps) give
    the same bits on this GPU?  If yes, decode may use the cheaper 64-row tile;
    if this fails, keep ``fwd_config``'s one shape on every path (as now)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, cu = make_inputs([1000, 64, 65, 1], 8, 2, 128, device="cuda")
    o128, _ = attention_fwd(q, k, v, cu, block_m=128, num_warps=8)
    o64, _ = attention_fwd(q, k, v, cu, block_m=64, num_warps=4)
    assert torch.equal(o64, o128)


# ---------------------------------------------------------------- bad input
def _paged_args():
    q, _, _, _ = make_inputs([70], 4, 2, 16)
    kc, vc = allocate_kv_cache(4, 2, 16)
    g = torch.Generator().manual_seed(1)
    kc.copy_(torch.randn(kc.shape, generator=g))
    vc.copy_(torch.randn(vc.shape, generator=g))
    return dict(q=q[:1].contiguous(), k_cache=kc, v_cache=vc, cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
                seq_lens=torch.tensor([70], dtype=torch.int32), block_table=torch.tensor([[2, 0]], dtype=torch.int32))


def _packed_args():
    q, k, v, cu = make_inputs([5, 6], 4, 2, 16)
    return dict(q=q, k=k, v=v, cu_seqlens=cu)


PACKED_BAD = {
    "cu-decreasing": (dict(cu_seqlens=torch.tensor([0, 6, 5, 11], dtype=torch.int32)), ValueError, "non-decreasing"),
    "cu-not-matching-T": (dict(cu_seqlens=torch.tensor([0, 5, 10], dtype=torch.int32)), ValueError, "ends at 10"),
    "cu-not-from-0": (dict(cu_seqlens=torch.tensor([1, 5, 11], dtype=torch.int32)), ValueError, "start at 0"),
    "cu-float": (dict(cu_seqlens=torch.tensor([0.0, 5.0, 11.0])), TypeError, "cu_seqlens has dtype"),
    "heads-not-dividing": (dict(q=torch.randn(11, 3, 16).bfloat16()), ValueError, "not a multiple of num kv heads"),
    "dtype-mismatch": (dict(k=torch.randn(11, 2, 16)), TypeError, "share a dtype"),
    "fp16": (dict(q=torch.randn(11, 4, 16).half()), TypeError, "q has dtype"),
    "non-contiguous-q": (dict(q=torch.randn(4, 11, 16).bfloat16().transpose(0, 1)), ValueError, "q must be contiguous"),
    "head-dim-512": (dict(q=torch.randn(11, 4, 512).bfloat16(), k=torch.randn(11, 2, 512).bfloat16(),
                          v=torch.randn(11, 2, 512).bfloat16()), ValueError, "head_dim 512"),
    "k-v-mismatch": (dict(v=torch.randn(11, 2, 8).bfloat16()), ValueError, "v has shape"),
    "k-tokens": (dict(k=torch.randn(10, 2, 16).bfloat16(), v=torch.randn(10, 2, 16).bfloat16()), ValueError, "k has 10 tokens"),
    "window-negative": (dict(window=-1), ValueError, "window"),
    "scale-zero": (dict(scale=0.0), ValueError, "scale"),
    "max-seqlen-short": (dict(max_seqlen=3), ValueError, "max_seqlen"),
}


@pytest.mark.parametrize("case", list(PACKED_BAD), ids=list(PACKED_BAD))
def test_bad_packed_input(case):
    change, exc, match = PACKED_BAD[case]
    args = {**_packed_args(), **change}
    with pytest.raises(exc, match=match):
        attention(**args)


PAGED_BAD = {
    "table-past-cache": (dict(block_table=torch.tensor([[2, 4]], dtype=torch.int32)), "points past the cache"),
    "table-negative": (dict(block_table=torch.tensor([[2, -1]], dtype=torch.int32)), "block_table\\[0, 1\\] = -1"),
    "position-past-cache": (dict(seq_lens=torch.tensor([129], dtype=torch.int32)), "past the cache"),
    "context-shorter-than-queries": (dict(seq_lens=torch.tensor([0], dtype=torch.int32)), "shorter than its 1 new queries"),
    "heads-not-dividing": (dict(q=torch.randn(1, 5, 16).bfloat16()), "not a multiple"),
    "cu-not-matching": (dict(cu_seqlens_q=torch.tensor([0, 2], dtype=torch.int32)), "ends at 2"),
    "batch-mismatch": (dict(seq_lens=torch.tensor([70, 3], dtype=torch.int32)), "describes 1 sequences"),
    "page-size": (dict(k_cache=torch.zeros(4, 32, 2, 16).bfloat16(), v_cache=torch.zeros(4, 32, 2, 16).bfloat16()), "PAGE_SIZE"),
    "cache-dtype": (dict(k_cache=torch.zeros(4, 64, 2, 16), v_cache=torch.zeros(4, 64, 2, 16)), "cache dtype"),
}


@pytest.mark.parametrize("case", list(PAGED_BAD), ids=list(PAGED_BAD))
def test_bad_paged_input(case):
    change, match = PAGED_BAD[case]
    args = {**_paged_args(), **change}
    with pytest.raises((ValueError, TypeError), match=match):
        paged_attention(**args)


def test_window_skips_freed_pages():
    """With a window the blocks before it are never read: their table entries
    may be freed (-1) and the checks accept it."""
    a = _paged_args()
    o_full = paged_attention(**a, window=4)
    assert not torch.equal(o_full, paged_attention(**a))  # the window does cut
    a["block_table"] = torch.tensor([[-1, 0]], dtype=torch.int32)
    o_freed = paged_attention(**a, window=4)
    assert torch.equal(o_full, o_freed)
    assert torch.equal(decode_attention(a["q"], a["k_cache"], a["v_cache"], a["seq_lens"], a["block_table"], window=4), o_full)
    with pytest.raises(ValueError, match="points past the cache"):
        paged_attention(**a, window=8)


def test_scale_default():
    q, k, v, cu = make_inputs([40], 2, 2, 16)
    assert torch.equal(attention(q, k, v, cu), attention(q, k, v, cu, scale=1 / math.sqrt(16)))
