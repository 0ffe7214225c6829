"""Expert parallelism whose rows equal one device's, bit for bit.

A model declares an ``EPPlan`` beside itself (``models/qwen35_gdn/parallelize.py``): which weights are
per-expert stacks (expert on dim 0) and where its MoE spec lives.  ``ep_server`` applies it: the rank
at EP position q holds experts [q·E/R, (q+1)·E/R) of every stack and runs the model's own ``forward``
unchanged; only the spec's expert format is wrapped (``ExpertParallel``), from outside, as
``tp_server`` mixes its gathers in.  The model file never mentions a rank.

Where the routed sum's order lives (``common/moe/cpu.py``, kept by the Triton path): each (token,
slot) row is computed alone, c_j = fp32 dot(a, W_down[e]) · w_tj, and the routed sum is
``slot_sum``: ((c_0 + c_1) + c_2) + ... in slot order, fp32, which ``moe_combine`` / the server's tree
then adds to the shared expert.  A row's bits depend on nothing but its token and its expert (that
is the kernels' batch invariance), so:

- **Rows, not partial sums.**  Every rank sees the same tokens (activations replicated, as in TP) and
  the same routing (the router runs replicated).  Rank q computes the rows of the (token, slot) pairs
  whose expert it owns, with its local stack, as a k = 1 problem (``slot_sum`` of one slot is c itself),
  in the one-device flat (token, slot) order.
- **Exchanged without reduction.**  The rows are all-gathered, each position's rows put back at their
  (token, slot) places; every pair has exactly one owner, so nothing is added across ranks and the
  padding of a short position never enters a sum.  The routed sum is then ``slot_sum`` over the whole
  (T, k, H) set: the one-device order.  The shared expert, the combine and everything outside the
  block run replicated, unchanged.

Bytes: the row counts of every position follow from the replicated routing, so no count is
exchanged; one all-gather a MoE layer of R · m rows of H fp32 (m: the largest position's row count,
T·k/R when the routing is balanced).  Received per token, balanced: (R-1)/R · k · H · 4 bytes;
qwen3.5-35B-A3B (H = 2048, k = 8) at EP 2: 32 KB a token a layer.  An all-to-all dispatch that
scatters tokens would move the activations as well; with them replicated, this is the whole cost.
Not saved: the router, attention and shared expert run on every rank; one host read of the counts a
layer (the CPU path reads them anyway; a CUDA-graph decode would want a static bound instead).

The trainer (``ep_trainer``, BF16/FP32 stacks without an experts adapter): the same forward through
``_EPExperts``; its backward runs ``common/moe``'s backward (``_experts_bwd``) on this rank's rows at
k = 1, all-gathers the rows of dx (fp32, before any rounding) and of the routing weights' gradients,
and sums dx over the slots as the one-device backward does (``dx_rows.view(T, k, H).sum(1)``), then
rounds once.  The downstream loss is replicated, so each rank's gradient of the gathered rows is
already the whole one; an expert's weight gradient comes from its own rows only.  One caveat: that
backward batches experts of one power-of-two count class into a bmm padded to the class's largest
count, and a rank's class holds only its experts, so its padding can be shorter than one device's
(fewer zero rows at the end of a weight gradient's reduction, a shorter M for dx).  The CPU bmm
gives the same bits either way (the tests compare every gradient with ``torch.equal``, EP 2 and 4);
a GPU BLAS may pick its kernel by shape, so on CUDA the EP trainer's gradients are not promised
until ``_experts_bwd`` takes the one-device grouping from its caller.

Logical positions: rank r holds EP position ``position`` (default r), a permutation of 0..R-1 settled
once at setup; rows are placed by position, never by rank id.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from ..common.moe import experts_fwd
from ..common.moe.lora import ExpertLoRA
from ..common.moe.op import _experts_bwd, _plain_stacks
from ..common.moe.router import slot_sum
from ..models.moe_block import Bf16Experts, MoEBlock
from .collectives import _all_gather, _size_rank, ordered_all_gather


@dataclass(frozen=True)
class EPPlan:
    """stacks: names ("{}" for the layer index) of the per-expert stacked weights, expert on dim 0 (a
    name absent from the weights, e.g. FP8 scales of a bf16 model, is skipped); layers: the MoE
    layers; num_experts: E; spec_attr: the server's attribute holding its ``MoESpec``."""
    stacks: tuple[str, ...]
    layers: tuple[int, ...]
    num_experts: int
    spec_attr: str = "moe_spec"


def check_layout(plan: EPPlan, ep: int) -> None:
    """Refuse an EP degree the plan cannot take, with its reason, before any process group is touched."""
    if not isinstance(ep, int) or ep < 1:
        raise ValueError(f"EP must be an int >= 1, got {ep!r}")
    if plan.num_experts % ep:
        raise ValueError(f"EP = {ep} does not divide {plan.num_experts} routed experts: each EP position owns "
                         f"E / EP whole experts")


def expert_range(num_experts: int, ep: int, position: int) -> tuple[int, int]:
    """[lo, hi) of the experts held at EP position ``position``."""
    if not 0 <= position < ep:
        raise ValueError(f"EP position {position} outside 0..{ep - 1}")
    n = num_experts // ep
    return position * n, (position + 1) * n


