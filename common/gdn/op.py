"""Gated DeltaNet: launchers, the open-chunk cache and the public functions.

The server calls ``gdn_fwd`` / ``conv1d_fwd`` (with a cache); the trainer
calls ``gdn`` / ``conv1d`` (no cache), which run the same code.  The
arithmetic and its reduction orders: ``cpu.py``'s docstring (the chunk-64
gated delta rule with an FP32 [K, V] state, every sum a fixed tree).

Shapes: T new tokens of B sequences, packed sequence after sequence
(``cu_seqlens`` (B + 1,) offsets); Hk qk heads of width K, Hv value heads of
width V (GVA: value head h reads qk head h // (Hv / Hk)); S cache slots.

The per-slot cache (``gdn_state_fields`` / ``gdn_cache``; the engine's
``StatePool`` holds one set per layer), all of a sequence's open chunk, the
rows of chunk floor(p / 64) that come before position p:

    state  (Hv, K, V)       fp32   the state at the chunk's start (the last
                                   64-aligned boundary)
    k      (64, Hk, K)      fp32   k_j of the chunk's rows
    g_cum  (64, Hv)         fp32   G_j, the cumulative log decay
    x      (64, Hv, V + K)  fp32   x_j = [u_j | w_j], the solved rows
    v_new  (64, Hv, V)      fp32   v_new_j = u_j - w_j . S0
    n      ()               int64  rows done, (start + len) % 64: written for
                                   inspection, never read (the position says)

Rows >= n are stale and never read (each row reads rows j < i only, masked
to -0.0).  A sequence at position 0 ignores its slot (a new or preempted
sequence's slot holds another sequence's old state) and writes all of it.
"""
from __future__ import annotations

import torch

from .._validate import check_tensor
from . import cpu
from .backward import gdn_matmul
from .cpu import CHUNK, CONV_K

F32 = torch.float32


