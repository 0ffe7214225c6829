"""Exact attention against vendor attention kernels at Qwen3-8B shapes (H200).

    . benchmarks/gpu_env.sh && python benchmarks/bench_attention.py [--quick] [--out DIR]

One run, one process, three sections (Hq 32, Hkv 8, D 128, bf16):

- prefill: ``attention_fwd`` (packed causal GQA, the training / prefill path)
  and ``paged_attention_fwd`` (the whole prompt into an empty paged cache,
  K/V written before timing) against ``F.scaled_dot_product_attention``
  forced to the flash backend (``is_causal=True``, GQA through
  ``enable_gqa=True``, or K/V repeated outside the timing if that fails), for
  one sequence of S = 1024, 4096, 16384 and a packed batch of 4 x 1024.
- backward: ``attention_bwd`` against the SDPA flash backward
  (``torch.autograd.grad`` of the flash forward) at S = 4096.
- decode: ``paged_attention_fwd`` with ``max_seqlen_q=1`` — the split decode
  kernel: one program per (1024-position segment, sequence, kv head), then the
  in-order merge kernel; its tile is ``kernel.decode_config`` (recorded in the
  table note; ``--decode-tile prefill`` runs the prefill tile instead) — (one
  query per sequence, cache pages shuffled by ``BlockManager``; the block
  table padded to ``--decode-table-pages`` pages when given, as a CUDA-graph
  batch pads it, so the extra segments' programs are timed) against the first vendor
  paged-decode kernel that imports, runs and agrees with ours to bf16
  tolerance: flash_attn ``flash_attn_with_kvcache`` (its own page-256 cache
  holding the same K/V), flashinfer ``BatchDecodeWithPagedKVCacheWrapper``,
  compiled ``flex_attention`` with a block mask over the physical pages, else
  SDPA on K/V gathered to contiguous tensors (gather not timed, labelled
  "sdpa-contiguous (not paged)").  B = 1, 8, 64, 256 x context 512, 2048, 8192.

Bit checks run before any timing: decode rows == the last rows of the same
sequences through the packed prefill (torch.equal); paged prefill == packed
prefill; packed forward and backward repeat bitwise.  A FAIL is still timed and
marked.  Times are ``bench_primitives._time`` (triton do_bench median, L2
flushed); ratio = vendor_ms / ours_ms (>= 1: ours is as fast or faster).
Writes attention.json and attention.md to --out after every row; after
--budget-s seconds (default 120) the remaining configs get 'skipped' rows, so a
cold run (Triton and Inductor compiles; flex compiles once per batch size)
stays under ~150 s.  Every config runs in its own try: a failure is an error
row.  ``--cpu-smoke`` runs tiny shapes on the CPU (code paths only).
"""
from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import os
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_engine import sync_device  # noqa: E402
from bench_primitives import HEAD_DIM, HEADS, KV_HEADS, _time, _time_wall, commit, ensure_alignzoo  # noqa: E402

HQ, HKV, D = HEADS, KV_HEADS, HEAD_DIM  # Qwen3-8B: 32 query heads, 8 kv heads, head_dim 128
G = HQ // HKV
DTYPE = torch.bfloat16
VENDOR_ATOL = VENDOR_RTOL = 1e-2  # a decode baseline must agree with ours this well to be used

FULL = dict(prefill=[[1024], [4096], [16384], [1024] * 4], backward=[4096],
            decode_b=[1, 8, 64, 256], decode_ctx=[512, 2048, 8192])
QUICK = dict(prefill=[[1024], [4096]], backward=[4096], decode_b=[1, 64], decode_ctx=[512, 8192])
SMOKE = dict(prefill=[[128], [64] * 2], backward=[128], decode_b=[1, 2], decode_ctx=[128, 192])
SECTIONS = ("prefill", "backward", "decode")


# ---------------------------------------------------------------- environment
def _probe_packages() -> dict:
    """Which vendor attention packages import here (name -> status)."""
    out = {}
    for name in ("flash_attn", "flashinfer", "vllm", "sgl_kernel"):
        try:
            if importlib.util.find_spec(name) is None:
                out[name] = "not installed"
                continue
            mod = importlib.import_module(name)
            out[name] = f"imports (version {getattr(mod, '__version__', '?')})"
        except Exception as e:  # a broken install must not stop the benchmark
            out[name] = f"import failed: {_err(e)}"
    return out


