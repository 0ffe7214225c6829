"""Pipeline parallelism for the trainer: one device's log-probs and gradients, bit for bit.

Stage s of S holds a contiguous range of layers (``stage_ranges``: by default the first L % S stages one
layer longer; or an explicit split of layer counts); stage 0 also holds the embedding, the last stage the
final norm and the LM head.  The forward passes what crosses a layer boundary (``PPPlan.carry``; for qwen3
the pair (x, residual), each (T, H) in the activations' dtype: bf16 rows for a bf16 trainer) from stage s
to s + 1 with a point-to-point send; the last stage forms the FP32 chosen-token log-probs and broadcasts
them, so every rank returns them and the RL code needs no rank logic.  The backward passes the carry's
gradients from s + 1 back to s the same way.

**What equality is delivered (CPU path, what CI proves: ``tests/test_parallel_pp.py``)**

- Forward: the log-probs equal the one-device trainer's (``torch.equal``): the whole packed batch is one
  microbatch, every stage runs the one-device ops on the one-device rows, and the carried rows are sent
  as they are (no cast).
- Parameter gradients: every ``.grad`` a stage holds equals the one-device trainer's, bitwise.  Each
  weight is read by one op, which sees the one-device operands (activations forward, output gradient
  backward), so its own backward forms the one-device dW: no gradient is split or reduced.  A tied LM
  head (the embedding read twice, on stage 0 and on the last stage) is the one exception: one device's
  autograd adds its two reads' gradients once (one rounding, and a + b == b + a), so ``reduce_gradients``
  swaps the two partials between the two stages and each forms the same sum.
- **Training runs one microbatch** (no GPipe / 1F1B backward): a weight gradient summed over microbatches
  is not one device's, because the CPU matmul's dW is one fp32 chain over all T tokens (``matmul/cpu.py``)
  and a second microbatch's chain would restart at 0 (``tests/test_parallel_cp.py``'s
  ``test_token_split_weight_gradient_is_not_one_device``).  An exact schedule would keep each microbatch's
  X and dY rows and run each weight's dW once on all of them after the last microbatch (a deferred
  weight pass, as zero-bubble PP's W step, at the memory of a whole-batch backward's operands).
- **Scoring may be microbatched**: under ``torch.no_grad()`` (an RL step's old and reference log-probs)
  ``logprobs(..., microbatches=M)`` cuts the sequences into M contiguous groups that flow through the
  stages one behind another (GPipe's forward).  Every op is row-wise or runs per sequence (attention), so
  a row's bits do not depend on its microbatch: the log-probs are the one-device ones (tested M = 3, 4).
- CUDA: not proven (no multi-GPU run).  With one microbatch every op sees the one-device shapes, so the
  bits follow wherever a kernel is deterministic for a fixed shape; microbatched scoring changes the row
  counts, so it keeps its bits only on batch-invariant kernels (the server's, ``common/matmul``).

**Cost.**  Forward: each boundary sends |carry|·T·H·b bytes once (2·T·H·2 for qwen3 in bf16), the log-probs
broadcast 4·R bytes (R scored rows); the backward sends the same carry volume back.  With one microbatch
the stages run one after another: S - 1 of S stages wait at any moment (the bubble is (S-1)/S of the step),
the price of the one-device dW; microbatched scoring cuts it to (S-1)/(M+S-1).  What PP buys is memory: a
stage holds about L/S of the layers' weights, gradients, optimizer state and activations.  Parameters
outside a rank's stage are never read, so they may stay on the ``meta`` device (``held_names``: what a
rank must load).

Not supported yet: multi-adapter LoRA rows and router replay (``TrainerBase.logprobs``' ``adapters`` and
``replay``).  One ``logprobs``, one backward over a loss every rank computes alike from the returned
log-probs, and ``reduce_gradients`` per step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..common.lm_head import lm_head_logits
from ..common.sampling import SamplingParams, params_to_tensors, sampling_logprobs
from ..models._packing import pack_scored, sampling_list
from .collectives import _size_rank
from .tp import even_range, rank_of_positions

Carry = tuple  # what one layer hands the next (qwen3: (x, residual); residual None before the first layer)


@dataclass(frozen=True)
class PPPlan:
    """How a model's trainer splits into pipeline stages (``models/<model>/parallelize.py``).

    num_layers: the layers the stages share out, in contiguous ranges
    layers:     the name of the trainer's ``ModuleList`` of layers
    embed:      embed(trainer, tokens) -> the carry into the first layer (stage 0)
    layer:      layer(trainer, module, carry, positions, cu_seqlens, max_seqlen) -> the carry out
    head:       head(trainer, carry, rows) -> (R, H) the final normed hidden of the scored rows (last stage)
    carry:      names of the tensors crossing a stage boundary, each (T, width) in ``dtype_of``'s dtype
    width:      their row width
    dtype_of:   the parameter whose dtype the carried rows have
    first:      modules stage 0 holds besides its layers; last: the last stage's (its LM head)"""
    num_layers: int
    layers: str
    embed: Callable[..., Carry]
    layer: Callable[..., Carry]
    head: Callable[..., torch.Tensor]
    carry: tuple[str, ...]
    width: int
    dtype_of: str
    first: tuple[str, ...]
    last: tuple[str, ...]


