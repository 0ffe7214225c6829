"""MoE routers: router logits (T, E) -> (weights (T, k), ids (T, k) int64).

The gate projection is the caller's fixed-K matmul
(``alignzoo.common.matmul.matmul`` / ``matmul_fwd``); a router sees only its
logits.  Every router returns its k selected experts in *probability order*:
slot 0 holds the largest router probability (the score before
normalization: softmax p, sigmoid s or sqrt-softplus s), ties to the smaller
expert id, so every later sum over slots visits them in one order and the
weights are non-increasing along the slots.

Why the bits do not depend on the batch, on the CPU and on CUDA alike: a
router is a sequence of element-wise torch ops (``exp``, ``log1p``,
``sqrt``, ``+ - * /``, ``maximum``, ``where``, ``gather``) on slices whose
pairing is fixed by E and k, never by T; selections are int64 sorts of
distinct keys; nothing reads a value on the host and every shape is static,
so the same code runs inside a CUDA graph.  On CUDA the server's softmax
router is one Triton launch that repeats these rules lane for lane
(``router_kernel.py``, the same bits; the trainer, forming a gradient, runs
the torch ops).

* Reductions over E: one pairwise tree over the last dim padded to a power
  of two with the identity (-inf for max, +0.0 for sums of values >= 0),
  level by level x[2i] op x[2i+1] (``tree_max``, ``tree_sum``).
* Reductions over the k slots: left to right, ((w0 + w1) + w2) + ...
  (``slot_sum``).
* Selection: ``alignzoo.common.sampling.rules.order_keys`` maps fp32 values
  to int64 keys, ascending = "value descending, then id ascending", distinct
  within a row; the k smallest keys (``torch.topk(largest=False)``) are the
  unique answer of any correct algorithm.
* Scores: torch 2.13's CPU ``torch.sigmoid`` and ``F.softplus`` can give an
  element other bits in a short slice (a vector tail) than inside a long
  tensor, ``exp``/``log1p``/``sqrt``/``reciprocal`` do not, so both are
  written here from the latter: ``sigmoid_fp32``, ``sqrtsoftplus_fp32``
  (tests/test_moe_router.py keeps checking them).

Layers: those rules -> ``*_fwd`` launchers (no validation: the server's
path) -> autograd (plain torch autograd through the element-wise ops, two
``autograd.Function`` for the score functions; selections carry no
gradient) -> the public routers (input checks, shapes).  ``router_weights``
recomputes a router's weights at given slots, and ``router_replay`` puts the
server's replayed routing in place of the trainer's own.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..sampling.rules import key_ids, order_keys
from ..tree.cpu import left_to_right, pairwise_tree

SCORINGS = ("softmax", "sigmoid", "sqrtsoftplus")
REPLAY_MODES = ("frozen", "straight-through")
NORM_EPS = 1e-20  # transformers' sum + 1e-20 (GLM-5, DeepSeek-V4), rounded to fp32 at the add
SOFTPLUS_THRESHOLD = 20.0  # F.softplus's default (beta 1): x above it is returned as is
_INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ExpertShape:
    """One real checkpoint's MoE shape, read from transformers' config defaults."""

    config: str  # transformers config class whose defaults these are
    scoring: str  # the router's score function (SCORINGS)
    num_experts: int
    top_k: int
    n_group: int  # expert groups for group-limited routing (1: none)
    topk_group: int
    routed_scaling_factor: float
    hidden_size: int
    moe_intermediate_size: int
    n_shared_experts: int
    shared_intermediate_size: int
    hash_layers: int  # leading MoE layers routed by tid2eid[input_ids]


EXPERT_SHAPES = {
    "Qwen3.5-35B-A3B": ExpertShape("Qwen3_5MoeTextConfig", "softmax", 256, 8, 1, 1, 1.0, 2048, 512, 1, 512, 0),
    "GLM-5": ExpertShape("GlmMoeDsaConfig", "sigmoid", 256, 8, 1, 1, 2.5, 6144, 2048, 1, 2048, 0),
    "DeepSeek-V4-Flash": ExpertShape("DeepseekV4Config", "sqrtsoftplus", 256, 6, 1, 1, 1.5, 4096, 2048, 1, 2048, 3),
}


# ---------------------------------------------------------------- rules: fixed-order element-wise pieces


def tree_max(x: torch.Tensor) -> torch.Tensor:
    """Max over the last dim by the fixed tree, -inf padding (a max is exact in any order; the tree keeps it element-wise)."""
    return pairwise_tree(x, torch.maximum, -1, float("-inf"))


def tree_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum of values >= 0 over the last dim by the fixed pairwise tree, +0.0 padding (x + 0.0 == x)."""
    return pairwise_tree(x, torch.add, -1, 0.0)


