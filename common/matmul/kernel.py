"""Triton GEMM ``y = x · wᵀ`` with one reduction order for every batch size.

Reduction order (the contract).  K is cut into S = ceil(K / SEG_K) segments
of SEG_K = 1024 elements (``reduction_config``: a function of (N, K) only,
never of M).  For each output element:

    p_s   = Σ over k-steps of segment s, in increasing k, each step one
            ``tl.dot`` of BLOCK_K (fp32 accumulator, starting from 0)
    total = ((0 + p_0) + p_1) + ... + p_{S-1}      (fp32 adds, left to right)
    y     = bf16(total)                            (the only rounding to bf16)

Six schedules compute exactly that arithmetic:

* ``_mm_fused_kernel`` — one program per (BLOCK_M × BLOCK_N) tile walks all S
  segments and keeps ``total`` in registers;
* ``_mm_split_kernel`` + ``_mm_merge_kernel`` — one program per (tile,
  segment) writes ``p_s`` in fp32 to a workspace, and the merge adds the S
  partials left to right (small M: S× more programs to fill 132 SMs);
* ``_mm_tma_persistent_kernel`` — the fused arithmetic with TMA loads and
  persistent programs (bf16 at M ≥ 128 by default), in one k-loop that
  restarts the chain after each segment's last step; tiles may be 1.5 powers
  of two wide (192 = 128 + 64 columns, two dots) to fill the SM waves, and
  those keep a k-loop per segment (four accumulators in one loop spill);
* ``_mm_tma_split_kernel`` ("tma_split") + ``_mm_merge_kernel`` — the split
  with TMA loads, for bf16 above 64 rows where even 64x64 tiles leave SMs
  idle (k/v-wide N); the merge launches as a PDL dependent of the split
  (``_pdl.pdl_pair``);
* ``gluon_kernel._mm_pipe_kernel`` ("gluon") — the persistent TMA arithmetic
  for 128-row tiles up to 192 wide, written in Gluon so that its loads run
  ahead across segment and tile boundaries without draining; its
  warp-specialized form ``_mm_ws_kernel`` ("gluon_ws": a producer warp issues
  the loads) runs the 192- and 96-wide tiles; the defaults pick either only
  inside ``launches.graph_launches()``.

The fused and split kernels call the same ``_segment_dot``; the schedule is
picked for speed alone and cannot change a bit.  Every output element is the
same chain of k16 wgmma steps whatever the tile around it, so BLOCK_M,
BLOCK_N, BLOCK_K (any divisor of SEG_K), num_warps and num_stages are free
launch knobs too, and ``launch_config`` is free to depend on M (every
schedule and tile of benchmarks/results/2026-11-30-h200-matmul.md gives the
default's bits; SEG_K = 2048 does not).  BLOCK_M stays ≥ 64 so Hopper
always runs wgmma (smaller tiles lower to mma.sync, whose in-instruction
summation is not promised equal).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._launch import FP_FUSION
from .._pdl import pdl_options, pdl_pair, wait_prior
from . import gluon_kernel
from .launches import graph_launches_active


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
def _mm_split_kernel(p_x, p_w, p_ws, M, N, K,
                     stride_xm, stride_xk, stride_wn, stride_wk,
                     SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr = False):
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b_p = _segment_dot(p_x, p_w, i_m, i_n, M, N, K, s * SEG_K,
                       stride_xm, stride_xk, stride_wn, stride_wk,
                       SEG_K, BLOCK_M, BLOCK_N, BLOCK_K, IEEE)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_ws + s * M * N + o_m[:, None] * N + o_n[None, :], b_p,
             mask=(o_m[:, None] < M) & (o_n[None, :] < N))


@triton.jit(do_not_specialize=["M"])
def _mm_tma_split_kernel(d_x, d_w, p_ws, M, N, SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """``_mm_split_kernel`` with TMA loads (bf16, TMA-able operands; out of
    bounds reads are zero): one program per (tile, K segment) chains the
    segment's k-steps from zero and writes ``p_s`` in fp32 for
    ``_mm_merge_kernel``; the same per-element arithmetic as
    ``_segment_dot``."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_n, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(s * SEG_K, (s + 1) * SEG_K, BLOCK_K):
        b_acc = tl.dot(d_x.load([i_m * BLOCK_M, kk]), d_w.load([i_n * BLOCK_N, kk]).T, b_acc)
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M)
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(p_ws + s * M * N + o_m[:, None] * N + o_n[None, :], b_acc,
             mask=(o_m[:, None] < M) & (o_n[None, :] < N))


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
    to right (measured bit-identical).

    One k-loop runs over all of K and restarts the chain from zero after each
    segment's last step: a loop per segment drains the software pipeline at
    every segment boundary (one loop: median 1.11x over 126 tile x shape x M cells).

    A tile is BLOCK_N + BLOCK_N2 columns wide: BLOCK_N2 > 0 adds a second,
    narrower column block (its own descriptors ``d_w2``/``d_y2`` and dot), so
    a tile can be 192 or 96 wide where powers of two leave SMs idle (wave
    quantisation).  Such tiles keep a k-loop per segment: one loop holding
    four accumulators runs 1.2-2.5x slower.  Each output element is still its
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
# one's speed relative to the 128x256 tile with every SM busy, rounded from sweeps
# at M = 4096 (benchmarks/results/2026-11-30-h200-matmul.md).
_TMA_TILES = ((128, 256, 64, 8, 3), (128, 192, 64, 8, 4), (128, 128, 128, 8, 3), (64, 128, 128, 4, 4),
              (64, 64, 128, 4, 4), (128, 96, 64, 8, 4))