def gdn_state_fields(Hk: int, Hv: int, K: int, V: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The per-slot cache as a ``StatePool`` field spec: {name: (shape, dtype)}
    (the module docstring says what each holds).  k is kept per qk head (Hk),
    the rest per value head.  Bytes per slot and layer:
    4 (Hv K V + 64 (Hk K + Hv (2 V + K + 1))) + 8; Qwen3.5-35B-A3B's shapes
    (Hk 16, Hv 32, K = V = 128): 2 MiB of state + 3.5 MiB of rows = 5.5 MiB."""
    return {
        "state": ((Hv, K, V), F32),
        "k": ((CHUNK, Hk, K), F32),
        "g_cum": ((CHUNK, Hv), F32),
        "x": ((CHUNK, Hv, V + K), F32),
        "v_new": ((CHUNK, Hv, V), F32),
        "n": ((), torch.int64),
    }


def gdn_cache(num_slots: int, Hk: int, Hv: int, K: int, V: int, device=None) -> dict[str, torch.Tensor]:
    """{name: (num_slots, *shape) zeros}, as ``StatePool.allocate`` makes them."""
    fields = gdn_state_fields(Hk, Hv, K, V)
    return {n: torch.zeros(num_slots, *s, dtype=d, device=device) for n, (s, d) in fields.items()}


def conv1d_state_fields(channels: int, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The conv's per-slot tail: the last three inputs (oldest first), in the input dtype."""
    return {"conv_tail": ((CONV_K - 1, channels), dtype)}


def _graded(*ts: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def l2norm_fwd(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x (..., D) -> fp32 x * rsqrt(sum(x * x) + eps), the sum a fixed pairwise
    tree over D padded with -0.0 to a power of two.  On CUDA the forward is one
    Triton launch of the same bits (``prologue_kernel.l2norm_triton``).
    Differentiable: with a gradient to form, ``_L2NormFn`` (the same forward,
    the closed-form backward)."""
    if _graded(x):
        return _L2NormFn.apply(x, eps)
    if x.is_cuda:
        from .prologue_kernel import l2norm_triton

        return l2norm_triton(x, eps)
    return cpu.l2norm_cpu(x, eps)


class _L2NormFn(torch.autograd.Function):
    """y = x r, r = rsqrt(sum x^2 + eps): dx = r dy - x r^3 sum(dy x), in fp32."""

    @staticmethod
    def forward(ctx, x, eps):
        with torch.no_grad():
            y = l2norm_fwd(x, eps)
        ctx.save_for_backward(x)
        ctx.eps = eps
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        xf = x.float()
        r = torch.rsqrt(xf.square().sum(-1, keepdim=True) + ctx.eps)
        return (r * dy - xf * r.pow(3) * (dy * xf).sum(-1, keepdim=True)).to(x.dtype), None


def _check(q, k, v, g, beta, cu_seqlens):
    for name, t, nd in (("q", q, 3), ("k", k, 3), ("v", v, 3), ("g", g, 2), ("beta", beta, 2)):
        check_tensor(name, t, ndim=nd, contiguous=False)
    T, Hk = k.shape[:2]
    Hv = v.shape[1]
    if q.shape != k.shape:
        raise ValueError(f"q must have the shape of k {tuple(k.shape)}, got {tuple(q.shape)}")
    if v.shape[0] != T or g.shape != (T, Hv) or beta.shape != (T, Hv):
        raise ValueError(f"v (T, Hv, V), g and beta (T, Hv) with T = {T}: got {tuple(v.shape)}, "
                         f"{tuple(g.shape)}, {tuple(beta.shape)}")
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of qk heads ({Hk})")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be (B + 1,), got shape {tuple(cu_seqlens.shape)}")


def _backend(backend, x):
    backend = backend or ("triton" if x.is_cuda else "torch")
    if backend not in ("torch", "triton"):
        raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
    return backend


def gdn_fwd(q, k, v, g, beta, cu_seqlens, *, start_positions=None, cache=None, slots=None, return_states=False,
            backend: str | None = None, host=None):
    """The gated delta rule over a packed batch -> o (T, Hv, V) fp32.

    q, k (T, Hk, K): L2-normalized (``l2norm_fwd``), q scaled by K^-0.5; v
    (T, Hv, V) (cast to fp32); g (T, Hv) fp32 log decay (<= 0); beta (T, Hv)
    fp32; cu_seqlens (B + 1,) int.

    Without ``cache`` (the trainer): every sequence starts at position 0;
    ``return_states`` (torch backend) also returns the (N, Hv, K, V) fp32 state
    after each complete chunk, by sequence then chunk.

    With ``cache`` (``gdn_cache``'s dict), ``slots`` (B,) int64 (-1: a padding
    row: read as slot 0 and never written) and ``start_positions`` (B,): each
    sequence continues from its slot at that position (position 0: the slot
    is not read) and writes its state and open chunk back.  ``host``: the
    caller's host lists (cu_seqlens, start_positions, slots) holding those
    tensors' values (``ForwardBatch.host``), read in their place, so a prefill
    never waits on the device.

    ``backend``: "torch" (``cpu.py``; the default off CUDA) or "triton"
    (``kernel.py``, ``chunk_kernel.py``; the default on CUDA).  torch: the decode shape, T == B
    (one token per sequence; no sequence may be empty), runs
    ``cpu.decode_step``, no host reads, capturable in a CUDA graph (but it
    builds (B, Hv, 64, K, V) temporaries for the state every step); any other
    shape runs ``cpu.chunked``, which reads cu_seqlens, start_positions and
    slots on the host to lay out its chunks.  triton: the decode shape runs
    ``gdn_decode_triton`` (two launches, graph-capturable, no host reads); any
    other runs ``gdn_chunk_triton`` (the state-free work of every 64-row chunk
    at once, then each sequence's chunks in order), which reads cu_seqlens,
    start_positions and slots on the host to lay out its chunks, as
    ``cpu.chunked`` does, or, for a call of few short sequences, where it is
    the faster (``_prefill_triton``), ``kernel.gdn_scan_triton`` (the decode's
    row function over each sequence's rows in order).  Within a backend every
    path gives a row the same bits.  The torch path and the Triton kernels
    under the interpreter compute ``cpu.py``'s trees; compiled on CUDA the
    kernels form the products with the state as tf32x3 tensor-core dots
    (``kernel.MMA``; the same function to ~1e-7, other bits), so a trainer and
    its server must run the same backend on one device, as the defaults do
    (the gpu tests of ``tests/test_gdn.py`` and ``tests/test_gdn_chunk.py``)."""
    _check(q, k, v, g, beta, cu_seqlens)
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    backend = _backend(backend, q)
    if q.shape[0] == 0:
        o = q.new_zeros(0, *v.shape[1:])
        return (o, q.new_zeros(0, v.shape[1], k.shape[2], v.shape[2])) if return_states else o
    if cache is None:
        if start_positions is not None or slots is not None or host is not None:
            raise ValueError("start_positions, slots and host lists need a cache")
        B = cu_seqlens.shape[0] - 1
        if backend == "triton" and not return_states:
            Hk, K = k.shape[1:]
            Hv, V = v.shape[1:]
            scratch = gdn_cache(B, Hk, Hv, K, V, q.device)
            ar = torch.arange(B, device=q.device)
            return _prefill_triton(*(t.contiguous() for t in (q, k, v, g, beta)), cu_seqlens.contiguous(),
                                   torch.zeros_like(ar), ar, scratch)
        cu = cu_seqlens.tolist()
        return cpu.chunked(q, k, v, g, beta, cu, [0] * (len(cu) - 1), return_states=return_states)
    if start_positions is None or slots is None:
        raise ValueError("a cache needs slots and start_positions")
    if return_states:
        raise ValueError("return_states is for the trainer (no cache)")
    B = cu_seqlens.shape[0] - 1
    if host is not None and [len(x) for x in host] != [B + 1, B, B]:
        raise ValueError(f"host lists must be (cu_seqlens, start_positions, slots) of {B + 1}, {B}, {B} entries, "
                         f"got {[len(x) for x in host]}")
    decode = q.shape[0] == B
    if backend == "triton":
        from .kernel import gdn_decode_triton

        args = [t.contiguous() for t in (q, k, v, g, beta)]
        if decode:
            return gdn_decode_triton(*args, start_positions.long().contiguous(), slots.long().contiguous(), cache)
        return _prefill_triton(*args, cu_seqlens.contiguous(), start_positions.long().contiguous(),
                               slots.long().contiguous(), cache, host)
    if decode:
        return cpu.decode_step(q, k, v, g, beta, start_positions.long(), slots.long(), cache)
    cu, st, sl = host if host is not None else cpu.host_lists(cu_seqlens, start_positions, slots)
    return cpu.chunked(q, k, v, g, beta, cu, st, cache=cache, slots=sl)


def _prefill_triton(q, k, v, g, beta, cu_seqlens, starts, slots, cache, host=None):
    """A non-decode Triton call: the chunk-parallel kernel or the row scan, whose bits are the same
    (the gpu tests of ``tests/test_gdn_chunk.py``).  The chunk kernel's time follows the call's
    tokens, the scan's its longest sequence (Qwen3.5's 32 value heads: 1.3-1.6 us a token
    against 35 us a row), so a call whose longest sequence is under a twentieth of its tokens runs
    the scan."""
    from .chunk_kernel import gdn_chunk_triton
    from .kernel import gdn_scan_triton

    host = cpu.host_lists(cu_seqlens, starts, slots) if host is None else host
    cu = host[0]
    if cu[-1] - cu[0] <= 20 * max(b - a for a, b in zip(cu, cu[1:])):
        return gdn_chunk_triton(q, k, v, g, beta, cu_seqlens, starts, slots, cache, host=host)
    return gdn_scan_triton(q, k, v, g, beta, cu_seqlens, starts, slots, cache)


class _GDNTritonFn(torch.autograd.Function):
    """Forward: the Triton prefill path (``_prefill_triton``).  Backward: the gradient of the same
    function written with batched matmuls (``backward.gdn_matmul``) recomputed under autograd:
    the true gradient to fp32 rounding, repeatable, in ~40 host ops a chunk."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, cu_seqlens):
        ctx.save_for_backward(q, k, v, g, beta, cu_seqlens)
        return gdn_fwd(q, k, v, g, beta, cu_seqlens, backend="triton")

    @staticmethod
    def backward(ctx, do):
        q, k, v, g, beta, cu_seqlens = ctx.saved_tensors
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in (q, k, v, g, beta)]
        with torch.enable_grad():
            o = gdn_matmul(*leaves, cu_seqlens)
            want = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(o, want, do) if want else ())
        return (*[next(grads) if t.requires_grad else None for t in leaves], None)


def gdn(q, k, v, g, beta, cu_seqlens, *, backend: str | None = None):
    """The trainer's differentiable gated delta rule: ``gdn_fwd`` without a
    cache, shapes as there -> o (T, Hv, V) fp32.  torch backend: the forward is
    element-wise torch ops, slices and gathers, so autograd differentiates the
    very arithmetic that ran (gradients w.r.t. q, k, v, g and beta).  triton
    (CUDA's default): the forward is the Triton prefill path, the
    backward the matmul form's autograd (``_GDNTritonFn``)."""
    if _backend(backend, q) == "triton":
        _check(q, k, v, g, beta, cu_seqlens)
        return _GDNTritonFn.apply(q, k, v, g, beta, cu_seqlens)
    return gdn_fwd(q, k, v, g, beta, cu_seqlens, backend="torch")


def conv1d_fwd(x, weight, cu_seqlens, *, tail=None, slots=None, start_positions=None):
    """Causal depthwise conv1d (kernel 4, no bias) + SiLU -> y (T, C) in x.dtype.

    x (T, C) packed, weight (C, 4) (transformers' ``conv1d.weight.squeeze(1)``),
    cu_seqlens (B + 1,).  With ``tail`` (S, 3, C) (``conv1d_state_fields``),
    ``slots`` (B,) and ``start_positions`` (B,): a sequence at start > 0 reads
    the taps before its first token from its slot's tail; every slot >= 0
    gets its last three inputs.  Rounding points: ``cpu.conv1d_cpu``.  No host
    reads in any shape; differentiable (x and weight).  On CUDA without a
    gradient to form: two Triton launches of the same bits
    (``prologue_kernel.conv1d_triton``) in place of the torch path's ~110."""
    check_tensor("x", x, ndim=2, contiguous=False)
    check_tensor("weight", weight, ndim=2, contiguous=False)
    if weight.shape != (x.shape[1], CONV_K):
        raise ValueError(f"weight must be (C, {CONV_K}) = ({x.shape[1]}, {CONV_K}), got {tuple(weight.shape)}")
    if (tail is None) != (slots is None) or (tail is None) != (start_positions is None):
        raise ValueError("tail, slots and start_positions go together")
    if x.shape[0] == 0:
        return x.new_zeros(x.shape)
    if x.is_cuda and not _graded(x, weight):
        from .prologue_kernel import conv1d_triton

        return conv1d_triton(x, weight, cu_seqlens, tail, slots, start_positions)
    return cpu.conv1d_cpu(x, weight, cu_seqlens, tail, slots, start_positions)


def conv1d(x, weight, cu_seqlens):
    """The trainer's differentiable conv1d + SiLU (every sequence from position 0):
    ``conv1d_fwd``'s forward (one Triton pair on CUDA), the closed-form backward."""
    if not _graded(x, weight):
        return conv1d_fwd(x, weight, cu_seqlens)
    return _Conv1dFn.apply(x, weight, cu_seqlens)


class _Conv1dFn(torch.autograd.Function):
    """y = silu(a), a = sum_d w_d x[t - 3 + d] within the sequence: da = dy silu'(a) in fp32
    (silu' = s (1 + a (1 - s)), s = sigmoid(a), at the a the forward rounded), then per tap
    d (3 - d rows back) dw_d = sum_t da[t] x[t - 3 + d] and dx[t - 3 + d] += w_d da[t], over the
    rows whose tap stays in the sequence.  A few dozen ops on (T, C); autograd through the torch
    path's ~110 would keep as many (T, C) fp32 tensors."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens):
        with torch.no_grad():
            y = conv1d_fwd(x, weight, cu_seqlens)
        ctx.save_for_backward(x, weight, cu_seqlens)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, cu = ctx.saved_tensors
        T = x.shape[0]
        t = torch.arange(T, device=x.device)
        local = t - cu.long()[torch.searchsorted(cu[1:].long(), t, right=True).clamp(max=max(cu.shape[0] - 2, 0))]
        xf, wf = x.float(), w.float()
        taps = [torch.where((local >= CONV_K - 1 - d)[:, None], xf[(t - (CONV_K - 1 - d)).clamp(min=0)], 0.0)
                for d in range(CONV_K)]
        a = taps[0] * wf[:, 0]
        for d in range(1, CONV_K):
            a = a + taps[d] * wf[:, d]
        a = a.to(x.dtype).float()
        s = torch.sigmoid(a)
        da = dy.float() * (s * (1 + a * (1 - s)))
        dw = torch.stack([(da * taps[d]).sum(0) for d in range(CONV_K)], 1)
        dx = torch.zeros_like(xf)
        for d in range(CONV_K):
            back = CONV_K - 1 - d
            part = torch.where((local >= back)[:, None], da, 0.0) * wf[:, d]
            dx[: T - back] += part[back:]
        return dx.to(x.dtype), dw.to(w.dtype), None