def stage_ranges(plan: PPPlan, pp: int, split: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """[lo, hi) of the layers of each stage; refuses a split the model cannot take, with its reason, before
    any process group is touched.  split: layers per stage (default: even, the first L % pp one longer)."""
    L = plan.num_layers
    if isinstance(pp, bool) or not isinstance(pp, int) or pp < 1:
        raise ValueError(f"PP must be an int >= 1, got {pp!r}")
    if split is None:
        if pp > L:
            raise ValueError(f"PP = {pp} stages over {L} layers: every stage needs at least one layer")
        return [even_range(L, pp, s) for s in range(pp)]
    split = list(split)
    if len(split) != pp:
        raise ValueError(f"a split of {len(split)} stages for PP = {pp}: one layer count per stage")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split):
        raise ValueError(f"split {split} leaves a stage without layers: every stage needs at least one (what "
                         f"crosses a boundary is a layer's output)")
    if sum(split) != L:
        raise ValueError(f"split {split} holds {sum(split)} layers, the model has {L}")
    ends = [sum(split[: s + 1]) for s in range(pp)]
    return [(e - n, e) for e, n in zip(ends, split)]


class _SendCarry(torch.autograd.Function):
    """Stage s < S - 1: the carry goes to stage s + 1, the last stage's log-probs come back (broadcast).
    The backward ignores dlp (the last stage holds the same: every rank computes the same loss) and
    receives the carry's gradients from s + 1.  ``anchor``: an empty tensor requiring grad whenever grad
    is enabled, so that this backward runs (and receives) even where the carry needs no gradient."""

    @staticmethod
    def forward(ctx, pp, n_rows, anchor, *carry):
        ctx.pp, ctx.shape = pp, carry[0].shape
        for x in carry:
            pp.send(x, pp.stage + 1)
        return pp.broadcast_logprobs(torch.empty(n_rows, dtype=torch.float32, device=pp.device))

    @staticmethod
    def backward(ctx, dlp):
        pp = ctx.pp
        return (None, None, None, *(pp.recv(ctx.shape, pp.stage + 1) for _ in pp.plan.carry))


class _RecvCarry(torch.autograd.Function):
    """Stage s > 0: the carry from stage s - 1; the backward sends its gradients back to s - 1."""

    @staticmethod
    def forward(ctx, pp, shape, anchor):
        ctx.pp, ctx.shape = pp, shape
        return tuple(pp.recv(shape, pp.stage - 1) for _ in pp.plan.carry)

    @staticmethod
    def backward(ctx, *grads):
        pp = ctx.pp
        for g in grads:
            pp.send(torch.zeros(ctx.shape, dtype=pp.dtype, device=pp.device) if g is None else g, pp.stage - 1)
        return None, None, None