def slot_sum(w: torch.Tensor) -> torch.Tensor:
    """(T, k, ...) -> (T, ...): ((w0 + w1) + w2) + ..., left to right over the slots (dim 1),
    element-wise in w's dtype (the router's (T, k) weights, the experts' (T, k, H) contributions)."""
    return left_to_right(w)


def softmax_fp32(x: torch.Tensor) -> torch.Tensor:
    """(T, E) fp32 -> (T, E): p = fl(e / S), e = fl(exp(fl(x - m))), m = tree_max(x)
    (detached: softmax does not depend on the shift), S = tree_sum(e)."""
    m = tree_max(x.detach()).unsqueeze(-1)
    e = torch.exp(x - m)
    return e / tree_sum(e).unsqueeze(-1)


def sigmoid_fp32(x: torch.Tensor) -> torch.Tensor:
    """fl(1 / fl(1 + fl(exp(-x)))), element-wise; 0.0 where exp(-x) overflows (x < -88.7)."""
    return torch.reciprocal(torch.exp(-x) + 1.0)


def sqrtsoftplus_fp32(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)) as transformers' ACT2FN["sqrtsoftplus"] (F.softplus, beta 1,
    threshold 20): fl(sqrt(x)) above 20, else fl(sqrt(fl(log1p(fl(exp(x))))))."""
    return torch.sqrt(torch.where(x > SOFTPLUS_THRESHOLD, x, torch.log1p(torch.exp(x))))


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        s = sigmoid_fp32(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g * (s * (1.0 - s))


class _SqrtSoftplus(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        r = sqrtsoftplus_fp32(x)
        ctx.save_for_backward(x, r)
        return r

    @staticmethod
    def backward(ctx, g):
        x, r = ctx.saved_tensors
        z = torch.exp(x)
        dsp = torch.where(x > SOFTPLUS_THRESHOLD, torch.ones_like(x), z / (z + 1.0))  # softplus' = sigmoid
        # r == 0 only where exp(x) underflows (x < -103.9): the true slope e^(x/2)/2 is below 1e-22
        return torch.where(r > 0, g * (dsp / (r + r)), torch.zeros_like(g))


def router_scores(x: torch.Tensor, scoring: str) -> torch.Tensor:
    """(T, E) fp32 logits -> (T, E) fp32 router probabilities, differentiable."""
    if scoring == "softmax":
        return softmax_fp32(x)
    if scoring == "sigmoid":
        return _Sigmoid.apply(x)
    return _SqrtSoftplus.apply(x)


def _smallest(keys: torch.Tensor, k: int) -> torch.Tensor:
    """The k smallest of distinct int64 keys along the last dim, ascending."""
    return torch.topk(keys, k, dim=-1, largest=False, sorted=True).values


def _in_probability_order(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Reorder (T, k) slots by the router probability, descending, ties to the smaller id."""
    return key_ids(torch.sort(order_keys(scores.detach()).gather(1, ids), dim=-1).values)


def _weight_dtype(scoring: str, logits_dtype: torch.dtype) -> torch.dtype:
    return logits_dtype if scoring == "softmax" else torch.float32