def shard_experts(weights: dict[str, torch.Tensor], plan: EPPlan, ep: int, position: int) -> dict[str, torch.Tensor]:
    """This position's weights: every per-expert stack cut to its experts; the rest shared."""
    check_layout(plan, ep)
    lo, hi = expert_range(plan.num_experts, ep, position)
    out = dict(weights)
    for name in (n.replace("{}", str(i)) for n in plan.stacks for i in plan.layers):
        if name not in out:
            continue
        if out[name].shape[0] != plan.num_experts:
            raise ValueError(f"{name} has {out[name].shape[0]} experts on dim 0; the plan has {plan.num_experts}")
        out[name] = out[name][lo:hi].contiguous()
    return out


def local_lora(lora: ExpertLoRA | None, lo: int, hi: int) -> ExpertLoRA | None:
    """Experts [lo, hi) of a layer's adapter (views: the adapters stay whole, and small, on every rank)."""
    return None if lora is None else ExpertLoRA(*(t[lo:hi] for t in lora.tensors()), lora.scale)


class _Rows:
    """Which flat (token, slot) rows each EP position owns, from the replicated routing ids (T, k)."""

    def __init__(self, ids: torch.Tensor, per_position: int, ep: int, position: int):
        self.T, self.k = ids.shape
        self.flat = ids.reshape(-1)
        owner = self.flat // per_position
        self.by_position = [(owner == q).nonzero().reshape(-1) for q in range(ep)]  # ascending: flat order
        self.mine = self.by_position[position]
        self.lo = position * per_position

    def inputs(self, x: torch.Tensor, weights: torch.Tensor):
        """This position's rows as a k = 1 problem on the local stack: x rows (n, H), ids (n, 1) local,
        routing weights (n, 1)."""
        local_ids = (self.flat[self.mine] - self.lo)[:, None]
        return x[self.mine // self.k], local_ids, weights.reshape(-1)[self.mine][:, None]

    def gather(self, x: torch.Tensor, rank_of: tuple[int, ...], group) -> torch.Tensor:
        """x (n_mine, ...) -> (T·k, ...): every position's rows at their places; no arithmetic."""
        counts = [r.numel() for r in self.by_position]
        if len(rank_of) == 1:
            return x
        m = max(counts)
        padded = x.new_zeros(m, *x.shape[1:])
        padded[: x.shape[0]] = x
        recv = padded.new_empty(len(rank_of), *padded.shape)
        _all_gather(recv, padded, group)
        full = x.new_empty(self.T * self.k, *x.shape[1:])
        for q, rows in enumerate(self.by_position):
            full[rows] = recv[rank_of[q], : counts[q]]
        return full


@dataclass(frozen=True, eq=False)
class ExpertParallel:
    """An expert format (``Bf16Experts``, ``Fp8Experts``, ...) over this rank's experts: the routed sum
    (T, H) fp32 of all experts, the one-device bits (module docstring)."""
    inner: object
    ep: int
    position: int
    per_position: int  # E / EP
    rank_of: tuple[int, ...]  # the rank holding each EP position, by position
    group: object = None

    def _rows(self, ids) -> _Rows:
        return _Rows(ids, self.per_position, self.ep, self.position)

    def routed_fwd(self, server, p, h, ids, w, limit, lora):
        rows = self._rows(ids)
        lora = local_lora(lora, rows.lo, rows.lo + self.per_position)
        c = self.inner.routed_fwd(server, p, *rows.inputs(h, w), limit, lora)  # (n, H): k = 1, c itself
        return slot_sum(rows.gather(c, self.rank_of, self.group).view(rows.T, rows.k, -1))

    def routed(self, block, h, ids, w, limit):
        check_trainer_block(block, sharded=True)
        return _EPExperts.apply(h, w, block.gate_up.weight, block.down.weight, self._rows(ids), self, limit)

    # the rest of the format's interface, unchanged
    def make(self, block, E, I, H, kw):
        self.inner.make(block, E, I, H, kw)

    def forward_weights(self, block, prefix):
        return self.inner.forward_weights(block, prefix)

    def invalidate(self, block):
        self.inner.invalidate(block)


class _EPExperts(torch.autograd.Function):
    """The trainer's routed sum over EP ranks: forward as ``ExpertParallel.routed_fwd``; backward in the
    module docstring (gradients of x and of the routing weights whole on every rank, of the stacks local)."""

    @staticmethod
    def forward(ctx, x, weights, w_gate_up, w_down, rows: _Rows, ep: ExpertParallel, limit):
        xr, ids, wr = rows.inputs(x, weights)
        ctx.save_for_backward(xr, ids, wr, w_gate_up, w_down)
        ctx.rows, ctx.ep, ctx.limit, ctx.x_dtype, ctx.w_dtype = rows, ep, limit, x.dtype, weights.dtype
        c = experts_fwd(xr, ids, wr, w_gate_up, w_down, limit)  # (n, H)
        return slot_sum(rows.gather(c, ep.rank_of, ep.group).view(rows.T, rows.k, -1))

    @staticmethod
    def backward(ctx, dy):
        xr, ids, wr, w_gate_up, w_down = ctx.saved_tensors
        rows, ep = ctx.rows, ctx.ep
        need_w = ctx.needs_input_grad[2] or ctx.needs_input_grad[3]
        dyr = dy[rows.mine // rows.k]
        dx, dw, dgu_w, dd_w, _ = _experts_bwd(xr, ids, wr, _plain_stacks(w_gate_up, w_down), dyr, ctx.limit,
                                              None, need_w)  # dx (n, H) fp32: one slot, no sum yet
        both = torch.cat([dx, dw], 1)  # one exchange: the rows' dx and their routing weight's gradient
        full = rows.gather(both, ep.rank_of, ep.group).view(rows.T, rows.k, -1)
        H = dx.shape[1]
        dx_all, dw_all = full[..., :H].contiguous().sum(1), full[..., H]  # the one-device slot sum, one rounding
        return (dx_all.to(ctx.x_dtype), dw_all.to(ctx.w_dtype), None if dgu_w is None else dgu_w.to(w_gate_up.dtype),
                None if dd_w is None else dd_w.to(w_down.dtype), None, None, None)


def check_trainer_block(block, sharded: bool) -> None:
    """The EP trainer's reach: BF16/FP32 expert stacks (their backward is ``_EPExperts``'), no experts
    adapter; ``sharded``: whether the block should already be ``ep_trainer``'s."""
    fmt = block.spec.experts
    if isinstance(fmt, ExpertParallel) != sharded:
        raise ValueError(f"MoE block {block.index} is {'not ' if sharded else ''}sharded by ep_trainer already")
    fmt = fmt.inner if sharded else fmt
    if not isinstance(fmt, Bf16Experts):
        raise NotImplementedError(f"the EP trainer runs BF16/FP32 experts; MoE block {block.index} has "
                                  f"{type(fmt).__name__} (FP8 masters and MXFP4 codes are not sharded in the "
                                  f"trainer yet)")
    if block.experts_lora is not None:
        raise NotImplementedError(f"MoE block {block.index} carries an experts adapter: experts' LoRA is not "
                                  f"sharded in the EP trainer yet")


def rank_of_positions(position: int, group=None) -> tuple[int, ...]:
    """The rank holding each EP position (one all-gather at setup); positions must be a permutation."""
    _, rank = _size_rank(group)
    return tuple(ordered_all_gather(torch.tensor([rank]), position, group, dim=0).tolist())


def wrap_spec(spec, ep: int, position: int, rank_of: tuple[int, ...], group=None):
    """``spec`` (a ``MoESpec``) with its expert format computing only position ``position``'s experts."""
    fmt = ExpertParallel(spec.experts, ep, position, spec.num_experts // ep, rank_of, group)
    return dataclasses.replace(spec, experts=fmt)


def ep_server(server_cls: type, cfg, weights: dict[str, torch.Tensor], plan: EPPlan, group=None,
              position: int | None = None, **server_kw):
    """``server_cls`` (a ``ServeModel``) over this rank's experts of the full ``weights``: the engine runs
    it as any model, the same requests on every rank of ``group``.  Returns full FP32 logits on every
    rank, bitwise the one-device server's.  position: this rank's EP position (default its rank).  Each
    MoE layer reads its row counts on the host: run its engine eagerly (``cuda_graphs=False``)."""
    R, rank = _size_rank(group)
    check_layout(plan, R)
    p = rank if position is None else position
    model = server_cls(cfg, shard_experts(weights, plan, R, p), **server_kw)
    spec = getattr(model, plan.spec_attr)
    setattr(model, plan.spec_attr, wrap_spec(spec, R, p, rank_of_positions(p, group), group))
    return model


def ep_trainer(model: torch.nn.Module, plan: EPPlan, group=None, position: int | None = None) -> torch.nn.Module:
    """Shard a trainer's MoE blocks in place: each keeps this position's experts of its stacks (new
    parameters: build the optimizer after) and computes the routed sum over the group.  Forward
    log-probs, and the gradients of everything but the expert stacks, are the one-device trainer's on
    every rank; the stacks' gradients are the one-device gradients' slices (tested on the CPU; on CUDA
    see the module docstring)."""
    R, rank = _size_rank(group)
    check_layout(plan, R)
    p = rank if position is None else position
    lo, hi = expert_range(plan.num_experts, R, p)
    blocks = [m for m in model.modules() if isinstance(m, MoEBlock)]
    for block in blocks:
        check_trainer_block(block, sharded=False)
        if block.spec.num_experts != plan.num_experts:
            raise ValueError(f"MoE block {block.index} has {block.spec.num_experts} experts; the plan has "
                             f"{plan.num_experts}")
    rank_of = rank_of_positions(p, group)
    for block in blocks:
        block.spec = wrap_spec(block.spec, R, p, rank_of, group)
        for stack in (block.gate_up, block.down):
            stack.weight = torch.nn.Parameter(stack.weight.detach()[lo:hi].clone(),
                                              requires_grad=stack.weight.requires_grad)
    return model