def _err(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:300]


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


# ---------------------------------------------------------------- data
def _packed(lens, dev, seed):
    """Random packed q (T, Hq, D), k, v (T, Hkv, D), cu_seqlens int32."""
    g = torch.Generator(device=dev).manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, HQ, D, generator=g, device=dev, dtype=DTYPE)
    k = torch.randn(T, HKV, D, generator=g, device=dev, dtype=DTYPE)
    v = torch.randn(T, HKV, D, generator=g, device=dev, dtype=DTYPE)
    cu = torch.tensor([0] + [sum(lens[: i + 1]) for i in range(len(lens))], dtype=torch.int32, device=dev)
    return q, k, v, cu


def _paged_cache(k, v, lens, seed):
    """Write packed k/v (sequences in order) into a fresh paged cache whose
    pages come from a shuffled free list: (k_cache, v_cache, block_table, seq_lens)."""
    from alignzoo.common.kv_cache import PAGE_SIZE, BlockManager, allocate_kv_cache, write_kv_fwd

    n_pages = sum(-(-n // PAGE_SIZE) for n in lens)
    bm = BlockManager(n_pages, shuffle_seed=seed)
    slots = []
    for b, n in enumerate(lens):
        slots += bm.append(b, n)
    kc, vc = allocate_kv_cache(n_pages, HKV, D, dtype=k.dtype, device=k.device)
    write_kv_fwd(k, v, kc, vc, torch.tensor(slots, dtype=torch.int32, device=k.device))
    ids = list(range(len(lens)))
    return kc, vc, bm.block_tables(ids, device=k.device), bm.seq_lens(ids, device=k.device)


# ---------------------------------------------------------------- SDPA
def _sdpa_forward(q, k, v, *, causal, backends):
    """(fn, label): SDPA restricted to one backend, the first of ``backends``
    x (enable_gqa, K/V repeated outside the timing) that runs.  q (B, Hq, S, D),
    k/v (B, Hkv, S, D) (any strides with a contiguous last dim)."""
    from torch.nn.attention import sdpa_kernel

    errors = []
    for be in backends:
        for gqa in (True, False):
            kk, vv = (k, v) if gqa else (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))

            def fn(kk=kk, vv=vv, be=be, gqa=gqa):
                with sdpa_kernel(be):
                    return F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa)

            try:
                fn()
                sync_device(q.device)
                return fn, f"{be.name.lower()}, {'enable_gqa' if gqa else 'K/V repeated'}"
            except RuntimeError as e:
                errors.append(f"{be.name}/{'gqa' if gqa else 'repeat'}: {_err(e)}")
    raise RuntimeError("no SDPA variant ran: " + " | ".join(errors))


def _sdpa_backward(q, k, v, do):
    """(fn, label, dq): the flash backward of a causal SDPA forward; fn runs
    only the backward (autograd.grad with retain_graph)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    errors = []
    for gqa in (True, False):
        try:
            qs = q.detach().requires_grad_(True)
            ks = (k if gqa else k.repeat_interleave(G, dim=1)).detach().requires_grad_(True)
            vs = (v if gqa else v.repeat_interleave(G, dim=1)).detach().requires_grad_(True)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)

            def fn(out=out, qs=qs, ks=ks, vs=vs):
                return torch.autograd.grad(out, (qs, ks, vs), do, retain_graph=True)

            grads = fn()
            sync_device(q.device)
            return fn, f"flash_attention, {'enable_gqa' if gqa else 'K/V repeated'}", grads[0]
        except RuntimeError as e:
            errors.append(f"{'gqa' if gqa else 'repeat'}: {_err(e)}")
    raise RuntimeError("SDPA flash backward did not run: " + " | ".join(errors))


def _bshd(x, B, S):
    """Packed (B*S, H, D) -> (B, H, S, D) view (the BSHD layout flash reads natively)."""
    return x.view(B, S, x.shape[1], x.shape[2]).transpose(1, 2)


# ---------------------------------------------------------------- rows
def _row(section, config, ours, vendor, **kw):
    r = dict(section=section, config=config, ours=ours, ours_ms=None, vendor=vendor, vendor_ms=None, ratio=None,
             check=None, bits=None, vendor_maxdiff=None, error=None, note=None)
    r.update(kw)
    return r


def _timed(r, key, fn, timer):
    """Time fn into r[key]; an error goes to r['error'] and the row stays."""
    try:
        r[key] = timer(fn)
    except Exception as e:
        msg = f"{key[:-3]} timing failed: {_err(e)}"
        r["error"] = f"{r['error']}; {msg}" if r["error"] else msg
        print(f"    ! {msg}", flush=True)


def _time_both(r, dev, ours, vendor_fn, timer):
    """Ours, then the vendor's when it set up; errors stay in the row."""
    sync_device(dev)
    _timed(r, "ours_ms", ours, timer)
    if vendor_fn is not None:
        _timed(r, "vendor_ms", vendor_fn, timer)


