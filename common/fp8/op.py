"""FP8 linear: quantizers, launchers (server), autograd Function and public ops (trainer).

The FP32 master weight is quantized once per optimizer step into the serving
layout (``Fp8WeightCache``); the trainer's forward and the server both run
``fp8_matmul_fwd`` on those very bytes, so they get the same bits.
Reduction order and rounding points: ``cpu.py`` (CPU) and ``kernel.py`` (CUDA);
quantization: ``quant.py``.
"""
from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..matmul.op import backward_mm
from .cpu import fp8_gemm_cpu
from .quant import BLOCK, FP8_DTYPE, cdiv, dequantize_weight, quantize_act, quantize_weight


def fp8_matmul_fwd(x: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor, **launch) -> torch.Tensor:
    """y = dequant(Q(x)) · dequant(W)ᵀ, no validation (the server's hot path).

    x: (M, K) bf16/fp32; w_codes: (N, K) e4m3fn; w_scale_inv: (ceil(N/128),
    ceil(K/128)) fp32 -> (M, N) in x.dtype.  x is quantized per token in 1×128
    groups (``quant.py``), then the block-scaled GEMM of the device's path runs.
    ``launch``: free knobs (CPU ``row_chunk``; CUDA ``block_m``, ``block_n``,
    ``num_warps``, ``num_stages``); none changes bits.
    """
    x_codes, x_scales = quantize_act(x)
    if x.is_cuda:
        from .kernel import fp8_gemm_triton

        return fp8_gemm_triton(x_codes, x_scales, w_codes.contiguous(), w_scale_inv.contiguous(), x.dtype, **launch)
    return fp8_gemm_cpu(x_codes, x_scales, w_codes, w_scale_inv, x.dtype, **launch)


def fp8_matmul_bwd(x: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor, dy: torch.Tensor,
                   need_dx: bool = True, need_dw: bool = True) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Straight-through backward of ``y = Q(x) · dequant(W)ᵀ``: the quantizers
    count as identity, so the layer is differentiated as ``y = x · Wdᵀ`` with
    Wd = dequant(W) rounded to x.dtype.

    x: (M, K), dy: (M, N) -> dX = dY · Wd (M, K) and dW = dYᵀ · X (N, K), both
    in x.dtype, each one ``backward_mm`` (deterministic run to run).
    """
    dy = dy.to(x.dtype)
    dx = dw = None
    if need_dx:
        w_deq = dequantize_weight(w_codes, w_scale_inv, x.dtype)  # (N, K)
        dx = backward_mm(dy, w_deq)  # (M, N) · (N, K)
    if need_dw:
        dw = backward_mm(dy.t(), x)  # (N, M) · (M, K): sum over tokens 0..M-1
    return dx, dw


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, master_w, w_codes, w_scale_inv):
        ctx.save_for_backward(x, w_codes, w_scale_inv)
        ctx.master_dtype = None if master_w is None else master_w.dtype
        return fp8_matmul_fwd(x, w_codes, w_scale_inv)

    @staticmethod
    def backward(ctx, dy):
        x, w_codes, w_scale_inv = ctx.saved_tensors
        need_dw = ctx.master_dtype is not None and ctx.needs_input_grad[1]
        dx, dw = fp8_matmul_bwd(x, w_codes, w_scale_inv, dy.contiguous(), ctx.needs_input_grad[0], need_dw)
        return dx, None if dw is None else dw.to(ctx.master_dtype), None, None


def _check_weight(w_codes: torch.Tensor, w_scale_inv: torch.Tensor) -> None:
    check_tensor("w_codes", w_codes, dtypes=(FP8_DTYPE,), ndim=2)
    check_tensor("w_scale_inv", w_scale_inv, dtypes=(torch.float32,), ndim=2)
    N, K = w_codes.shape
    want = (cdiv(N, BLOCK), cdiv(K, BLOCK))
    if tuple(w_scale_inv.shape) != want:
        raise ValueError(f"w_scale_inv has shape {tuple(w_scale_inv.shape)}; codes of shape {(N, K)} need "
                         f"{want} (one scale per {BLOCK}x{BLOCK} block)")


def _check_x(x: torch.Tensor, K: int, what: str) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=range(1, 8))
    if x.shape[-1] != K:
        raise ValueError(f"x has K={x.shape[-1]} but {what}")


def fp8_linear(x: torch.Tensor, master_w: torch.Tensor | None, w_codes: torch.Tensor,
               w_scale_inv: torch.Tensor) -> torch.Tensor:
    """Batch-invariant FP8 linear ``Q(x) · dequant(W)ᵀ`` with a straight-through
    gradient to the master weight.

    x: (..., K) bf16/fp32; master_w: (N, K) fp32/bf16 (or None: no weight
    gradient); w_codes (N, K) e4m3fn and w_scale_inv (ceil(N/128), ceil(K/128))
    fp32: the quantization of master_w (``quantize_weight_fp8`` /
    ``Fp8WeightCache``) -> (..., N) in x.dtype.  master_w's value is never read:
    the forward uses the codes only, and the backward returns dW = dYᵀ · X to
    master_w (in its dtype) and dX = dY · dequant(W) to x.
    Row i of the output depends only on row i of x and on the codes.
    """
    _check_weight(w_codes, w_scale_inv)
    N, K = w_codes.shape
    _check_x(x, K, f"w_codes has shape {(N, K)} (expected (N, {x.shape[-1]}))")
    if master_w is not None:
        check_tensor("master_w", master_w, dtypes=FLOAT_DTYPES, ndim=2, contiguous=False)
        if master_w.shape != w_codes.shape:
            raise ValueError(f"master_w has shape {tuple(master_w.shape)} but w_codes has {(N, K)}")
    check_same_device(x=x, master_w=master_w, w_codes=w_codes, w_scale_inv=w_scale_inv)
    lead = x.shape[:-1]
    y = _Fp8Linear.apply(x.reshape(-1, K), master_w, w_codes, w_scale_inv)
    return y.reshape(*lead, N)


def fp8_matmul(x: torch.Tensor, w_codes: torch.Tensor, w_scale_inv: torch.Tensor) -> torch.Tensor:
    """``fp8_linear`` with a frozen FP8 weight: x (..., K) -> (..., N); gradient to x only."""
    return fp8_linear(x, None, w_codes, w_scale_inv)


def quantize_weight_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) fp32/bf16 -> (``weight`` codes (N, K) float8_e4m3fn,
    ``weight_scale_inv`` (ceil(N/128), ceil(K/128)) fp32), the layout of FP8
    Hugging Face checkpoints (DeepSeek-V3, Qwen3-FP8): W ≈ codes * scale_inv[block].
    Same bits on every device; rounding rules in ``quant.py``."""
    check_tensor("w", w, dtypes=FLOAT_DTYPES, ndim=2, contiguous=False)
    return quantize_weight(w.detach())


