"""Triton GEMM ``y = x · wᵀ`` with one reduction order for every batch size.

Reduction order (the contract).  K is cut into S = ceil(K / SEG_K) segments
of SEG_K = 1024 elements (``reduction_config``: a function of (N, K) only,
never of M).  For each output element:

    p_s   = Σ over k-steps of segment s, in increasing k, each step one
            ``tl.dot`` of BLOCK_K (fp32 accumulator, starting from 0)
    total = ((0 + p_0) + p_1) + ... + p_{S-1}      (fp32 adds, left to right)
    y     = bf16(total)                            (the only rounding to bf16)

Three schedules compute exactly that arithmetic:

* ``_mm_fused_kernel`` — one program per (BLOCK_M × BLOCK_N) tile walks all S
  segments and keeps ``total`` in registers;
* ``_mm_split_kernel`` — one program per (tile, segment) writes ``p_s`` in
  fp32 to a workspace, and the program that arrives last at its tile (an
  acq_rel atomic counter per tile, reset by that program) adds the S
  partials left to right and stores y (small M: S× more programs to fill
  132 SMs; the memory-ordering argument is in its docstring).  Schedule
  ``split2`` runs the same kernel without the in-place merge, then
  ``_mm_merge_kernel`` adds the partials in a second launch, the same adds:
  the reference the tests hold the one-launch merge to (which saves a launch
  a split matmul, three a layer at Qwen3-8B decode);
* ``_mm_tma_persistent_kernel`` — the fused arithmetic with TMA loads and
  persistent programs (bf16 at M ≥ 128 by default), in one k-loop that
  restarts the chain after each segment's last step; tiles may be 1.5 powers
  of two wide (192 = 128 + 64 columns, two dots) to fill the SM waves, and
  those keep a k-loop per segment (four accumulators in one loop spill).

The fused and split kernels call the same ``_segment_dot``; the schedule is
picked for speed alone and cannot change a bit (nor can which program of a
split tile merges: the merge reads p_0 ... p_{S-1} in order).  Every output
element is the same chain of k16 wgmma steps whatever the tile around it, so
BLOCK_M, BLOCK_N, BLOCK_K (any divisor of SEG_K), num_warps and num_stages
are free launch knobs too.  Measured on the H200: every combination of BM ∈ {64, 128},
BN ∈ {64, 128, 256}, BK ∈ {64, 128}, 4/8 warps, 3/4 stages and the two
pointer-load schedules gave identical bits at SEG_K = 1024, while SEG_K =
2048 changed them (benchmarks/results/2026-11-30-h200-matmul-sweep.txt); in
session 4, 22 schedule × tile candidates including the TMA schedule and
64×32 tiles, at six Qwen3-8B (N, K) and M = 1…1024, all gave the default's
bits (…-session4-matmul-sweep.txt); in session 5 the one-loop TMA kernel,
192- and 96-wide tiles and a stream-K schedule (dropped: slower everywhere)
did too (…-session5-matmul-sweeps.txt).  ``launch_config`` is therefore free
to depend on M.  BLOCK_M stays ≥ 64 so Hopper always runs wgmma (smaller tiles
lower to mma.sync, whose in-instruction summation is not promised equal).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._pdl import pdl_options, wait_prior


@triton.jit
def _segment_dot(p_x, p_w, i_m, i_n, M, N, K, k_lo,
                 stride_xm, stride_xk, stride_wn, stride_wk,
                 SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 IEEE: tl.constexpr):
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + SEG_K, BLOCK_K):
        m_k = (k0 + o_k) < K
        b_x = tl.load(p_x + o_m[:, None] * stride_xm + (k0 + o_k)[None, :] * stride_xk,
                      mask=(o_m[:, None] < M) & m_k[None, :], other=0.0)
        b_w = tl.load(p_w + o_n[None, :] * stride_wn + (k0 + o_k)[:, None] * stride_wk,
                      mask=(o_n[None, :] < N) & m_k[:, None], other=0.0)
        if IEEE:
            b_acc = tl.dot(b_x, b_w, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_x, b_w, b_acc)
    return b_acc


@triton.jit
def _tile_coords(tile, n_m, n_n, GROUP_M: tl.constexpr):
    """Grouped tile order (GROUP_M row tiles share column tiles, for L2 reuse).
    Which program computes a tile never touches a sum."""
    first_m = (tile // (GROUP_M * n_n)) * GROUP_M
    size_m = min(n_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % (GROUP_M * n_n)) // size_m


@triton.jit(do_not_specialize=["M"])
def _mm_fused_kernel(p_x, p_w, p_y, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
                     N_SEG, SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    b_total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, N_SEG):
        b_total += _segment_dot(p_x, p_w, i_m, i_n, M, N, K, s * SEG_K,
                                stride_xm, stride_xk, stride_wn, stride_wk,
                                SEG_K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_y + o_m[:, None] * stride_ym + o_n[None, :] * stride_yn,
             b_total.to(p_y.dtype.element_ty), mask=(o_m[:, None] < M) & (o_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _mm_split_kernel(p_x, p_w, p_ws, p_y, p_cnt, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn, N_SEG,
                     SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE: tl.constexpr, MERGE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (i_m, i_n, s) stores the fp32 partial p_s of tile (i_m, i_n) to
    ``p_ws[s]``.  MERGE=False stops there (``_mm_merge_kernel`` adds them in a
    second launch).  MERGE=True: the program that arrives last at its tile
    merges in place: it loads p_0 ... p_{S-1} and adds them exactly as
    ``_mm_merge_kernel`` does (fp32 zeros, += p_0, += p_1, ... left to right,
    one rounding to y's dtype), whichever segment it computed itself.  No
    program ever waits for another, so no grid size can deadlock.

    Memory ordering (PTX memory model; CUTLASS's split-K semaphore and
    stream-K fixup do the same):
      1. every thread of the program stores its part of p_s (weak stores);
      2. ``tl.debug_barrier()`` (bar.sync): those stores precede, in causality
         order, everything thread 0 does after the barrier;
      3. thread 0 alone (Triton issues a scalar atomic from one thread and
         broadcasts the old value through shared memory) runs
         ``atomic_add(counter[tile], 1, sem="acq_rel", scope="gpu")``.  Its
         release half is cumulative: it publishes at gpu scope every store
         before it in causality order, the whole CTA's of step 1.  Every
         increment is acq_rel, so each synchronizes with the one it read:
         the program that reads S - 1 has all S - 1 other programs' partial
         stores before it in causality order;
      4. that last program runs a second barrier, so its other threads'
         loads follow thread 0's acquire, then loads the S partials with
         ``cache_modifier=".cg"`` (from L2: never a stale L1 line; its own
         p_s, written by other threads of the CTA, included) and stores y;
      5. it resets the counter to 0 (relaxed exchange): no program of this
         launch touches it again, and the next launch that reads it starts
         after this grid has finished (stream order; or, PDL-launched, only
         once its ``wait_prior`` has seen this whole grid complete).
    PDL: a consumer of y launched with PDL passes its ``wait_prior`` only
    once every program of this grid has exited, the merging ones included,
    so y is complete before anyone reads it.
    """
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b_p = _segment_dot(p_x, p_w, i_m, i_n, M, N, K, s * SEG_K,
                       stride_xm, stride_xk, stride_wn, stride_wk,
                       SEG_K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_y = (o_m[:, None] < M) & (o_n[None, :] < N)
    p_tile = p_ws + o_m[:, None] * N + o_n[None, :]  # (BM, BN) of p_0; p_s is s * M * N further
    tl.store(p_tile + s * M * N, b_p, mask=m_y)
    if MERGE:
        tl.debug_barrier()  # 2: the CTA's partial stores before thread 0's release
        p_c = p_cnt + i_m * tl.num_programs(1) + i_n
        if tl.atomic_add(p_c, 1, sem="acq_rel", scope="gpu") == N_SEG - 1:  # 3: the last arrival
            tl.debug_barrier()  # 4: every thread's loads after the acquire
            b_total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for t in range(0, N_SEG):  # left to right, the adds of _mm_merge_kernel
                b_total += tl.load(p_tile + t * M * N, mask=m_y, other=0.0, cache_modifier=".cg")
            tl.store(p_y + o_m[:, None] * stride_ym + o_n[None, :] * stride_yn,
                     b_total.to(p_y.dtype.element_ty), mask=m_y)
            tl.atomic_xchg(p_c, 0, sem="relaxed", scope="gpu")  # 5: ready for the next launch


@triton.jit(do_not_specialize=["M"])
def _mm_merge_kernel(p_ws, p_y, M, N, stride_ym, stride_yn, N_SEG, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)  # PDL: first, before any global load or store
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = o < M * N
    b_total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, N_SEG):  # left to right, the same adds as the fused kernel
        b_total += tl.load(p_ws + s * M * N + o, mask=mask, other=0.0)
    i_m, i_n = o // N, o % N
    tl.store(p_y + i_m * stride_ym + i_n * stride_yn, b_total.to(p_y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _mm_tma_persistent_kernel(d_x, d_w, d_w2, d_y, d_y2, M, N, K, N_SEG,
                              SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_N2: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                              NUM_PROGS: tl.constexpr, PDL: tl.constexpr = False):
    """Large-M schedule: persistent programs walk the tiles; operands arrive by
    TMA (out-of-bounds reads are zero).  Same per-element arithmetic as
    ``_segment_dot`` + the fused kernel: segment chains from zero, added left
    to right (measured bit-identical on the H200).

    One k-loop runs over all of K and restarts the chain from zero after each
    segment's last step: a loop per segment drained the software pipeline at
    every segment boundary (4-12 times a tile; one loop measured 1.03-1.30x
    faster, median 1.11x, over 126 tile x shape x M cells of the session-5
    sweep).

    A tile is BLOCK_N + BLOCK_N2 columns wide: BLOCK_N2 > 0 adds a second,
    narrower column block (its own descriptors ``d_w2``/``d_y2`` and dot), so
    a tile can be 192 or 96 wide where powers of two leave SMs idle (wave
    quantisation).  Such tiles keep a k-loop per segment: one loop holding
    four accumulators ran 1.2-2.5x slower.  Each output element is still its
    own k16 chain: the column block it sits in does not touch its sum."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    BLOCK_W: tl.constexpr = BLOCK_N + BLOCK_N2
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_W)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_PROGS, flatten=False):
        i_m, i_n = _tile_coords(tile, n_m, n_n, GROUP_M)
        o_m, o_n = i_m * BLOCK_M, i_n * BLOCK_W
        b_total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if BLOCK_N2 == 0:
            for kk in range(0, N_SEG * SEG_K, BLOCK_K):
                b_acc = tl.dot(d_x.load([o_m, kk]), d_w.load([o_n, kk]).T, b_acc)
                if (kk + BLOCK_K) % SEG_K == 0:  # a segment's last step
                    b_total += b_acc
                    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            b_total2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
            for s in range(0, N_SEG):
                b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                b_acc2 = tl.zeros((BLOCK_M, BLOCK_N2), dtype=tl.float32)
                for kk in range(s * SEG_K, (s + 1) * SEG_K, BLOCK_K):
                    b_x = d_x.load([o_m, kk])
                    b_acc = tl.dot(b_x, d_w.load([o_n, kk]).T, b_acc)
                    b_acc2 = tl.dot(b_x, d_w2.load([o_n + BLOCK_N, kk]).T, b_acc2)
                b_total += b_acc
                b_total2 += b_acc2
            d_y2.store([o_m, o_n + BLOCK_N], b_total2.to(d_y2.dtype))
        d_y.store([o_m, o_n], b_total.to(d_y.dtype))


_NUM_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _NUM_SMS[idx]


def reduction_config(N: int, K: int) -> dict:
    """The one parameter that fixes the K-reduction's bits: a function of
    (N, K) only, never of M.  SEG_K = 1024 for every shape today."""
    return {"SEG_K": 1024}


# Persistent TMA tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) and each
# one's speed relative to the 128x256 tile with every SM busy (rounded from the
# session-5 sweeps, benchmarks/results/2026-11-30-h200-session5-matmul-sweeps.txt).
_TMA_TILES = ((128, 256, 64, 8, 3), (128, 192, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4),
              (64, 64, 128, 4, 4))
_TMA_SPEED = (1.0, 0.87, 0.9, 0.85, 0.65)


def _tma_config(bm: int, bn: int, bk: int, nw: int, ns: int) -> dict:
    return {"schedule": "tma", "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}


def _wave_fill(tiles: int, sms: int) -> float:
    """Busy fraction of the SM-waves that ``tiles`` equal tiles take."""
    return tiles / (cdiv(tiles, sms) * sms)


def _split_config(M: int, N: int, n_seg: int, sms: int) -> dict:
    """Split (one program per tile and K segment): narrow 64x32 tiles with
    BLOCK_K 128 while the programs fit two per SM, else 64-row tiles."""
    if cdiv(M, 64) * cdiv(N, 32) * n_seg <= 2 * sms:
        return {"schedule": "split", "BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
    return {"schedule": "split", "BLOCK_M": 64, "BLOCK_N": 64 if N <= 2048 else 128, "BLOCK_K": 64,
            "num_warps": 4, "num_stages": 4}


_SMEM = 224 << 10  # bytes of shared memory a program may use on the H200 (227 KB, less headroom)


def _fit_stages(stages: int, BM: int, BN: int, BK: int, elem: int) -> int:
    """The default pipeline depth, lowered until the operand tiles fit the
    H200's shared memory (a tile picked by hand can need fewer stages)."""
    while stages > 2 and (BM + BN) * BK * elem * stages > _SMEM:
        stages -= 1
    return stages


def launch_config(M: int, N: int, K: int, sms: int = 132, tma: bool = True) -> dict:
    """Bit-neutral schedule and tile for speed: any choice gives the same
    bits (H200 sweeps of sessions 4 and 5, benchmarks/results/2026-11-30-h200-session4-matmul-sweep.txt
    and ...-session5-matmul-sweeps.txt: every schedule x tile candidate at six
    Qwen3-8B (N, K) and M = 1...4096 gave the default's bits).

    * M <= 64 (decode): 64-row tiles streaming the weight; split over the K
      segments while the tiles alone would not fill two waves, else fused.
    * larger M with TMA-able operands: the persistent TMA tile with the best
      (tile speed x wave fill): at M = 128-1024 wave quantisation costs more
      than a smaller tile does; split instead when even 64x64 tiles would
      leave 30% of the SMs idle.
    * otherwise (fp32 or unaligned operands): the pointer-load fused/split kernels.
    """
    n_seg = cdiv(K, reduction_config(N, K)["SEG_K"])
    if M <= 64:
        bn, bk = (32, 128) if N <= 2048 else (64, 64)
        split = n_seg > 1 and cdiv(N, bn) < 2 * sms
        return {"schedule": "split" if split else "fused", "BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk,
                "num_warps": 4, "num_stages": 4}
    if tma:
        if n_seg > 1 and cdiv(M, 64) * cdiv(N, 64) < 0.7 * sms:  # the smallest tile's count
            return _split_config(M, N, n_seg, sms)
        score = [v * _wave_fill(cdiv(M, bm) * cdiv(N, bn), sms)
                 for (bm, bn, *_), v in zip(_TMA_TILES, _TMA_SPEED)]
        return _tma_config(*_TMA_TILES[score.index(max(score))])
    cfg = ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4} if M <= 512 else
           {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3})
    split = n_seg > 1 and cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]) < sms
    return {"schedule": "split" if split else "fused", **cfg}


