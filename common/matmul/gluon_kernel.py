"""Gluon GEMM for the 128-row TMA tiles up to 192 wide, with the library's bits.

Per output element the arithmetic is ``kernel.py``'s contract: K cut into
segments of SEG_K, each a chain of k16 wgmma steps from zero (a segment's first
step runs with ``use_acc=False``), the segment sums added left to right into an
fp32 total, rounded to bf16 once.  Tiles are 128 rows by BN (+ BN2) columns:
a power of two up to 128, or 1.5 times one as two column blocks (192 = 128 +
64, 96 = 64 + 32; one wgmma each per k-step: each element's chain is its own,
whatever block it sits in).  128 x 256 stays on Triton's kernel: its chain
and total need 256 registers a thread here.

Why Gluon: Triton's two-column-block tiles keep a k-loop per segment (one loop
holding four accumulators spilled), so their software pipeline drains at every
segment boundary and again at every tile.  Here one 8-warp program walks a
flattened (tile, k-step) sequence: step g waits for its stage, issues its
wgmmas, waits for step g - 1 (its stage is then free) and refills that stage
with step g + STAGES - 1, which may belong to the next segment or the next
tile; nothing drains until the program's last step.  The load side keeps its
own (k-step, tile) counters, so the per-step path holds no integer division
(one there doubled the issued instructions).  Epilogue: the tile goes through shared memory and a TMA store that
overlaps the next tile's steps.

Bits equal Triton's kernel at the same tile, at ragged M and for rows
computed alone.  The launch router picks it for the 192 and 96 tiles at
middle M, where Triton's tiles are slower, and keeps Triton's 128 x 256 tile
at large M (figures: benchmarks/results/2026-11-30-h200-matmul.md).

Warp-specialized form (``_mm_ws_kernel``, schedule "gluon_ws"): the same
MMA steps in the kernel's 8 warps, while a producer warp (``gl.warp_specialize``)
issues every TMA load behind a ready / empty barrier pair per ring stage, so
no expect / load issue (and none of the CTA barriers Triton 3.6 emits around
them) sits between the wgmmas.  The router runs the two-block tiles (192, 96)
in this form, same bits; at 128 x 128 it gains nothing.

Its launch costs more Python than Triton's (five descriptors with layouts, and
their binding), so the defaults pick it only inside
``launches.graph_launches()`` (CUDA graphs replay device time only).

Needs ``triton.experimental.gluon`` (Triton 3.6 names the TMA copies
``async_copy_*``, later versions ``async_load`` / ``async_store``; both work)
and sm_90.  ``available()`` says whether this Triton has it.
"""
from __future__ import annotations

import functools

import torch

from .._host import cdiv
from .._launch import FP_FUSION

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor
except ImportError:  # a Triton without Gluon: launch_config never picks this schedule
    gluon = None

BLOCK_M = 128  # two warpgroups of 64 rows
NUM_WARPS = 8
MAX_BLOCK_N = 192
WS_MAXNREG = 168  # the warp-specialized kernel's 12 warps (8 + a producer rounded up to a warpgroup) share 64K registers


def available() -> bool:
    return gluon is not None


