"""Exact attention: every row has the same bits on the training path (packed),
server prefill, token-by-token decode and chunked prefill, whatever the batch
and page placement, across the 1024-position KV segments; accuracy and
gradients against float64."""
from __future__ import annotations

import math

import pytest
import torch

from alignzoo.common.attention import (
    attention,
    attention_bwd,
    attention_fwd,
    attention_ref,
    decode_attention,
    paged_attention,
    paged_attention_fwd,
)
from alignzoo.common.attention.checks import (
    chunked_schedule,
    compare_rows,
    decode_schedule,
    ladder,
    make_inputs,
    prefill_schedule,
    resegmented_decode,
    serve,
    split_kv_decode,
)
from alignzoo.common.attention.op import SEGMENT
from alignzoo.common.kv_cache import BlockManager, allocate_kv_cache, write_kv
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


# lens [2100, 1030, 64]: chunks up to just before a segment boundary, then decode steps across
# it (1024 for sequences 0 and 1, 2048 for sequence 0), mixed with the other sequences' chunks
SEGMENT_LENS = [2100, 1030, 64]
SEGMENT_STEPS = ([{0: 1019, 1: 1000, 2: 60}] + [{0: 1, 1: 1, 2: 1}] * 4 + [{0: 1, 1: 1}] * 6
                 + [{0: 1015, 1: 10}] + [{0: 1, 1: 1}] * 10 + [{0: 46}])


@pytest.mark.parametrize("hq,hkv,window", [(4, 2, 0), (3, 1, 128)], ids=["gqa2", "gqa3-window128"])
def test_long_sequences_cpu(hq, hkv, window):
    """Lengths to 2100 on the CPU (three 1024-position segments): prefill,
    and chunks then token-by-token decode across the 1024 and 2048 boundaries
    with the other sequences alongside.  With the window, rows from position
    1151 on see nothing in segment 0, and row chunks across a boundary hold
    rows that see nothing in the next segment (empty segments to merge)."""
    assert SEGMENT == 1024
    q, k, v, cu = make_inputs(SEGMENT_LENS, hq, hkv, 8, seed=7)
    o, lse = attention_fwd(q, k, v, cu, window=window)
    o_s, lse_s = serve(q, k, v, cu, SEGMENT_STEPS, window=window, shuffle_seed=5)
    assert torch.equal(o_s, o) and torch.equal(lse_s, lse)
    o_p, lse_p = serve(q, k, v, cu, prefill_schedule(SEGMENT_LENS), window=window, shuffle_seed=6)
    assert torch.equal(o_p, o) and torch.equal(lse_p, lse)
    ref, lse_ref = attention_ref(q, k, v, cu, window=window, return_lse=True)
    assert rel_err(o, ref) < 4e-3
    assert (lse.double() - lse_ref).abs().max().item() < 1e-4


def test_segment_size_is_caught(device):
    """A decode that merges 512-position segments instead of 1024 differs
    from training (rows past position 512) and is caught; it stays accurate."""
    lens = [700, 600]
    q, k, v, cu = make_inputs(lens, 4, 2, 16, device=device, seed=8)
    o, lse = attention_fwd(q, k, v, cu)
    steps = [{0: 640, 1: 540}] + [{0: 1, 1: 1}] * 60
    o_h, lse_h = serve(q, k, v, cu, steps)
    assert torch.equal(o_h, o) and torch.equal(lse_h, lse)
    o_w, lse_w = serve(q, k, v, cu, steps, attn=resegmented_decode)
    rows = torch.cat([torch.arange(640, 700), torch.arange(700 + 540, 1300)]).to(device)
    bad = (lse_w[rows] != lse[rows]).any(-1) | (o_w[rows] != o[rows]).flatten(1).any(-1)
    assert int(bad.sum()) > 0
    keep = torch.ones(q.shape[0], dtype=torch.bool, device=device)
    keep[rows] = False
    assert torch.equal(o_w[keep], o[keep])  # only the decode rows changed
    assert rel_err(o_w, attention_ref(q, k, v, cu)) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("d,window", [(128, 0), (128, 128), (256, 0), (64, 0)], ids=["d128", "d128-window128", "d256", "d64"])