SCHEDULES = ("fused", "split", "split2", "tma")  # split2: the two-kernel split (reference, sweeps)


def column_blocks(BN: int) -> tuple[int, int]:
    """A tile width -> the TMA kernel's (BLOCK_N, BLOCK_N2): a power of two,
    or one and a half (192 = 128 + 64, 96 = 64 + 32)."""
    main = 1 << (BN.bit_length() - 1)
    rest = BN - main
    if rest and rest * 2 != main:
        raise ValueError(f"block_n={BN} must be a power of two or 1.5 times one (96, 192, ...)")
    return main, rest


def resolve_launch(M: int, N: int, K: int, elem: int, sms: int, tma_ok: bool, *, seg_k: int,
                   block_m=None, block_n=None, block_k=None, schedule=None, num_warps=None,
                   num_stages=None) -> tuple:
    """The launch a call runs -> (schedule, BM, BN, BK, num_warps, num_stages):
    ``launch_config``'s choice, an explicit schedule's default tile, the
    caller's knobs on top, default stages fitted to shared memory; checked.
    BN is the tile width: 1.5 times a power of two only on the TMA schedule."""
    lc = launch_config(M, N, K, sms, tma_ok)
    if schedule is None:
        schedule = lc["schedule"]
    elif schedule != lc["schedule"] and (schedule, lc["schedule"]) != ("split2", "split"):
        # an explicit schedule takes that schedule's default tile (split2 where split is the default: split's)
        lc = _tma_config(*_TMA_TILES[0]) if schedule == "tma" else _split_config(M, N, cdiv(K, seg_k), sms)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    BM, BN, BK = block_m or lc["BLOCK_M"], block_n or lc["BLOCK_N"], block_k or lc["BLOCK_K"]
    if column_blocks(BN)[1] and schedule != "tma":
        raise ValueError(f"block_n={BN} (not a power of two) needs schedule='tma'")
    while not block_k and BK > 32 and (BM + BN) * BK * elem * 2 > _SMEM:  # fp32 tiles: a shorter k-step
        BK //= 2
    nw, ns = num_warps or lc["num_warps"], num_stages or _fit_stages(lc["num_stages"], BM, BN, BK, elem)
    if BM < 64:
        raise ValueError("block_m below 64 would change the MMA instruction (and bits) on Hopper")
    if seg_k % BK:
        raise ValueError(f"block_k={BK} must divide SEG_K={seg_k}")
    return schedule, BM, BN, BK, nw, ns