def pipeline_stages(bn: int, bk: int = 64, elem: int = 2) -> int:
    """The deepest load ring that fits beside the epilogue's output tile."""
    from .kernel import _SMEM  # a program's shared-memory budget

    return min(8, (_SMEM - BLOCK_M * bn * elem) // ((BLOCK_M + bn) * bk * elem))


if gluon is not None:
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global

    @gluon.jit
    def _tile_coords(tile, n_m, n_n, GROUP_M: gl.constexpr):
        """``kernel._tile_coords`` (grouped order for L2 reuse); touches no sum."""
        first_m = (tile // (GROUP_M * n_n)) * GROUP_M
        size_m = gl.minimum(n_m - first_m, GROUP_M)
        return first_m + (tile % size_m), (tile % (GROUP_M * n_n)) // size_m

    @gluon.jit
    def _next_stage(s, phase, NUM_BUF: gl.constexpr):
        """The ring position after stage s: counters, not divisions, on the per-step path."""
        wrap = s == NUM_BUF - 1
        return gl.where(wrap, 0, s + 1), gl.where(wrap, phase ^ 1, phase)

    @gluon.jit
    def _issue(pred, s, i_m, i_n, kk, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, BN2: gl.constexpr):
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
    def _advance(k, tile, i_m, i_n, N_K, n_m, n_n, GROUP_M: gl.constexpr, NUM_PROGS):
        """The (k-step, tile) after this one; tile coordinates recomputed only when the tile changes."""
        k += 1
        if k == N_K:
            k = 0
            tile += NUM_PROGS
            i_m, i_n = _tile_coords(tile, n_m, n_n, GROUP_M)
        return k, tile, i_m, i_n

    @gluon.jit
    def _alloc_ring(d_x, d_w, d_w2, d_y, d_y2, BN2: gl.constexpr, NUM_BUF: gl.constexpr, WS: gl.constexpr):
        """The operand ring (NUM_BUF stages of x, w and w2 tiles), a ready
        barrier per stage (with ``WS`` an empty one too; else ``empty`` is
        ``ready``, unused), and the output tiles the epilogue stores from."""
        BM: gl.constexpr = d_x.block_type.shape[0]
        BK: gl.constexpr = d_x.block_type.shape[1]
        W2: gl.constexpr = d_w2.block_type.shape[0]  # BN2, or the placeholder's width
        dtype: gl.constexpr = d_x.dtype
        bufs_x = gl.allocate_shared_memory(dtype, [NUM_BUF, BM, BK], d_x.layout)
        bufs_w = gl.allocate_shared_memory(dtype, [NUM_BUF, d_w.block_type.shape[0], BK], d_w.layout)
        bufs_w2 = gl.allocate_shared_memory(dtype, [NUM_BUF if BN2 else 1, W2, BK], d_w2.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        if WS:
            empty = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        else:
            empty = ready
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(ready.index(i), count=1)
            if WS:
                mbarrier.init(empty.index(i), count=1)
        c_smem = gl.allocate_shared_memory(dtype, [BM, d_w.block_type.shape[0]], d_y.layout)
        c_smem2 = gl.allocate_shared_memory(dtype, [BM if BN2 else 8, W2], d_y2.layout)
        return bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2

    @gluon.jit
    def _mma_step(s, chain, acc, acc2, bufs_x, bufs_w, bufs_w2, BN2: gl.constexpr):
        """Stage s's wgmmas (a chain restarts from zero where ``chain`` is
        False), then wait for the previous step's: its stage is free after."""
        acc = warpgroup_mma(bufs_x.index(s), bufs_w.index(s).permute((1, 0)), acc, use_acc=chain, is_async=True)
        if BN2 == 0:
            acc = warpgroup_mma_wait(1, deps=(acc, ))
        else:
            acc2 = warpgroup_mma(bufs_x.index(s), bufs_w2.index(s).permute((1, 0)), acc2, use_acc=chain,
                                 is_async=True)
            acc, acc2 = warpgroup_mma_wait(2, deps=(acc, acc2))
        return acc, acc2

    @gluon.jit
    def _segment_end(acc, acc2, total, total2, BN2: gl.constexpr):
        """A segment's last step: wait for its chains and add them to the totals."""
        if BN2 == 0:
            acc = warpgroup_mma_wait(0, deps=(acc, ))
        else:
            acc, acc2 = warpgroup_mma_wait(0, deps=(acc, acc2))
            total2 += acc2
        total += acc
        return acc, acc2, total, total2

    @gluon.jit
    def _store_tile(total, total2, c_smem, c_smem2, d_y, d_y2, i_m, i_n, BN2: gl.constexpr):
        """Round the totals to bf16 once and store tile (i_m, i_n) by TMA,
        after the previous tile's stores have left the output tiles."""
        BM: gl.constexpr = c_smem.shape[0]
        BN: gl.constexpr = c_smem.shape[1]
        tma.store_wait(0)
        c_smem.store(total.to(c_smem.dtype))
        if BN2 != 0:
            c_smem2.store(total2.to(c_smem.dtype))
        fence_async_shared()
        _tma_store(d_y, [i_m * BM, i_n * (BN + BN2)], c_smem)
        if BN2 != 0:
            _tma_store(d_y2, [i_m * BM, i_n * (BN + BN2) + BN], c_smem2)

    @gluon.jit(do_not_specialize=["M"])
    def _mm_pipe_kernel(d_x, d_w, d_w2, d_y, d_y2, M, N, N_K, NUM_PROGS, SEG_STEPS: gl.constexpr,
                        BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        """``BN2`` = 0: one column block (``d_w2`` / ``d_y2`` are then unused placeholders)."""
        BM: gl.constexpr = d_x.block_type.shape[0]
        BK: gl.constexpr = d_x.block_type.shape[1]
        BN: gl.constexpr = d_w.block_type.shape[0]
        W2: gl.constexpr = d_w2.block_type.shape[0]  # BN2, or the placeholder's width
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BN, 16])
        layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, W2, 16])
        bufs_x, bufs_w, bufs_w2, ready, _, c_smem, c_smem2 = _alloc_ring(d_x, d_w, d_w2, d_y, d_y2, BN2, NUM_BUF,
                                                                         False)
        n_m = gl.cdiv(M, BM)
        n_n = gl.cdiv(N, BN + BN2)
        pid = gl.program_id(0)
        total_steps = gl.cdiv(n_m * n_n - pid, NUM_PROGS) * N_K
        # the load side runs NUM_BUF - 1 steps ahead of the MMA side, with its own (k, tile) counters
        lk = 0
        l_tile = pid
        l_m, l_n = _tile_coords(pid, n_m, n_n, GROUP_M)
        for j in gl.static_range(NUM_BUF - 1):
            _issue(j < total_steps, j, l_m, l_n, lk * BK, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, BN2)
            lk, l_tile, l_m, l_n = _advance(lk, l_tile, l_m, l_n, N_K, n_m, n_n, GROUP_M, NUM_PROGS)
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
            # chain False: a segment's first step starts from zero
            acc, acc2 = _mma_step(s, (k % SEG_STEPS) != 0, acc, acc2, bufs_x, bufs_w, bufs_w2, BN2)
            # step g - 1 is done: its stage (ls) takes step g + NUM_BUF - 1
            _issue(g + NUM_BUF - 1 < total_steps, ls, l_m, l_n, lk * BK, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2,
                   ready, BN2)
            ls = s
            lk, l_tile, l_m, l_n = _advance(lk, l_tile, l_m, l_n, N_K, n_m, n_n, GROUP_M, NUM_PROGS)
            if (k + 1) % SEG_STEPS == 0:  # a segment's last step: add its chains to the totals
                acc, acc2, total, total2 = _segment_end(acc, acc2, total, total2, BN2)
            if k == N_K - 1:  # the tile's last step: store it (overlapping the next tile), start the next
                i_m, i_n = _tile_coords(c_tile, n_m, n_n, GROUP_M)
                _store_tile(total, total2, c_smem, c_smem2, d_y, d_y2, i_m, i_n, BN2)
                if BN2 != 0:
                    total2 = gl.zeros([BM, BN2], gl.float32, layout2)
                total = gl.zeros([BM, BN], gl.float32, layout)
                c_tile += NUM_PROGS
                k = -1
            k += 1
            s, phase = _next_stage(s, phase, NUM_BUF)
        tma.store_wait(0)


    @gluon.jit
    def _ws_loads(d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, empty, M, N, N_K, NUM_PROGS,
                  BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr):
        """Producer partition (one warp): every (tile, k-step) of this program in
        order, each into the next ring stage once the MMA side has released it."""
        BM: gl.constexpr = d_x.block_type.shape[0]
        BK: gl.constexpr = d_x.block_type.shape[1]
        n_m = gl.cdiv(M, BM)
        n_n = gl.cdiv(N, d_w.block_type.shape[0] + BN2)
        s = 0
        phase = 0
        for tile in range(gl.program_id(0), n_m * n_n, NUM_PROGS):
            i_m, i_n = _tile_coords(tile, n_m, n_n, GROUP_M)
            for k in range(N_K):
                mbarrier.wait(empty.index(s), phase ^ 1)  # a fresh barrier passes phase 1: the ring starts empty
                _issue(True, s, i_m, i_n, k * BK, d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, BN2)
                s, phase = _next_stage(s, phase, NUM_BUF)

    @gluon.jit
    def _ws_mma(d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, NUM_PROGS,
                SEG_STEPS: gl.constexpr, BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr,
                layout: gl.constexpr, layout2: gl.constexpr):
        """MMA partition (the kernel's warps): ``_mm_pipe_kernel``'s per-step
        arithmetic, releasing each stage as soon as its wgmmas have retired."""
        BM: gl.constexpr = c_smem.shape[0]
        BN: gl.constexpr = c_smem.shape[1]
        W2: gl.constexpr = c_smem2.shape[1]
        n_m = gl.cdiv(M, BM)
        n_n = gl.cdiv(N, BN + BN2)
        s = 0
        phase = 0
        prev = 0
        first = True
        acc = gl.zeros([BM, BN], gl.float32, layout)
        acc2 = gl.zeros([BM, W2], gl.float32, layout2)
        for tile in range(gl.program_id(0), n_m * n_n, NUM_PROGS):
            total = gl.zeros([BM, BN], gl.float32, layout)
            total2 = gl.zeros([BM, W2], gl.float32, layout2)
            for k in range(N_K):
                mbarrier.wait(ready.index(s), phase)
                # chain False: a segment's first step starts from zero
                acc, acc2 = _mma_step(s, (k % SEG_STEPS) != 0, acc, acc2, bufs_x, bufs_w, bufs_w2, BN2)
                mbarrier.arrive(empty.index(prev), pred=not first)  # the previous step's wgmmas are done
                first = False
                prev = s
                if (k + 1) % SEG_STEPS == 0:  # a segment's last step: add its chains to the totals
                    acc, acc2, total, total2 = _segment_end(acc, acc2, total, total2, BN2)
                s, phase = _next_stage(s, phase, NUM_BUF)
            i_m, i_n = _tile_coords(tile, n_m, n_n, GROUP_M)
            _store_tile(total, total2, c_smem, c_smem2, d_y, d_y2, i_m, i_n, BN2)
        tma.store_wait(0)

    @gluon.jit(do_not_specialize=["M"])
    def _mm_ws_kernel(d_x, d_w, d_w2, d_y, d_y2, M, N, N_K, NUM_PROGS, SEG_STEPS: gl.constexpr,
                      BN2: gl.constexpr, GROUP_M: gl.constexpr, NUM_BUF: gl.constexpr, num_warps: gl.constexpr):
        """``_mm_pipe_kernel``'s arithmetic, warp-specialized: one producer warp
        issues every TMA load (ready / empty barrier pair per ring stage), the
        kernel's warps only wait, issue wgmmas, release stages and store tiles."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, d_w.block_type.shape[0], 16])
        layout2: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                          instr_shape=[16, d_w2.block_type.shape[0], 16])
        bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2 = _alloc_ring(d_x, d_w, d_w2, d_y, d_y2, BN2,
                                                                             NUM_BUF, True)
        gl.warp_specialize([
            (_ws_mma, (d_y, d_y2, bufs_x, bufs_w, bufs_w2, ready, empty, c_smem, c_smem2, M, N, N_K, NUM_PROGS,
                       SEG_STEPS, BN2, GROUP_M, NUM_BUF, layout, layout2)),
            (_ws_loads, (d_x, d_w, d_w2, bufs_x, bufs_w, bufs_w2, ready, empty, M, N, N_K, NUM_PROGS,
                         BN2, GROUP_M, NUM_BUF)),
        ], [1], [40])


@functools.lru_cache(maxsize=None)
def _layout(rows: int, cols: int):
    """A box's shared-memory layout (~20 µs to derive in Python: cached, as it is
    asked for five times a call and prefill is not a CUDA graph)."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def _desc(t: torch.Tensor, box: list[int]):
    return _GluonDescriptor(t, list(t.shape), list(t.stride()), box, _layout(*box))


