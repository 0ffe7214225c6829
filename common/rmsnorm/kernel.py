"""Triton RMSNorm kernels (plain, fused residual-add, gated) and their CUDA launchers.

Reduction order (the contract; ``cpu.py`` computes the same order):

* row sums (``sum(x^2)`` forward, ``sum(dn * n)`` backward): the order of
  ``cpu.row_tree_sum``.  The row's P = next_pow2(H) lanes (masked lanes hold
  0) are read in NC = P / 256 chunks of ``ROW_CHUNK`` = 256 lanes and added
  element-wise, chunk by chunk in order, into a (rows, 256) accumulator; then
  one 8-level pairwise tree ``s[i] <- s[2i] + s[2i+1]`` over its lanes (a row
  of P <= 256 lanes: the tree alone).  The chunk adds are element-wise, so
  they cannot depend on a layout; ``_row_tree_sum`` builds the tree from
  ``reshape`` + ``split`` + element-wise ``+``, so its result is fixed by the
  tensor *semantics*, not by the layout Triton picks: ``tl.sum``'s order
  follows the layout (``sizePerThread``), and the seeds saw one extra bf16
  store change that layout and 2,854 of 8,192 outputs.  So the plain and the
  fused kernel (which stores the new residual) add in the same order, and
  ``num_warps`` and rows per program (BM) are free launch knobs.
  Chunks first, then one tree: a single 4096-lane tree takes ptxas minutes to
  compile (triton 3.6).
* ``dw``: two levels of "slots, then a pairwise tree" (``cpu.py`` spells the
  order out): one program per block of S * DW_TILES rows accumulates tile row
  s into slot s and trees the S slots (``_col_tree_sum``); ``_dw_sum_kernel``
  does the same over the block partials with DW_SLOTS2 slots.  S is fixed by
  H, so the order depends on M and H only: deterministic run to run.

Rounding points (transformers' Qwen3RMSNorm / Qwen3_5MoeRMSNormGated):

    fused:  s = dtype(fp32(x) + fp32(res))            -> new residual; x := s
    rstd = div_rn(1, sqrt_rn(div_rn(tree_sum(x*x), H) + eps))    (fp32)
    n = dtype(x * rstd);  y = dtype(n * w)                       (plain, fused; w of x's dtype)
    y = dtype(w * (x * rstd))             (w fp32, x narrower: DeepseekV4RMSNorm, ROUND_N off)
    y = dtype(x * dtype(rstd))            (no w: DeepseekV4UnweightedRMSNorm, HAS_W off)
    gated:  out = dtype(y * z / (1 + exp(-z)))                   (fp32 gate)

Every kernel is launched with ``enable_fp_fusion=False``: no mul+add is
contracted into an FMA, so each op rounds where the source says, as on the
CPU.  (``/`` and ``tl.exp`` are approximate but deterministic; the plain and
fused paths avoid both.)  ``_row_tree_sum``, ``_rstd`` and ``_normalize`` are
also the server's fused q/k norm's (``qk_norm_rope/kernel.py``): one
definition of the order and the rounding points for both.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior
from .cpu import DW_SLOTS2, DW_TILES, ROW_CHUNK, dw_slots, tree_width


@triton.jit
def _row_tree_sum(b, BM: tl.constexpr, LOG2_H: tl.constexpr):
    """Sum a (BM, 2**LOG2_H) fp32 tile over its last dim: s[i] <- s[2i] + s[2i+1]."""
    for _ in tl.static_range(LOG2_H):
        b_even, b_odd = tl.split(tl.reshape(b, (BM, b.shape[1] // 2, 2)))
        b = b_even + b_odd
    return tl.reshape(b, (BM,))


@triton.jit
def _load_row_chunk(p_x, p_res, p_res_out, o_x, m_x, dtype, HAS_RES: tl.constexpr, STORE_RES: tl.constexpr):
    """fp32 (BM, CHUNK) tile of the rows to normalise: x, or the fused sum
    s = dtype(x + res) (stored as the new residual when STORE_RES)."""
    b_x = tl.load(p_x + o_x, mask=m_x, other=0.0).to(tl.float32)
    if HAS_RES:
        b_s = (b_x + tl.load(p_res + o_x, mask=m_x, other=0.0).to(tl.float32)).to(dtype)
        if STORE_RES:
            tl.store(p_res_out + o_x, b_s, mask=m_x)
        b_x = b_s.to(tl.float32)
    return b_x


@triton.jit
def _rstd(b_ss, H, eps, BM: tl.constexpr):
    """(BM,) fp32 rstd = div_rn(1, sqrt_rn(div_rn(sum(x^2), H) + eps)) from the row sums."""
    b_var = tl.math.div_rn(b_ss, tl.full((BM,), H, tl.float32))
    return tl.math.div_rn(tl.full((BM,), 1.0, tl.float32), tl.math.sqrt_rn(b_var + eps))


@triton.jit
def _normalize(b_x, b_rstd, b_w, dtype, ROUND_N: tl.constexpr = True):
    """y = dtype(dtype(x * rstd) * w) of an fp32 (BM, lanes) tile; w: fp32 (lanes,).  ROUND_N off (an fp32 w
    beside a narrower x): y = dtype(w * (x * rstd))."""
    b_n = b_x * b_rstd[:, None]
    if ROUND_N:
        b_n = b_n.to(dtype).to(tl.float32)
    return (b_n * b_w[None, :]).to(dtype)


@triton.jit
def _normalize_store(b_x, b_rstd, p_w, p_z, p_y, o_h, m_h, o_x, m_x, dtype, HAS_Z: tl.constexpr,
                     ROUND_N: tl.constexpr = True, HAS_W: tl.constexpr = True):
    if HAS_W:
        b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)
        b_y = _normalize(b_x, b_rstd, b_w, dtype, ROUND_N)
    else:
        b_y = (b_x * b_rstd.to(dtype).to(tl.float32)[:, None]).to(dtype)
    if HAS_Z:
        b_z = tl.load(p_z + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_y = (b_y.to(tl.float32) * (b_z / (1.0 + tl.exp(-b_z)))).to(dtype)
    tl.store(p_y + o_x, b_y, mask=m_x)


@triton.jit(do_not_specialize=["M"])
def _rmsnorm_fwd_kernel(
    p_x,
    p_res,
    p_z,
    p_w,
    p_y,
    p_res_out,
    p_rstd,
    M,
    eps,
    H: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    NC: tl.constexpr,
    BM: tl.constexpr,
    HAS_RES: tl.constexpr,
    HAS_Z: tl.constexpr, PDL: tl.constexpr = False, ROUND_N: tl.constexpr = True, HAS_W: tl.constexpr = True,
):
    """The row's P = NC * CHUNK lanes: the chunks added element-wise in
    order, then one CHUNK-lane tree (the order of ``cpu.row_tree_sum``).
    NC > 1 reads the rows twice: pass 1 only loads (its chunk loop is
    unrolled and holds no store, so every load is in flight at once: a store
    between them would pin their order, as the pointers may alias); pass 2
    normalises the whole (BM, P) row tile element-wise, recomputing the fused
    sum and storing it as the new residual there."""
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_m = tl.program_id(0)
    o_m = i_m * BM + tl.arange(0, BM)  # (BM,)
    o_c = tl.arange(0, CHUNK)  # (CHUNK,)
    m_m = o_m < M
    dtype = p_y.dtype.element_ty
    if NC == 1:
        m_h = o_c < H
        m_x = m_m[:, None] & m_h[None, :]
        o_x = o_m[:, None].to(tl.int64) * H + o_c[None, :]  # (BM, CHUNK)
        b_x = _load_row_chunk(p_x, p_res, p_res_out, o_x, m_x, dtype, HAS_RES, True)
        b_ss = _row_tree_sum(b_x * b_x, BM, LOG2_CHUNK)  # (BM,)
    else:
        b_acc = tl.zeros((BM, CHUNK), dtype=tl.float32)
        for i_c in tl.static_range(NC):
            o_h = i_c * CHUNK + o_c
            m_x = m_m[:, None] & (o_h < H)[None, :]
            o_x = o_m[:, None].to(tl.int64) * H + o_h[None, :]
            b_x = _load_row_chunk(p_x, p_res, p_res_out, o_x, m_x, dtype, HAS_RES, False)
            b_acc = b_acc + b_x * b_x  # lane j += x[i_c * CHUNK + j]^2
        b_ss = _row_tree_sum(b_acc, BM, LOG2_CHUNK)
    b_rstd = _rstd(b_ss, H, eps, BM)
    tl.store(p_rstd + o_m, b_rstd, mask=m_m)
    if NC == 1:
        _normalize_store(b_x, b_rstd, p_w, p_z, p_y, o_c, m_h, o_x, m_x, dtype, HAS_Z, ROUND_N, HAS_W)
    else:
        o_h = tl.arange(0, NC * CHUNK)  # the whole row: element-wise from here on
        m_h = o_h < H
        m_x = m_m[:, None] & m_h[None, :]
        o_x = o_m[:, None].to(tl.int64) * H + o_h[None, :]
        b_x = _load_row_chunk(p_x, p_res, p_res_out, o_x, m_x, dtype, HAS_RES, True)
        _normalize_store(b_x, b_rstd, p_w, p_z, p_y, o_h, m_h, o_x, m_x, dtype, HAS_Z, ROUND_N, HAS_W)


@triton.jit
def _col_tree_sum(b, S: tl.constexpr, BLOCK: tl.constexpr, LOG2_S: tl.constexpr):
    """Sum a (S, BLOCK) fp32 tile over its rows by the pairwise tree -> (BLOCK,)."""
    return _row_tree_sum(tl.trans(b), BLOCK, LOG2_S)


@triton.jit
def _bwd_terms(p_dy, p_x, p_z, p_dz, b_w, b_rstd, o_x, m_x, HAS_Z: tl.constexpr, STORE_DZ: tl.constexpr):
    """(n, dh) of a (S, CHUNK) tile: n = x * rstd; dh = dy (gated: dy * silu(z),
    and dz stored when STORE_DZ)."""
    b_x = tl.load(p_x + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_dy = tl.load(p_dy + o_x, mask=m_x, other=0.0).to(tl.float32)
    b_n = b_x * b_rstd
    if HAS_Z:
        b_z = tl.load(p_z + o_x, mask=m_x, other=0.0).to(tl.float32)
        b_e = tl.exp(-b_z)
        if STORE_DZ:
            b_sig = 1.0 / (1.0 + b_e)
            b_dz = b_dy * (b_n * b_w) * (b_sig * (1.0 + b_z * (1.0 - b_sig)))
            tl.store(p_dz + o_x, b_dz.to(p_dz.dtype.element_ty), mask=m_x)
        b_dh = b_dy * (b_z / (1.0 + b_e))
    else:
        b_dh = b_dy
    return b_n, b_dh


@triton.jit
def _dx_store(b_n, b_dh, b_w, b_rstd, b_c, p_dres, p_dx, o_x, m_x, HAS_DRES: tl.constexpr):
    """dx = rstd * (dh * w - n * c) (+ dres), rounded once."""
    b_dx = b_rstd * (b_dh * b_w - b_n * b_c[:, None])
    if HAS_DRES:
        b_dx = b_dx + tl.load(p_dres + o_x, mask=m_x, other=0.0).to(tl.float32)
    tl.store(p_dx + o_x, b_dx.to(p_dx.dtype.element_ty), mask=m_x)


@triton.jit(do_not_specialize=["M"])
def _rmsnorm_bwd_kernel(
    p_dy,
    p_x,
    p_z,
    p_w,
    p_rstd,
    p_dres,
    p_dx,
    p_dz,
    p_dw_part,
    p_c,
    M,
    H: tl.constexpr,
    CHUNK: tl.constexpr,
    LOG2_CHUNK: tl.constexpr,
    NC: tl.constexpr,
    S: tl.constexpr,
    LOG2_S: tl.constexpr,
    TILES: tl.constexpr,
    HAS_DRES: tl.constexpr,
    HAS_Z: tl.constexpr,
):
    """One program per block of S * TILES rows, as TILES (S, P) tiles in order;
    writes dx (and dz) per row and the block's dw partial: row t*S + s of the
    block goes to slot s, then the pairwise tree over the S slots.
    NC > 1 (P = NC * CHUNK lanes): pass 1 computes each row's c = sum(dn * n) / H
    (chunks added element-wise in order, then the CHUNK-lane tree) into the
    scratch ``p_c``; pass 2 walks the chunks, each over the block's tiles."""
    i_b = tl.program_id(0)
    o_c = tl.arange(0, CHUNK)
    if NC == 1:
        m_h = o_c < H
        b_w = tl.load(p_w + o_c, mask=m_h, other=0.0).to(tl.float32)[None, :]  # (1, CHUNK)
        b_acc = tl.zeros((S, CHUNK), dtype=tl.float32)
        for i_t in range(TILES):
            o_m = (i_b * TILES + i_t) * S + tl.arange(0, S)  # (S,)
            m_m = o_m < M
            m_x = m_m[:, None] & m_h[None, :]
            o_x = o_m[:, None].to(tl.int64) * H + o_c[None, :]  # (S, CHUNK)
            b_rstd = tl.load(p_rstd + o_m, mask=m_m, other=0.0)[:, None]  # (S, 1)
            b_n, b_dh = _bwd_terms(p_dy, p_x, p_z, p_dz, b_w, b_rstd, o_x, m_x, HAS_Z, True)
            b_c = _row_tree_sum((b_dh * b_w) * b_n, S, LOG2_CHUNK)  # (S,)
            b_c = tl.math.div_rn(b_c, tl.full((S,), H, tl.float32))
            _dx_store(b_n, b_dh, b_w, b_rstd, b_c, p_dres, p_dx, o_x, m_x, HAS_DRES)
            b_acc = b_acc + b_dh * b_n
        b_part = _col_tree_sum(b_acc, S, CHUNK, LOG2_S)  # (CHUNK,)
        tl.store(p_dw_part + i_b * H + o_c, b_part, mask=m_h)
    else:
        for i_t in range(TILES):
            o_m = (i_b * TILES + i_t) * S + tl.arange(0, S)
            m_m = o_m < M
            b_rstd = tl.load(p_rstd + o_m, mask=m_m, other=0.0)[:, None]
            b_sums = tl.zeros((S, CHUNK), dtype=tl.float32)
            for i_c in range(NC):
                o_h = i_c * CHUNK + o_c
                m_h = o_h < H
                m_x = m_m[:, None] & m_h[None, :]
                o_x = o_m[:, None].to(tl.int64) * H + o_h[None, :]
                b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
                b_n, b_dh = _bwd_terms(p_dy, p_x, p_z, p_dz, b_w, b_rstd, o_x, m_x, HAS_Z, False)
                b_sums = b_sums + (b_dh * b_w) * b_n  # lane j += chunk i_c's lane j
            b_c = tl.math.div_rn(_row_tree_sum(b_sums, S, LOG2_CHUNK), tl.full((S,), H, tl.float32))
            tl.store(p_c + o_m, b_c, mask=m_m)
        tl.debug_barrier()  # pass 2 reads c written by other threads of this program
        for i_c in range(NC):
            o_h = i_c * CHUNK + o_c
            m_h = o_h < H
            b_w = tl.load(p_w + o_h, mask=m_h, other=0.0).to(tl.float32)[None, :]
            b_acc = tl.zeros((S, CHUNK), dtype=tl.float32)
            for i_t in range(TILES):
                o_m = (i_b * TILES + i_t) * S + tl.arange(0, S)
                m_m = o_m < M
                m_x = m_m[:, None] & m_h[None, :]
                o_x = o_m[:, None].to(tl.int64) * H + o_h[None, :]
                b_rstd = tl.load(p_rstd + o_m, mask=m_m, other=0.0)[:, None]
                b_c = tl.load(p_c + o_m, mask=m_m, other=0.0)
                b_n, b_dh = _bwd_terms(p_dy, p_x, p_z, p_dz, b_w, b_rstd, o_x, m_x, HAS_Z, True)
                _dx_store(b_n, b_dh, b_w, b_rstd, b_c, p_dres, p_dx, o_x, m_x, HAS_DRES)
                b_acc = b_acc + b_dh * b_n
            b_part = _col_tree_sum(b_acc, S, CHUNK, LOG2_S)
            tl.store(p_dw_part + i_b * H + o_h, b_part, mask=m_h)