def bench_prefill(ctx, lens):
    from alignzoo.common.attention import attention_fwd, paged_attention_fwd
    from torch.nn.attention import SDPBackend

    dev, B, S, T = ctx.dev, len(lens), max(lens), sum(lens)
    assert all(n == S for n in lens), "the SDPA baseline is a padded batch: equal lengths only"
    config = f"S={S}" if B == 1 else f"{B}x{S} packed"
    q, k, v, cu = _packed(lens, dev, seed=S + B)
    r_pk = _row("prefill", config, "attention_fwd (packed)", "sdpa", check="forward twice: same bits")
    r_pg = _row("prefill", config, "paged_attention_fwd (empty cache, pages shuffled)", "sdpa",
                check="paged == packed")

    o, _ = attention_fwd(q, k, v, cu, max_seqlen=S)
    r_pk["bits"] = "PASS" if torch.equal(attention_fwd(q, k, v, cu, max_seqlen=S)[0], o) else "FAIL"
    kc, vc, bt, sl = _paged_cache(k, v, lens, seed=S)
    o_pg, _ = paged_attention_fwd(q, kc, vc, cu, sl, bt, max_seqlen_q=S)
    r_pg["bits"] = "PASS" if torch.equal(o_pg, o) else "FAIL"

    vendor_fn = None
    try:
        q4, k4, v4 = _bshd(q, B, S), _bshd(k, B, S), _bshd(v, B, S)
        fn, label = _sdpa_forward(q4, k4, v4, causal=True, backends=[SDPBackend.FLASH_ATTENTION])
        diff = _maxdiff(fn().transpose(1, 2).reshape(T, HQ, D), o)
        for r in (r_pk, r_pg):
            r["vendor"], r["vendor_maxdiff"] = f"sdpa ({label})", diff
        vendor_fn = fn
    except Exception as e:
        for r in (r_pk, r_pg):
            r["error"] = f"vendor: {_err(e)}"
    sync_device(dev)

    _timed(r_pk, "ours_ms", lambda: attention_fwd(q, k, v, cu, max_seqlen=S), ctx.timer)
    _timed(r_pg, "ours_ms", lambda: paged_attention_fwd(q, kc, vc, cu, sl, bt, max_seqlen_q=S), ctx.timer)
    if vendor_fn is not None:
        _timed(r_pk, "vendor_ms", vendor_fn, ctx.timer)
        r_pg["vendor_ms"] = r_pk["vendor_ms"]
    return [r_pk, r_pg]


def bench_backward(ctx, S):
    from alignzoo.common.attention import attention_bwd, attention_fwd

    dev = ctx.dev
    q, k, v, cu = _packed([S], dev, seed=7 * S)
    o, lse = attention_fwd(q, k, v, cu, max_seqlen=S)
    g = torch.Generator(device=dev).manual_seed(S)
    do = torch.randn(o.shape, generator=g, device=dev, dtype=DTYPE)
    r = _row("backward", f"S={S}", "attention_bwd (dq, dk, dv)", "sdpa flash backward",
             check="backward twice: same bits")

    def ours():
        return attention_bwd(q, k, v, o, lse, do, cu, max_seqlen=S)

    g1, g2 = ours(), ours()
    r["bits"] = "PASS" if all(torch.equal(a, b) for a, b in zip(g1, g2)) else "FAIL"
    vendor_fn = None
    try:
        fn, label, dq = _sdpa_backward(_bshd(q, 1, S), _bshd(k, 1, S), _bshd(v, 1, S), _bshd(do, 1, S))
        r["vendor"] = f"sdpa backward ({label})"
        r["vendor_maxdiff"] = _maxdiff(dq.transpose(1, 2).reshape(S, HQ, D), g1[0])
        r["note"] = "vendor max abs diff is on dq"
        vendor_fn = fn
    except Exception as e:
        r["error"] = f"vendor: {_err(e)}"
    _time_both(r, dev, ours, vendor_fn, ctx.timer)
    return [r]


