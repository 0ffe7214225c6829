"""The vendor baseline's attention (``common/attention/vendor.py``): torch's
fast paths over the paged cache are accurate (not bitwise: they are the
mismatch the aligned kernels remove) on prefill, chunked prefill and decode,
and its decode replays from a CUDA graph."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.attention import attention_ref
from alignzoo.common.attention.checks import chunked_schedule, decode_schedule, make_inputs, prefill_schedule, serve
from alignzoo.common.attention.vendor import VendorAttention
from alignzoo.common.kv_cache import PAGE_SIZE
from alignzoo.common.ladder import rel_err


def _vendor(q, k_cache, v_cache, cu_q, seq_lens, block_table, *, max_seqlen_q, window=0, scale=None):
    """``paged_attention_fwd``'s signature for ``checks.serve``; the new rows'
    own k/v are read back from their slots (the server passes them directly)."""
    assert window == 0
    lens, qlens = seq_lens.long(), torch.diff(cu_q).long()
    b_of = torch.repeat_interleave(torch.arange(len(qlens), device=q.device), qlens)
    pos = (lens - qlens)[b_of] + torch.arange(q.shape[0], device=q.device) - cu_q[b_of].long()
    slots = block_table.long()[b_of, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE
    k, v = k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots]
    attend = VendorAttention(cu_q, seq_lens, block_table, max_seqlen_q, k_cache.shape[0], n_tokens=q.shape[0],
                             scale=scale)
    return attend(q, k, v, k_cache, v_cache), torch.zeros(q.shape[:2], device=q.device)  # no LSE


SCHEDULES = {"prefill": prefill_schedule, "decode": decode_schedule,
             "chunked": lambda lens: chunked_schedule(lens, seed=3)}


@pytest.mark.parametrize("schedule", list(SCHEDULES), ids=list(SCHEDULES))
def test_vendor_attention_is_accurate(device, schedule):
    lens = [300, 1, 130, 65] if device.type == "cpu" else [1500, 1, 700, 65, 64]
    q, k, v, cu = make_inputs(lens, 8, 2, 64 if device.type == "cpu" else 128, device=device, seed=4)
    o, _ = serve(q, k, v, cu, SCHEDULES[schedule](lens), shuffle_seed=2, nan_cache=False, attn=_vendor)
    assert rel_err(o, attention_ref(q, k, v, cu)) < 1e-2


@pytest.mark.gpu
def test_gpu_vendor_decode_replays_from_a_cuda_graph():
    """Decode through flex over the pages, captured once and replayed with
    other sequence lengths and pages written into the same inputs."""
    lens = [900, 64, 1]
    q, k, v, cu = make_inputs(lens, 8, 2, 128, device="cuda", seed=6)
    ref = attention_ref(q, k, v, cu)
    P, B, W = 52, len(lens), 16
    kc = torch.zeros(P, PAGE_SIZE, 2, 128, dtype=q.dtype, device="cuda")
    vc = torch.zeros_like(kc)
    table = torch.randperm(P)
    pages = [table[i * W:(i + 1) * W] for i in range(B)]
    for b, n in enumerate(lens):
        pos = torch.arange(n)
        slots = (pages[b][pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE).cuda()
        kc.flatten(0, 1)[slots] = k[cu[b]:cu[b + 1]]
        vc.flatten(0, 1)[slots] = v[cu[b]:cu[b + 1]]
    s_q = torch.zeros(B, 8, 128, dtype=q.dtype, device="cuda")
    s_lens = torch.ones(B, dtype=torch.int32, device="cuda")
    s_table = torch.zeros(B, W, dtype=torch.int32, device="cuda")
    s_cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")

    def step():
        return VendorAttention(s_cu, s_lens, s_table, 1, P, n_tokens=B)(s_q, None, None, kc, vc)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for upto in (lens, [n // 2 + 1 for n in lens]):
        last = torch.tensor([cu[b] + n - 1 for b, n in enumerate(upto)], device="cuda")
        s_q.copy_(q[last])
        s_lens.copy_(torch.tensor(upto, dtype=torch.int32))
        s_table.copy_(torch.stack(pages).to(torch.int32))
        graph.replay()
        want = torch.stack([attention_ref(q[cu[b]:cu[b] + n], k[cu[b]:cu[b] + n], v[cu[b]:cu[b] + n],
                                          torch.tensor([0, n], dtype=torch.int32, device="cuda"))[-1]
                            for b, n in enumerate(upto)])
        assert rel_err(out, want) < 1e-2
        if upto is lens:
            assert rel_err(out, ref[last]) < 1e-2
