"""Ladder rungs for attention, and a small serving simulation the tests share.

Rung 1: the packed forward twice.  Rung 2: a sequence's rows do not depend on
the batch (other sequences, order, padding sequences, launch knobs).  Rung 3:
the same tokens through the server — full prefill, token-by-token decode with
sequences joining late, chunked prefill at random split points mixed with
decode, decode across the 1024-position segment boundaries — give the training
path's bits for every row (shuffled page order).
"""
from __future__ import annotations

import contextlib
import random

import torch

from ..kv_cache import BlockManager, allocate_kv_cache, write_kv
from ..ladder import RungResult, accuracy, rows_differing, rung1_repeat, rung2_rows
from .naive import attention_ref
from .op import _scale, attention_fwd, check_paged_inputs, paged_attention_fwd

NAME = "attention"


def make_inputs(lens, hq, hkv, d, *, dtype=torch.bfloat16, device="cpu", seed=0):
    """Random packed q (T, Hq, D), k, v (T, Hkv, D) and cu_seqlens (int32)."""
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q, k, v = (torch.randn(T, h, d, generator=g).to(dtype).to(device) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return q, k, v, cu


# ---------------------------------------------------------------- schedules
def prefill_schedule(lens):
    """One step: every prompt whole."""
    return [{b: n for b, n in enumerate(lens) if n}]


def decode_schedule(lens, join=None):
    """Token by token; sequence b joins at step join[b] (default 0)."""
    join = join or [0] * len(lens)
    steps = []
    for t in range(max(j + n for j, n in zip(join, lens))):
        step = {b: 1 for b, n in enumerate(lens) if join[b] <= t < join[b] + n}
        if step:
            steps.append(step)
    return steps


def chunked_schedule(lens, seed=0, max_chunk=200):
    """Random split points: each step gives every unfinished sequence a random
    chunk (1 = a decode token) and leaves some sequences out (late joins)."""
    rng = random.Random(seed)
    done = [0] * len(lens)
    steps = []
    while any(d < n for d, n in zip(done, lens)):
        step = {}
        for b, n in enumerate(lens):
            if done[b] < n and rng.random() < 0.7:
                c = min(n - done[b], rng.choice([1, 1, 2, 63, 64, 65, rng.randint(1, max_chunk)]))
                step[b] = c
                done[b] += c
        if step:
            steps.append(step)
    return steps


def serve(q, k, v, cu_seqlens, steps, *, window=0, scale=None, shuffle_seed=0, nan_cache=True, check=False, attn=None, **knobs):
    """Run packed tokens through a paged-cache server.

    Each step maps sequence -> number of its next tokens; the step writes their
    k/v with ``write_kv`` (pages from a shuffled free list; the cache starts
    as NaN so a read of an unwritten slot shows) and runs the paged forward on
    their queries.  Returns (o, lse) in the packed order of q.
    ``attn`` replaces ``paged_attention_fwd`` (the counter-examples below).
    """
    attn = attn or paged_attention_fwd
    cu = cu_seqlens.tolist()
    lens = [b - a for a, b in zip(cu[:-1], cu[1:])]
    hkv, d = k.shape[1], k.shape[2]
    n_pages = sum(-(-n // 64) for n in lens) + 2
    kc, vc = allocate_kv_cache(n_pages, hkv, d, dtype=k.dtype, device=k.device)
    if nan_cache:
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
    bm = BlockManager(n_pages, shuffle_seed=shuffle_seed)
    o = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    done = [0] * len(lens)
    for step in steps:
        seqs = list(step)
        idx, slots, qlens = [], [], []
        for b in seqs:
            n = step[b]
            idx.append(torch.arange(cu[b] + done[b], cu[b] + done[b] + n))
            slots += bm.append(b, n)
            qlens.append(n)
            done[b] += n
        idx = torch.cat(idx).to(q.device)
        write_kv(k[idx], v[idx], kc, vc, torch.tensor(slots, dtype=torch.int32, device=q.device))
        cu_q = torch.tensor([0, *torch.tensor(qlens).cumsum(0).tolist()], dtype=torch.int32, device=q.device)
        args = (q[idx], kc, vc, cu_q, bm.seq_lens(seqs, device=q.device), bm.block_tables(seqs, device=q.device))
        if check:
            check_paged_inputs(*args, window=window, scale=scale)
        o_s, lse_s = attn(*args, max_seqlen_q=max(qlens), window=window, scale=scale, **knobs)
        o[idx] = o_s
        lse[idx] = lse_s
    return o, lse


def split_kv_decode(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, split=64, **kw):
    """A deliberately wrong decode: KV split at a page boundary that is not a
    segment boundary, two passes, merged by their LSEs (a split-KV merge that
    is not the fixed segment order)."""
    o_a, lse_a = paged_attention_fwd(q, k_cache, v_cache, cu_seqlens_q, torch.clamp(seq_lens, max=split), block_table, **kw)
    long = seq_lens > split
    if not bool(long.any()):
        return o_a, lse_a
    table_b = block_table[:, split // 64 :].clone()
    table_b[~long, 0] = block_table[~long, 0]  # short sequences: a dummy 1-token pass over a real page
    o_b, lse_b = paged_attention_fwd(q, k_cache, v_cache, cu_seqlens_q, torch.where(long, seq_lens - split, 1), table_b, **kw)
    lse = torch.logaddexp(lse_a, lse_b)
    w_a, w_b = torch.exp(lse_a - lse)[..., None], torch.exp(lse_b - lse)[..., None]
    merged = (o_a.float() * w_a + o_b.float() * w_b).to(q.dtype)
    rows = long.repeat_interleave(torch.diff(cu_seqlens_q).long())[:, None, None]
    return torch.where(rows, merged, o_a), torch.where(rows[..., 0], lse, lse_a)


def resegmented_decode(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table, *, max_seqlen_q, seg_blocks=8,
                       window=0, scale=None, **kw):
    """A deliberately wrong decode: one-query steps merge segments of
    ``seg_blocks`` pages (512 positions) instead of ``op.SEGMENT``; longer
    steps are left honest."""
    if max_seqlen_q != 1:
        return paged_attention_fwd(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table,
                                   max_seqlen_q=max_seqlen_q, window=window, scale=scale, **kw)
    args = (q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_table)
    if q.is_cuda:
        from .kernel import paged_attention_fwd_triton

        return paged_attention_fwd_triton(*args, 1, window, _scale(scale, q.shape[-1]), seg_blocks=seg_blocks, **kw)
    from .cpu import paged_attention_fwd_cpu

    return paged_attention_fwd_cpu(*args, window, _scale(scale, q.shape[-1]), seg_blocks=seg_blocks, **kw)


def compare_rows(primitive, check, out, ref) -> RungResult:
    mask = rows_differing(out, ref)
    bad = int(mask.sum())
    return RungResult(primitive, 3, check, bad == 0, mask.numel(), bad, f"{bad} token rows differ" if bad else "")


@contextlib.contextmanager
def _one_cpu_thread(device):
    # torch's 2-thread CPU loops were ~100x slower than 1 thread on the 2-core CI box
    n = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def ladder(device: torch.device) -> list[RungResult]:
    device = torch.device(device)
    with _one_cpu_thread(device):
        return _ladder(device)


def _ladder(device: torch.device) -> list[RungResult]:
    gpu = device.type == "cuda"
    hq, hkv, d = (8, 2, 128) if gpu else (4, 2, 16)
    lens = [300, 1, 64, 65, 129, 17] if not gpu else [1000, 1, 64, 65, 129, 593]
    q, k, v, cu = make_inputs(lens, hq, hkv, d, device=device)
    results = [rung1_repeat(NAME, lambda: attention_fwd(q, k, v, cu))]

    # rung 2: sequences as rows (zero-padded to the longest; lengths ride along)
    lens2 = [200, 1, 64, 65, 17] if not gpu else lens
    q, k, v, cu = make_inputs(lens2, hq, hkv, d, device=device, seed=5)
    B, Lmax = len(lens2), max(lens2)
    qs = torch.zeros(B, Lmax, hq, d, dtype=q.dtype, device=device)
    ks = torch.zeros(B, Lmax, hkv, d, dtype=k.dtype, device=device)
    vs = torch.zeros_like(ks)
    c = cu.tolist()
    for b in range(B):
        qs[b, : lens2[b]], ks[b, : lens2[b]], vs[b, : lens2[b]] = q[c[b] : c[b + 1]], k[c[b] : c[b + 1]], v[c[b] : c[b + 1]]
    n = torch.tensor(lens2, device=device)

    def packed(qs, ks, vs, n, **knobs):
        ln = n.tolist()
        cu_b = torch.tensor([0, *torch.tensor(ln).cumsum(0).tolist()], dtype=torch.int32, device=device)
        cat = lambda x: torch.cat([x[i, : ln[i]] for i in range(len(ln))])  # noqa: E731
        o, _ = attention_fwd(cat(qs), cat(ks), cat(vs), cu_b, **knobs)
        out = torch.zeros_like(qs)
        for i, (a, z) in enumerate(zip(cu_b[:-1].tolist(), cu_b[1:].tolist())):
            out[i, : z - a] = o[a:z]
        return out

    configs = ({}, {"num_stages": 2}, {"mask_all": True}) if gpu else ({}, {"row_chunk": 37})
    results.append(rung2_rows(NAME, packed, [qs, ks, vs, n], configs=configs, batch_sizes=(1, 2, 5)))

    # rung 3: train == server prefill == decode == chunked prefill
    q, k, v, cu = make_inputs(lens, hq, hkv, d, device=device)
    o, _ = attention_fwd(q, k, v, cu)
    results.append(compare_rows(NAME, "train==prefill", serve(q, k, v, cu, prefill_schedule(lens))[0], o))
    dec_lens = [min(n, 130) for n in lens]  # decode is one call per token on the CPU: keep it short
    q2, k2, v2, cu2 = make_inputs(dec_lens, hq, hkv, d, device=device, seed=1)
    o2, _ = attention_fwd(q2, k2, v2, cu2)
    join = [3 * b for b in range(len(dec_lens))]
    results.append(compare_rows(NAME, "train==decode (late joins)", serve(q2, k2, v2, cu2, decode_schedule(dec_lens, join), shuffle_seed=1)[0], o2))
    results.append(compare_rows(NAME, "train==chunked prefill", serve(q, k, v, cu, chunked_schedule(lens, seed=2), shuffle_seed=2)[0], o))
    ow, _ = attention_fwd(q, k, v, cu, window=128)
    results.append(compare_rows(NAME, "window 128: train==chunked", serve(q, k, v, cu, chunked_schedule(lens, seed=3), window=128, shuffle_seed=3)[0], ow))
    # decode steps across the 1024-position segment boundaries (CUDA: the split decode kernel)
    seg_lens = [1040, 2070] if gpu else [1040, 300]
    q3, k3, v3, cu3 = make_inputs(seg_lens, hq, hkv, d, device=device, seed=6)
    steps = [{0: 1000, 1: seg_lens[1] - 40}] + [{0: 1, 1: 1}] * 40
    results.append(compare_rows(NAME, "train==decode across segments", serve(q3, k3, v3, cu3, steps, shuffle_seed=4)[0],
                                attention_fwd(q3, k3, v3, cu3)[0]))

    qa, ka, va, cua = make_inputs([593, 100, 7], hq, hkv, 60 if not gpu else 96, device=device, seed=4)
    ref = attention_ref(qa, ka, va, cua)
    results.append(accuracy(NAME, attention_fwd(qa, ka, va, cua)[0], ref, 1e-2 if gpu else 4e-3, "vs float64 (bf16)"))
    return results