# ---------------------------------------------------------------- decode baselines
# Each builder takes the decode case c (q (B, Hq, D), packed k/v, our paged
# cache kc/vc/bt/sl, B, ctx) and returns (fn, label); fn() -> (B, Hq, D).
def _decode_flash_attn(c):
    from flash_attn import flash_attn_with_kvcache

    page = 256  # flash-attn 2's paged KV needs a page size divisible by 256
    if c.ctx % page:
        raise ValueError(f"context {c.ctx} is not a multiple of flash-attn's page {page}")
    n = c.B * c.ctx // page
    perm = torch.randperm(n, device=c.dev)
    kc = torch.empty(n, page, HKV, D, dtype=DTYPE, device=c.dev)
    vc = torch.empty_like(kc)
    kc[perm] = c.k.view(n, page, HKV, D)  # sequence b's logical page j -> physical page perm[b * pps + j]
    vc[perm] = c.v.view(n, page, HKV, D)
    bt = perm.view(c.B, c.ctx // page).to(torch.int32)
    q = c.q.unsqueeze(1)  # (B, 1, Hq, D)
    seqlens = c.sl.to(torch.int32)

    def fn():
        return flash_attn_with_kvcache(q, kc, vc, cache_seqlens=seqlens, block_table=bt, causal=True).squeeze(1)

    return fn, "flash_attn.flash_attn_with_kvcache (paged, page 256)"


def _decode_flashinfer(c):
    import flashinfer

    from alignzoo.common.kv_cache import PAGE_SIZE

    ws = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=c.dev)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")  # NHD == our (pages, 64, Hkv, D) layout
    n_pages = -(-c.sl.long() // PAGE_SIZE)
    indptr = torch.zeros(c.B + 1, dtype=torch.int32, device=c.dev)
    indptr[1:] = n_pages.cumsum(0).to(torch.int32)
    indices = torch.cat([c.bt[b, : int(n_pages[b])] for b in range(c.B)]).to(torch.int32)
    last = (c.sl.long() - (n_pages - 1) * PAGE_SIZE).to(torch.int32)
    try:
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE_SIZE, q_data_type=DTYPE, kv_data_type=DTYPE)
    except TypeError:  # older flashinfer: data_type names the kv dtype
        w.plan(indptr, indices, last, HQ, HKV, D, PAGE_SIZE, data_type=DTYPE, q_data_type=DTYPE)
    run = w.run if hasattr(w, "run") else w.forward
    kv = (c.kc, c.vc)

    def fn():
        return run(c.q, kv)

    return fn, f"flashinfer BatchDecodeWithPagedKVCacheWrapper (NHD, page {PAGE_SIZE})"


_FLEX = None


