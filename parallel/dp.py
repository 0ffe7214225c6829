"""Data-parallel gradients that do not depend on the layout: one device, DP 2 and DP 4 give the same bits.

A step's batch is N **leaves** in a fixed logical order (e.g. fixed-size groups of sequences).  Each
leaf's gradient is computed by its own backward (``torch.autograd.grad``: nothing accumulates in
``.grad``), in the parameters' dtype; the step's gradient is ``common/tree``'s tree over the N leaf
gradients in logical order (pairwise in float64, rounded once to the parameters' dtype).

Layout on R ranks: leaf j lives on the rank at DP position j mod R, in its local slot j div R.  Slot i
ends with one ``exchange_chunks`` (an all-to-all: rank r receives chunk r of leaf i·R + d from every
position d) whose rows are pushed, in logical order, into a ``TreeAccumulator`` over rank r's chunk;
after the last slot each rank rounds its chunk once and an all-gather rebuilds the whole gradient.
Leaves past N (when R does not divide N) are padding: their rows are marked invalid and skipped.  On
one device (no group, or R = 1) the same code pushes leaves 0..N-1 in order: the same tree, the same
bits, whatever R.  (With bf16 leaves the float64 tree is exact while an element's leaves span < 45
bits of exponent, so there order rarely shows; a sum in bf16, as DDP and FSDP do, changes the bits.)

Cost per rank and step, for P gradient elements of b bytes and ceil(N/R) slots: ceil(N/R)·(R-1)/R·P·b
received by all-to-all plus (R-1)/R·P·b by the all-gather, against 2·(R-1)/R·P·b for a ring all-reduce
of accumulated gradients: equal for one slot, (slots + 1)/2 times for more.  Memory: ~log2(N) + 1
float64 partial sums of P/R elements each.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .collectives import TreeAccumulator, _all_gather, _size_rank, exchange_chunks, gather_labels, logical_order


def flat_grads(grads: Sequence[torch.Tensor | None], params: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    """One leaf's gradients as a (width,) row: parameters in order, an unused one as zeros, then zero padding."""
    row = torch.zeros(width, dtype=params[0].dtype)
    o = 0
    for g, p in zip(grads, params):
        if g is not None:
            row[o: o + p.numel()] = g.reshape(-1)
        o += p.numel()
    return row


def step_gradients(loss_fn: Callable[[object], torch.Tensor], params: Sequence[torch.Tensor],
                   leaves: Sequence[object], group=None, position: int | None = None) -> list[torch.Tensor]:
    """Set each parameter's ``.grad`` to the tree over ``leaves`` of d loss_fn(leaf) / d param.

    loss_fn:   leaf -> scalar loss (differentiable in ``params``); a normalisation over the whole
               batch (e.g. 1 / all tokens) is the caller's constant, the same on every rank
    params:    the trained tensors, one dtype, the same list on every rank
    leaves:    all N leaves in logical order, the same list on every rank; this rank computes only
               leaves[position::R]
    group:     the data-parallel process group (None without torch.distributed: one device)
    position:  this rank's DP position (default: its rank in ``group``); a permutation of 0..R-1
    Returns the local leaves' losses (detached), in slot order."""
    params = list(params)
    if not params or len({p.dtype for p in params}) != 1:
        raise ValueError(f"params must be a non-empty list of one dtype, got {sorted({str(p.dtype) for p in params})}")
    R, rank = _size_rank(group)
    d = rank if position is None else position
    if not 0 <= d < R:
        raise ValueError(f"DP position {d} outside 0..{R - 1}")
    N = len(leaves)
    if N == 0:
        raise ValueError("no leaves: a step needs at least one")
    M = sum(p.numel() for p in params)
    S = -(-M // R)
    slots = -(-N // R)
    acc = TreeAccumulator()
    losses = []
    for i in range(slots):
        j = i * R + d
        if j < N:
            loss = loss_fn(leaves[j])
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            losses.append(loss.detach())
            row = flat_grads(grads, params, S * R)
        else:
            row = torch.zeros(S * R, dtype=params[0].dtype)
        pos, valid = gather_labels(torch.tensor([j]), torch.tensor([j < N]), group)  # (R, 1) each
        recv = exchange_chunks(row[None], group)  # (R, 1, S)
        for idx in logical_order(pos.reshape(-1), valid.reshape(-1)):
            acc.push(recv[idx, 0])
    chunk = acc.result(params[0].dtype)
    full = chunk
    if R > 1:
        full = chunk.new_empty(R * S)
        _all_gather(full, chunk, group=group)
    o = 0
    for p in params:
        p.grad = full[o: o + p.numel()].view_as(p).clone()
        o += p.numel()
    return losses