@triton.jit
def _dw_sum_kernel(p_part, p_dw, NB, H, S2: tl.constexpr, LOG2_S2: tl.constexpr, BLOCK: tl.constexpr):
    """dw over the NB block partials: partial b into slot b % S2 (in order of b),
    then the pairwise tree over the S2 slots."""
    o_h = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m_h = o_h < H
    b_acc = tl.zeros((S2, BLOCK), dtype=tl.float32)
    for i_t in range(tl.cdiv(NB, S2)):
        o_b = i_t * S2 + tl.arange(0, S2)
        m = (o_b < NB)[:, None] & m_h[None, :]
        b_acc = b_acc + tl.load(p_part + o_b[:, None].to(tl.int64) * H + o_h[None, :], mask=m, other=0.0)
    b_dw = _col_tree_sum(b_acc, S2, BLOCK, LOG2_S2)
    tl.store(p_dw + o_h, b_dw.to(p_dw.dtype.element_ty), mask=m_h)


def _chunks(H: int) -> dict:
    """The row sum's chunking for width H (``cpu.row_tree_sum``), as the
    kernels' constexprs: CHUNK lanes per chunk (a power of two) and NC chunks per row."""
    chunk = min(tree_width(H), ROW_CHUNK)
    return dict(CHUNK=chunk, LOG2_CHUNK=chunk.bit_length() - 1, NC=tree_width(H) // chunk)


def _fwd_config(H: int, M: int) -> tuple[int, int]:
    """Default (rows per program, num_warps); neither shapes the reduction (see
    module docstring), so any value gives the same bits.  One row per program
    for wide rows: a program's rows are walked as one latency chain, so more
    programs beat more rows each (0.9x F.rms_norm at H = 4096, M <= 1024,
    against 0.4x at 8 rows a program: 2026-11-30-h200-primitives.md); narrow
    rows (q/k norms, H = 128) batch rows as M grows."""
    if tree_width(H) > ROW_CHUNK:
        return 1, 2 if M < 4096 else 4
    if M <= 256:
        return 1, 1
    return (4, 2) if M <= 4096 else (16, 4)


def rmsnorm_fwd_triton(x, w, eps, residual=None, z=None, block_rows=None, num_warps=None):
    """x, residual, z: (M, H) contiguous; w: (H,) -> (y, new_residual or None, rstd (M,) fp32)."""
    M, H = x.shape
    bm, nw = _fwd_config(H, M)
    bm = block_rows or bm
    nw = num_warps or nw
    if bm & (bm - 1):
        raise ValueError(f"block_rows must be a power of two on CUDA, got {bm}")
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    new_res = torch.empty_like(x) if residual is not None else None
    if M == 0:
        return y, new_res, rstd
    _rmsnorm_fwd_kernel[(cdiv(M, bm),)](
        x,
        residual if residual is not None else x,
        z if z is not None else x,
        w if w is not None else x,
        y,
        new_res if new_res is not None else y,
        rstd,
        M,
        float(eps),
        H=H,
        **_chunks(H),
        BM=bm,
        HAS_RES=residual is not None,
        HAS_Z=z is not None,
        ROUND_N=w is None or w.dtype == x.dtype,
        HAS_W=w is not None,
        num_warps=nw,
        enable_fp_fusion=FP_FUSION, **pdl_options(x.device, M),
    )
    return y, new_res, rstd


def rmsnorm_bwd_triton(dy, x, w, rstd, dres=None, z=None, num_warps=None):
    """Backward of the three variants -> (dx, dz or None, dw); see ``cpu.rmsnorm_bwd_cpu``."""
    M, H = x.shape
    chunks = _chunks(H)
    S = dw_slots(H)
    nw = num_warps or max(2, min(16, S * chunks["CHUNK"] // 256))
    dx = torch.empty_like(x)
    dz = torch.empty_like(z) if z is not None else None
    nb = max(1, cdiv(M, S * DW_TILES))
    part = torch.empty(nb, H, dtype=torch.float32, device=x.device)
    _rmsnorm_bwd_kernel[(nb,)](
        dy,
        x,
        z if z is not None else x,
        w,
        rstd,
        dres if dres is not None else dy,
        dx,
        dz if dz is not None else dx,
        part,
        torch.empty(M, dtype=torch.float32, device=x.device) if chunks["NC"] > 1 else rstd,  # c scratch
        M,
        H=H,
        **chunks,
        S=S,
        LOG2_S=S.bit_length() - 1,
        TILES=DW_TILES,
        HAS_DRES=dres is not None,
        HAS_Z=z is not None,
        num_warps=nw,
        enable_fp_fusion=FP_FUSION,
    )
    dw = torch.empty_like(w)
    block = min(128, tree_width(H))
    _dw_sum_kernel[(cdiv(H, block),)](
        part, dw, nb, H, S2=DW_SLOTS2, LOG2_S2=DW_SLOTS2.bit_length() - 1, BLOCK=block, num_warps=4,
        enable_fp_fusion=FP_FUSION
    )
    return dx, dz, dw