def _decode_flex(c):
    """flex_attention (torch.compile, dynamic=False so the decode kernel is
    used) over the physical pages: K/V as one (1, Hkv, pages*64, D) sequence
    holding our cache's pages in place, and a BlockMask whose kv_indices are our
    block tables (block size 64 = a page).  Contexts are whole pages, so every
    listed block is fully visible: no mask_mod (noop).  The blocks are passed
    as partial, not 'full', blocks: flex-decode splits the KV of full blocks
    over the whole physical length instead of the sequence's."""
    global _FLEX
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    from alignzoo.common.kv_cache import PAGE_SIZE

    if c.ctx % PAGE_SIZE:
        raise ValueError(f"context {c.ctx} is not whole pages")
    if _FLEX is None:
        # one compile per decode shape; past dynamo's recompile limit flex would
        # run unfused (the whole score matrix) instead
        dynamo_config = importlib.import_module("torch._dynamo").config
        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, 256)
                break
        _FLEX = torch.compile(flex_attention, dynamic=False)
    # (1, Hkv, P*64, D) holding our cache's pages in place, padded to the page count of this
    # batch size's longest context, so every context of one B has the same shapes: one compile per B
    n = c.kc.shape[0] * PAGE_SIZE
    P = max(c.kc.shape[0], c.flex_pages)
    kf = torch.zeros(1, HKV, P * PAGE_SIZE, D, dtype=DTYPE, device=c.dev)
    vf = torch.zeros_like(kf)
    kf[0, :, :n] = c.kc.view(n, HKV, D).transpose(0, 1)
    vf[0, :, :n] = c.vc.view(n, HKV, D).transpose(0, 1)
    n_blocks = c.ctx // PAGE_SIZE
    kv_num = torch.full((c.B, 1, 1), n_blocks, dtype=torch.int32, device=c.dev)
    # one column per physical page, as PagedAttention.convert_logical_block_mask pads it
    # (flex checks KV_LEN <= columns * 64 on some backends); columns past n_blocks are never read
    kv_idx = torch.zeros(c.B, 1, 1, P, dtype=torch.int32, device=c.dev)
    kv_idx[:, 0, 0, :n_blocks] = c.bt[:, :n_blocks].to(torch.int32)
    mask = BlockMask.from_kv_blocks(kv_num, kv_idx, BLOCK_SIZE=(128, PAGE_SIZE), seq_lengths=(1, P * PAGE_SIZE),
                                    compute_q_blocks=False)
    q = c.q.unsqueeze(2)  # (B, Hq, 1, D)

    def fn():
        return _FLEX(q, kf, vf, block_mask=mask, enable_gqa=True).squeeze(2)

    return fn, "flex_attention (compiled, block mask over the paged cache, page 64)"