def matmul_fwd_gluon(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *, seg_k: int, n_seg: int, BN: int,
                     BK: int, stages: int, sms: int, group_m: int = 8, ws: bool = False) -> torch.Tensor:
    """y = x · wᵀ into ``y`` (bf16, TMA-able: checked by the caller) with the
    segment-chain bits; BN a power of two up to 128 or 1.5 times one (192, 96),
    ``seg_k`` a multiple of BK with ``n_seg · seg_k`` ≥ K."""
    from .kernel import column_blocks

    M = x.shape[0]
    N = w.shape[0]
    bn, bn2 = column_blocks(BN)
    w2 = bn2 or 16  # placeholder descriptors for a one-block tile
    progs = min(sms, cdiv(M, BLOCK_M) * cdiv(N, BN))
    kernel, extra = (_mm_ws_kernel, {"maxnreg": WS_MAXNREG}) if ws else (_mm_pipe_kernel, {})
    kernel[(progs,)](_desc(x, [BLOCK_M, BK]), _desc(w, [bn, BK]), _desc(w, [w2, BK]),
                              _desc(y, [BLOCK_M, bn]), _desc(y, [BLOCK_M, w2]), M, N, n_seg * seg_k // BK, progs,
                              SEG_STEPS=seg_k // BK, BN2=bn2, GROUP_M=group_m, NUM_BUF=stages, num_warps=NUM_WARPS,
                              **extra, enable_fp_fusion=FP_FUSION)
    return y
