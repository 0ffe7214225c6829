"""Collectives that fix their order: exchange without reducing, then the fixed tree.

The contract (what a reader checks, as a kernel's reduction order):

- **Leaves.** A reduction's leaves are its contributors.  Each rank offers ``k``
  rows (``parts`` (k, ...), the same k on every rank: a rank with fewer pads
  with rows marked invalid), each labelled by a **logical position**
  (``positions`` (k,) ints, e.g. ``dp · CP + cp``: data-parallel major,
  context-parallel minor) and a validity flag (``valid`` (k,) bool).  Rank ids
  never enter the order: they only say where bytes travel.
- **Order.** The valid rows of all ranks, sorted by logical position (positions
  of valid rows are unique across the group: checked, ``ValueError`` otherwise),
  are the leaves of ``common/tree``'s tree: neighbours (0,1), (2,3), ... added
  in float64, an odd last one carried up, rounded once to ``out_dtype``.
  Invalid rows (padding) never enter the tree.  Every element is reduced on its
  own, so which rank holds which shard of the result never changes its bits.
- **Movement.** ``ordered_reduce_scatter``: one ``all_to_all`` (rank r receives
  chunk r of every rank's rows: the bytes a reduce-scatter of k rows moves) plus
  an ``all_gather`` of the labels (3 int64 per row).  ``ordered_all_reduce``:
  that, then an ``all_gather`` of the reduced chunks in ``out_dtype``.
  ``ordered_all_gather``: shards concatenated by logical position.

``TreeAccumulator`` builds the same tree from leaves pushed one at a time in
logical order (a binary counter of float64 partial sums, ~log2(N) + 1 of them),
so a trainer can reduce leaves as their gradients appear.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..common.tree import tree_reduce_fwd


def _all_gather(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """out (R, ...) <- every rank's x (...), in rank-id order, as flat views (gloo takes only the concatenated
    form); all_gather_single is 2.13's name for it (2.11 lacks it)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out.view(-1), x.reshape(-1), group=group)


def _size_rank(group) -> tuple[int, int]:
    if group is None and not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class TreeAccumulator:
    """``common/tree``'s tree over leaves pushed in logical order.

    A stack of (leaf count, float64 partial) pairs: a pushed leaf merges with
    the top while both cover the same count (the tree's aligned subtrees of 1,
    2, 4, ... leaves); ``result`` folds what is left from the right, which is
    where the tree carries an odd node up.  Every add is element-wise in
    float64 and the result is rounded once, so its bits equal
    ``tree_reduce_fwd(torch.stack(leaves), out_dtype)`` for any leaf count."""

    def __init__(self):
        self._stack: list[tuple[int, torch.Tensor]] = []
        self.count = 0

    def push(self, leaf: torch.Tensor) -> None:
        if self._stack and leaf.shape != self._stack[0][1].shape:
            raise ValueError(f"leaf of shape {tuple(leaf.shape)}, the tree's leaves have {tuple(self._stack[0][1].shape)}")
        n, x = 1, leaf.double()
        while self._stack and self._stack[-1][0] == n:
            m, y = self._stack.pop()
            n, x = n + m, y + x
        self._stack.append((n, x))
        self.count += 1

    def result(self, out_dtype: torch.dtype) -> torch.Tensor:
        if not self._stack:
            raise ValueError("no valid leaf was pushed: the tree of nothing is undefined")
        n, x = self._stack[-1]
        for m, y in reversed(self._stack[:-1]):
            n, x = n + m, y + x
        return x.to(out_dtype)


def _labels(parts: torch.Tensor, positions, valid) -> tuple[torch.Tensor, torch.Tensor]:
    k = parts.shape[0]
    positions = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    valid = torch.ones(k, dtype=torch.bool) if valid is None else torch.as_tensor(valid, dtype=torch.bool).reshape(-1)
    if positions.numel() != k or valid.numel() != k:
        raise ValueError(f"{k} rows but {positions.numel()} positions and {valid.numel()} valid flags: one each")
    return positions, valid


def logical_order(positions: torch.Tensor, valid: torch.Tensor) -> list[int]:
    """Indices of the valid entries of the flat (n,) label tables, sorted by logical position;
    a position held twice among valid rows is refused (the tree would depend on who sent first)."""
    idx = valid.nonzero().reshape(-1)
    pos = positions[idx]
    order = idx[pos.argsort(stable=True)]
    sorted_pos = positions[order]
    dup = sorted_pos[1:][sorted_pos[1:] == sorted_pos[:-1]]
    if dup.numel():
        raise ValueError(f"logical position {int(dup[0])} is held by more than one valid row: positions must be unique")
    if (sorted_pos < 0).any():
        raise ValueError(f"logical positions must be >= 0, got {int(sorted_pos[0])}")
    return order.tolist()


