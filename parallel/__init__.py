"""Parallel layouts on torch.distributed whose results do not depend on the layout: collectives
that exchange without reducing and then run ``common/tree``'s tree in logical order
(``collectives``), and data-parallel gradients equal to one device's (``dp``)."""
from .collectives import (
    TreeAccumulator,
    ordered_all_gather,
    ordered_all_reduce,
    ordered_reduce_scatter,
)
from .dp import step_gradients

__all__ = ["TreeAccumulator", "ordered_all_gather", "ordered_all_reduce", "ordered_reduce_scatter",
           "step_gradients"]
