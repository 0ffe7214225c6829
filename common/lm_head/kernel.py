"""Triton LM-head kernels (CUDA) and their launchers.

The steps and rounding points are the CPU path's (``cpu.py``); only the
projection's inner order is the tensor cores'.  None of the parameters that
shape a reduction depends on T.

Forward, ``_lm_head_fwd_kernel``, grid (cdiv(T, BM), G), G = cdiv(V, 256);
program (i_m, i_g) owns rows [i_m*BM, +BM) and vocabulary group i_g:

- Projection: ``z = h · Wᵀ`` tile (BM, 256) with one FP32 accumulator,
  ``tl.dot`` over K in steps of BK from k = 0 (the K tail masked to zeros,
  which add exactly), no split-K.  BK is fixed per dtype: 64 for bf16, where
  inside one BK step the order is the tensor core's (wgmma k16 slices in
  order); 16 for fp32 with ``input_precision="ieee"`` (never TF32), a
  sequential FMA chain over k.  Logits stay FP32.  BM (rows per program) is a
  launch knob in ``op.CUDA_BLOCK_MS`` = (64, 128); for bf16 it runs BM / 16 warps so
  that both issue the same m64n256k16 wgmma per 64-row slice (checked in the
  sm_90 PTX with triton 3.9): a row's K order does not depend on BM.
- Group stats: ``m = tl.max(z)`` (a max is exact in any order; only the sign of
  a zero max could vary and it cannot reach the LSE: exp(±0) = 1 and
  ±0 + log L rounds to the same value), ``l = sum fl(exp(fl(z - m)))`` by the
  explicit pairwise tree of ``_pairwise_sum``: the tile is reshaped to
  (BM, n/2, 2) and the two halves of each pair added, level by level.  Every
  addition has exactly two terms, so the order cannot depend on the register
  layout Triton picks (which changes with BM and num_warps); a ``tl.sum``
  would not give that guarantee.
- The target logit is copied (a max over one real value and -infs, exact)
  by the program whose group holds the target.

Merge, ``_lm_head_merge_kernel``, grid (cdiv(T, BR),): loads a row's G
(m, l) pairs padded to G2 = next power of two with the identity (-inf, 0),
and merges them by the pairwise tree over the group index, level by level,
with ``(m, l) (+) (m', l') = (M, fl(fl(l·exp(fl(m - M))) + fl(l'·exp(fl(m' - M)))))``.
A real group merged with the identity comes back bit for bit (exp(0) = 1,
exp(-inf) = 0), so this is the CPU tree with "odd one carried up"; a pair of
pads stays a pad (guarded against -inf - -inf).  Then ``lse = fl(M + fl(log L))``,
``logprob = fl(z_target - lse)``.

Backward, per vocabulary chunk of whole groups (its size cannot change bits):
``_lm_head_dz_kernel`` recomputes the chunk's logits by the forward's
projection, ``p = fl(exp(fl(z - lse)))``, ``d = fl(1 - p)`` at the target and
``-p`` elsewhere, ``dz = fl(grad·d)`` rounded to the input dtype, stored to a
(T, chunk) buffer in the input dtype (there is never a (T, V) FP32 tensor).  ``_gemm_kernel`` then does ``dh += dz · W_chunk`` into one FP32
(T, K) accumulator loaded and stored per chunk — the vocabulary is summed in
steps of BL = 64 from v = 0, and since chunks start on multiples of 256 the
sequence of ``tl.dot`` steps is the same for any chunk size — and
``dW_chunk = dzᵀ · h``, tokens summed in steps of BL from t = 0, rounded once
to W's dtype.  Both are deterministic run to run; dh rows are batch-invariant.

All kernels are compiled with ``enable_fp_fusion=False``: no multiply-add is
contracted into an FMA, so the rounding points above are the real ones.
``tl.exp`` is ex2.approx(fl(x·log2 e)) and ``tl.log`` libdevice's logf: not
the CPU's routines, but fixed per element, so they cannot depend on the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv, next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior
from .cpu import VOCAB_GROUP

DEFAULT_BLOCK_M = 64
_LOG2_GROUP = VOCAB_GROUP.bit_length() - 1
_FWD_STAGES = 3
# Backward GEMM tiles: fixed constants (BL = 64 divides the 256-logit group,
# which keeps the dh vocabulary order independent of the chunk size).
_GEMM_BL = 64
_GEMM_WARPS = 4
# Bytes of the backward's (T, chunk) dz buffer when the caller gives no chunk.
_DZ_BYTES = 1 << 28


@triton.jit
def _logits_tile(h, w, i_m, i_g, T, V, K, BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """FP32 z tile (BM, BV) = h[rows] · W[group]ᵀ, K in BK steps from 0."""
    o_m = i_m * BM + tl.arange(0, BM)
    o_v = i_g * BV + tl.arange(0, BV)
    o_k = tl.arange(0, BK)
    m_m = o_m < T
    m_v = o_v < V
    p_h = h + o_m[:, None].to(tl.int64) * K + o_k[None, :]  # (BM, BK)
    p_w = w + o_v[None, :].to(tl.int64) * K + o_k[:, None]  # (BK, BV): Wᵀ tile
    b_acc = tl.zeros((BM, BV), dtype=tl.float32)
    for k0 in range(0, K, BK):
        m_k = (k0 + o_k) < K
        b_h = tl.load(p_h, mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_w = tl.load(p_w, mask=m_k[:, None] & m_v[None, :], other=0.0)
        if IEEE:
            b_acc = tl.dot(b_h, b_w, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_h, b_w, b_acc)
        p_h += BK
        p_w += BK
    return b_acc


@triton.jit
def _pairwise_sum(x, BM: tl.constexpr, N: tl.constexpr, LOG2N: tl.constexpr):
    """(BM, N) -> (BM,): level by level, column 2i + column 2i+1."""
    for i in tl.static_range(LOG2N):
        a, b = tl.split(tl.reshape(x, (BM, N >> (i + 1), 2)))
        x = a + b
    return tl.reshape(x, (BM,))


@triton.jit(do_not_specialize=["T"])
def _lm_head_fwd_kernel(
    h, w, tgt, z_out, m_out, l_out, zt_out,
    T, V, K, G,
    BM: tl.constexpr, BV: tl.constexpr, LOG2BV: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
    WRITE_LOGITS: tl.constexpr, WRITE_STATS: tl.constexpr, HAS_TARGETS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Logits tile of (row tile i_m, group i_g); optionally store it (FP32),
    and/or the group's (max, pairwise sum of exp(z - max)) and target logits."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m, i_g = tl.program_id(0), tl.program_id(1)
    b_z = _logits_tile(h, w, i_m, i_g, T, V, K, BM, BV, BK, IEEE)  # (BM, BV)
    o_m = i_m * BM + tl.arange(0, BM)
    o_v = i_g * BV + tl.arange(0, BV)
    m_m = o_m < T
    m_v = o_v < V
    if WRITE_LOGITS:
        p_z = z_out + o_m[:, None].to(tl.int64) * V + o_v[None, :]
        tl.store(p_z, b_z, mask=m_m[:, None] & m_v[None, :])
    if WRITE_STATS:
        b_z = tl.where(m_v[None, :], b_z, float("-inf"))
        b_m = tl.max(b_z, axis=1)  # (BM,)
        b_l = _pairwise_sum(tl.exp(b_z - b_m[:, None]), BM, BV, LOG2BV)  # (BM,)
        o_s = o_m.to(tl.int64) * G + i_g
        tl.store(m_out + o_s, b_m, mask=m_m)
        tl.store(l_out + o_s, b_l, mask=m_m)
        if HAS_TARGETS:
            b_t = tl.load(tgt + o_m, mask=m_m, other=-1)
            b_hit = tl.where(o_v[None, :] == b_t[:, None], b_z, float("-inf"))
            b_zt = tl.max(b_hit, axis=1)
            m_t = m_m & (b_t >= i_g * BV) & (b_t < i_g * BV + BV)
            tl.store(zt_out + o_m, b_zt, mask=m_t)


@triton.jit(do_not_specialize=["T"])
def _lm_head_merge_kernel(
    m_in, l_in, zt_in, lp_out, lse_out,
    T, G,
    BR: tl.constexpr, G2: tl.constexpr, LOG2G2: tl.constexpr, HAS_TARGETS: tl.constexpr, PDL: tl.constexpr = False,
):
    """Per row: merge the G group stats by the fixed pairwise tree, then
    lse = M + log L and logprob = z_target - lse."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_r = tl.program_id(0)
    o_r = i_r * BR + tl.arange(0, BR)
    o_g = tl.arange(0, G2)
    m_r = o_r < T
    p_s = o_r[:, None].to(tl.int64) * G + o_g[None, :]
    m_s = m_r[:, None] & (o_g < G)[None, :]
    b_m = tl.load(m_in + p_s, mask=m_s, other=float("-inf"))  # (BR, G2)
    b_l = tl.load(l_in + p_s, mask=m_s, other=0.0)
    for i in tl.static_range(LOG2G2):
        m_a, m_b = tl.split(tl.reshape(b_m, (BR, G2 >> (i + 1), 2)))
        l_a, l_b = tl.split(tl.reshape(b_l, (BR, G2 >> (i + 1), 2)))
        b_big = tl.maximum(m_a, m_b)
        # two pads: keep (-inf, 0) instead of exp(-inf - -inf) = NaN
        b_pad = b_big == float("-inf")
        e_a = tl.exp(tl.where(b_pad, 0.0, m_a - b_big))
        e_b = tl.exp(tl.where(b_pad, 0.0, m_b - b_big))
        b_l = l_a * e_a + l_b * e_b
        b_m = b_big
    b_m = tl.reshape(b_m, (BR,))
    b_l = tl.reshape(b_l, (BR,))
    b_lse = b_m + tl.log(b_l)
    tl.store(lse_out + o_r, b_lse, mask=m_r)
    if HAS_TARGETS:
        b_zt = tl.load(zt_in + o_r, mask=m_r, other=0.0)
        tl.store(lp_out + o_r, b_zt - b_lse, mask=m_r)