def _decode_sdpa_contiguous(c):
    from torch.nn.attention import SDPBackend

    from alignzoo.common.kv_cache import PAGE_SIZE

    n_blocks = -(-c.ctx // PAGE_SIZE)
    idx = c.bt[:, :n_blocks].long()
    kg = c.kc[idx].reshape(c.B, n_blocks * PAGE_SIZE, HKV, D)[:, : c.ctx].transpose(1, 2)  # gathered, not timed
    vg = c.vc[idx].reshape(c.B, n_blocks * PAGE_SIZE, HKV, D)[:, : c.ctx].transpose(1, 2)
    q = c.q.unsqueeze(2)
    fn, label = _sdpa_forward(q, kg, vg, causal=False,
                              backends=[SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    return (lambda: fn().squeeze(2)), f"sdpa-contiguous (not paged) [{label}]"


DECODE_BASELINES = [("flash_attn", _decode_flash_attn), ("flashinfer", _decode_flashinfer),
                    ("flex_attention", _decode_flex), ("sdpa-contiguous", _decode_sdpa_contiguous)]


def _choose_decode_baseline(ctx, c, o_ours):
    """The first baseline that imports, runs and agrees with our output."""
    for name, build in DECODE_BASELINES:
        try:
            fn, label = build(c)
            out = fn()
            sync_device(c.dev)
            diff = _maxdiff(out, o_ours)
            if not torch.allclose(out.float(), o_ours.float(), atol=VENDOR_ATOL, rtol=VENDOR_RTOL):
                raise ValueError(f"output differs from ours by up to {diff:.3g} (atol/rtol {VENDOR_ATOL})")
            ctx.decode_attempts[name] = f"chosen: {label}"
            ctx.decode_baseline = (name, build)
            print(f"    decode baseline: {label}", flush=True)
            return fn, label
        except Exception as e:
            ctx.decode_attempts[name] = _err(e)
            print(f"    decode baseline {name} not used: {_err(e)}", flush=True)
            gc.collect()
    ctx.decode_baseline = ("none", _no_decode_baseline)  # do not retry the cascade on every config
    raise RuntimeError("no decode baseline ran (see decode_attempts)")


def _no_decode_baseline(c):
    raise RuntimeError("no decode baseline ran (see decode_attempts)")


def bench_decode(ctx, B, n_ctx):
    from alignzoo.common.attention import attention_fwd, paged_attention_fwd

    dev = ctx.dev
    lens = [n_ctx] * B
    q_all, k, v, cu = _packed(lens, dev, seed=B * 100_003 + n_ctx)
    last = (cu[1:] - 1).long()
    # the reference: the same sequences through the packed prefill, last rows
    o_pre = attention_fwd(q_all, k, v, cu, max_seqlen=n_ctx)[0][last]
    q = q_all[last].contiguous()  # (B, Hq, D): each sequence's last query
    del q_all
    kc, vc, bt, sl = _paged_cache(k, v, lens, seed=B + n_ctx)
    bt_ours = bt
    if ctx.table_pages > bt.shape[1]:  # a CUDA-graph batch's fixed width: more (empty) segments
        bt_ours = torch.zeros(B, ctx.table_pages, dtype=bt.dtype, device=dev)
        bt_ours[:, : bt.shape[1]] = bt
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)

    def ours():
        return paged_attention_fwd(q, kc, vc, cu_q, sl, bt_ours, max_seqlen_q=1)[0]

    o_dec = ours()
    r = _row("decode", f"B={B} ctx={n_ctx}", "paged_attention_fwd (max_seqlen_q=1)", None,
             check="decode == packed prefill's last rows",
             bits="PASS" if torch.equal(o_dec, o_pre) else "FAIL")
    del o_pre
    c = SimpleNamespace(dev=dev, B=B, ctx=n_ctx, q=q, k=k, v=v, kc=kc, vc=vc, bt=bt, sl=sl,
                        flex_pages=B * getattr(ctx, "max_ctx", n_ctx) // 64)
    vendor_fn = None
    try:
        if ctx.decode_baseline is None:
            fn, label = _choose_decode_baseline(ctx, c, o_dec)
        else:
            fn, label = ctx.decode_baseline[1](c)
        out = fn()  # also compiles (flex) before the timing
        r["vendor"], r["vendor_maxdiff"] = label, _maxdiff(out, o_dec)
        if not torch.allclose(out.float(), o_dec.float(), atol=VENDOR_ATOL, rtol=VENDOR_RTOL):
            r["note"] = "vendor output differs from ours beyond bf16 tolerance"
        vendor_fn = fn
    except Exception as e:
        r["vendor"] = ctx.decode_baseline[0] if ctx.decode_baseline else None
        r["error"] = f"vendor: {_err(e)}"
    _time_both(r, dev, ours, vendor_fn, ctx.timer)
    return [r]


# ---------------------------------------------------------------- output
def _fmt_ms(x):
    return "—" if x is None else f"{x:.4f}"


def _ratio_str(r):
    if r["ratio"] is None:
        return "—"
    s = f"{r['ratio']:.2f}"
    return f"{s} (bits FAIL)" if r["bits"] == "FAIL" else s


def _write(out_dir, meta, rows):
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "attention.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    L = [f"# Attention benchmarks ({meta['gpu']}, {meta['date']}, commit {meta['commit']})", "",
         f"Command: `{meta['command']}` · torch {meta['torch']} · triton {meta['triton']} · CUDA {meta['cuda']}", "",
         f"Shapes: Qwen3-8B attention (Hq {HQ}, Hkv {HKV}, D {D}, bf16). Times: {meta['timing']}.", "",
         "ratio = vendor ms / ours ms (≥ 1: ours as fast or faster). 'bits' = the exactness check of the row "
         "(column 'check'), run before timing; a FAIL row is still timed and marked. Without --cuda-graphs "
         "the smallest decode configs may include either side's CPU launch overhead.", "",
         f"Vendor packages: {', '.join(f'{k}: {v}' for k, v in meta['packages'].items())}.", "",
         f"Decode (ours): {meta['decode_kernel']}.", "",
         f"Decode baseline: {meta['decode_baseline'] or 'none chosen'}"
         + ("" if not meta["decode_attempts"] else " (attempts: "
            + "; ".join(f"{k}: {v}" for k, v in meta["decode_attempts"].items()) + ")") + ".", ""]
    for section in SECTIONS:
        rs = [r for r in rows if r["section"] == section]
        if not rs:
            continue
        L += [f"## {section}", "",
              "| config | ours | ours ms | vendor | vendor ms | ratio | bits | check | vendor max abs diff "
              "| error / note |", "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rs:
            md = "—" if r["vendor_maxdiff"] is None else f"{r['vendor_maxdiff']:.2e}"
            extra = "; ".join(x for x in (r["error"], r["note"]) if x) or ""
            L.append(f"| {r['config']} | {r['ours']} | {_fmt_ms(r['ours_ms'])} | {r['vendor'] or '—'} | "
                     f"{_fmt_ms(r['vendor_ms'])} | {_ratio_str(r)} | {r['bits'] or '—'} | {r['check'] or ''} | "
                     f"{md} | {extra.replace('|', '/')} |")
        L.append("")
    L.append(f"Elapsed: {meta['elapsed_s']:.0f} s.")
    with open(os.path.join(out_dir, "attention.md"), "w") as f:
        f.write("\n".join(L) + "\n")


def _print_row(r):
    ratio = _ratio_str(r)
    print(f"  {r['section']:8s} {r['config']:18s} {r['ours'][:34]:34s} bits={r['bits'] or '-':4s} "
          f"ours={_fmt_ms(r['ours_ms'])}ms vendor={_fmt_ms(r['vendor_ms'])}ms ratio={ratio}"
          + (f"  ERROR {r['error']}" if r["error"] else "") + (f"  ({r['note']})" if r["note"] else ""), flush=True)


def _decode_kernel_note(dev, table_pages) -> str:
    """What ``paged_attention_fwd(max_seqlen_q=1)`` runs here."""
    from alignzoo.common.attention.op import SEGMENT

    width = f"; block tables padded to {table_pages} pages" if table_pages else ""
    if dev.type != "cuda":
        return f"CPU path (attend_rows), segments of {SEGMENT} positions{width}"
    from alignzoo.common.attention import kernel

    cfg = kernel.decode_config(D, DTYPE)
    return (f"split kernel, grid (segments of {SEGMENT} positions = ceil(table pages / {kernel.SEG_BLOCKS}), B, Hkv), "
            f"then the in-order merge kernel (one launch when the table holds one segment); tile block_m="
            f"{cfg['block_m']}, num_warps={cfg['num_warps']}, num_stages={cfg['num_stages']} "
            f"(kernel.decode_config, DECODE_SMALL_TILE={kernel.DECODE_SMALL_TILE}){width}")


# ---------------------------------------------------------------- main
def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"),
                    help="folder for attention.json and attention.md (default: $OUT or benchmarks/results)")
    ap.add_argument("--quick", action="store_true",
                    help="smaller set: prefill S=1024, 4096; backward S=4096; decode B=1, 64 x ctx 512, 8192")
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma list of prefill, backward, decode")
    ap.add_argument("--budget-s", type=float, default=120.0,
                    help="start no new configuration after this many seconds (it gets a 'skipped' row)")
    ap.add_argument("--max-cache-gib", type=float, default=40.0, help="skip decode configs whose K+V cache is larger")
    ap.add_argument("--decode-tile", choices=("decode", "prefill"), default="decode",
                    help="decode's tile: kernel.decode_config as shipped, or the prefill tile (DECODE_SMALL_TILE=False)")
    ap.add_argument("--decode-table-pages", type=int, default=0,
                    help="pad decode block tables to this many pages (a CUDA-graph batch's width; 0: as needed)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="time CUDA-graph replays (bench_primitives --cuda-graphs; not yet seen to finish on the H200)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="developer check without a GPU: tiny shapes on the CPU, wall-clock times (meaningless)")
    args = ap.parse_args()
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    bad = [s for s in sections if s not in SECTIONS]
    if bad:
        ap.error(f"unknown section(s) {bad}; choose from {list(SECTIONS)}")

    if not args.cpu_smoke and not torch.cuda.is_available():
        print(f"bench_attention.py needs a CUDA GPU: torch.cuda.is_available() is False here "
              f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). Run it on the GPU machine "
              f"(. benchmarks/gpu_env.sh first); --cpu-smoke exercises the code paths on the CPU.", file=sys.stderr)
        sys.exit(2)

    import triton

    import bench_primitives

    bench_primitives._GRAPHS = args.cuda_graphs  # read by bench_primitives._time
    ensure_alignzoo()
    t0 = time.perf_counter()
    dev = torch.device("cpu" if args.cpu_smoke else "cuda")
    if dev.type == "cuda":
        from alignzoo.common.attention import kernel

        kernel.DECODE_SMALL_TILE = args.decode_tile == "decode"
    shapes = SMOKE if args.cpu_smoke else QUICK if args.quick else FULL
    ctx = SimpleNamespace(dev=dev, timer=_time_wall if args.cpu_smoke else _time, decode_baseline=None,
                          decode_attempts={}, max_ctx=max(shapes["decode_ctx"]), table_pages=args.decode_table_pages)
    meta = dict(
        gpu=torch.cuda.get_device_name() if dev.type == "cuda" else f"CPU smoke ({platform.processor() or 'cpu'})",
        capability=".".join(map(str, torch.cuda.get_device_capability())) if dev.type == "cuda" else None,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=commit(), command=shlex.join([os.path.basename(sys.executable)] + sys.argv),
        timing=("wall clock, median of 3 (CPU smoke)" if args.cpu_smoke else
                "bench_primitives._time with --cuda-graphs: _time_graph (CUDA-graph replay median, L2 flushed; "
                "do_bench where capture fails)"
                if args.cuda_graphs else
                "bench_primitives._time = triton.testing.do_bench(warmup=25, rep=100) median, L2 flushed"),
        quick=args.quick, packages=None, decode_baseline=None, decode_attempts=ctx.decode_attempts, elapsed_s=0.0,
        decode_kernel=_decode_kernel_note(dev, args.decode_table_pages),
    )
    for key in ("gpu", "torch", "triton", "date", "commit", "command"):
        print(f"# {key}: {meta[key]}", flush=True)
    meta["packages"] = _probe_packages()
    print(f"# packages: {meta['packages']}", flush=True)

    jobs = []
    if "prefill" in sections:
        jobs += [("prefill", f"prefill {len(ls)}x{ls[0]}", (lambda ls=ls: bench_prefill(ctx, ls)))
                 for ls in shapes["prefill"]]
    if "backward" in sections:
        jobs += [("backward", f"backward S={s}", (lambda s=s: bench_backward(ctx, s))) for s in shapes["backward"]]
    if "decode" in sections:
        for B in shapes["decode_b"]:
            for n in shapes["decode_ctx"]:
                gib = 2 * B * n * HKV * D * 2 / 2**30
                if gib > args.max_cache_gib:
                    jobs.append(("decode", f"decode B={B} ctx={n}", None))
                else:
                    jobs.append(("decode", f"decode B={B} ctx={n}", (lambda B=B, n=n: bench_decode(ctx, B, n))))

    rows = []
    for section, name, job in jobs:
        elapsed = time.perf_counter() - t0
        config = name.split(" ", 1)[1]
        if job is None:
            new = [_row(section, config, "—", None, note=f"skipped: K+V cache over {args.max_cache_gib:g} GiB")]
        elif elapsed > args.budget_s:
            new = [_row(section, config, "—", None, note=f"skipped: time budget ({args.budget_s:g} s) spent")]
        else:
            print(f"[{elapsed:6.1f}s] {name} ...", flush=True)
            try:
                new = job()
            except Exception as e:
                traceback.print_exc()
                new = [_row(section, config, "—", None, error=_err(e))]
        for r in new:
            if r["ours_ms"] and r["vendor_ms"]:
                r["ratio"] = r["vendor_ms"] / r["ours_ms"]
            rows.append(r)
            _print_row(r)
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        meta["decode_baseline"] = next((v[len("chosen: "):] for v in ctx.decode_attempts.values()
                                        if v.startswith("chosen: ")), None)
        meta["elapsed_s"] = time.perf_counter() - t0
        _write(args.out, meta, rows)
    print(f"# done in {time.perf_counter() - t0:.1f} s; wrote {os.path.join(args.out, 'attention.json')} and "
          f"attention.md", flush=True)


if __name__ == "__main__":
    main()
