"""Pipeline parallelism for the trainer: one device's log-probs and gradients, bit for bit.

Stage s of S holds a contiguous range of layers (``stage_ranges``: by default the first L % S stages one
layer longer; or an explicit split of layer counts); stage 0 also holds the embedding, the last stage the
final norm and the LM head.  The forward passes what crosses a layer boundary (``PPPlan.carry``; for qwen3
the pair (x, residual), each (T, H) in the activations' dtype: bf16 rows for a bf16 trainer) from stage s
to s + 1 with a point-to-point send; the last stage forms the FP32 chosen-token log-probs and broadcasts
them, so every rank returns them and the RL code needs no rank logic.  The backward passes the carry's
gradients from s + 1 back to s the same way.

**What equality is delivered (CPU path, what CI proves: ``tests/test_parallel_pp.py``)**

- Forward: the log-probs equal the one-device trainer's (``torch.equal``): every stage runs the one-device
  ops, and the carried rows are sent as they are (no cast).  Every op is row-wise or runs per sequence
  (attention), so a row's bits do not depend on the microbatch that holds it.
- Parameter gradients: every ``.grad`` a stage holds equals the one-device trainer's, bitwise, for any
  number of microbatches M.  With M = 1 each weight's op sees the one-device operands (activations
  forward, output gradient backward), so its own backward forms the one-device dW.  A weight gradient
  summed over microbatches would not be one device's: the CPU matmul's dW is one fp32 chain over all T
  tokens (``matmul/cpu.py``) and a second microbatch's chain would restart at 0
  (``tests/test_parallel_cp.py``'s ``test_token_split_weight_gradient_is_not_one_device``).  So with
  M > 1 (GPipe order, ``_Schedule``) the microbatches form activation gradients only (the stage's
  parameters read frozen), each microbatch's carry gradient flowing back as soon as it is formed, and a
  **weight pass** follows: each stage runs its ops once more on the whole batch (its carry rows and their
  gradients concatenated in sequence order: the one-device packing) and takes the dW of that one
  backward, the one-device op on the one-device operands.  A tied LM head (the embedding read on stage 0
  and on the last stage) is the one gradient split over stages: one device's autograd adds its two reads'
  gradients once (one rounding, and a + b == b + a), so ``reduce_gradients`` swaps the two partials
  between those stages and each forms the same sum.
- CUDA: not proven (no multi-GPU run).  With one microbatch every op sees the one-device shapes, so the
  bits follow wherever a kernel is deterministic for a fixed shape; with M > 1 the microbatches' forward
  and activation gradients see fewer rows, so they keep their bits only on batch-invariant kernels (the
  server's forward is; the trainer's cuBLAS dX, ``matmul.op.backward_mm``, is not known to be).

**Cost.**  Each boundary sends |carry|·T·H·b bytes forward and as much back (2·T·H·2 for qwen3 in bf16),
and the log-probs broadcast 4·R bytes (R scored rows).  With M = 1 the stages run one after another:
S - 1 of S stages wait at any moment, a step takes ≈ S·(f + b) (f, b: one stage's whole-batch forward and
backward).  With M microbatches the forward and the activation backward pipeline, a bubble of
(S-1)/(M+S-1), and the weight pass adds a forward and a backward of the whole batch on every stage at
once (no stage waits on another): ≈ (M+S-1)/M·(f + b_act) + f + b, e.g. ≈ 5.75·f against 12·f at S = 4,
M = 8 (b ≈ 2·f, b_act ≈ f).  Memory: the microbatch graphs hold the whole batch's activations (as M = 1
does), freed as their backward passes, then the weight pass holds the whole batch's graph of the stage;
the carry rows and their gradients, 2·|carry|·T·H·b, wait for the weight pass.  What PP buys is memory:
a stage holds about L/S of the layers' weights, gradients, optimizer state and activations.  Parameters
outside a rank's stage are never read, so they may stay on the ``meta`` device (``held_names``: what a
rank must load).  Scoring under ``torch.no_grad()`` has no weight pass: microbatches cost only the bubble.

The layers run as the trainer built them: LoRA (tested: separate), FP8 projections and activation
checkpointing need nothing of PP.  Not supported yet: multi-adapter LoRA rows and router replay
(``TrainerBase.logprobs``' ``adapters`` and ``replay``).  Per step: one ``logprobs`` with a graph, one
backward of a loss every rank computes alike from the returned log-probs, then ``reduce_gradients``.
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
    """A trainer's forward and backward over S pipeline stages (module docstring).

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
        stage.  microbatches: the sequences cut into that many contiguous groups that flow through the
        stages one behind another, forward and backward (module docstring: the weight pass)."""
        cfg = self.trainer.cfg
        params = sampling_list(sampling, len(sequences))
        n = len(sequences)
        if isinstance(microbatches, bool) or not isinstance(microbatches, int) or not 1 <= microbatches <= max(n, 1):
            raise ValueError(f"microbatches must be an int in [1, {n}] (whole sequences each), got {microbatches!r}")
        if microbatches == 1:
            batch = pack_scored(sequences, prompt_lens, cfg.vocab_size, cfg.max_position, self.device)
            anchor = torch.empty(0, device=self.device, requires_grad=torch.is_grad_enabled())
            carry = None if self.stage == 0 else _RecvCarry.apply(self, self._shape(batch), anchor)
            out = self._stage(batch, params, carry)
            if self.stage < self.S - 1:
                lp = _SendCarry.apply(self, batch.rows.shape[0], anchor, *out)
            else:
                self.broadcast_logprobs(out.detach())  # sent from here: ``out`` keeps its graph
                lp = out
            return list(lp.split(batch.counts))
        spans = [even_range(n, microbatches, m) for m in range(microbatches)]
        batches = [pack_scored(sequences[lo:hi], prompt_lens[lo:hi], cfg.vocab_size, cfg.max_position, self.device)
                   for lo, hi in spans]
        counts = [c for b in batches for c in b.counts]
        trainable = [self.trainer.get_parameter(n) for n in self.held_names]
        trainable = [p for p in trainable if p.requires_grad]
        run = _Schedule(self, batches, [params[lo:hi] for lo, hi in spans], params)
        if not torch.is_grad_enabled():
            return list(run.forward(graph=False).split(counts))
        run.whole = pack_scored(sequences, prompt_lens, cfg.vocab_size, cfg.max_position, self.device)
        anchor = torch.empty(0, device=self.device, requires_grad=True)
        return list(_Microbatched.apply(run, anchor, *trainable).split(counts))

    def _shape(self, batch) -> tuple[int, int]:
        return batch.tokens.shape[0], self.plan.width

    def _stage(self, batch, params, carry):
        """This stage's part of one packed batch from the carry it received (stage 0: None): the carry it
        hands on, or on the last stage the log-probs."""
        trainer, plan = self.trainer, self.plan
        if carry is None:
            carry = plan.embed(trainer, batch.tokens)
        for i in range(self.lo, self.hi):
            carry = plan.layer(trainer, self.layers[i], carry, batch.positions, batch.cu_seqlens, batch.max_seqlen)
        if self.stage < self.S - 1:
            shape = self._shape(batch)
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


class _Schedule:
    """M microbatches through this stage (GPipe order): ``forward`` all of them, activations only (the
    stage's parameters read frozen, so no microbatch forms a weight gradient); ``backward`` passes each
    microbatch's carry gradient back, last microbatch first, then runs the weight pass: the stage's ops
    once on the whole batch (the carry rows and their gradients concatenated in sequence order, which is
    the one-device packing), so every dW is the one-device op on the one-device operands."""

    def __init__(self, pp: PipelineParallel, batches, params, whole_params):
        self.pp, self.batches, self.params, self.whole_params = pp, batches, params, whole_params
        self.whole = None  # the whole batch packed, for the weight pass
        self.saved: list[tuple] = []  # (carry in, out) per microbatch

    def forward(self, graph: bool) -> torch.Tensor:
        pp, lps = self.pp, []
        for batch, params in zip(self.batches, self.params):
            carry = None
            if pp.stage > 0:
                carry = tuple(pp.recv(pp._shape(batch), pp.stage - 1).requires_grad_(graph) for _ in pp.plan.carry)
            with torch.set_grad_enabled(graph):
                out = pp._stage(batch, params, carry)
            if pp.stage < pp.S - 1:
                for x in out:
                    pp.send(x.detach(), pp.stage + 1)
            else:
                lps.append(out.detach())
            if graph:
                self.saved.append((carry, out if pp.stage > 0 else None))  # stage 0 sends no gradient back
        rows = sum(b.rows.shape[0] for b in self.batches)
        lp = torch.cat(lps) if lps else torch.empty(rows, dtype=torch.float32, device=pp.device)
        return pp.broadcast_logprobs(lp)

    def backward(self, dlp: torch.Tensor, trainable) -> tuple:
        pp = self.pp
        last = pp.stage == pp.S - 1
        dlps = dlp.split([b.rows.shape[0] for b in self.batches])
        douts: list = [None] * len(self.batches)
        for m in reversed(range(len(self.batches))):
            carry, out = self.saved[m]
            if last:
                g, out = (dlps[m],), (out,)
            else:
                g = tuple(pp.recv(pp._shape(self.batches[m]), pp.stage + 1) for _ in pp.plan.carry)
            douts[m] = g
            if pp.stage > 0:
                grads = torch.autograd.grad(out, carry, g, allow_unused=True)
                for x, dx in zip(carry, grads):
                    pp.send(torch.zeros_like(x) if dx is None else dx, pp.stage - 1)
            self.saved[m] = (tuple(x.detach() for x in carry) if carry else None, None)
        if not trainable:
            return ()
        carry = None
        if pp.stage > 0:
            carry = tuple(torch.cat([c[i] for c, _ in self.saved]) for i in range(len(pp.plan.carry)))
        with torch.enable_grad():
            out = pp._stage(self.whole, self.whole_params, carry)
            dout = dlp if last else tuple(torch.cat([d[i] for d in douts]) for i in range(len(pp.plan.carry)))
            return torch.autograd.grad(out, trainable, dout, allow_unused=True)


class _Microbatched(torch.autograd.Function):
    """The log-probs of a microbatched step; the backward returns this stage's exact weight gradients
    (``_Schedule``).  The stage's trainable parameters are its inputs, read frozen in the forward."""

    @staticmethod
    def forward(ctx, run, anchor, *trainable):
        ctx.run, ctx.trainable = run, trainable
        for p in trainable:
            p.requires_grad_(False)
        try:
            return run.forward(graph=True)
        finally:
            for p in trainable:
                p.requires_grad_(True)

    @staticmethod
    def backward(ctx, dlp):
        return (None, None, *ctx.run.backward(dlp, ctx.trainable))