class PipelineParallel:
    """A trainer's forward and backward over S pipeline stages, one microbatch (module docstring).

    Every rank calls ``logprobs`` with the same batch, computes the same loss from the returned (full)
    log-probs, calls ``loss.backward()``, then ``reduce_gradients()``: each parameter its stage holds
    (``held_names``) then has the one-device trainer's ``.grad``; the others are never read.
    position: this rank's stage (default its rank); split: layers per stage (``stage_ranges``)."""

    def __init__(self, trainer, plan: PPPlan, group=None, position: int | None = None,
                 split: Sequence[int] | None = None):
        S, rank = _size_rank(group)
        ranges = stage_ranges(plan, S, split)
        self.trainer, self.plan, self.group, self.S = trainer, plan, group, S
        self.stage = rank if position is None else position
        if not 0 <= self.stage < S:
            raise ValueError(f"PP stage {self.stage} of {S}: stages are 0..{S - 1}")
        self.lo, self.hi = ranges[self.stage]
        self.layers = trainer.get_submodule(plan.layers)
        head = self._name_of(trainer.lm_head_weight)
        mods = [f"{plan.layers}.{i}." for i in range(self.lo, self.hi)]
        mods += [m + "." for m in plan.first] * (self.stage == 0) + [m + "." for m in plan.last] * (self.stage == S - 1)
        self.held_names = tuple(n for n, _ in trainer.named_parameters()
                                if n.startswith(tuple(mods)) or (n == head and self.stage == S - 1))
        # a tied LM head is read on stage 0 (embedding) and on the last stage: its two partials meet there
        self.tied = head.startswith(tuple(m + "." for m in plan.first)) and S > 1
        held = trainer.get_parameter(self.held_names[0])
        self.device, self.dtype = held.device, trainer.get_parameter(plan.dtype_of).dtype
        self.rank_of = rank_of_positions(self.stage, group)

    def _name_of(self, w: torch.Tensor) -> str:
        return next(n for n, p in self.trainer.named_parameters() if p is w)

    # --- movement ------------------------------------------------------------------------------------

    def _global(self, stage: int) -> int:
        r = self.rank_of[stage]
        return r if self.group is None else dist.get_global_rank(self.group, r)

    def send(self, x: torch.Tensor, stage: int) -> None:
        dist.send(x.contiguous(), self._global(stage), group=self.group)

    def recv(self, shape, stage: int) -> torch.Tensor:
        x = torch.empty(shape, dtype=self.dtype, device=self.device)
        dist.recv(x, self._global(stage), group=self.group)
        return x

    def broadcast_logprobs(self, lp: torch.Tensor) -> torch.Tensor:
        if self.S > 1:
            dist.broadcast(lp, self._global(self.S - 1), group=self.group)
        return lp

    # --- the step ----------------------------------------------------------------------------------------

    def logprobs(self, sequences: Sequence, prompt_lens: Sequence[int],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 microbatches: int = 1) -> list[torch.Tensor]:
        """``TrainerBase.logprobs`` over the pipeline: every sequence's FP32 log-probs on every rank (the
        one-device bits), differentiable: a loss computed alike on every rank backpropagates through every
        stage in turn (stage S - 1 first).  microbatches: under ``torch.no_grad()`` only (scoring), the
        sequences cut into that many contiguous groups that flow through the stages one behind another."""
        cfg = self.trainer.cfg
        params = sampling_list(sampling, len(sequences))
        n = len(sequences)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= max(n, 1):
            raise ValueError(f"microbatches must be an int in [1, {n}] (whole sequences each), got {microbatches!r}")
        if microbatches > 1 and torch.is_grad_enabled():
            raise ValueError("PP microbatches only under torch.no_grad(): a weight gradient summed over microbatches "
                             "is not the one-device one (the dW chain restarts per microbatch)")
        if microbatches == 1:
            batch = pack_scored(sequences, prompt_lens, cfg.vocab_size, cfg.max_position, self.device)
            anchor = torch.empty(0, device=self.device, requires_grad=torch.is_grad_enabled())
            out = self._stage(batch, params, anchor)
            if self.stage < self.S - 1:
                lp = _SendCarry.apply(self, batch.rows.shape[0], anchor, *out)
            else:
                self.broadcast_logprobs(out.detach())  # sent from here: ``out`` keeps its graph
                lp = out
            return list(lp.split(batch.counts))
        counts, lps = [], []
        for m in range(microbatches):
            lo, hi = even_range(n, microbatches, m)
            batch = pack_scored(sequences[lo:hi], prompt_lens[lo:hi], cfg.vocab_size, cfg.max_position, self.device)
            out = self._stage(batch, params[lo:hi], None)
            if self.stage < self.S - 1:
                for x in out:
                    self.send(x, self.stage + 1)
            else:
                lps.append(out)
            counts += batch.counts
        lp = torch.cat(lps) if lps else torch.empty(sum(counts), dtype=torch.float32, device=self.device)
        return list(self.broadcast_logprobs(lp).split(counts))

    def _stage(self, batch, params, anchor):
        """This stage's part of one packed batch: the carry it hands on, or on the last stage the log-probs."""
        trainer, plan = self.trainer, self.plan
        shape = (batch.tokens.shape[0], plan.width)
        if self.stage == 0:
            carry = plan.embed(trainer, batch.tokens)
        elif anchor is None:
            carry = tuple(self.recv(shape, self.stage - 1) for _ in plan.carry)
        else:
            carry = _RecvCarry.apply(self, shape, anchor)
        for i in range(self.lo, self.hi):
            carry = plan.layer(trainer, self.layers[i], carry, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        if self.stage < self.S - 1:
            bad = [(n, tuple(x.shape), x.dtype) for n, x in zip(plan.carry, carry)
                   if x.shape != shape or x.dtype != self.dtype]
            if len(carry) != len(plan.carry) or bad:
                raise RuntimeError(f"stage {self.stage} hands on {bad or len(carry)}, the plan's carry is "
                                   f"{plan.carry}, each {shape} {self.dtype}")
            return carry
        logits = lm_head_logits(plan.head(trainer, carry, batch.rows), trainer.lm_head_weight)
        trainer.tap("lm_head.logits", logits, rows="logits")
        per_row = [p for p, n in zip(params, batch.counts) for _ in range(n)]
        t = params_to_tensors(per_row, [0] * len(per_row), device=logits.device)
        return sampling_logprobs(logits, batch.targets, t["temperature"], t["top_k"], t["top_p"], t["min_p"])

    def reduce_gradients(self) -> None:
        """After ``loss.backward()`` on every rank: a tied LM head's two partials (stage 0's embedding rows,
        the last stage's head) swapped and added, the one-device sum on both; otherwise nothing to do."""
        if not self.tied or self.stage not in (0, self.S - 1):
            return
        w = self.trainer.lm_head_weight
        if w.grad is None:
            return
        other = torch.empty_like(w.grad)
        peer = self.S - 1 if self.stage == 0 else 0
        if self.stage == 0:
            self.send(w.grad, peer)
            dist.recv(other, self._global(peer), group=self.group)
        else:
            dist.recv(other, self._global(peer), group=self.group)
            self.send(w.grad, peer)
        w.grad = w.grad + other
