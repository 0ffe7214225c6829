"""Block layout: the units in which a tensor is diffed and shipped.

Every tensor is seen as a 3-D view ``(E, N, M)`` of its elements in memory
order, cut into ``(br, bc)`` blocks over the last two dimensions.  Block
``(e, i, j)`` has the flat index ``(e * nbr + i) * nbc + j`` with
``nbr = ceil(N / br)``, ``nbc = ceil(M / bc)``; edge blocks are partial.

========================================  ===================  ============
tensor                                    view (E, N, M)       block
========================================  ===================  ============
float8 codes ``X.weight`` (..., N, K)     (prod(...), N, K)    128 x 128
its scales ``X.weight_scale_inv``         (prod(...), nbr,     1 x 1
(..., ceil(N/128), ceil(K/128)), fp32     nbc)
or E8M0 bytes
any other tensor with dim >= 2            (prod(...), N, K)    R x K (R rows)
(..., N, K): bf16/fp32 expert stacks,
packed E2M1 codes (..., N, K/2) and
their E8M0 scales (..., N, K/32) as
uint8, integer tables
1-D and 0-D tensors                       (1, 1, numel)        one block
========================================  ===================  ============

The float8 blocks are the quantizer's blocks, so a re-quantized block is one
unit; its scale is scale block ``(i, j)`` -- the same flat index -- and ships
on its own (4 bytes) only when the scale itself changed: codes and scale of a
block change independently, and byte comparison tells each exactly.

Leading dims (experts, stacked layers) are the view's E, so no block straddles
two experts: a step that changes one expert of an (E, N, K) stack ships that
expert's ``ceil(N / R)`` blocks.  Packed 4-bit codes and their per-32 scales
take whole-row blocks of the same R rows: MXFP4 groups lie along K, so a
re-quantized group is inside one row block of each, and code block b and scale
block b cover the same weight rows (the same flat index, as for float8).

A block's data are its elements in memory order of the whole tensor, i.e.
the payload of a tensor is ``view[mask]`` for the element mask of its changed
blocks (for row blocks: the blocks concatenated in index order).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

FP8_BLOCK = 128
FLOAT8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
                      if hasattr(torch, n))
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_int(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers of the same width (same shape, shares storage):
    comparisons on it are byte comparisons, so -0.0 != 0.0 and NaN payloads
    differ by their bits."""
    dt = _INT_OF_SIZE.get(t.element_size())
    if dt is None:
        raise TypeError(f"cannot sync a {t.dtype} tensor: elements of {t.element_size()} bytes "
                        f"(supported: 1, 2, 4, 8 bytes)")
    return t.view(dt)


@dataclass(frozen=True)
class Layout:
    view: tuple[int, int, int]  # (E, N, M)
    block: tuple[int, int]  # (br, bc)

    @property
    def grid(self) -> tuple[int, int, int]:
        """(E, nbr, nbc): blocks along each dimension of the view."""
        E, N, M = self.view
        br, bc = self.block
        return E, -(-N // br), -(-M // bc)

    @property
    def num_blocks(self) -> int:
        return prod(self.grid)

    def check(self, numel: int) -> None:
        """Raise ValueError if this layout cannot describe a tensor of ``numel`` elements."""
        if len(self.view) != 3 or any(not isinstance(v, int) or v < 0 for v in self.view) or prod(self.view) != numel:
            raise ValueError(f"view {self.view} does not hold {numel} elements")
        if len(self.block) != 2 or any(not isinstance(b, int) or b < 1 for b in self.block):
            raise ValueError(f"block {self.block} must be two ints >= 1")

    def changed_blocks(self, ne: torch.Tensor) -> torch.Tensor:
        """``ne`` (E, N, M) bool, True where an element changed -> (E, nbr, nbc)
        bool, True where a block holds a changed element."""
        E, N, M = self.view
        br, bc = self.block
        _, nbr, nbc = self.grid
        if bc >= M:
            g = ne.any(2, keepdim=True)  # (E, N, 1)
        elif bc == 1:
            g = ne
        else:
            g = _pad(ne, 2, nbc * bc).view(E, N, nbc, bc).any(3)  # (E, N, nbc)
        if br > 1:
            g = _pad(g, 1, nbr * br).view(E, nbr, br, nbc).any(2)  # (E, nbr, nbc)
        return g

    def blocks_from_indices(self, indices: torch.Tensor) -> torch.Tensor:
        """(n,) flat block indices -> (E, nbr, nbc) bool."""
        g = torch.zeros(self.num_blocks, dtype=torch.bool, device=indices.device)
        g[indices] = True
        return g.view(self.grid)

    def mask(self, blocks: torch.Tensor) -> torch.Tensor:
        """(E, nbr, nbc) bool -> the index that picks those blocks' elements from
        the (E, N, M) view: an (E, N) row mask when a block spans whole rows,
        else an (E, N, M) element mask."""
        E, N, M = self.view
        br, bc = self.block
        rows = blocks.repeat_interleave(br, dim=1)[:, :N] if br > 1 else blocks  # (E, N, nbc)
        if bc >= M:
            return rows[:, :, 0]
        return rows.repeat_interleave(bc, dim=2)[:, :, :M] if bc > 1 else rows

    def numel_of(self, indices: torch.Tensor) -> int:
        """Elements inside the blocks ``indices`` (edge blocks are partial)."""
        _, N, M = self.view
        br, bc = self.block
        _, nbr, nbc = self.grid
        i = (indices // nbc) % nbr
        j = indices % nbc
        rows = (N - i * br).clamp(max=br)
        cols = (M - j * bc).clamp(max=bc)
        return int((rows * cols).sum().item())


def layout_of(name: str, t: torch.Tensor, weights: dict[str, torch.Tensor], rows_per_block: int) -> Layout:
    """The block layout of ``weights[name] = t`` (see the module docstring)."""
    shape = tuple(t.shape)
    if t.dtype in FLOAT8_DTYPES and t.dim() >= 2:
        return Layout((prod(shape[:-2]), shape[-2], shape[-1]), (FP8_BLOCK, FP8_BLOCK))
    if name.endswith("_scale_inv") and t.dim() >= 2:
        codes = weights.get(name[: -len("_scale_inv")])
        if (codes is not None and codes.dtype in FLOAT8_DTYPES and codes.dim() == t.dim()
                and shape == (*codes.shape[:-2], -(-codes.shape[-2] // FP8_BLOCK), -(-codes.shape[-1] // FP8_BLOCK))):
            return Layout((prod(shape[:-2]), shape[-2], shape[-1]), (1, 1))
    if t.dim() >= 2:
        N, K = shape[-2:]
        return Layout((prod(shape[:-2]), N, K), (rows_per_block, max(K, 1)))
    n = t.numel()
    return Layout((1, 1, n), (1, max(n, 1)))


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if x.shape[dim] == size:
        return x.contiguous()
    shape = list(x.shape)
    shape[dim] = size
    out = x.new_zeros(shape)
    out.narrow(dim, 0, x.shape[dim]).copy_(x)
    return out