def _weights_at(scores, ids, scoring, normalize, scale, dtype):
    """Weights of the (T, k) slots in their order: softmax p / slot_sum(p), cast to
    ``dtype``; sigmoid / sqrt-softplus fl(fl(s / fl(slot_sum(s) + 1e-20)) * scale) in fp32."""
    w = scores.gather(1, ids)
    if scoring == "softmax":
        if normalize:
            w = w / slot_sum(w).unsqueeze(-1)
        return w.to(dtype)
    if normalize:
        w = w / (slot_sum(w) + NORM_EPS).unsqueeze(-1)
    return w * scale


def _group_limited(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """-inf on the experts outside the top ``topk_group`` groups; a group's score is
    its two largest choice scores (order-free: the 2 smallest keys) added larger + smaller."""
    T, E = choice.shape
    keys = order_keys(choice).view(T, n_group, E // n_group)  # global expert ids: distinct within a group
    top2 = key_ids(_smallest(keys, 2)).view(T, 2 * n_group)
    pair = choice.gather(1, top2).view(T, n_group, 2)
    group_keys = order_keys(pair[..., 0] + pair[..., 1])  # (T, G): ties to the smaller group id
    last = _smallest(group_keys, topk_group)[:, -1:]
    keep = (group_keys <= last).unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)
    return torch.where(keep, choice, torch.full_like(choice, float("-inf")))


def _biased_topk(s, bias, top_k, n_group=1, topk_group=1):
    """ids (T, k): top-k of s + bias (group-limited when n_group > 1), in the order of s."""
    choice = s.detach() if bias is None else s.detach() + bias
    if n_group > 1:
        choice = _group_limited(choice, n_group, topk_group)
    ids = key_ids(_smallest(order_keys(choice), top_k))
    return _in_probability_order(s, ids)


# ---------------------------------------------------------------- launchers (the server calls these)


def softmax_topk_fwd(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3.5's router without input checks.  (T, E) -> ((T, k) logits.dtype, (T, k) int64).
    On CUDA one Triton launch of the same bits (``router_kernel``), the trainer's included: with a
    gradient to form, ``_SoftmaxTopK`` runs the same forward and a closed-form backward."""
    if torch.is_grad_enabled() and logits.requires_grad:
        return _SoftmaxTopK.apply(logits, top_k, normalize)
    if logits.is_cuda:
        from .router_kernel import softmax_topk_triton

        return softmax_topk_triton(logits, top_k, normalize)
    return softmax_topk_torch(logits, top_k, normalize)


def softmax_topk_torch(logits: torch.Tensor, top_k: int, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The softmax router as torch ops on any device: the CPU's path, and the statement the CUDA
    kernel is tested against."""
    p = softmax_fp32(logits.float())
    ids = key_ids(_smallest(order_keys(p.detach()), top_k))
    return _weights_at(p, ids, "softmax", normalize, 1.0, logits.dtype), ids


class _SoftmaxTopK(torch.autograd.Function):
    """The softmax router's forward (``softmax_topk_fwd``'s bits, one launch on CUDA) and the gradient
    of w = p[ids] / sum_j p[ids_j] (p = softmax(x), fp32) in closed form, a dozen ops instead of
    autograd through the trees (~180 a layer, forward and backward, at Qwen3.5's 256 experts):

        d sel = (dw - sum_j dw_j w_j) / D   (normalize; else dw),   dx = p * (dp - sum_j d sel_j sel_j)

    with dp the scatter of d sel to the picked experts.  The selection has no gradient."""

    @staticmethod
    def forward(ctx, logits, top_k, normalize):
        with torch.no_grad():
            w, ids = softmax_topk_fwd(logits, top_k, normalize)
        ctx.save_for_backward(logits, ids)
        ctx.normalize = normalize
        ctx.mark_non_differentiable(ids)
        return w, ids

    @staticmethod
    def backward(ctx, dw, _):
        logits, ids = ctx.saved_tensors
        p = torch.softmax(logits.float(), -1)
        sel = p.gather(1, ids)
        d_sel = dw.float()
        if ctx.normalize:
            den = sel.sum(-1, keepdim=True)
            d_sel = (d_sel - (d_sel * sel).sum(-1, keepdim=True) / den) / den
        dp = torch.zeros_like(p).scatter_(1, ids, d_sel)
        return (p * (dp - (d_sel * sel).sum(-1, keepdim=True))).to(logits.dtype), None, None


def sigmoid_topk_fwd(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GLM-5's router without input checks.  (T, E) -> ((T, k) fp32, (T, k) int64)."""
    s = _Sigmoid.apply(logits.float())
    ids = _biased_topk(s, bias, top_k, n_group, topk_group)
    return _weights_at(s, ids, "sigmoid", normalize, routed_scaling_factor, torch.float32), ids


def sqrtsoftplus_topk_fwd(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's learned router without input checks.  (T, E) -> ((T, k) fp32, (T, k) int64)."""
    s = _SqrtSoftplus.apply(logits.float())
    ids = _biased_topk(s, bias, top_k)
    return _weights_at(s, ids, "sqrtsoftplus", True, routed_scaling_factor, torch.float32), ids


def hash_route_fwd(
    logits: torch.Tensor, input_ids: torch.Tensor, tid2eid: torch.Tensor, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's hash router without input checks.  (T, E), (T,), (V, k) -> ((T, k) fp32, (T, k) int64)."""
    s = _SqrtSoftplus.apply(logits.float())
    ids = _in_probability_order(s, tid2eid.index_select(0, input_ids.reshape(-1)).long())
    return _weights_at(s, ids, "sqrtsoftplus", True, routed_scaling_factor, torch.float32), ids


def router_weights_fwd(
    logits: torch.Tensor, ids: torch.Tensor, scoring: str, routed_scaling_factor: float = 1.0, normalize: bool = True
) -> torch.Tensor:
    """The weights a router gives the (T, k) slots ``ids``, in their order, without input checks."""
    s = router_scores(logits.float(), scoring)
    return _weights_at(s, ids.long(), scoring, normalize, routed_scaling_factor, _weight_dtype(scoring, logits.dtype))


# ---------------------------------------------------------------- public routers (trainer side: checks + autograd)


def _check_logits(logits: torch.Tensor) -> tuple[int, int]:
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim=2)
    if logits.shape[1] < 1:
        raise ValueError(f"logits must have shape (T, E) with E >= 1, got {tuple(logits.shape)}")
    return logits.shape


def _check_int(name: str, v, lo: int, hi: int) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or not lo <= v <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {v!r}")


def _check_scale(v) -> None:
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"routed_scaling_factor must be a finite real number > 0, got {v!r}")


def _check_bias(bias: torch.Tensor | None, logits: torch.Tensor) -> None:
    if bias is None:
        return
    check_tensor("bias", bias, dtypes=(torch.float32,), ndim=1)
    if bias.shape[0] != logits.shape[1]:
        raise ValueError(f"bias must have shape (E,) = ({logits.shape[1]},), got {tuple(bias.shape)}")
    check_same_device(logits=logits, bias=bias)


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k router (Qwen3.5, transformers' ``Qwen3_5MoeTopKRouter``).

    logits: (T, E) bf16 or fp32 -> weights (T, k) in logits.dtype, ids (T, k) int64,
    in probability order.  Rounding points, all FP32 until the last:
    m = tree_max(x); e = fl(exp(fl(x - m))); S = tree_sum(e) (pairwise over E
    padded to a power of two); p = fl(e / S); the k smallest ``order_keys(p)``;
    with ``normalize`` (a config's norm_topk_prob; Qwen3.5 always) w = fl(p / D),
    D = slot_sum(p) left to right over the slots; one cast to logits.dtype.
    Differentiable w.r.t. logits (the selection is not).
    """
    T, E = _check_logits(logits)
    _check_int("top_k", top_k, 1, E)
    return softmax_topk_fwd(logits, int(top_k), bool(normalize))


def sigmoid_topk(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    top_k: int,
    *,
    n_group: int = 1,
    topk_group: int = 1,
    routed_scaling_factor: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid router with a selection-only correction bias (GLM-5, ``GlmMoeDsaTopkRouter``).

    logits: (T, E) bf16 or fp32; bias: (E,) fp32 ``e_score_correction_bias`` or None
    -> weights (T, k) fp32, ids (T, k) int64, in the order of the unbiased s.
    s = ``sigmoid_fp32(x)``; choice c = fl(s + bias).  With ``n_group`` > 1 the E
    experts form n_group consecutive groups; a group's score is fl(c1 + c2) of
    its two largest c (found as its 2 smallest keys: no order to fix), the top
    ``topk_group`` groups by score are kept (ties to the smaller group id) and
    the others' c set to -inf.  ids = the k smallest ``order_keys(c)``, reordered
    by ``order_keys(s)``.  w = fl(fl(s / fl(slot_sum(s) + 1e-20)) * scale), the
    sum left to right over the reordered slots (without ``normalize``:
    fl(s * scale)); kept in FP32.  Differentiable w.r.t. logits.
    """
    T, E = _check_logits(logits)
    _check_bias(bias, logits)
    _check_int("n_group", n_group, 1, E)
    if E % n_group:
        raise ValueError(f"n_group={n_group} must divide the number of experts E={E}")
    _check_int("topk_group", topk_group, 1, n_group)
    if n_group > 1 and E // n_group < 2:
        raise ValueError(f"group-limited routing needs >= 2 experts per group, got E={E}, n_group={n_group}")
    _check_int("top_k", top_k, 1, E if n_group == 1 else topk_group * (E // n_group))
    _check_scale(routed_scaling_factor)
    return sigmoid_topk_fwd(logits, bias, int(top_k), int(n_group), int(topk_group), float(routed_scaling_factor), bool(normalize))


def sqrtsoftplus_topk(
    logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, *, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sqrt-softplus router with a selection-only bias (DeepSeek-V4, ``DeepseekV4TopKRouter``).

    logits: (T, E) bf16 or fp32; bias: (E,) fp32 or None -> weights (T, k) fp32,
    ids (T, k) int64, in the order of the unbiased s.  s = ``sqrtsoftplus_fp32(x)``;
    ids = the k smallest ``order_keys(fl(s + bias))``, reordered by
    ``order_keys(s)``; w = fl(fl(s / fl(slot_sum(s) + 1e-20)) * scale), the sum
    left to right over the reordered slots; FP32.  Differentiable w.r.t. logits.
    """
    T, E = _check_logits(logits)
    _check_bias(bias, logits)
    _check_int("top_k", top_k, 1, E)
    _check_scale(routed_scaling_factor)
    return sqrtsoftplus_topk_fwd(logits, bias, int(top_k), float(routed_scaling_factor))


def hash_route(
    logits: torch.Tensor, input_ids: torch.Tensor, tid2eid: torch.Tensor, *, routed_scaling_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Hash router (DeepSeek-V4's first layers, ``DeepseekV4HashRouter``).

    logits: (T, E) bf16 or fp32; input_ids: (T,) int; tid2eid: (V, k) int -> weights
    (T, k) fp32, ids (T, k) int64.  The experts are tid2eid[input_ids]; the
    logits give only the weights: s = ``sqrtsoftplus_fp32(x)``, the slots
    reordered by ``order_keys(s)`` (descending s, ties to the smaller id),
    w = fl(fl(s / fl(slot_sum(s) + 1e-20)) * scale) left to right over them; FP32.
    An id past V or a table entry past E fails in the gather, as in transformers.
    Differentiable w.r.t. logits.
    """
    T, E = _check_logits(logits)
    check_tensor("input_ids", input_ids, dtypes=_INDEX_DTYPES, ndim=1)
    check_tensor("tid2eid", tid2eid, dtypes=_INDEX_DTYPES, ndim=2)
    if input_ids.shape[0] != T:
        raise ValueError(f"input_ids must have shape (T,) = ({T},), got {tuple(input_ids.shape)}")
    _check_int("tid2eid's k", tid2eid.shape[1], 1, E)
    check_same_device(logits=logits, input_ids=input_ids, tid2eid=tid2eid)
    _check_scale(routed_scaling_factor)
    return hash_route_fwd(logits, input_ids, tid2eid, float(routed_scaling_factor))


def _check_slots(name: str, t: torch.Tensor, dtypes, T: int, k: int | None = None) -> None:
    check_tensor(name, t, dtypes=dtypes, ndim=2)
    if t.shape[0] != T or (k is not None and t.shape[1] != k) or t.shape[1] < 1:
        want = f"({T}, {k})" if k is not None else f"({T}, k >= 1)"
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def _check_scoring(scoring: str) -> None:
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


def router_weights(
    logits: torch.Tensor, ids: torch.Tensor, scoring: str, *, routed_scaling_factor: float = 1.0, normalize: bool = True
) -> torch.Tensor:
    """The weights a router gives the slots ``ids`` (T, k), in the order given.

    scoring: "softmax" (Qwen3.5; ``routed_scaling_factor`` unused), "sigmoid"
    (GLM-5) or "sqrtsoftplus" (DeepSeek-V4, learned and hash) -> (T, k) in the
    router's dtype (logits.dtype for softmax, else fp32), with the router's
    rounding points; at the router's own ids, the router's weights bitwise.
    """
    T, E = _check_logits(logits)
    _check_scoring(scoring)
    _check_slots("ids", ids, _INDEX_DTYPES, T)
    check_same_device(logits=logits, ids=ids)
    _check_scale(routed_scaling_factor)
    return router_weights_fwd(logits, ids, scoring, float(routed_scaling_factor), bool(normalize))


def router_replay(
    logits: torch.Tensor,
    replay_ids: torch.Tensor,
    replay_weights: torch.Tensor,
    *,
    mode: str,
    scoring: str,
    routed_scaling_factor: float = 1.0,
    normalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router replay (Total Router Recall): the server's routing in place of the trainer's.

    logits: (T, E), the trainer router's own logits; replay_ids (T, k) int32/int64
    and replay_weights (T, k) float: the server's ids* and weights*, in its slot
    order -> (weights (T, k) in the router's dtype, ids* (T, k) int64).

    * ``"frozen"``: (w*, ids*), w* cast to the router's dtype (exact when w*
      came from the same router); nothing is differentiated: no gradient
      reaches the logits.
    * ``"straight-through"``: w = ``router_weights(logits, ids*, scoring)``, the
      trainer's own probabilities gathered at ids* and renormalized as the
      router does (the slot sum left to right in the server's slot order);
      returns fl(fl(w - sg[w]) + w*) = w* bitwise for finite w (w - sg[w] is
      +0.0).  What is differentiated: d out / d logits = d w / d logits, w
      the renormalized weights at ids* (an upstream g reaches the logits as
      w's backward of g, bitwise); w* and ids* carry no gradient.

    The logits are needed because ids* may name experts outside the trainer's
    own top-k, whose weights its (weights, ids) do not hold.
    """
    T, E = _check_logits(logits)
    _check_scoring(scoring)
    if mode not in REPLAY_MODES:
        raise ValueError(f"mode must be one of {REPLAY_MODES}, got {mode!r}")
    _check_slots("replay_ids", replay_ids, _INDEX_DTYPES, T)
    _check_slots("replay_weights", replay_weights, (torch.bfloat16, torch.float32), T, replay_ids.shape[1])
    check_same_device(logits=logits, replay_ids=replay_ids, replay_weights=replay_weights)
    _check_scale(routed_scaling_factor)
    ids = replay_ids.long()
    w_star = replay_weights.detach().to(_weight_dtype(scoring, logits.dtype))
    if mode == "frozen":
        return w_star, ids
    w = router_weights_fwd(logits, ids, scoring, float(routed_scaling_factor), bool(normalize))
    return (w - w.detach()) + w_star, ids
