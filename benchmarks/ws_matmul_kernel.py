"""Warp-specialized persistent GEMM (Gluon, Hopper) with the library's bits.

The arithmetic is ``kernel.py``'s contract, element for element: K is cut into
segments of SEG_K; each segment is a chain of k16 wgmma steps from zero (the
first step of a segment runs with ``use_acc=False``), and the segment sums are
added left to right into an fp32 total that is rounded to bf16 once.

What differs is who waits for what.  One producer warp streams the x and w
k-steps into a ring of NUM_BUF shared-memory stages by TMA, across segment and
tile boundaries, so the loads never drain where a segment ends (the Triton
kernel's pipeline drains at each of its per-segment loops).  Two consumer
warpgroups take the top and bottom 64 rows of the 128-row tile and issue one
wgmma a k-step on the whole tile width (192 columns is one instruction here,
two dots in Triton); each releases a stage on its own barrier arrival, so the
stage is refilled only once both have finished reading it.  Each consumer
stores its half of the tile by TMA while the ring fills for the next tile.

Needs ``triton.experimental.gluon`` (Triton >= 3.6) and sm_90.

An experiment, kept beside its probe (``probe_ws_matmul.py``), not a library
path: on the H200 (session 8, benchmarks/results/2026-11-30-h200-session8-
ws-matmul.md) it gives the library default's bits at every tile, ragged M and
rows computed alone, but runs at 0.19-0.94x cuBLAS, best 0.65-0.73x at M =
256-1024, where the Triton kernel gets 0.73-0.96x.  Deeper rings (5-9
stages), BK = 128, a register epilogue, and running all of K as one chain
(no segment restarts) each moved it by a few percent at most, so neither the
load depth nor the restarts are what it lacks.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from alignzoo.common._host import cdiv

# Triton 3.6 (the H200's) names the TMA copies async_copy_*; later versions async_load / async_store.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
_tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

WS_BLOCK_M = 128  # two consumer warpgroups of 64 rows
_HALF_M = 64


@gluon.jit
def _ws_tile_coords(tile, n_m, n_n, GROUP_M: gl.constexpr):
    """``kernel._tile_coords`` (grouped order for L2 reuse); touches no sum."""
    first_m = (tile // (GROUP_M * n_n)) * GROUP_M
    size_m = gl.minimum(n_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % (GROUP_M * n_n)) // size_m


@gluon.jit
def _ws_next_stage(s, phase, NUM_BUF: gl.constexpr):
    """The ring position after stage s: counters, not divisions, on the per-step path."""
    wrap = s == NUM_BUF - 1
    return gl.where(wrap, 0, s + 1), gl.where(wrap, phase ^ 1, phase)


@gluon.jit
def _ws_load_partition(d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, empty, M, N, N_K,
                       BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS,
                       NUM_BUF: gl.constexpr):
    """The producer warp: every k-step of every tile of this program, in order."""
    BM: gl.constexpr = d_x.block_type.shape[0]
    BK: gl.constexpr = d_x.block_type.shape[1]
    BN: gl.constexpr = d_w.block_type.shape[0]
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN + BN2)
    s = 0
    phase = 1  # a stage is free once both consumers arrived; the first lap passes
    for tile in range(gl.program_id(0), n_m * n_n, NUM_PROGS):
        i_m, i_n = _ws_tile_coords(tile, n_m, n_n, GROUP_M)
        for k in range(N_K):
            mbarrier.wait(empty.index(s), phase)
            bar = ready.index(s)
            if BN2 == 0:
                mbarrier.expect(bar, d_x.block_type.nbytes + d_w.block_type.nbytes)
            else:
                mbarrier.expect(bar, d_x.block_type.nbytes + d_w.block_type.nbytes + d_w2.block_type.nbytes)
                _tma_load(d_w2, [i_n * (BN + BN2) + BN, k * BK], bar, bufs_w2.index(s))
            _tma_load(d_x, [i_m * BM, k * BK], bar, bufs_x.index(s))
            _tma_load(d_w, [i_n * (BN + BN2), k * BK], bar, bufs_w.index(s))
            s, phase = _ws_next_stage(s, phase, NUM_BUF)


@gluon.jit
def _store_block(p_y, stride_ym, total, o_m, o_n, M, N, layout: gl.constexpr):
    rows = o_m + gl.arange(0, total.shape[0], layout=gl.SliceLayout(1, layout))
    cols = o_n + gl.arange(0, total.shape[1], layout=gl.SliceLayout(0, layout))
    gl.store(p_y + rows[:, None] * stride_ym + cols[None, :], total.to(p_y.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@gluon.jit
def _ws_mma_partition(p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, SEG_STEPS: gl.constexpr,
                      HALF: gl.constexpr, BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS,
                      NUM_BUF: gl.constexpr, SMEM_EPI: gl.constexpr):
    """One consumer warpgroup: rows [HALF*64, HALF*64 + 64) of every tile, a
    BN-wide column block (and a BN2-wide one beside it when BN2 > 0: each
    element's chain is its own, whatever block it sits in)."""
    HM: gl.constexpr = d_y.block_type.shape[0]
    BN: gl.constexpr = d_y.block_type.shape[1]
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BN, 16])
    layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, BN2 if BN2 else BN, 16])
    n_m = gl.cdiv(M, 2 * HM)
    n_n = gl.cdiv(N, BN + BN2)
    s = 0
    phase = 0
    prev = NUM_BUF - 1  # the stage of the step before
    for tile in range(gl.program_id(0), n_m * n_n, NUM_PROGS):
        i_m, i_n = _ws_tile_coords(tile, n_m, n_n, GROUP_M)
        total = gl.zeros([HM, BN], gl.float32, layout)
        acc = gl.zeros([HM, BN], gl.float32, layout)
        total2 = gl.zeros([HM, BN2 if BN2 else BN], gl.float32, layout2)
        acc2 = gl.zeros([HM, BN2 if BN2 else BN], gl.float32, layout2)
        for k in range(N_K):
            mbarrier.wait(ready.index(s), phase)
            a = bufs_x.index(s).slice(HALF * HM, HM, dim=0)
            chain = (k % SEG_STEPS) != 0  # False: a segment's first step starts from zero
            acc = warpgroup_mma(a, bufs_w.index(s).permute((1, 0)), acc, use_acc=chain, is_async=True)
            if BN2 == 0:
                acc = warpgroup_mma_wait(1, deps=(acc, ))  # the step before this one is done
            else:
                acc2 = warpgroup_mma(a, bufs_w2.index(s).permute((1, 0)), acc2, use_acc=chain, is_async=True)
                acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
            mbarrier.arrive(empty.index(prev), pred=k > 0)  # ... so is its stage
            if (k + 1) % SEG_STEPS == 0:  # a segment's last step: add its chain to the total
                if BN2 == 0:
                    acc = warpgroup_mma_wait(0, deps=(acc, ))
                else:
                    acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
                    total2 += acc2
                total += acc
            prev = s
            s, phase = _ws_next_stage(s, phase, NUM_BUF)
        mbarrier.arrive(empty.index(prev))
        o_m = i_m * 2 * HM + HALF * HM
        o_n = i_n * (BN + BN2)
        if SMEM_EPI:  # through shared memory and a TMA store that overlaps the next tile
            tma.store_wait(0)  # the previous tile's stores have left c_smem
            c_smem.store(total.to(d_y.dtype))
            if BN2 != 0:
                c_smem2.store(total2.to(d_y.dtype))
            fence_async_shared()
            _tma_store(d_y, [o_m, o_n], c_smem)
            if BN2 != 0:
                _tma_store(d_y2, [o_m, o_n + BN], c_smem2)
        else:  # straight from registers: the shared memory goes to the load ring instead
            _store_block(p_y, stride_ym, total, o_m, o_n, M, N, layout)
            if BN2 != 0:
                _store_block(p_y, stride_ym, total2, o_m, o_n + BN, M, N, layout2)
    tma.store_wait(0)