_TMA_SPEED = (1.0, 0.87, 0.9, 0.85, 0.65, 0.7)


# The Gluon kernel's speed where it differs from Triton's at the same tile; with these
# speeds the model picks the measured fastest tile at each of 48 (shape, M) cells.
_GLUON_SPEED = {192: 0.93, 96: 0.78}


def _gluon_schedule(bn: int) -> str:
    """The Gluon form a tile runs: warp-specialized for the two-block tiles (192, 96), 1.00-1.29x the
    one-partition form."""
    return "gluon_ws" if column_blocks(bn)[1] else "gluon"


def _tma_config(bm: int, bn: int, bk: int, nw: int, ns: int, gluon: bool = False) -> dict:
    """A TMA tile's launch: with ``gluon``, 128-row tiles up to 192 wide run on
    the Gluon kernel (its pipeline never drains mid-program; ``_gluon_schedule``
    picks its form), the rest on Triton's."""
    if gluon and bm == gluon_kernel.BLOCK_M and bn <= gluon_kernel.MAX_BLOCK_N:
        return {"schedule": _gluon_schedule(bn), "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
                "num_warps": gluon_kernel.NUM_WARPS, "num_stages": gluon_kernel.pipeline_stages(bn, bk)}
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


def _tma_split_config(M: int, N: int, n_seg: int, sms: int) -> dict:
    """The TMA split's tile: 64 x 32 (BLOCK_K 128) for M <= 64 and N <= 2048, else 64 x 128; above 64 rows the
    widest of 64 x 32 (BLOCK_K 128) and 64 x 64 (BLOCK_K 128) whose programs fit two an SM in one wave, else
    64 x 64 with BLOCK_K 64 while they fit three an SM, else the 128 x 64 or 64 x 128 tile (BLOCK_K 64) that pads
    fewer rows.  A launch knob: every tile gives the same bits.  Figures by M:
    benchmarks/results/2026-11-30-h200-matmul.md."""
    cfg = {"schedule": "tma_split", "BLOCK_M": 64, "num_warps": 4}
    if M <= 64:
        return {**cfg, **({"BLOCK_N": 32, "BLOCK_K": 128} if N <= 2048 else {"BLOCK_N": 128, "BLOCK_K": 64}),
                "num_stages": 4}
    progs = lambda bm, bn: cdiv(M, bm) * cdiv(N, bn) * n_seg  # noqa: E731
    if progs(64, 32) <= 2 * sms:
        return {**cfg, "BLOCK_N": 32, "BLOCK_K": 128, "num_stages": 4}
    if progs(64, 64) <= 2 * sms:
        return {**cfg, "BLOCK_N": 64, "BLOCK_K": 128, "num_stages": 3}
    if progs(64, 64) > 3 * sms:
        bm, bn = (128, 64) if cdiv(M, 128) * 128 <= cdiv(M, 64) * 64 else (64, 128)
        if progs(bm, bn) <= 2 * sms:
            return {**cfg, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 64, "num_stages": 4}
    return {**cfg, "BLOCK_N": 64, "BLOCK_K": 64, "num_stages": 4}


_SMEM = 224 << 10  # bytes of shared memory a program may use on Hopper (227 KB, less headroom)


def _fit_stages(stages: int, BM: int, BN: int, BK: int, elem: int) -> int:
    """The default pipeline depth, lowered until the operand tiles fit
    ``_SMEM`` (a tile picked by hand can need fewer stages)."""
    while stages > 2 and (BM + BN) * BK * elem * stages > _SMEM:
        stages -= 1
    return stages


