"""CPU RoPE, batch-invariant by construction.

Every output element is a function of its own token row and the table row at
that token's position, computed by element-wise IEEE operations only:

    (a, b)   = the pair, upcast to fp32 (exact for bf16)
    (c, s)   = cos[p], sin[p] from the fp32 table (s = -s when rotating by -theta)
    out_a    = RN_out( fl32(fl32(a * c) - fl32(b * s)) )
    out_b    = RN_out( fl32(fl32(b * c) + fl32(a * s)) )

There is no reduction at all; the table rows are gathered by ``index_select``
(a copy) and ``mul``/``sub``/``add`` round each element on its own whatever the
vector width, thread split or tensor shape.  So a token's bits never depend on
the batch, its place in it, or the ``row_chunk`` split.  The rounding points
(two products, one add, one cast to the output dtype) are those of the Triton
kernel launched with FMA contraction off, so CPU and CUDA give the same bits.
Channels outside the rotary slice are copied unchanged.
"""
from __future__ import annotations

import torch


def rope_rotate_cpu(
    x: torch.Tensor,  # (T, H, D)
    positions: torch.Tensor,  # (T,) int
    cos: torch.Tensor,  # (P, R/2) fp32
    sin: torch.Tensor,  # (P, R/2) fp32
    *,
    rot_offset: int,
    in_interleaved: bool,
    out_interleaved: bool,
    negate_sin: bool,
    row_chunk: int | None = None,
) -> torch.Tensor:
    """Rotate x[..., rot_offset : rot_offset + R] pairwise; returns a new tensor of x's dtype."""
    T = x.shape[0]
    y = x.clone()  # pass-through channels keep their bits
    if T == 0:
        return y
    chunk = T if row_chunk is None else max(1, int(row_chunk))
    half = cos.shape[1]
    R = 2 * half
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        xr = x[t0:t1, :, rot_offset : rot_offset + R].float()  # (t, H, R)
        if in_interleaved:
            a, b = xr[..., 0::2], xr[..., 1::2]
        else:
            a, b = xr[..., :half], xr[..., half:]
        pos = positions[t0:t1].long()
        c = cos.index_select(0, pos).unsqueeze(1)  # (t, 1, R/2)
        s = sin.index_select(0, pos).unsqueeze(1)
        if negate_sin:
            s = -s
        ya = a * c - b * s  # (t, H, R/2)
        yb = b * c + a * s
        if out_interleaved:
            yr = torch.stack((ya, yb), dim=-1).flatten(-2)
        else:
            yr = torch.cat((ya, yb), dim=-1)
        y[t0:t1, :, rot_offset : rot_offset + R] = yr.to(x.dtype)
    return y
