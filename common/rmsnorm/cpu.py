"""CPU RMSNorm (plain, fused residual-add, gated), batch-invariant by construction.

Every value is built from element-wise operations on fp32 tensors: add, mul,
div and rsqrt (each correctly rounded element by element, whatever the vector
width, thread split or tensor shape) plus ``exp`` for the gated SiLU.  No torch
reduction is used: torch's CPU ``sum``/``mean`` may split a row across threads
depending on the shape, so the row reductions are spelled out here, in the
order the Triton kernel uses too:

* row sum (sum of squares, and the backward's ``sum(dn * n)``): the row is
  padded with zeros to ``P = next_pow2(H)`` lanes.  ``P <= ROW_CHUNK`` (256):
  a pairwise tree over adjacent lanes, ``s[i] <- s[2i] + s[2i+1]``, log2(P)
  levels.  Wider rows are NC = P / 256 chunks of 256 lanes: lane j of the
  chunk accumulator adds chunk c's lane j in order of c, starting from 0,
  ``a[j] = ((0 + v[j]) + v[256 + j]) + ... + v[(NC-1)*256 + j]``, then the
  8-level pairwise tree over the 256 lanes of ``a``.  Zero lanes add exactly
  0, so the padding never changes a bit.  (Why chunks first: the Triton
  kernel's chunk accumulation is element-wise, so only one 8-level tree per
  row needs cross-lane work; a pure P-lane tree walks 16 subtrees one after
  another at H = 4096, 0.3x ``F.rms_norm``.)
* ``dw`` (sum over rows), two levels, each "slots, then a tree":
  level 1: rows in blocks of ``RB = S * DW_TILES`` rows; inside a block, row
  ``t * S + s`` is added (from 0, t in order) to slot s, then the S slots are
  summed by the pairwise tree -> one partial per block.  S = ``dw_slots(H)``
  (1 for H > 1024, up to 16 for narrow rows) is fixed by the width.
  level 2: partial b goes to slot ``b % DW_SLOTS2`` (in order of b), then a
  pairwise tree over the ``DW_SLOTS2`` = 32 slots.
  The order depends only on M and H, never on a launch knob.

``rsqrt``: fp32 ``torch.rsqrt`` gives ``fl(1 / fl(sqrt(v)))`` with an IEEE sqrt
and division (measured on 1M values against a float64 sqrt; a 1-element call
and a long call agree), so it is element-wise invariant and the value the GPU's
``div_rn(1, sqrt_rn(v))`` gives.  (fp32 ``torch.sqrt`` is *not* correctly
rounded here: 15% of those values differ; torch 2.13, AVX2.)  transformers'
Qwen3RMSNorm calls the same ``torch.rsqrt``.

``exp``: fp32 ``torch.exp`` runs ATen's vml path (MKL VML in the CPU wheel)
and gives an element the same bits whatever the tensor's length, alignment or
thread split (measured: 3.3M values, lengths 1..65537, offsets 0..16, 1 and 2
threads; ``tests/test_swiglu.py`` keeps checking it).  ``F.silu`` and
``torch.sigmoid`` do not: their last few elements take a scalar fallback (190
of 5000 values differed between a 1-element and a 200k-element call, torch
2.13 AVX2), which is why SiLU is written out as ``z / (1 + exp(-z))``
(``swiglu.cpu.silu``, shared with SwiGLU, the MoE experts and the GDN conv).

A row's output therefore depends only on that row and ``w``: the same bits for
any batch size, row order, padding or ``block_rows``.  Plain and fused
RMSNorm share ``_normalize`` and so give identical bits on the same
(rounded) input.  The plain and fused paths use no fused multiply-add and
correctly rounded sqrt/div, like the Triton kernel compiled with
``enable_fp_fusion=False`` (``sqrt_rn``, ``div_rn``): the two devices are
expected (not promised) to agree bit for bit on plain and fused RMSNorm.
"""
from __future__ import annotations

import torch

from ..swiglu.cpu import silu
from ..tree.cpu import pad_to, pairwise_tree, tree_width

ROW_CHUNK = 256  # lanes of the row sum's chunk accumulator (part of its order, see above)
DW_TILES = 16  # row tiles per block in the dw reduction (part of its order, not a knob)
DW_SLOTS2 = 32  # slots of the dw reduction's second level (part of its order)