@gluon.jit
def _ws_top(p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, SEG_STEPS: gl.constexpr,
            BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS, NUM_BUF: gl.constexpr, SMEM_EPI: gl.constexpr):
    _ws_mma_partition(p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, SEG_STEPS,
                      0, BN2, GROUP_M, NUM_PROGS, NUM_BUF, SMEM_EPI)


@gluon.jit
def _ws_bottom(p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, SEG_STEPS: gl.constexpr,
               BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS, NUM_BUF: gl.constexpr, SMEM_EPI: gl.constexpr):
    _ws_mma_partition(p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, SEG_STEPS,
                      1, BN2, GROUP_M, NUM_PROGS, NUM_BUF, SMEM_EPI)


@gluon.jit(do_not_specialize=["M"])
def _mm_ws_kernel(d_x, d_w, d_w2, d_y, d_y2, p_y, stride_ym, M, N, N_K, SEG_STEPS: gl.constexpr,
                  BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS, NUM_BUF: gl.constexpr,
                  CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, SMEM_EPI: gl.constexpr):
    BM: gl.constexpr = d_x.block_type.shape[0]
    BK: gl.constexpr = d_x.block_type.shape[1]
    BN: gl.constexpr = d_w.block_type.shape[0]
    HM: gl.constexpr = d_y.block_type.shape[0]
    W2: gl.constexpr = BN2 if BN2 else 16  # placeholders when there is no second block
    dtype: gl.constexpr = d_x.dtype
    bufs_x = gl.allocate_shared_memory(dtype, [NUM_BUF, BM, BK], d_x.layout)
    bufs_w = gl.allocate_shared_memory(dtype, [NUM_BUF, BN, BK], d_w.layout)
    bufs_w2 = gl.allocate_shared_memory(dtype, [NUM_BUF if BN2 else 1, W2, BK], d_w2.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warpgroup
    C_M: gl.constexpr = HM if SMEM_EPI else 8  # placeholders without the shared-memory epilogue
    c_top = gl.allocate_shared_memory(dtype, [C_M, BN], d_y.layout)
    c_bottom = gl.allocate_shared_memory(dtype, [C_M, BN], d_y.layout)
    c_top2 = gl.allocate_shared_memory(dtype, [C_M, W2], d_y2.layout)
    c_bottom2 = gl.allocate_shared_memory(dtype, [C_M, W2], d_y2.layout)
    gl.warp_specialize([
        (_ws_top, (p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_top, c_top2, M, N, N_K,
                   SEG_STEPS, BN2, GROUP_M, NUM_PROGS, NUM_BUF, SMEM_EPI)),
        (_ws_bottom, (p_y, stride_ym, d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_bottom, c_bottom2, M, N,
                      N_K, SEG_STEPS, BN2, GROUP_M, NUM_PROGS, NUM_BUF, SMEM_EPI)),
        (_ws_load_partition, (d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, empty, M, N, N_K,
                              BN2, GROUP_M, NUM_PROGS, NUM_BUF)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def mm_ws(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, seg_k: int, n_seg: int, BN: int, BK: int = 64,
          num_buf: int = 4, sms: int = 132, group_m: int = 8, consumer_regs: int = 224,
          producer_regs: int = 24, smem_epilogue: bool = False, pdl: dict | None = None) -> torch.Tensor:
    """y = x · wᵀ (bf16, TMA-able) with the segment-chain bits.  ``BN``: the
    tile width, a power of two or 1.5 times one (192 = 128 + 64); ``seg_k`` a
    multiple of BK with ``n_seg · seg_k`` ≥ K."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from alignzoo.common.matmul.kernel import column_blocks

    M, K = x.shape
    N = w.shape[0]
    if seg_k % BK:
        raise ValueError(f"block_k={BK} must divide SEG_K={seg_k}")
    bn, bn2 = column_blocks(BN)

    def desc(t, box):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))

    d_w, d_y = desc(w, [bn, BK]), desc(y, [_HALF_M, bn])
    d_w2, d_y2 = (desc(w, [bn2, BK]), desc(y, [_HALF_M, bn2])) if bn2 else (desc(w, [16, BK]), desc(y, [_HALF_M, 16]))
    progs = min(sms, cdiv(M, WS_BLOCK_M) * cdiv(N, BN))
    _mm_ws_kernel[(progs,)](desc(x, [WS_BLOCK_M, BK]), d_w, d_w2, d_y, d_y2, y, y.stride(0), M, N, n_seg * seg_k // BK,
                            SEG_STEPS=seg_k // BK, BN2=bn2, GROUP_M=group_m, NUM_PROGS=progs, NUM_BUF=num_buf,
                            CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, SMEM_EPI=smem_epilogue, num_warps=4,
                            **(pdl or {}))
    return y


# --- the same bits without warp specialization --------------------------------------------------
# One 8-warp partition walks a flattened (tile, k-step) sequence: each step waits for its stage,
# issues the wgmma, waits for the step before (so that step's stage is free) and refills that
# stage with the step NUM_BUF - 1 ahead, which may belong to the next segment or the next tile.
# That is Triton's software pipeline without its drains: the Triton kernel's 1.5-power tiles run a
# loop per segment and every tile restarts the pipeline.

@gluon.jit
def _pipe_issue(pred, s, i_m, i_n, kk, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, BN2: gl.constexpr):
    """Loads of one k-step (tile (i_m, i_n), k offset kk) into stage s, if pred."""
    BM: gl.constexpr = d_x.block_type.shape[0]
    BN: gl.constexpr = d_w.block_type.shape[0]
    bar = ready.index(s)
    if BN2 == 0:
        mbarrier.expect(bar, d_x.block_type.nbytes + d_w.block_type.nbytes, pred=pred)
    else:
        mbarrier.expect(bar, d_x.block_type.nbytes + d_w.block_type.nbytes + d_w2.block_type.nbytes, pred=pred)
        _tma_load(d_w2, [i_n * (BN + BN2) + BN, kk], bar, bufs_w2.index(s), pred)
    _tma_load(d_x, [i_m * BM, kk], bar, bufs_x.index(s), pred)
    _tma_load(d_w, [i_n * (BN + BN2), kk], bar, bufs_w.index(s), pred)


@gluon.jit
def _pipe_advance(k, tile, i_m, i_n, N_K, n_m, n_n, GROUP_M: gl.constexpr, NUM_PROGS):
    """The (k-step, tile) after this one; tile coordinates recomputed only when the tile changes."""
    k += 1
    if k == N_K:
        k = 0
        tile += NUM_PROGS
        i_m, i_n = _ws_tile_coords(tile, n_m, n_n, GROUP_M)
    return k, tile, i_m, i_n


@gluon.jit(do_not_specialize=["M"])
def _mm_pipe_kernel(d_x, d_w, d_w2, d_y, d_y2, p_y, stride_ym, M, N, N_K, SEG_STEPS: gl.constexpr, NUM_PROGS,
                    BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, SMEM_EPI: gl.constexpr,
                    num_warps: gl.constexpr):
    BM: gl.constexpr = d_x.block_type.shape[0]
    BK: gl.constexpr = d_x.block_type.shape[1]
    BN: gl.constexpr = d_w.block_type.shape[0]
    W2: gl.constexpr = BN2 if BN2 else 16
    dtype: gl.constexpr = d_x.dtype
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                     instr_shape=[16, BN, 16])
    layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, W2, 16])
    bufs_x = gl.allocate_shared_memory(dtype, [NUM_BUF, BM, BK], d_x.layout)
    bufs_w = gl.allocate_shared_memory(dtype, [NUM_BUF, BN, BK], d_w.layout)
    bufs_w2 = gl.allocate_shared_memory(dtype, [NUM_BUF if BN2 else 1, W2, BK], d_w2.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_BUF):
        mbarrier.init(ready.index(i), count=1)
    C_M: gl.constexpr = BM if SMEM_EPI else 8  # placeholders without the shared-memory epilogue
    c_smem = gl.allocate_shared_memory(dtype, [C_M, BN], d_y.layout)
    c_smem2 = gl.allocate_shared_memory(dtype, [C_M, W2], d_y2.layout)
    n_m = gl.cdiv(M, BM)
    n_n = gl.cdiv(N, BN + BN2)
    pid = gl.program_id(0)
    total_steps = gl.cdiv(n_m * n_n - pid, NUM_PROGS) * N_K
    # the load side runs NUM_BUF - 1 steps ahead of the MMA side, each with its own (k, tile) counters
    lk = 0
    l_tile = pid
    l_m, l_n = _ws_tile_coords(pid, n_m, n_n, GROUP_M)
    for j in gl.static_range(NUM_BUF - 1):
        _pipe_issue(j < total_steps, j, l_m, l_n, lk * BK, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, BN2)
        lk, l_tile, l_m, l_n = _pipe_advance(lk, l_tile, l_m, l_n, N_K, n_m, n_n, GROUP_M, NUM_PROGS)
    ls = NUM_BUF - 1
    k = 0
    c_tile = pid
    s = 0
    phase = 0
    total = gl.zeros([BM, BN], gl.float32, layout)
    acc = gl.zeros([BM, BN], gl.float32, layout)
    total2 = gl.zeros([BM, W2], gl.float32, layout2)
    acc2 = gl.zeros([BM, W2], gl.float32, layout2)
    for g in range(total_steps):
        mbarrier.wait(ready.index(s), phase)
        chain = (k % SEG_STEPS) != 0  # False: a segment's first step starts from zero
        acc = warpgroup_mma(bufs_x.index(s), bufs_w.index(s).permute((1, 0)), acc, use_acc=chain, is_async=True)
        if BN2 == 0:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
        else:
            acc2 = warpgroup_mma(bufs_x.index(s), bufs_w2.index(s).permute((1, 0)), acc2, use_acc=chain,
                                 is_async=True)
            acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
        # step g - 1 is done: its stage (ls) takes step g + NUM_BUF - 1
        _pipe_issue(g + NUM_BUF - 1 < total_steps, ls, l_m, l_n, lk * BK, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2,
                    ready, BN2)
        ls = s
        lk, l_tile, l_m, l_n = _pipe_advance(lk, l_tile, l_m, l_n, N_K, n_m, n_n, GROUP_M, NUM_PROGS)
        if (k + 1) % SEG_STEPS == 0:  # a segment's last step: add its chain to the total
            if BN2 == 0:
                acc = warpgroup_mma_wait(0, deps=(acc, ))
            else:
                acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
                total2 += acc2
            total += acc
        if k == N_K - 1:  # the tile's last step: store it, start the next
            i_m, i_n = _ws_tile_coords(c_tile, n_m, n_n, GROUP_M)
            if SMEM_EPI:  # through shared memory and a TMA store that overlaps the next tile
                tma.store_wait(0)  # the previous tile's stores have left c_smem
                c_smem.store(total.to(dtype))
                if BN2 != 0:
                    c_smem2.store(total2.to(dtype))
                fence_async_shared()
                _tma_store(d_y, [i_m * BM, i_n * (BN + BN2)], c_smem)
                if BN2 != 0:
                    _tma_store(d_y2, [i_m * BM, i_n * (BN + BN2) + BN], c_smem2)
            else:
                _store_block(p_y, stride_ym, total, i_m * BM, i_n * (BN + BN2), M, N, layout)
                if BN2 != 0:
                    _store_block(p_y, stride_ym, total2, i_m * BM, i_n * (BN + BN2) + BN, M, N, layout2)
            total = gl.zeros([BM, BN], gl.float32, layout)
            if BN2 != 0:
                total2 = gl.zeros([BM, W2], gl.float32, layout2)
            c_tile += NUM_PROGS
            k = -1
        k += 1
        s, phase = _ws_next_stage(s, phase, NUM_BUF)
    if SMEM_EPI:
        tma.store_wait(0)


def mm_pipe(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, seg_k: int, n_seg: int, BN: int, BK: int = 64,
            num_buf: int = 4, sms: int = 132, group_m: int = 8, num_warps: int = 8,
            smem_epilogue: bool = False) -> torch.Tensor:
    """``mm_ws``'s bits from ``_mm_pipe_kernel`` (128-row tiles, 8 warps)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from alignzoo.common.matmul.kernel import column_blocks

    M, K = x.shape
    N = w.shape[0]
    if seg_k % BK:
        raise ValueError(f"block_k={BK} must divide SEG_K={seg_k}")
    bn, bn2 = column_blocks(BN)

    def desc(t, box):
        return TensorDescriptor.from_tensor(t, box, gl.NVMMASharedLayout.get_default_for(box, gl.bfloat16))

    progs = min(sms, cdiv(M, WS_BLOCK_M) * cdiv(N, BN))
    _mm_pipe_kernel[(progs,)](desc(x, [WS_BLOCK_M, BK]), desc(w, [bn, BK]), desc(w, [bn2 or 16, BK]),
                              desc(y, [WS_BLOCK_M, bn]), desc(y, [WS_BLOCK_M, bn2 or 16]), y, y.stride(0),
                              M, N, n_seg * seg_k // BK, NUM_PROGS=progs, SEG_STEPS=seg_k // BK, BN2=bn2, GROUP_M=group_m,
                              NUM_BUF=num_buf, SMEM_EPI=smem_epilogue, num_warps=num_warps)
    return y