def matmul_fwd_triton(x: torch.Tensor, w: torch.Tensor, *, block_m: int | None = None,
                      block_n: int | None = None, block_k: int | None = None,
                      schedule: str | None = None, num_warps: int | None = None,
                      num_stages: int | None = None, _reduction: dict | None = None) -> torch.Tensor:
    """x (M, K) · w (N, K)ᵀ -> (M, N) in x.dtype.  Strided inputs are fine.

    ``block_m``/``block_n``/``block_k``, ``schedule`` (``SCHEDULES``;
    ``split2``: the split schedule's two-kernel reference, on split's tile),
    ``num_warps`` and ``num_stages`` are free launch knobs (defaults from
    ``launch_config``); none changes a bit.  ``_reduction`` overrides
    ``reduction_config`` (for sweeps only: it does change bits).
    """
    M, K = x.shape
    N = w.shape[0]
    SEG_K = {**reduction_config(N, K), **(_reduction or {})}["SEG_K"]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    sms, tma_ok = _num_sms(x.device), _tma_ok(x, w, y)
    schedule, BM, BN, BK, nw, ns = resolve_launch(
        M, N, K, x.element_size(), sms, tma_ok, seg_k=SEG_K, block_m=block_m, block_n=block_n,
        block_k=block_k, schedule=schedule, num_warps=num_warps, num_stages=num_stages)
    n_seg = cdiv(K, SEG_K)
    seg_k = SEG_K if n_seg > 1 else cdiv(K, BK) * BK
    ieee = x.dtype == torch.float32
    tiles = cdiv(M, BM) * cdiv(N, BN)
    pdl = pdl_options(x.device, M)
    if schedule == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        if not tma_ok:
            raise ValueError("schedule='tma' needs bf16 operands with unit last stride and 16-byte aligned rows")
        progs = min(sms, tiles)
        bn, bn2 = column_blocks(BN)
        d_w, d_y = TensorDescriptor.from_tensor(w, [bn, BK]), TensorDescriptor.from_tensor(y, [BM, bn])
        d_w2, d_y2 = ((TensorDescriptor.from_tensor(w, [bn2, BK]), TensorDescriptor.from_tensor(y, [BM, bn2]))
                      if bn2 else (d_w, d_y))
        _mm_tma_persistent_kernel[(progs,)](
            TensorDescriptor.from_tensor(x, [BM, BK]), d_w, d_w2, d_y, d_y2, M, N, K, n_seg,
            SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=bn, BLOCK_N2=bn2, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=progs,
            num_warps=nw, num_stages=ns, **pdl)
    elif schedule in ("split", "split2") and n_seg > 1:
        split_launch(x, w, y, n_seg, seg_k=seg_k, BM=BM, BN=BN, BK=BK, num_warps=nw, num_stages=ns,
                     merge=schedule == "split", pdl=pdl)
    else:  # fused, or split with a single K segment
        _mm_fused_kernel[(tiles,)](
            x, w, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
            n_seg, SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, IEEE=ieee,
            num_warps=nw, num_stages=ns, **pdl)
    return y