def dw_slots(H: int) -> int:
    """Rows per tile (= slots) of the dw reduction's first level, fixed by the width."""
    return max(1, min(16, 2048 // tree_width(H)))


def row_tree_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum fp32 v (M, H) over its last dim in the row order (module docstring) -> (M,):
    chunks of ROW_CHUNK lanes accumulated in order, then the pairwise tree."""
    M, H = v.shape
    P = tree_width(H)
    v = pad_to(v, 1, P, 0.0)  # (M, P)
    if P > ROW_CHUNK:
        acc = v.new_zeros(M, ROW_CHUNK)
        for c in range(P // ROW_CHUNK):
            acc = acc + v[:, c * ROW_CHUNK : (c + 1) * ROW_CHUNK]
        v = acc
    return pairwise_tree(v)


def _slot_sum(v: torch.Tensor, slots: int) -> torch.Tensor:
    """v (B, R, H) -> (B, H): row r into slot r % slots in order of r, then the
    pairwise tree over the slots.  R is padded with zero rows."""
    B, R, H = v.shape
    steps = max(1, -(-R // slots))
    if steps * slots != R:
        v = torch.cat([v, v.new_zeros(B, steps * slots - R, H)], dim=1)
    v = v.view(B, steps, slots, H)
    acc = torch.zeros(B, slots, H, dtype=torch.float32, device=v.device)
    for t in range(steps):
        acc = acc + v[:, t]
    return pairwise_tree(acc, dim=1)


def dw_sum(v: torch.Tensor) -> torch.Tensor:
    """Sum fp32 v (M, H) over rows in the dw order (module docstring) -> (H,)."""
    M, H = v.shape
    S = dw_slots(H)
    RB = S * DW_TILES
    NB = max(1, -(-M // RB))
    if NB * RB != M:
        v = torch.cat([v, v.new_zeros(NB * RB - M, H)])
    part = _slot_sum(v.view(NB, RB, H), S)  # (NB, H)
    return _slot_sum(part[None], DW_SLOTS2)[0]


def _rstd(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """rstd = 1 / sqrt(sum(x^2) / H + eps), each op correctly rounded in fp32."""
    var = row_tree_sum(xf * xf) / xf.shape[1]
    return torch.rsqrt(var + eps)  # (M,)


def _normalize(xf: torch.Tensor, w: torch.Tensor | None, eps: float, dtype: torch.dtype):
    """The rounding points, by the weight (returns (y fp32 holding dtype values, rstd)):
    w of x's dtype (Qwen3RMSNorm):         n = dtype(x * rstd); y = dtype(n * w)
    w fp32, x narrower (DeepseekV4RMSNorm): y = dtype(w * (x * rstd)), one rounding
    w None (DeepseekV4UnweightedRMSNorm):   y = dtype(x * dtype(rstd))"""
    rstd = _rstd(xf, eps)
    if w is None:
        return (xf * rstd.to(dtype).float()[:, None]).to(dtype).float(), rstd
    n = xf * rstd[:, None]
    if w.dtype == dtype or w.dtype != torch.float32:
        n = n.to(dtype).float()
    return (n * w.float()).to(dtype).float(), rstd


def _fwd_rows(x, w, eps, residual, z):
    dtype = x.dtype
    xf = x.float()
    new_res = None
    if residual is not None:
        new_res = (xf + residual.float()).to(dtype)  # the one rounding of the sum
        xf = new_res.float()
    y, rstd = _normalize(xf, w, eps, dtype)
    if z is not None:
        # Qwen3_5MoeRMSNormGated: (w * n) rounded to the input dtype, then the
        # fp32 gate, rounded once more at the output.
        y = y * silu(z.float())
    return y.to(dtype), new_res, rstd


def rmsnorm_fwd_cpu(
    x: torch.Tensor,
    w: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    block_rows: int | None = None,
):
    """x, residual, z: (M, H); w: (H,) -> (y (M, H), new_residual (M, H) or None, rstd (M,) fp32).

    ``block_rows`` processes the rows in independent chunks (a launch-shape
    knob for the rung-2 checks; it cannot change bits).
    """
    M = x.shape[0]
    if block_rows is None or block_rows >= M:
        return _fwd_rows(x, w, eps, residual, z)
    outs = [
        _fwd_rows(
            x[i : i + block_rows],
            w,
            eps,
            None if residual is None else residual[i : i + block_rows],
            None if z is None else z[i : i + block_rows],
        )
        for i in range(0, M, block_rows)
    ]
    y = torch.cat([o[0] for o in outs])
    new_res = None if residual is None else torch.cat([o[1] for o in outs])
    return y, new_res, torch.cat([o[2] for o in outs])


def rmsnorm_bwd_cpu(
    dy: torch.Tensor,
    x: torch.Tensor,
    w: torch.Tensor,
    rstd: torch.Tensor,
    dres: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
):
    """Backward of the three variants -> (dx, dz or None, dw).

    x is the normalised input (for the fused variant: the new residual);
    ``dres`` is the gradient arriving at the new residual, added to dx in fp32.
    Straight-through the forward's bf16 roundings: n = x * rstd in fp32.

        dh = dy            (gated: dy * silu(z);  dz = dy * (n * w) * silu'(z))
        dn = dh * w
        c  = tree_sum(dn * n)
        dx = rstd * (dn - n * (c / H))   (+ dres)
        dw = dw_sum(dh * n)

    Each output is rounded once to its input's dtype.
    """
    H = x.shape[1]
    xf = x.float()
    wf = w.float()
    dyf = dy.float()
    n = xf * rstd[:, None]
    dz = None
    if z is not None:
        zf = z.float()
        e = torch.exp(-zf)
        s = 1.0 / (1.0 + e)
        dz = (dyf * (n * wf) * (s * (1.0 + zf * (1.0 - s)))).to(z.dtype)
        dh = dyf * (zf / (1.0 + e))
    else:
        dh = dyf
    dn = dh * wf
    c = row_tree_sum(dn * n)
    dx = rstd[:, None] * (dn - n * (c / H)[:, None])
    if dres is not None:
        dx = dx + dres.float()
    dw = dw_sum(dh * n)
    return dx.to(x.dtype), dz, dw.to(w.dtype)