@triton.jit(do_not_specialize=["T"])
def _lm_head_dz_kernel(
    h, w, tgt, lse, grad, dz,
    T, V, K, g0, n_cols,
    BM: tl.constexpr, BV: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """dz[t, c] = grad[t] · (onehot - exp(z - lse[t])) for group g0 + i_c,
    rounded once to dz's dtype; padded vocabulary columns get 0."""
    i_m, i_c = tl.program_id(0), tl.program_id(1)
    i_g = g0 + i_c
    b_z = _logits_tile(h, w, i_m, i_g, T, V, K, BM, BV, BK, IEEE)  # (BM, BV)
    o_m = i_m * BM + tl.arange(0, BM)
    o_v = i_g * BV + tl.arange(0, BV)
    o_c = i_c * BV + tl.arange(0, BV)
    m_m = o_m < T
    b_lse = tl.load(lse + o_m, mask=m_m, other=0.0)
    b_t = tl.load(tgt + o_m, mask=m_m, other=-1)
    b_g = tl.load(grad + o_m, mask=m_m, other=0.0)
    b_p = tl.exp(b_z - b_lse[:, None])
    b_d = tl.where(o_v[None, :] == b_t[:, None], 1.0 - b_p, -b_p)
    b_dz = tl.where((o_v < V)[None, :], b_g[:, None] * b_d, 0.0)
    p_dz = dz + o_m[:, None].to(tl.int64) * n_cols + o_c[None, :]
    tl.store(p_dz, b_dz.to(dz.dtype.element_ty), mask=m_m[:, None])


@triton.jit
def _gemm_kernel(
    a, b, c,
    M, N, L,
    s_am, s_al, s_bl, s_bn, s_cm, s_cn,
    BM: tl.constexpr, BN: tl.constexpr, BL: tl.constexpr, IEEE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """c (M, N) = [c +] a (M, L) · b (L, N): one FP32 accumulator (loaded from c
    when ACCUMULATE), L summed in BL steps from 0, rounded once to c's dtype."""
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    o_m = i_m * BM + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_l = tl.arange(0, BL)
    m_m = o_m < M
    m_n = o_n < N
    p_c = c + o_m[:, None].to(tl.int64) * s_cm + o_n[None, :].to(tl.int64) * s_cn
    m_c = m_m[:, None] & m_n[None, :]
    if ACCUMULATE:
        b_acc = tl.load(p_c, mask=m_c, other=0.0).to(tl.float32)
    else:
        b_acc = tl.zeros((BM, BN), dtype=tl.float32)
    for l0 in range(0, L, BL):
        m_l = (l0 + o_l) < L
        p_a = a + o_m[:, None].to(tl.int64) * s_am + (l0 + o_l)[None, :].to(tl.int64) * s_al
        p_b = b + (l0 + o_l)[:, None].to(tl.int64) * s_bl + o_n[None, :].to(tl.int64) * s_bn
        b_a = tl.load(p_a, mask=m_m[:, None] & m_l[None, :], other=0.0)
        b_b = tl.load(p_b, mask=m_l[:, None] & m_n[None, :], other=0.0)
        if IEEE:
            b_acc = tl.dot(b_a, b_b, b_acc, input_precision="ieee")
        else:
            b_acc = tl.dot(b_a, b_b, b_acc)
    tl.store(p_c, b_acc.to(c.dtype.element_ty), mask=m_c)


def _proj_consts(dtype: torch.dtype, block_m: int) -> dict:
    """Projection constants: BK per dtype, and num_warps = BM / 16 for bf16 so
    that BM = 64 (4 warps) and BM = 128 (8 warps) both issue m64n256k16 wgmma."""
    if dtype == torch.float32:
        return dict(BK=16, IEEE=True, num_warps=8)
    return dict(BK=64, IEEE=False, num_warps=block_m // 16)


def _fwd_block_m(T: int) -> int:
    """Forward rows per program when the caller names none: 128 (two
    warpgroups sharing each W tile) once T fills the GPU with them, else 64.
    Both issue the same wgmma per 64-row slice, so the bits do not change."""
    return 128 if T >= 256 else DEFAULT_BLOCK_M


def _fwd_launch(h, w, targets, block_m, write_logits, want_stats):
    """-> (logprobs or None, lse or None, logits or None)."""
    T, K = h.shape
    V = w.shape[0]
    G = cdiv(V, VOCAB_GROUP)
    BM = block_m or _fwd_block_m(T)
    dev = h.device
    f32 = dict(dtype=torch.float32, device=dev)
    logits = torch.empty(T, V, **f32) if write_logits else None
    has_t = targets is not None
    lp = torch.empty(T, **f32) if has_t else None
    lse = torch.empty(T, **f32) if want_stats else None
    if T == 0:
        return lp, lse, logits
    dummy = torch.empty(1, **f32)
    m = torch.empty(T, G, **f32) if want_stats else dummy
    l = torch.empty(T, G, **f32) if want_stats else dummy
    zt = torch.full((T,), float("nan"), **f32) if has_t else dummy
    _lm_head_fwd_kernel[(cdiv(T, BM), G)](
        h, w, targets if has_t else torch.empty(1, dtype=torch.int64, device=dev),
        logits if write_logits else dummy, m, l, zt,
        T, V, K, G,
        BM=BM, BV=VOCAB_GROUP, LOG2BV=_LOG2_GROUP, **_proj_consts(h.dtype, BM),
        WRITE_LOGITS=write_logits, WRITE_STATS=want_stats, HAS_TARGETS=has_t,
        num_stages=_FWD_STAGES, enable_fp_fusion=FP_FUSION, **pdl_options(h.device, T),
    )
    if want_stats:
        G2 = max(2, next_power_of_2(G))
        BR = max(2, min(16, 4096 // G2))
        _lm_head_merge_kernel[(cdiv(T, BR),)](
            m, l, zt, lp if has_t else dummy, lse, T, G,
            BR=BR, G2=G2, LOG2G2=G2.bit_length() - 1, HAS_TARGETS=has_t,
            num_warps=4, enable_fp_fusion=FP_FUSION, **pdl_options(h.device, T),
        )
    return lp, lse, logits


def lm_head_fwd_triton(h, w, targets, *, block_m=None):
    """(T, K), (V, K), (T,) int64 -> (logprobs (T,), lse (T,)), FP32."""
    lp, lse, _ = _fwd_launch(h, w, targets, block_m, write_logits=False, want_stats=True)
    return lp, lse


def lm_head_logits_triton(h, w, *, return_lse=False, block_m=None):
    """(T, K), (V, K) -> FP32 logits (T, V) by the forward's projection (and its LSE)."""
    _, lse, logits = _fwd_launch(h, w, None, block_m, write_logits=True, want_stats=return_lse)
    return (logits, lse) if return_lse else logits


_SPLIT_BLOCK = 4096


@triton.jit
def _split_hi_lo_kernel(g, hi, lo, n, BLOCK: tl.constexpr):
    o = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    x = tl.load(g + o, mask=m, other=0.0)
    b_hi = x.to(tl.bfloat16)  # round to nearest even, as torch's .to(bfloat16)
    tl.store(hi + o, b_hi, mask=m)
    tl.store(lo + o, (x - b_hi.to(tl.float32)).to(tl.bfloat16), mask=m)


def split_hi_lo_triton(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 g (contiguous) -> bf16 (hi, lo) = (g.bf16, (g - hi).bf16) in one pass: g read once."""
    hi, lo = torch.empty_like(g, dtype=torch.bfloat16), torch.empty_like(g, dtype=torch.bfloat16)
    n = g.numel()
    if n:
        _split_hi_lo_kernel[(cdiv(n, _SPLIT_BLOCK),)](g, hi, lo, n, BLOCK=_SPLIT_BLOCK, num_warps=8,
            enable_fp_fusion=FP_FUSION)
    return hi, lo


def _gemm(a, a_strides, b, b_strides, c, c_strides, M, N, L, accumulate):
    ieee = a.dtype == torch.float32
    BM, BN = (64, 64) if ieee else (64, 128)
    _gemm_kernel[(cdiv(M, BM), cdiv(N, BN))](
        a, b, c, M, N, L, *a_strides, *b_strides, *c_strides,
        BM=BM, BN=BN, BL=_GEMM_BL, IEEE=ieee, ACCUMULATE=accumulate,
        num_warps=_GEMM_WARPS, num_stages=3, enable_fp_fusion=FP_FUSION,
    )


def lm_head_bwd_triton(h, w, targets, lse, grad, *, block_m=None, vocab_chunk=None):
    """Gradients of sum_t grad[t]·logprob[t] -> (dh (T, K) h.dtype, dW (V, K) w.dtype)."""
    T, K = h.shape
    V = w.shape[0]
    G = cdiv(V, VOCAB_GROUP)
    BM = block_m or DEFAULT_BLOCK_M
    dev = h.device
    dh = torch.zeros(T, K, dtype=torch.float32, device=dev)
    dw = torch.empty(V, K, dtype=w.dtype, device=dev)
    if T == 0:
        return dh.to(h.dtype), dw.zero_()
    if vocab_chunk is None:
        vocab_chunk = max(1, _DZ_BYTES // (T * VOCAB_GROUP * h.element_size()))
    vocab_chunk = min(vocab_chunk, G)
    n_cols = vocab_chunk * VOCAB_GROUP
    dz = torch.empty(T, n_cols, dtype=h.dtype, device=dev)
    grad = grad.float().contiguous()
    for g0 in range(0, G, vocab_chunk):
        g1 = min(g0 + vocab_chunk, G)
        v0, v1 = g0 * VOCAB_GROUP, min(g1 * VOCAB_GROUP, V)
        _lm_head_dz_kernel[(cdiv(T, BM), g1 - g0)](
            h, w, targets, lse, grad, dz, T, V, K, g0, n_cols,
            BM=BM, BV=VOCAB_GROUP, **_proj_consts(h.dtype, BM),
            num_stages=_FWD_STAGES, enable_fp_fusion=FP_FUSION,
        )
        w_c = w[v0:v1]  # (Vc, K)
        # dh (T, K) += dz (T, Vc) · W_c (Vc, K)
        _gemm(dz, (n_cols, 1), w_c, (K, 1), dh, (K, 1), T, K, v1 - v0, accumulate=True)
        # dW_c (Vc, K) = dzᵀ (Vc, T) · h (T, K)
        _gemm(dz, (1, n_cols), h, (K, 1), dw[v0:v1], (K, 1), v1 - v0, K, T, accumulate=False)
    return dh.to(h.dtype), dw