def launch_config(M: int, N: int, K: int, sms: int = 132, tma: bool = True, gluon: bool = True) -> dict:
    """Bit-neutral schedule and tile for speed: any choice gives the same
    bits (module docstring).

    * M <= 64 (decode): 64-row tiles streaming the weight; split over the K
      segments while the tiles alone would not fill two waves, else fused;
      the split loads by TMA from 32 rows up (``_tma_split_config``).
    * larger M with TMA-able operands: the persistent TMA tile with the best
      (tile speed x wave fill): at M = 128-1024 wave quantisation costs more
      than a smaller tile does; the TMA split instead when even 64x64 tiles
      would leave 30% of the SMs idle, or leave any idle while splitting
      them makes at most four programs an SM (q/o at M = 128, k/v up to 512).
    * otherwise (fp32 or unaligned operands): the pointer-load fused/split kernels.
    """
    n_seg = cdiv(K, reduction_config(N, K)["SEG_K"])
    if M <= 64:
        bn, bk = (32, 128) if N <= 2048 else (64, 64)
        split = n_seg > 1 and cdiv(N, bn) < 2 * sms
        if split and tma and M >= 32:
            return _tma_split_config(M, N, n_seg, sms)
        return {"schedule": "split" if split else "fused", "BLOCK_M": 64, "BLOCK_N": bn, "BLOCK_K": bk,
                "num_warps": 4, "num_stages": 4}
    if tma:
        tiles64 = cdiv(M, 64) * cdiv(N, 64)  # the smallest tile's count
        if n_seg > 1 and (tiles64 < 0.7 * sms or (tiles64 < sms and tiles64 * n_seg <= 4 * sms)):
            return _tma_split_config(M, N, n_seg, sms)
        gluon = gluon and gluon_kernel.available()
        tiles = [(t, _GLUON_SPEED.get(t[1], v) if gluon and t[0] == gluon_kernel.BLOCK_M else v)
                 for t, v in zip(_TMA_TILES, _TMA_SPEED) if t[1] != 96 or gluon]  # 96 wide: Gluon only
        score = [v * _wave_fill(cdiv(M, bm) * cdiv(N, bn), sms) for (bm, bn, *_), v in tiles]
        return _tma_config(*tiles[score.index(max(score))][0], gluon=gluon)
    cfg = ({"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 4} if M <= 512 else
           {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3})
    split = n_seg > 1 and cdiv(M, cfg["BLOCK_M"]) * cdiv(N, cfg["BLOCK_N"]) < sms
    return {"schedule": "split" if split else "fused", **cfg}


SCHEDULES = ("fused", "split", "tma", "gluon", "gluon_ws", "tma_split")
_GLUON = ("gluon", "gluon_ws")


def _schedule_default(schedule: str, M: int, N: int, n_seg: int, sms: int) -> dict:
    """An explicit schedule's tile where ``launch_config`` picked another
    schedule: the first TMA tile, the 192-wide Gluon tile, the split tiles."""
    if schedule == "tma":
        return _tma_config(*_TMA_TILES[0])
    if schedule in _GLUON:
        return {**_tma_config(*_TMA_TILES[1], gluon=True), "schedule": schedule}
    if schedule == "tma_split":
        return _tma_split_config(M, N, n_seg, sms)
    return _split_config(M, N, n_seg, sms)


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
                   num_stages=None, gluon: bool = True) -> tuple:
    """The launch a call runs -> (schedule, BM, BN, BK, num_warps, num_stages):
    ``launch_config``'s choice, an explicit schedule's default tile, the
    caller's knobs on top, default stages fitted to shared memory; checked.
    BN is the tile width: 1.5 times a power of two only on the TMA and Gluon
    schedules.  ``gluon`` lets ``launch_config`` pick the Gluon kernel."""
    lc = launch_config(M, N, K, sms, tma_ok, gluon)
    if schedule is None:
        schedule = lc["schedule"]
    elif schedule != lc["schedule"]:  # an explicit schedule takes that schedule's default tile
        lc = _schedule_default(schedule, M, N, cdiv(K, seg_k), sms)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    BM, BN, BK = block_m or lc["BLOCK_M"], block_n or lc["BLOCK_N"], block_k or lc["BLOCK_K"]
    if column_blocks(BN)[1] and schedule not in ("tma", *_GLUON):
        raise ValueError(f"block_n={BN} (not a power of two) needs schedule='tma', 'gluon' or 'gluon_ws'")
    if schedule in _GLUON:
        if not gluon_kernel.available():
            raise ValueError(f"schedule={schedule!r} needs triton.experimental.gluon (Triton >= 3.6)")
        if BM != gluon_kernel.BLOCK_M or BN > gluon_kernel.MAX_BLOCK_N or (num_warps or 8) != gluon_kernel.NUM_WARPS:
            raise ValueError(f"schedule={schedule!r} runs {gluon_kernel.BLOCK_M}-row tiles at most "
                             f"{gluon_kernel.MAX_BLOCK_N} wide on {gluon_kernel.NUM_WARPS} warps, "
                             f"got block_m={BM} block_n={BN} num_warps={num_warps}")
        lc = {**lc, "num_stages": gluon_kernel.pipeline_stages(BN, BK, elem)}
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

    ``block_m``/``block_n``/``block_k``, ``schedule`` (``SCHEDULES``),
    ``num_warps`` and ``num_stages`` are free launch knobs (defaults from
    ``launch_config``, with its Gluon picks only inside ``graph_launches()``);
    none changes a bit.  ``_reduction`` overrides
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
        block_k=block_k, schedule=schedule, num_warps=num_warps, num_stages=num_stages,
        gluon=graph_launches_active())
    n_seg = cdiv(K, SEG_K)
    seg_k = SEG_K if n_seg > 1 else cdiv(K, BK) * BK
    ieee = x.dtype == torch.float32
    tiles = cdiv(M, BM) * cdiv(N, BN)
    pdl = pdl_options(x.device, M)
    if schedule in ("tma", *_GLUON, "tma_split") and not tma_ok:
        raise ValueError(f"schedule={schedule!r} needs bf16 operands with unit last stride and 16-byte aligned rows")
    if schedule in _GLUON:  # no PDL (it stops at 64 rows anyway): a plain launch is always safe
        gluon_kernel.matmul_fwd_gluon(x, w, y, seg_k=seg_k, n_seg=n_seg, BN=BN, BK=BK, stages=ns, sms=sms,
                                      ws=schedule == "gluon_ws")
    elif schedule == "tma":
        from triton.tools.tensor_descriptor import TensorDescriptor

        progs = min(sms, tiles)
        bn, bn2 = column_blocks(BN)
        d_w, d_y = TensorDescriptor.from_tensor(w, [bn, BK]), TensorDescriptor.from_tensor(y, [BM, bn])
        d_w2, d_y2 = ((TensorDescriptor.from_tensor(w, [bn2, BK]), TensorDescriptor.from_tensor(y, [BM, bn2]))
                      if bn2 else (d_w, d_y))
        _mm_tma_persistent_kernel[(progs,)](
            TensorDescriptor.from_tensor(x, [BM, BK]), d_w, d_w2, d_y, d_y2, M, N, K, n_seg,
            SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=bn, BLOCK_N2=bn2, BLOCK_K=BK, GROUP_M=8, NUM_PROGS=progs,
            num_warps=nw, num_stages=ns, **pdl, enable_fp_fusion=FP_FUSION)
    elif schedule == "tma_split" or (schedule == "split" and n_seg > 1):
        ws = torch.empty((n_seg, M, N), dtype=torch.float32, device=x.device)
        pdl_split, pdl_merge = pdl_pair(x.device, M)  # the merge's launch overlaps the split's last wave
        if schedule == "tma_split":
            from triton.tools.tensor_descriptor import TensorDescriptor

            _mm_tma_split_kernel[(cdiv(M, BM), cdiv(N, BN), n_seg)](
                TensorDescriptor.from_tensor(x, [BM, BK]), TensorDescriptor.from_tensor(w, [BN, BK]), ws, M, N,
                SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, num_warps=nw, num_stages=ns, **pdl_split,
                enable_fp_fusion=FP_FUSION)
        else:
            _mm_split_kernel[(cdiv(M, BM), cdiv(N, BN), n_seg)](
                x, w, ws, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
                SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, IEEE=ieee, num_warps=nw, num_stages=ns, **pdl_split,
                enable_fp_fusion=FP_FUSION)
        _mm_merge_kernel[(cdiv(M * N, 1024),)](ws, y, M, N, y.stride(0), y.stride(1), n_seg, BLOCK=1024, **pdl_merge,
            enable_fp_fusion=FP_FUSION, num_warps=4)
    else:  # fused, or split with a single K segment
        _mm_fused_kernel[(tiles,)](
            x, w, y, M, N, K, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
            n_seg, SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=8, IEEE=ieee,
            num_warps=nw, num_stages=ns, **pdl, enable_fp_fusion=FP_FUSION)
    return y


def _tma_ok(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """TMA descriptors need unit last strides and 16-byte aligned rows/bases."""
    return all(t.dtype == torch.bfloat16 and t.stride(1) == 1 and (t.stride(0) * 2) % 16 == 0
               and t.data_ptr() % 16 == 0 for t in (x, w, y))