def split_launch(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, n_seg: int, *, seg_k: int, BM: int, BN: int,
                 BK: int, num_warps: int, num_stages: int, merge: bool = True, pdl: dict | None = None) -> None:
    """y = x · wᵀ by the split schedule over ``n_seg`` K segments of ``seg_k``:
    one launch of ``_mm_split_kernel`` that merges in place (``merge``, the
    default), or the two-kernel reference (split, then ``_mm_merge_kernel``).
    Same partials, same adds in the same order: the same bits.  CPU tensors
    run under ``TRITON_INTERPRET=1`` (the tests)."""
    M, K = x.shape
    N = w.shape[0]
    grid = (cdiv(M, BM), cdiv(N, BN), n_seg)
    pdl = pdl or {"PDL": False}
    ws = torch.empty((n_seg, M, N), dtype=torch.float32, device=x.device)
    cnt = split_counters(x.device, grid[0] * grid[1]) if merge else ws
    _mm_split_kernel[grid](
        x, w, ws, y, cnt, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        n_seg, SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, IEEE=x.dtype == torch.float32, MERGE=merge,
        num_warps=num_warps, num_stages=num_stages, **pdl)
    if not merge:
        BLOCK = 1024
        _mm_merge_kernel[(cdiv(M * N, BLOCK),)](ws, y, M, N, y.stride(0), y.stride(1), n_seg, BLOCK=BLOCK, **pdl)


