"""LoRA on a bias-free linear layer: merged, separate and multi-adapter modes.

A layer with frozen base weight W (N, K) carries an adapter A (r, K), B (N, r)
and a scale s = lora_alpha / r: y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ.  Every product goes
through the batch-invariant ``matmul_fwd`` (or its fixed-order CPU core), every
other step is element-wise, so output row i depends only on row i of x.

Each mode has a ``*_fwd`` launcher (the server: no checks, run under no_grad) and a
public differentiable function (the trainer).  Both run one body; only the
linear differs (``matmul_fwd`` itself, or ``matmul``'s autograd, whose forward is
``matmul_fwd``), so the two sides get the same bits by construction.

Rounding points (x, W, A, B share one dtype; ``s`` is rounded to fp32 once):

* merged   delta = fp32(B·A), summed over r left to right (``fixed_order_dot``:
           element-wise IEEE ops, the same bits on CPU and CUDA);
           d = fp32(s · delta);  W' = dtype(fp32(W) + d), and W's element
           itself where d == 0 (B = 0 leaves W's bits, signed zeros too);
           y = matmul_fwd(x, W').
* separate base = matmul_fwd(x, W), t = matmul_fwd(x, A), u = matmul_fwd(t, B),
           each rounded once to dtype by the matmul;
           y = dtype(fp32(base) + fp32(s · fp32(u)))  (multiply, add, round).
* multi    every row runs through each adapter j's separate-mode arithmetic
           (A[j], B[j], s[j]: the rounding points above), and
           ``torch.where(idx == j, branch_j, out)`` keeps, per row, its own
           adapter's result (a copy, no arithmetic); rows with index -1 keep
           ``base``.  Row invariance of the matmul makes row i equal to the
           separate mode with its own adapter, bit for bit.  Shapes never
           depend on ``idx`` and nothing reads it on the host, so decode can
           be captured in a CUDA graph with idx a static input; the price is
           J branches over all M rows (each r·(K + N) multiply-adds a row,
           against the base's N·K: 3% of it at r = 16, K = N = 1024).

Backward (deterministic run to run; every product in matmul's fixed order):
separate/multi differentiate through ``matmul``'s autograd (dX = dY·W, dW = dYᵀ·X, each
rounded once to dtype, formed only when needed) and the element-wise combine
(the branch gets dtype(fp32(s) · fp32(dY))); multi's ``torch.where`` hands
adapter j's branch dY on its own rows and exact zeros elsewhere.  Merged: dW' = dYᵀ·X from
``matmul``, then dA = dtype(s · dtype(Bᵀ·dW')), dB = dtype(s · dtype(dW'·Aᵀ)).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..matmul import fixed_order_dot, matmul_fwd
from ..matmul.op import _Matmul

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The differentiable row-invariant linear (dW only when w needs it)."""
    return _Matmul.apply(x, w)


def fp32_scale(scale: float) -> float:
    """The Python float holding fp32(scale): what every side multiplies by."""
    return torch.tensor(float(scale), dtype=torch.float32).item()


# --------------------------------------------------------------------------- merged


