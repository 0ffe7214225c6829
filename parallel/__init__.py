"""Parallel layouts on torch.distributed whose results do not depend on the layout: collectives
that exchange without reducing and then run ``common/tree``'s tree in logical order
(``collectives``), data-parallel gradients equal to one device's (``dp``), and FSDP2's reduce-scatter
replaced by the ordered one (``fsdp.shard_ordered``, imported on use: it reads FSDP2's private ABC), and
tensor-parallel serving with one device's bits from a model's declared plan (``tp``), and expert
parallelism for the MoE models, server and trainer, each EP position owning E / EP whole experts and
the routed rows exchanged without reduction before the one-device slot sum (``ep``), and trainer
context parallelism, heads exchanged around the model's own attention and each weight gradient
replayed by its owner on every token's rows (``cp``), trainer pipeline parallelism whose microbatches
pipeline only the gradients between stages (``pp``), and weight sync from a trainer on one layout to a
TP server on another, all ranks or none (``layout_sync``)."""
from .collectives import (
    TreeAccumulator,
    ordered_all_gather,
    ordered_all_reduce,
    ordered_reduce_scatter,
)
from .cp import ContextParallel, CPPlan, check_cp
from .dp import step_gradients
from .ep import EPPlan, ep_server, ep_trainer
from .layout_sync import FSDPSource, LayoutSync, replicated_source
from .pp import PipelineParallel, PPPlan, stage_ranges
from .tp import Column, Row, TPPlan, Vocab, check_layout, tp_server

__all__ = ["TreeAccumulator", "ordered_all_gather", "ordered_all_reduce", "ordered_reduce_scatter",
           "step_gradients", "Column", "Row", "TPPlan", "Vocab", "check_layout", "tp_server",
           "EPPlan", "ep_server", "ep_trainer", "ContextParallel", "CPPlan", "check_cp",
           "FSDPSource", "LayoutSync", "replicated_source", "PipelineParallel", "PPPlan", "stage_ranges"]
