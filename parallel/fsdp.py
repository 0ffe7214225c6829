"""FSDP2 (``fully_shard``) whose gradients are ``dp``'s: the reduce-scatter replaced by the ordered one.

FSDP2 reduce-scatters each parameter group's gradient once per backward; ``set_custom_reduce_scatter``
(torch >= 2.8) takes the collective.  ``OrderedReduceScatter`` keeps ``dp``'s contract: one backward
a leaf, leaf j on DP position j mod R in local slot j div R; slot i's call is an all-to-all (the bytes
FSDP's own reduce-scatter moves) whose rows it pushes, in logical order, into a ``TreeAccumulator``
over this rank's shard.  FSDP adds each call's output into the sharded ``.grad``: slots before the
last give -0.0 (x + -0.0 == x for every x, signed zeros included), the last gives the tree rounded
once, so the sharded gradient is bit for bit the shard of one device's.  FSDP's own divide is turned
off (factor 1, sum only): a mean is the loss's constant, as in ``dp``.

Cost against FSDP's default (a reduce-scatter per backward, accumulated in the parameters' dtype):
the same bytes on the wire; memory ~log2(N) + 1 float64 partial sums of the shard (P/R elements)
per parameter group.  At world size 1 FSDP skips the collective and accumulates in the parameters'
dtype itself: use ``dp.step_gradients`` (the one-device path) there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter  # the ABC set_custom_reduce_scatter takes

from .collectives import TreeAccumulator, _size_rank, exchange_chunks, gather_labels, logical_order


class OrderedReduceScatter(ReduceScatter):
    """The custom reduce-scatter of one FSDP parameter group for steps of ``n_leaves`` leaves.

    Call i of a step (the backward of leaf i·R + position): input (R·S,), chunk r for rank r, in the
    group's reduce dtype -> output (S,): -0.0 until the step's last slot, then the tree over all
    leaves of this rank's chunk, rounded once to the output's dtype."""

    def __init__(self, n_leaves: int, position: int, group=None):
        R, _ = _size_rank(group)
        if n_leaves % R:
            raise ValueError(f"{n_leaves} leaves do not split over {R} FSDP ranks: every rank must run "
                             f"the same number of backwards (pad the batch to a multiple of {R} leaves)")
        if not 0 <= position < R:
            raise ValueError(f"DP position {position} outside 0..{R - 1}")
        self.n_leaves, self.position, self.slots = n_leaves, position, n_leaves // R
        self._slot = 0
        self._acc = TreeAccumulator()

    def allocate(self, size, *, dtype, device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.RedOpType.SUM):
            raise ValueError(f"the ordered reduce-scatter sums only, got {op}: call set_gradient_divide_factor(1.0) "
                             f"and set_force_sum_reduction_for_comms(True) (``shard_ordered`` does)")
        R, _ = _size_rank(group)
        j = self._slot * R + self.position
        pos, valid = gather_labels(torch.tensor([j]), torch.tensor([True]), group)  # (R, 1): who sent which leaf
        recv = exchange_chunks(input_tensor.reshape(1, -1), group)  # (R, 1, S)
        for idx in logical_order(pos.reshape(-1), valid.reshape(-1)):
            self._acc.push(recv[idx, 0])
        self._slot += 1
        if self._slot < self.slots:
            output_tensor.fill_(-0.0)
        else:
            output_tensor.copy_(self._acc.result(output_tensor.dtype))
            self._slot, self._acc = 0, TreeAccumulator()
        return None


def shard_ordered(module: torch.nn.Module, n_leaves: int, position: int | None = None, group=None) -> None:
    """Give every FSDP parameter group under ``module`` (after ``fully_shard``) its own
    ``OrderedReduceScatter`` for steps of ``n_leaves`` leaves, and turn FSDP's divide off."""
    _, rank = _size_rank(group)
    mods = [m for m in module.modules() if isinstance(m, FSDPModule)]
    if not mods:
        raise ValueError("no FSDPModule under the module: call fully_shard first")
    for m in mods:
        m.set_custom_reduce_scatter(OrderedReduceScatter(n_leaves, rank if position is None else position, group))
        m.set_gradient_divide_factor(1.0)
        m.set_force_sum_reduction_for_comms(True)