@torch.no_grad()
def lora_merge_fwd(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """W' = dtype(fp32(W) + fp32(s · fp32(B·A))), W's element where the added
    term is exactly zero.  w: (N, K), a: (r, K), b: (N, r) -> (N, K) in w.dtype.

    B·A is summed over r left to right with element-wise fp32 ops
    (``fixed_order_dot``), so W' has the same bits on CPU and CUDA.
    """
    d = fixed_order_dot(b, a.t())  # (N, K) fp32
    d.mul_(fp32_scale(scale))
    w32 = w.float()
    return torch.where(d == 0, w32, w32 + d).to(w.dtype)


def _merge_bwd(dw_m: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float):
    """dA = s·Bᵀ·dW' (sum over N), dB = s·dW'·Aᵀ (sum over K): each product
    rounded to dtype by ``matmul_fwd``, then fp32(s ·) and one more rounding."""
    s = fp32_scale(scale)
    da = (matmul_fwd(b.t(), dw_m.t()).float() * s).to(a.dtype)  # (r, N)·(K, N)ᵀ -> (r, K)
    db = (matmul_fwd(dw_m, a).float() * s).to(b.dtype)  # (N, K)·(r, K)ᵀ -> (N, r)
    return da, db


class _MergedWeight(torch.autograd.Function):
    """Hands out an already merged W' and routes dW' to A and B (and W:
    straight through the rounding).  W' is an input, so the same cached tensor
    can serve many forwards: autograd returns it as a fresh alias each time."""

    @staticmethod
    def forward(ctx, w_m, w, a, b, scale):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return w_m

    @staticmethod
    def backward(ctx, dw_m):
        a, b = ctx.saved_tensors
        dw_m = dw_m.contiguous()
        need_w, need_a, need_b = ctx.needs_input_grad[1:4]
        da = db = None
        if need_a or need_b:
            da, db = _merge_bwd(dw_m, a, b, ctx.scale)
        return None, dw_m if need_w else None, da if need_a else None, db if need_b else None, None


def _check_ab(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype, N: int, K: int) -> None:
    check_tensor("lora_A", a, dtypes=(dtype,), ndim=2)
    check_tensor("lora_B", b, dtypes=(dtype,), ndim=2)
    check_same_device(lora_A=a, lora_B=b)
    r = a.shape[0]
    if r < 1 or a.shape[1] != K:
        raise ValueError(f"lora_A has shape {tuple(a.shape)}, expected (r, {K}) with r >= 1")
    if tuple(b.shape) != (N, r):
        raise ValueError(f"lora_B has shape {tuple(b.shape)}, expected ({N}, {r}): N outputs, rank r={r} from lora_A")


def _check_adapter(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2)
    _check_ab(a, b, w.dtype, *w.shape)
    check_same_device(w=w, lora_A=a)
    _check_scale(scale)


def _check_scale(scale) -> None:
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale != scale or abs(scale) == float("inf"):
        raise ValueError(f"scale must be a finite real number (lora_alpha / r), got {scale!r}")


def lora_merge(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
               merged: torch.Tensor | None = None) -> torch.Tensor:
    """Merged LoRA weight W' = W + s·B·A (rounding: ``lora_merge_fwd``), with
    autograd to A and B (and to W if it requires grad).

    w: (N, K), a: (r, K), b: (N, r), one float dtype -> (N, K).  ``merged``: a
    W' already built by ``lora_merge_fwd`` for exactly these tensors (what
    ``MergedLoRACache`` passes), used instead of merging again.
    """
    _check_adapter(w, a, b, scale)
    scale = float(scale)
    if merged is None:
        merged = lora_merge_fwd(w, a, b, scale)
    return _MergedWeight.apply(merged, w, a, b, scale)


# --------------------------------------------------------------------------- separate


def _combine(base: torch.Tensor, u: torch.Tensor, scale: float) -> torch.Tensor:
    """dtype(fp32(base) + fp32(s · fp32(u))): two fp32 roundings, then one to dtype."""
    return (base.float() + u.float() * scale).to(base.dtype)


def _add_body(base, x, a, b, scale, linear: Linear):
    u = linear(linear(x, a), b)  # (M, r) -> (M, N)
    return _combine(base, u, scale)


@torch.no_grad()
def lora_add_fwd(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """y = dtype(fp32(base) + fp32(s · u)), u = (x·Aᵀ)·Bᵀ by two ``matmul_fwd``.

    base: (M, N) (may be a column slice of a fused projection), x: (M, K)
    contiguous, a: (r, K), b: (N, r) -> (M, N) in base.dtype.
    """
    return _add_body(base, x, a, b, fp32_scale(scale), matmul_fwd)


@torch.no_grad()
def lora_linear_separate_fwd(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """Server launcher of ``lora_linear_separate``.  x: (M, K) -> (M, N)."""
    return _add_body(matmul_fwd(x, w), x, a, b, fp32_scale(scale), matmul_fwd)


def _check_rows(x: torch.Tensor, w: torch.Tensor) -> None:
    check_tensor("x", x, dtypes=(w.dtype,), ndim=2)
    check_same_device(x=x, w=w)
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but w has shape {tuple(w.shape)} (expected (N, {x.shape[1]}))")


def _check_base(base: torch.Tensor, x: torch.Tensor, n: int) -> None:
    check_tensor("base", base, dtypes=(x.dtype,), ndim=2, contiguous=False)
    check_same_device(base=base, x=x)
    if tuple(base.shape) != (x.shape[0], n):
        raise ValueError(f"base has shape {tuple(base.shape)}, expected ({x.shape[0]}, {n})")


def lora_add(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """Add a LoRA branch to an existing projection output, with autograd.

    base: (M, N) = the base layer's output for x (e.g. the q columns of a
    fused qkv projection), x: (M, K) contiguous, a: (r, K), b: (N, r), one
    dtype -> (M, N).  Rounding: ``lora_add_fwd``; gradients reach base, x, A, B.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("base", base, dtypes=(x.dtype,), ndim=2, contiguous=False)
    _check_ab(a, b, x.dtype, base.shape[1], x.shape[1])
    _check_base(base, x, base.shape[1])
    check_same_device(x=x, lora_A=a)
    _check_scale(scale)
    return _add_body(base, x, a, b, fp32_scale(scale), _linear)


def lora_linear_separate(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """Unmerged LoRA linear y = dtype(fp32(x·Wᵀ) + fp32(s · (x·Aᵀ)·Bᵀ)), with
    autograd to x, A, B (and W only if it requires grad).

    x: (M, K) contiguous, w: (N, K), a: (r, K), b: (N, r), one dtype -> (M, N).
    Rounding points: module docstring, "separate".
    """
    _check_adapter(w, a, b, scale)
    _check_rows(x, w)
    return _add_body(_linear(x, w), x, a, b, fp32_scale(scale), _linear)


# --------------------------------------------------------------------------- multi


def _multi_body(base, x, idx, a_n, b_n, scales: Sequence[float], linear: Linear):
    """Static shapes, no host read of ``idx`` (CUDA-graph safe): every row goes
    through each adapter's branch, and ``torch.where`` keeps the row's own."""
    out = base  # (M, N)
    for j, (a, b, s) in enumerate(zip(a_n, b_n, scales)):
        if a is not None:
            out = torch.where((idx == j).unsqueeze(1), _add_body(base, x, a, b, s, linear), out)
    return out


def _scales(scales, n: int) -> list[float]:
    vals = scales.tolist() if isinstance(scales, torch.Tensor) else list(scales)
    if len(vals) != n:
        raise ValueError(f"scales has {len(vals)} entries, expected one per adapter ({n})")
    for v in vals:
        _check_scale(v)
    return [fp32_scale(v) for v in vals]


@torch.no_grad()
def lora_add_multi_fwd(base, x, idx, a_n, b_n, scales) -> torch.Tensor:
    """Server launcher of ``lora_add_multi``: no checks and no host read of
    ``idx`` (rows whose index names no adapter keep ``base``).  Give
    ``scales`` as Python floats inside a CUDA-graph capture."""
    return _multi_body(base, x, idx, a_n, b_n, _scales(scales, len(a_n)), matmul_fwd)


@torch.no_grad()
def lora_linear_multi_fwd(x, w, idx, a_n, b_n, scales) -> torch.Tensor:
    """Server launcher of ``lora_linear_multi``."""
    return _multi_body(matmul_fwd(x, w), x, idx, a_n, b_n, _scales(scales, len(a_n)), matmul_fwd)


def _check_multi(x, n_out, idx, a_n, b_n) -> None:
    check_tensor("idx", idx, dtypes=(torch.int64,), ndim=1)
    check_same_device(x=x, idx=idx)
    if idx.shape[0] != x.shape[0]:
        raise ValueError(f"idx has {idx.shape[0]} entries, expected one per row of x ({x.shape[0]})")
    if isinstance(a_n, torch.Tensor) or isinstance(b_n, torch.Tensor):
        check_tensor("lora_A", a_n, dtypes=(x.dtype,), ndim=3)
        check_tensor("lora_B", b_n, dtypes=(x.dtype,), ndim=3)
        if b_n.shape[0] != a_n.shape[0] or b_n.shape[2] != a_n.shape[1]:
            raise ValueError(f"lora_B has shape {tuple(b_n.shape)}, expected ({a_n.shape[0]}, {n_out}, "
                             f"{a_n.shape[1]}): stacked adapters need the same rank r (stack_adapters pads smaller ones; "
                             f"or pass lists)")
    elif len(a_n) != len(b_n):
        raise ValueError(f"{len(a_n)} lora_A but {len(b_n)} lora_B: give one of each per adapter")
    for j, (a, b) in enumerate(zip(a_n, b_n)):
        if (a is None) != (b is None):
            raise ValueError(f"adapter {j}: lora_A and lora_B must both be tensors or both None")
        if a is not None:
            try:
                _check_ab(a, b, x.dtype, n_out, x.shape[1])
                check_same_device(x=x, lora_A=a)
            except (TypeError, ValueError) as e:
                raise type(e)(f"adapter {j}: {e}") from None
    bad = ((idx < -1) | (idx >= len(a_n))).nonzero()  # a host read: the trainer is never graph-captured
    if bad.numel():
        raise IndexError(f"adapter index {int(idx[bad[0, 0]])} out of range: {len(a_n)} adapters, -1 means none")


def lora_add_multi(base, x, idx, a_n, b_n, scales) -> torch.Tensor:
    """``lora_add`` with one adapter per row, with autograd.

    base: (M, N), x: (M, K) contiguous, idx: (M,) int64 in [-1, J) (-1: no
    adapter, the row is ``base``); a_n, b_n: J adapters, either stacked
    (J, r, K) and (J, N, r) tensors of one rank, or sequences of J (r_j, K)
    and (N, r_j) tensors, where None (in both) means adapter j has no branch
    here and its rows keep ``base``; scales: J floats (or a (J,) tensor) -> (M, N).
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("base", base, dtypes=(x.dtype,), ndim=2, contiguous=False)
    _check_base(base, x, base.shape[1])
    _check_multi(x, base.shape[1], idx, a_n, b_n)
    return _multi_body(base, x, idx, a_n, b_n, _scales(scales, len(a_n)), _linear)


def lora_linear_multi(x, w, idx, a_n, b_n, scales) -> torch.Tensor:
    """Multi-LoRA linear: row i is ``lora_linear_separate(x[i], w, a_n[j],
    b_n[j], scales[j])`` with j = idx[i] (bit for bit), or x[i]·Wᵀ for j = -1.

    x: (M, K) contiguous, w: (N, K), idx: (M,) int64; a_n, b_n, scales: as
    ``lora_add_multi`` -> (M, N).
    """
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2)
    _check_rows(x, w)
    _check_multi(x, w.shape[0], idx, a_n, b_n)
    return _multi_body(_linear(x, w), x, idx, a_n, b_n, _scales(scales, len(a_n)), _linear)