def dequantize_weight_fp8(codes: torch.Tensor, scale_inv: torch.Tensor,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(codes (N, K) e4m3fn, scale_inv (ceil(N/128), ceil(K/128)) fp32) -> (N, K) dtype,
    dtype(fl32(code * scale_inv[n // 128, k // 128]))."""
    _check_weight(codes, scale_inv)
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be bfloat16 or float32, got {dtype}")
    check_same_device(codes=codes, scale_inv=scale_inv)
    return dequantize_weight(codes, scale_inv, dtype)


def quantize_act_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., K) bf16/fp32 -> (codes (..., K) e4m3fn, scales (..., ceil(K/128)) fp32),
    one scale per token and 128-wide K group; row-local by construction."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=range(1, 8), contiguous=False)
    K = x.shape[-1]
    codes, scales = quantize_act(x.detach().reshape(-1, K))
    return codes.view(*x.shape), scales.view(*x.shape[:-1], scales.shape[-1])


class QuantizedCache:
    """A quantized copy of master tensors, remade only when a master changed: ``get()`` returns
    ``quantize(*masters)`` and requantizes iff some master's ``_version`` (bumped by every in-place
    op: optimizer steps, ``copy_``, ``load_state_dict``) or storage pointer differs from the last
    time.  So the trainer's forwards, the server and the weight sync all read the same bytes until
    the next step.  Writes that bypass the version counter are invisible: through ``.data``, and —
    measured on torch 2.13 — ``torch.optim`` with ``fused=True``, whose kernels leave ``_version``
    alone.  For those call ``invalidate()``, or ``invalidate_after(optimizer)`` once to do it after
    every step."""

    def __init__(self, masters: tuple[torch.Tensor, ...], quantize):
        self.masters, self._quantize = masters, quantize
        self.quantizations = 0  # how many times get() has requantized
        self._key: tuple | None = None
        self._value: tuple | None = None

    def get(self) -> tuple:
        key = tuple((m._version, m.data_ptr()) for m in self.masters)
        if key != self._key:
            self._value = self._quantize(*(m.detach() for m in self.masters))
            self._key = key
            self.quantizations += 1
        return self._value

    def invalidate(self) -> None:
        self._key = None

    def invalidate_after(self, optimizer: torch.optim.Optimizer):
        """Invalidate after every ``optimizer.step()``; returns the hook handle."""
        return optimizer.register_step_post_hook(lambda *_: self.invalidate())


class Fp8WeightCache(QuantizedCache):
    """The FP8 serving copy of one master weight (``QuantizedCache`` of ``quantize_weight``):
    ``get()`` -> (codes, scale_inv), requantized only when the master changed.

        cache = Fp8WeightCache(layer.weight)   # an fp32 nn.Parameter (N, K)
        y = cache.linear(x)                    # fp8_linear(x, master, *cache.get())
        opt.step(); y = cache.linear(x)        # requantized once, here
    """

    def __init__(self, master: torch.Tensor):
        check_tensor("master", master, dtypes=FLOAT_DTYPES, ndim=2, contiguous=False)
        super().__init__((master,), quantize_weight)
        self.master = master

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_linear(x, self.master, *self.get())