def test_long_sequences_gpu(d, window):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [8200, 3100, 1, 700, 1100]  # the decoded last 300 tokens cross 8192, 3072 and 1024
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
    o_d, lse_d = serve(q, k, v, cu, steps, window=window, shuffle_seed=3)
    assert torch.equal(o_d, o) and torch.equal(lse_d, lse)


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
    — a second reduction outside the fixed segment order — differs from
    training and is caught."""
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
    q2, k2, v2, cu2 = make_inputs([1100, 3], 2, 1, 8, seed=6)  # row chunks across a segment boundary
    o2, lse2 = attention_fwd(q2, k2, v2, cu2, window=128)
    assert all(torch.equal(a, b) for a, b in zip(attention_fwd(q2, k2, v2, cu2, window=128, row_chunk=37), (o2, lse2)))
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
@pytest.mark.parametrize("d,window", [(128, 0), (128, 128), (64, 0)], ids=["d128", "d128-window128", "d64"])
def test_gpu_segments_same_bits(d, window):
    """SEGMENT_STEPS on the GPU: decode steps across 1024 and 2048 (the split
    decode kernel, ``decode_config``'s tile) between multi-query chunks (the
    tile kernel's in-register merge), under the free decode knobs: one or two
    programs walking each row's segments (``seg_programs``) instead of one
    per segment."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, k, v, cu = make_inputs(SEGMENT_LENS, 8, 2, d, device="cuda", seed=12)
    o, lse = attention_fwd(q, k, v, cu, window=window)
    for knobs in ({}, {"num_stages": 2}, {"num_stages": 4}, {"mask_all": True}, {"seg_programs": 1}, {"seg_programs": 2}):
        o_s, lse_s = serve(q, k, v, cu, SEGMENT_STEPS, window=window, shuffle_seed=5, **knobs)
        assert torch.equal(o_s, o) and torch.equal(lse_s, lse), knobs


@pytest.mark.gpu
def test_gpu_tile_shape_probe():
    """Probe, not a contract: do BLOCK_M = 64 (4 warps) and 128 (8 warps) give
    the same bits on this GPU?  ``kernel.decode_config`` relies on it for
    D <= 128 (``DECODE_SMALL_TILE``); if this fails, set that to False."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    for d in (128, 64):
        q, k, v, cu = make_inputs([1000, 64, 65, 1], 8, 2, d, device="cuda")
        o128, _ = attention_fwd(q, k, v, cu, block_m=128, num_warps=8)
        o64, _ = attention_fwd(q, k, v, cu, block_m=64, num_warps=4)
        assert torch.equal(o64, o128), d


@pytest.mark.gpu
@pytest.mark.parametrize("seg_programs", [None, 1, 3])
def test_gpu_decode_cuda_graph_replay(seg_programs):
    """Decode captured once in a CUDA graph over a fixed-width block table
    (4 segments), replayed while the sequences grow across 1024 and 2048:
    every replay gives the packed path's rows (and eager decode's), whether a
    program owns one segment or walks several (``seg_programs``)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    lens = [2100, 1100, 300, 1]
    B, width = len(lens), 64  # 64 pages: 4 segments, wider than any sequence needs
    q, k, v, cu = make_inputs(lens, 8, 2, 128, device="cuda", seed=13)
    o, lse = attention_fwd(q, k, v, cu)
    n_pages = sum(-(-n // 64) for n in lens) + 1
    kc, vc = allocate_kv_cache(n_pages, 2, 128, device="cuda")
    bm = BlockManager(n_pages, shuffle_seed=3)
    slots = [s for b, n in enumerate(lens) for s in bm.append(b, n)]  # all K/V up front: never read past seq_lens
    write_kv(k, v, kc, vc, torch.tensor(slots, dtype=torch.int32, device="cuda"))
    table = torch.zeros(B, width, dtype=torch.int32, device="cuda")
    for b in range(B):
        pages = bm.block_table(b)
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int32)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    q_s = q[cu[:-1].long()].clone()  # static inputs: position 0 of every sequence
    sl_s = torch.ones(B, dtype=torch.int32, device="cuda")
    kw = dict(max_seqlen_q=1, seg_programs=seg_programs)
    paged_attention_fwd(q_s, kc, vc, cu_q, sl_s, table, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_s, lse_s = paged_attention_fwd(q_s, kc, vc, cu_q, sl_s, table, **kw)
    for p in (0, 1, 63, 64, 700, 1022, 1023, 1024, 1025, 1099, 2046, 2047, 2048, 2049, 2099):
        pos = [min(p, n - 1) for n in lens]
        rows = (cu[:-1] + torch.tensor(pos, device="cuda")).long()
        q_s.copy_(q[rows])
        sl_s.copy_(torch.tensor(pos, dtype=torch.int32, device="cuda") + 1)
        graph.replay()
        o_e, lse_e = paged_attention_fwd(q_s, kc, vc, cu_q, sl_s, table, max_seqlen_q=1)  # the default programs
        assert torch.equal(o_s, o[rows]) and torch.equal(lse_s, lse[rows]), p
        assert torch.equal(o_e, o_s) and torch.equal(lse_e, lse_s), p


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


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_seg_programs(bad):
    with pytest.raises(ValueError, match="seg_programs"):
        paged_attention_fwd(**_paged_args(), max_seqlen_q=1, seg_programs=bad)


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