def gather_labels(positions: torch.Tensor, valid: torch.Tensor, group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, k) positions and valid flags of every rank's rows, in rank-id order (where bytes came from)."""
    R, _ = _size_rank(group)
    mine = torch.stack([positions, valid.to(torch.int64)])  # (2, k)
    if R == 1:
        table = mine[None]
    else:
        table = mine.new_empty(R, *mine.shape)
        _all_gather(table, mine.contiguous(), group=group)
    return table[:, 0], table[:, 1].bool()


def exchange_chunks(flat: torch.Tensor, group=None) -> torch.Tensor:
    """flat (k, R·S), chunk r of each row meant for rank r -> (R, k, S): chunk ``rank`` of every rank's rows,
    rows of source rank s at [s].  No arithmetic: an ``all_to_all``."""
    R, _ = _size_rank(group)
    k, n = flat.shape
    if n % R:
        raise ValueError(f"rows of {n} elements do not split into {R} equal chunks")
    send = flat.reshape(k, R, n // R).transpose(0, 1).contiguous()  # (R dest, k, S)
    if R == 1:
        return send
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    return recv


def reduce_received(recv: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor,
                    out_dtype: torch.dtype) -> torch.Tensor:
    """recv (R, k, S) with (R, k) labels -> (S,): the tree over the valid rows in logical order."""
    order = logical_order(positions.reshape(-1), valid.reshape(-1))
    if not order:
        raise ValueError("no valid row in the group: the tree of nothing is undefined")
    return tree_reduce_fwd(recv.reshape(-1, recv.shape[-1])[order], out_dtype)


def ordered_reduce_scatter(parts: torch.Tensor, positions, valid=None, group=None,
                           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """parts (k, ...) with positions (k,), valid (k,) -> (S,): this rank's chunk of the tree-reduced
    flat tensor, S = ceil(M / R) for M = parts[0].numel(); rank r holds flat elements [r·S, (r+1)·S)
    (the last chunk padded past M).  Bits: the module docstring's tree over valid rows in logical order."""
    R, _ = _size_rank(group)
    positions, valid = _labels(parts, positions, valid)
    flat = parts.reshape(parts.shape[0], -1)
    S = -(-flat.shape[1] // R)
    if S * R != flat.shape[1]:
        flat = torch.nn.functional.pad(flat, (0, S * R - flat.shape[1]))
    pos_table, valid_table = gather_labels(positions, valid, group)
    return reduce_received(exchange_chunks(flat, group), pos_table, valid_table, out_dtype or parts.dtype)


def ordered_all_reduce(parts: torch.Tensor, positions, valid=None, group=None,
                       out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """parts (k, ...) -> (...) on every rank: ``ordered_reduce_scatter`` then an all-gather of the chunks
    (bits equal to ``tree_reduce_fwd`` over the valid rows of all ranks, sorted by logical position)."""
    R, _ = _size_rank(group)
    chunk = ordered_reduce_scatter(parts, positions, valid, group, out_dtype)
    full = chunk if R == 1 else chunk.new_empty(R * chunk.numel())
    if R > 1:
        _all_gather(full, chunk, group=group)
    return full[: parts[0].numel()].reshape(parts.shape[1:])


def ordered_all_gather(x: torch.Tensor, position: int, group=None, dim: int = -1) -> torch.Tensor:
    """Every rank's shard x, concatenated along ``dim`` in logical order of ``position`` (e.g. a
    vocabulary-sharded LM head's logits (T, V_r) -> (T, V), shard p holding the p-th vocabulary slice).
    Positions are a permutation of 0..R-1; shards may differ in size along ``dim`` only."""
    R, _ = _size_rank(group)
    dim = dim % x.dim()
    if R == 1:
        if position != 0:
            raise ValueError(f"one rank holds shard position {position}: positions must be 0..R-1")
        return x
    head = torch.tensor([position, x.shape[dim]], dtype=torch.int64)
    heads = head.new_empty(R, 2)
    _all_gather(heads, head, group=group)
    if sorted(heads[:, 0].tolist()) != list(range(R)):
        raise ValueError(f"shard positions {heads[:, 0].tolist()} (by rank) are not a permutation of 0..{R - 1}")
    width = int(heads[:, 1].max())
    padded = torch.nn.functional.pad(x.movedim(dim, -1), (0, width - x.shape[dim])).contiguous()
    out = padded.new_empty(R, *padded.shape)
    _all_gather(out, padded, group=group)
    by_pos = heads[:, 0].argsort().tolist()
    return torch.cat([out[r, ..., : int(heads[r, 1])] for r in by_pos], -1).movedim(-1, dim)