# Arrival counters of the in-place split merge: one int32 per tile, zero between launches (the
# last program of a tile resets its own).  One buffer per (device, stream): launches on one stream
# run one after another (or, PDL-launched, touch memory only after the previous grid has ended),
# so two launches can never use one buffer at once.  Buffers are never freed: a captured CUDA
# graph keeps the address of the buffer of the stream it was captured on.
COUNTERS_MIN = 1 << 16  # tiles per buffer (256 KiB); launch_config splits grids of < 2 x 132 tiles only
_COUNTERS: dict[tuple, torch.Tensor] = {}
_SPARE: dict = {}  # device -> one zeroed buffer, >= every buffer of the device: a capture's first one
_RETIRED: list[torch.Tensor] = []


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The zeroed int32 arrival counters (at least ``tiles``) of the current
    stream of ``device`` (CPU: the interpreter's one buffer).

    Zeroed memory cannot be allocated during a CUDA-graph capture (the zero
    fill would be captured and replayed), so buffers are allocated, or grown
    (new zeros, the old buffer kept alive), by eager launches only, at least
    ``COUNTERS_MIN`` long; an eager launch also keeps one zeroed spare per
    device, as long as the longest buffer.  A capture on a stream whose
    buffer is missing or too short (``torch.cuda.graph`` captures on a side
    stream of its own) takes the spare: its zero fill was queued before the
    capture began, and ``torch.cuda.graph`` synchronizes the device first.
    With no spare long enough the launch raises: run the matmul once eagerly
    on the device before capturing (the warm-up every capture has anyway).

    A graph replays with its capture stream's buffer, whatever stream it is
    replayed on: graphs captured on one stream must not replay concurrently
    with each other (the engine replays one at a time)."""
    dev = device.index if device.type == "cuda" else device.type
    key = (dev, _current_stream(dev) if device.type == "cuda" else None)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= tiles and dev in _SPARE:
        return buf
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if buf is None or buf.numel() < tiles:
        if capturing:
            if _SPARE.get(dev) is None or _SPARE[dev].numel() < tiles:
                raise RuntimeError(
                    f"the split matmul needs {tiles} zeroed arrival counters on this capturing stream, and "
                    "zeroed memory cannot be allocated during a capture: run the matmul once eagerly on this "
                    "device before capturing it")
            new = _SPARE.pop(dev)
        else:
            new = torch.zeros(max(tiles, COUNTERS_MIN), dtype=torch.int32, device=device)
        if buf is not None:
            _RETIRED.append(buf)
        buf = _COUNTERS[key] = new
    if not capturing and (dev not in _SPARE or _SPARE[dev].numel() < buf.numel()):
        _SPARE[dev] = torch.zeros(buf.numel(), dtype=torch.int32, device=device)
    return buf


def _current_stream(dev: int) -> int:
    """The raw handle of the stream a Triton launch on device ``dev`` goes to
    (Triton's own lookup)."""
    return triton.runtime.driver.active.get_current_stream(dev)


def _tma_ok(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """TMA descriptors need unit last strides and 16-byte aligned rows/bases."""
    return all(t.dtype == torch.bfloat16 and t.stride(1) == 1 and (t.stride(0) * 2) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (x, w, y))
