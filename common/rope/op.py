"""RoPE: launchers, autograd and the public function.

The server calls ``rope_fwd`` directly; the trainer calls ``rope``.  Both go
through the same launcher, so they give the same bits.
"""
from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_dim, check_same_device, check_tensor
from .cpu import rope_rotate_cpu
from .table import RopeSpec, rope_table

POSITION_DTYPES = (torch.int64, torch.int32)


def _check_positions_range(positions: torch.Tensor, spec: RopeSpec) -> None:
    if positions.numel() == 0:
        return
    lo, hi = int(positions.min()), int(positions.max())  # a host sync on CUDA
    if lo < 0:
        raise ValueError(f"positions: got negative position {lo}")
    if hi >= spec.max_position:
        raise ValueError(
            f"positions: position {hi} is past the RoPE table (max_position={spec.max_position}); "
            "build the RopeSpec with a larger max_position"
        )


def _rotate(x, positions, spec, *, forward: bool, conjugate: bool, block_rows: int | None, check: bool):
    if check:
        _check_positions_range(positions, spec)
    cos, sin = rope_table(spec, x.device)
    in_il = spec.pairing in ("interleaved", "interleaved_to_half")
    out_il = spec.pairing == "interleaved"
    if not forward:  # the transpose: read the output layout, write the input layout, rotate by -theta
        in_il, out_il = out_il, in_il
    kw = dict(
        rot_offset=spec.rotary_offset(x.shape[-1]),
        in_interleaved=in_il,
        out_interleaved=out_il,
        negate_sin=conjugate == forward,
    )
    if x.is_cuda:
        from .kernel import rope_rotate_triton

        return rope_rotate_triton(x, positions, cos, sin, block_rows=block_rows, **kw)
    return rope_rotate_cpu(x, positions, cos, sin, row_chunk=block_rows, **kw)


def rope_fwd(
    x: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    *,
    conjugate: bool = False,
    block_rows: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Rotate x (T, H, D) by its tokens' positions (T,); returns a new tensor.

    ``conjugate`` rotates by -theta.  ``block_rows`` is a launch knob that never
    changes bits (CUDA: rows per program, a power of two; CPU: tokens per
    chunk).  ``check=False`` skips the position range check, which syncs with
    the host on CUDA (use inside CUDA graphs; the kernel then clamps
    out-of-range positions instead of reading outside the table).  Inputs are
    otherwise assumed valid; ``rope`` validates them.
    """
    return _rotate(x, positions, spec, forward=True, conjugate=conjugate, block_rows=block_rows, check=check)


def rope_bwd(
    dy: torch.Tensor,
    positions: torch.Tensor,
    spec: RopeSpec,
    *,
    conjugate: bool = False,
    block_rows: int | None = None,
    check: bool = True,
) -> torch.Tensor:
    """dx = R(theta)^T dy (rotation by -theta, layouts swapped), cast once to dy's
    dtype; pass-through channels copy dy.  No gradient flows to the table."""
    return _rotate(dy, positions, spec, forward=False, conjugate=conjugate, block_rows=block_rows, check=check)


class RopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, spec, conjugate):
        ctx.save_for_backward(positions)
        ctx.spec, ctx.conjugate = spec, conjugate
        return rope_fwd(x, positions, spec, conjugate=conjugate, check=False)

    @staticmethod
    def backward(ctx, dy):
        (positions,) = ctx.saved_tensors
        dx = rope_bwd(dy.contiguous(), positions, ctx.spec, conjugate=ctx.conjugate, check=False)
        return dx, None, None, None


def rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, *, conjugate: bool = False) -> torch.Tensor:
    """Rotary position embedding of q or k, per token.

    x:         (T, H, D) bf16 or fp32, contiguous (packed tokens, any number of heads)
    positions: (T,) int64 (or int32), each in [0, spec.max_position); any order,
               so packed sequences just carry their own positions
    spec:      RopeSpec (table, pairing, rotary slice)
    conjugate: rotate by -theta (DeepSeek-V4 un-rotates its attention output so)
    returns    (T, H, D), x's dtype: the rotary slice rotated in fp32 with the
               fp32 table and rounded once; the other channels bit-exact copies.
    Differentiable in x.
    """
    if not isinstance(spec, RopeSpec):
        raise TypeError(f"spec must be a RopeSpec, got {type(spec).__name__}")
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=3)
    check_tensor("positions", positions, dtypes=POSITION_DTYPES, ndim=1)
    check_same_device(x=x, positions=positions)
    check_dim("positions", positions.shape[0], x.shape[0], "length (tokens)")
    if spec.rotary_dim > x.shape[2]:
        raise ValueError(f"x: head dim {x.shape[2]} is smaller than spec.rotary_dim {spec.rotary_dim}")
    _check_positions_range(positions, spec)
    return RopeFunction.apply(x, positions, spec, bool(conjugate))
