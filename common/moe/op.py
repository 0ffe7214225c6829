"""Routed experts: the launcher both sides call, its autograd, and the combine.

``experts_fwd`` is the server's launcher and the trainer's forward (the same
bits): the Triton grouped kernels on CUDA (``kernel.py``), the element-wise
CPU path elsewhere (``cpu.py``); both keep the rounding points in ``cpu.py``'s
docstring, and neither lets a token's arithmetic depend on how many tokens its
experts got.  ``moe_experts`` is its differentiable form for the trainer: the
backward is the gradient of that forward (through the one bf16 rounding of the
SwiGLU output as the identity), w.r.t. the activations, the routing weights and
both expert weight stacks.  ``experts_fp8_fwd`` / ``moe_experts_fp8`` are the
same for FP8 experts (GLM-5: e4m3 codes in 128x128 blocks, ``quantize_experts_fp8``),
with a straight-through backward to the FP32 masters; ``experts_mxfp4_fwd`` /
``moe_experts_mxfp4`` for MXFP4 experts (DeepSeek-V4, ``mxfp4.py``), the bf16 path's
bits at the exactly decoded weights.  ``moe_combine`` adds the routed sum and the shared
expert(s) by the FP64 tree in logical order and rounds once.

Shapes: T tokens, H hidden, E experts, I expert width, k slots.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .._validate import FLOAT_DTYPES, check_same_device, check_tensor
from ..fp8.quant import BLOCK, FP8_DTYPE, cdiv, dequantize_weight, quantize_weight
from ..swiglu.cpu import clamp_gate_up, limit_in
from ..tree import tree_reduce
from .cpu import experts_fwd_cpu, experts_fwd_fp8_cpu, experts_fwd_mxfp4_cpu, swiglu_f32
from .lora import ExpertLoRA
from .mxfp4 import E8M0_DTYPES, check_mx_shape, dequantize_mxfp4, quantize_mxfp4


def experts_fwd(x, ids, weights, w_gate_up, w_down, limit=None, lora=None) -> torch.Tensor:
    """(T, H) fp32 routed sum (unrounded); no checks (``moe_experts`` checks).  ``lora``: an
    ``ExpertLoRA`` added inside the experts (``lora.py``), on every format's launcher."""
    if x.is_cuda:
        from .kernel import experts_fwd_triton

        return experts_fwd_triton(x, ids, weights, w_gate_up, w_down, limit, lora=lora)
    return experts_fwd_cpu(x, ids, weights, w_gate_up, w_down, limit, lora=lora)


def experts_fp8_fwd(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit=None, lora=None) -> torch.Tensor:
    """FP8 experts (``quantize_experts_fp8``'s layout) -> (T, H) fp32 routed sum (unrounded); no checks."""
    if x.is_cuda:
        from .kernel import experts_fwd_fp8_triton

        return experts_fwd_fp8_triton(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit, lora=lora)
    return experts_fwd_fp8_cpu(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit, lora=lora)


def experts_mxfp4_fwd(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit=None, lora=None) -> torch.Tensor:
    """MXFP4 experts (``quantize_experts_mxfp4``'s layout) -> (T, H) fp32 routed sum: the bits of
    ``experts_fwd`` at the exactly decoded weights, computed packed on CUDA; no checks."""
    if x.is_cuda:
        from .kernel import experts_fwd_mxfp4_triton

        return experts_fwd_mxfp4_triton(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit, lora=lora)
    return experts_fwd_mxfp4_cpu(x, ids, weights, gu_codes, gu_scales, d_codes, d_scales, limit, lora=lora)


def _swiglu_bwd(gu: torch.Tensor, da: torch.Tensor, limit: float | None, dtype: torch.dtype) -> torch.Tensor:
    """d[gate | up] (R, 2I) fp32 of a = SiLU(g)·u at fp32 ``gu``, clamped where the
    forward clamps (``swiglu_f32``: at ``limit_in(dtype, limit)``, not at the raw limit)."""
    I = gu.shape[1] // 2
    g, u = gu[:, :I], gu[:, I:]
    pass_g = pass_u = None
    if limit is not None:
        lim = limit_in(dtype, limit)
        pass_g, pass_u = g <= lim, (u >= -lim) & (u <= lim)
        g, u = clamp_gate_up(g, u, lim)
    s = torch.sigmoid(g)
    dg = da * u * (s * (1 + g * (1 - s)))
    du = da * g * s
    if limit is not None:
        dg, du = dg * pass_g, du * pass_u
    return torch.cat([dg, du], dim=1)


# fp32 bytes one group of the experts' backward holds at once (its experts' weights and padded rows)
_BWD_GROUP_BYTES = 1 << 30


def _bwd_groups(counts: list[int], per_expert: int, per_row: int, budget: int) -> list[tuple[list[int], int]]:
    """The experts with rows, as (expert ids, padded rows P) groups of the batched backward: experts
    whose counts share a power-of-two class go together (P = the group's largest count, so padding
    stays under 2x), cut where n experts' weights and n * P rows would pass ``budget`` bytes."""
    classes: dict[int, list[int]] = {}
    for e, c in enumerate(counts):
        if c:
            classes.setdefault((c - 1).bit_length(), []).append(e)
    groups = []
    for _, es in sorted(classes.items()):
        cur: list[int] = []
        P = 0
        for e in es:
            if cur and (len(cur) + 1) * (per_expert + max(P, counts[e]) * per_row) > budget:
                groups.append((cur, P))
                cur, P = [], 0
            cur.append(e)
            P = max(P, counts[e])
        groups.append((cur, P))
    return groups


class _Stacks(NamedTuple):
    """The expert weights as the backward reads them, a group at a time: ``fetch(es)`` -> (gate_up
    (n, 2I, H), down (n, H, I)) fp32 of experts ``es``; ``bytes_per_weight``: what that takes a weight
    element while it runs (the group budget's unit)."""

    E: int
    I: int
    H: int
    fetch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    bytes_per_weight: int


def _plain_stacks(w_gate_up: torch.Tensor, w_down: torch.Tensor) -> _Stacks:
    E, I2, H = w_gate_up.shape
    return _Stacks(E, I2 // 2, H, lambda es: (w_gate_up[es].float(), w_down[es].float()),
                   4 + w_gate_up.element_size())


def _quantized_stacks(fmt: str, codes: tuple, dtype: torch.dtype) -> _Stacks:
    """FP8 / MXFP4 experts decoded a group at a time, each weight dtype(its exact value), as the
    forward's: the whole dequantized stack never exists (DeepSeek-V4's MXFP4 gate-up is 8 GiB in
    bf16, and its fp32 decode temporaries several times that)."""
    gu_codes, _, d_codes, _ = codes
    E, I2 = gu_codes.shape[:2]
    H = d_codes.shape[1]

    def fetch(es):
        gu, d = _FORMATS[fmt][1](*(c[es] for c in codes), dtype=dtype)
        return gu.float(), d.float()

    return _Stacks(E, I2 // 2, H, fetch, 32 if fmt == "mxfp4" else 12)


def _experts_bwd(x, ids, weights, stacks: _Stacks, dy, limit, lora=None, need_w: bool = True):
    """(dx, dweights, dW_gate_up, dW_down, LoRA grads) fp32 of the routed sum at the expert weights
    ``stacks`` gives (bf16 / fp32, or decoded); the forward's SwiGLU rows (and adapter products)
    recomputed in fp32 and rounded where the forward rounds them, each rounding's gradient the
    identity.  ``need_w`` False: no base weight grads (frozen experts; at DeepSeek-V4's shapes an fp32
    dW stack is 8 GiB).  The LoRA grads: (dA_gu, dB_gu, dA_d, dB_d) or None.

    Batched over experts (``_bwd_groups``): each group's rows are padded to (n, P) with zero rows,
    which add nothing to any gradient, and every product is one fp32 bmm, so a layer is a few dozen
    launches, not a dozen an expert.  dx adds a token's slots in slot order: deterministic."""
    T, k = ids.shape
    E, I, H = stacks.E, stacks.I, stacks.H
    I2 = 2 * I
    dy, dev = dy.float(), x.device
    # one row a (token, slot), and a last one that padded rows write into (no boolean index, no host read)
    dx_rows = torch.zeros(T * k + 1, H, dtype=torch.float32, device=dev)
    dw = torch.zeros(T * k + 1, dtype=torch.float32, device=dev)
    dgu_w = torch.zeros(E, I2, H, dtype=torch.float32, device=dev) if need_w else None
    dd_w = torch.zeros(E, H, I, dtype=torch.float32, device=dev) if need_w else None
    dl = None if lora is None else [torch.zeros(t.shape, dtype=torch.float32, device=dev) for t in lora.tensors()]
    s = None if lora is None else lora.s
    flat, wflat = ids.reshape(-1), weights.reshape(-1).float()
    # each expert's rows in row order: slices of one stable sort, its counts read on the host once
    order = torch.sort(flat, stable=True).indices
    counts = torch.bincount(flat, minlength=E)
    starts = counts.cumsum(0) - counts
    r = 0 if lora is None else lora.tensors()[0].shape[1]
    per_expert = stacks.bytes_per_weight * 3 * I * H + 4 * r * (2 * H + 3 * I)
    per_row = 4 * (6 * H + 7 * I + 4 * r)
    bmm = torch.bmm
    groups = _bwd_groups(counts.tolist(), per_expert, per_row, _BWD_GROUP_BYTES)
    all_es = torch.tensor([e for es, _ in groups for e in es], device=dev)  # one copy to the device
    e0 = 0
    for group, P in groups:
        es, e0 = all_es[e0:e0 + len(group)], e0 + len(group)
        pos = torch.arange(P, device=dev)
        valid = pos[None, :] < counts[es, None]  # (n, P)
        sel = order[(starts[es, None] + pos).clamp_max(T * k - 1)]
        tok, dst = sel // k, torch.where(valid, sel, T * k)
        live = valid[..., None]
        xe = torch.where(live, x[tok].float(), 0.0)  # (n, P, H), padded rows 0 (where: no 0 * inf)
        wgu, wd = stacks.fetch(es)  # (n, 2I, H), (n, H, I) fp32
        gu = bmm(xe, wgu.transpose(1, 2))
        if lora is not None:
            a1, b1, a2, b2 = (t[es].float() for t in lora.tensors())
            t1 = bmm(xe, a1.transpose(1, 2)).to(x.dtype).float()
            gu = gu + s * bmm(t1, b1.transpose(1, 2))
        a = swiglu_f32(gu.view(-1, I2), limit, x.dtype).float().view(-1, P, I)  # the forward's bf16 SwiGLU rows
        down = bmm(a, wd.transpose(1, 2))  # (n, P, H)
        if lora is not None:
            t2 = bmm(a, a2.transpose(1, 2)).to(x.dtype).float()
            down = down + s * bmm(t2, b2.transpose(1, 2))
        g = torch.where(live, dy[tok], 0.0)  # padded rows: no gradient reaches any product
        dw[dst] = (g * down).sum(2)
        d_down = g * wflat[sel][..., None]
        da = bmm(d_down, wd)
        if need_w:
            dd_w.index_copy_(0, es, bmm(d_down.transpose(1, 2), a))
        if lora is not None:
            dl[3].index_copy_(0, es, s * bmm(d_down.transpose(1, 2), t2))
            dt2 = s * bmm(d_down, b2)
            dl[2].index_copy_(0, es, bmm(dt2.transpose(1, 2), a))
            da = da + bmm(dt2, a2)
        dgu = _swiglu_bwd(gu.view(-1, I2), da.view(-1, I), limit, x.dtype).view(-1, P, I2)
        if need_w:
            dgu_w.index_copy_(0, es, bmm(dgu.transpose(1, 2), xe))
        dxe = bmm(dgu, wgu)
        if lora is not None:
            dl[1].index_copy_(0, es, s * bmm(dgu.transpose(1, 2), t1))
            dt1 = s * bmm(dgu, b1)
            dl[0].index_copy_(0, es, bmm(dt1.transpose(1, 2), xe))
            dxe = dxe + bmm(dt1, a1)
        dx_rows[dst] = dxe
    return dx_rows[:-1].view(T, k, H).sum(1), dw[:-1].view(T, k), dgu_w, dd_w, dl


def _lora_of(lora_tensors, scale):
    return None if lora_tensors[0] is None else ExpertLoRA(*lora_tensors, scale)


def _lora_grads(lora, dl):
    return (None,) * 4 if lora is None else tuple(g.to(t.dtype) for g, t in zip(dl, lora.tensors()))


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ids, weights, w_gate_up, w_down, limit, la, lb, lc, ld, scale):
        ctx.save_for_backward(x, ids, weights, w_gate_up, w_down, la, lb, lc, ld)
        ctx.limit, ctx.scale = limit, scale
        return experts_fwd(x, ids, weights, w_gate_up, w_down, limit, _lora_of((la, lb, lc, ld), scale))

    @staticmethod
    def backward(ctx, dy):
        x, ids, weights, w_gate_up, w_down, *lt = ctx.saved_tensors
        lora = _lora_of(lt, ctx.scale)
        need_w = ctx.needs_input_grad[3] or ctx.needs_input_grad[4]
        dx, dw, dgu_w, dd_w, dl = _experts_bwd(x, ids, weights, _plain_stacks(w_gate_up, w_down), dy, ctx.limit,
                                               lora, need_w)
        return (dx.to(x.dtype), None, dw.to(weights.dtype), None if dgu_w is None else dgu_w.to(w_gate_up.dtype),
                None if dd_w is None else dd_w.to(w_down.dtype), None, *_lora_grads(lora, dl), None)


def _check_tokens(x, ids, weights) -> None:
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("ids", ids, dtypes=(torch.int32, torch.int64), ndim=2)
    check_tensor("weights", weights, dtypes=FLOAT_DTYPES, ndim=2)


def _check_lora(lora, E: int, H: int, I: int, x: torch.Tensor) -> None:
    if lora is not None:
        if not isinstance(lora, ExpertLoRA):
            raise TypeError(f"lora must be an ExpertLoRA, got {type(lora).__name__}")
        lora.check(E, H, I, x.dtype, x.device)


def _lora_args(lora) -> tuple:
    """The autograd Functions' trailing inputs: the four adapter stacks and the scale (Nones without)."""
    return (None,) * 5 if lora is None else (*lora.tensors(), lora.scale)


def _check_routing(ids, weights, T: int, E: int) -> None:
    if ids.shape[0] != T or weights.shape != ids.shape:
        raise ValueError(f"ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must both be (T={T}, k)")
    if ids.numel() and bool(((ids < 0) | (ids >= E)).any()):
        raise ValueError(f"expert ids must be in [0, {E}); got min {int(ids.min())}, max {int(ids.max())}")


def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                w_down: torch.Tensor, *, limit: float | None = None, lora=None) -> torch.Tensor:
    """The routed experts' sum for each token, in fp32 (round it with the
    shared expert in ``moe_combine``).

    x: (T, H) bf16/fp32; ids: (T, k) int32/int64 in [0, E), the slots in the
    router's order; weights: (T, k) (the router's dtype, read as fp32);
    w_gate_up: (E, 2I, H) [gate | up] rows; w_down: (E, H, I); ``limit``:
    DeepSeek-V4's SwiGLU clamp; ``lora``: an ``ExpertLoRA`` (``lora.py``) added
    inside every expert -> (T, H) fp32.  Differentiable w.r.t. x, weights,
    w_gate_up, w_down and the adapters."""
    _check_tokens(x, ids, weights)
    check_tensor("w_gate_up", w_gate_up, dtypes=(x.dtype,), ndim=3)
    check_tensor("w_down", w_down, dtypes=(x.dtype,), ndim=3)
    check_same_device(x=x, ids=ids, weights=weights, w_gate_up=w_gate_up, w_down=w_down)
    T, H = x.shape
    E, I2, H2 = w_gate_up.shape
    if H2 != H or I2 % 2 or tuple(w_down.shape) != (E, H, I2 // 2):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, w_gate_up {tuple(w_gate_up.shape)} "
                         f"(want (E, 2I, {H})), w_down {tuple(w_down.shape)} (want (E, {H}, I))")
    _check_routing(ids, weights, T, E)
    _check_lora(lora, E, H, I2 // 2, x)
    return _Experts.apply(x, ids, weights, w_gate_up, w_down, limit, *_lora_args(lora))


def quantize_experts_fp8(w_gate_up: torch.Tensor, w_down: torch.Tensor):
    """Expert stacks -> FP8 e4m3 in 128x128 blocks with FP32 scales, as FP8 MoE checkpoints
    (GLM-5, DeepSeek-V3) store each expert's gate_proj, up_proj and down_proj:

    w_gate_up (E, 2I, H) [gate | up] -> gu_codes (E, 2I, H) e4m3fn and gu_scale
    (E, 2 * ceil(I/128), ceil(H/128)) fp32: gate's block rows, then up's (each quantized as
    its own matrix, so a block never mixes gate and up rows);
    w_down (E, H, I) -> d_codes (E, H, I), d_scale (E, ceil(H/128), ceil(I/128)).
    The bits of ``quantize_weight_fp8`` on each matrix, on every device."""
    check_tensor("w_gate_up", w_gate_up, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
    check_tensor("w_down", w_down, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
    if w_gate_up.shape[0] == 0 or w_gate_up.shape[0] != w_down.shape[0]:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} and w_down {tuple(w_down.shape)} must stack the same "
                         "experts, at least one")
    E, I2, H = w_gate_up.shape
    I, nbi, nbh, dev = I2 // 2, cdiv(I2 // 2, BLOCK), cdiv(H, BLOCK), w_gate_up.device
    gu_codes = torch.empty(E, I2, H, dtype=FP8_DTYPE, device=dev)
    gu_scale = torch.empty(E, 2 * nbi, nbh, dtype=torch.float32, device=dev)
    d_codes = torch.empty(E, H, I, dtype=FP8_DTYPE, device=dev)
    d_scale = torch.empty(E, nbh, nbi, dtype=torch.float32, device=dev)
    for e in _expert_chunks(w_gate_up):  # a few stacked calls a layer, not three an expert
        gu_codes[e, :I], gu_scale[e, :nbi] = quantize_weight(w_gate_up[e, :I].detach())
        gu_codes[e, I:], gu_scale[e, nbi:] = quantize_weight(w_gate_up[e, I:].detach())
        d_codes[e], d_scale[e] = quantize_weight(w_down[e].detach())
    return gu_codes, gu_scale, d_codes, d_scale


# fp32 bytes of expert weights one stacked (de)quantization call takes (its temporaries are a few times that):
# on CUDA enough that each launch is bandwidth-bound; on the CPU what stays near the caches (quantize 3x faster
# than in 256 MiB calls at E 256, I 96, H 256)
_QUANT_CHUNK_BYTES = {"cpu": 1 << 24, "cuda": 1 << 28}


def _expert_chunks(w_gate_up: torch.Tensor) -> list[slice]:
    """The expert slices of the stacked FP8 (de)quantizers: as many experts a call as fit the
    device's ``_QUANT_CHUNK_BYTES`` of fp32 gate, up and down weights (at least one)."""
    E, I2, H = w_gate_up.shape
    budget = _QUANT_CHUNK_BYTES.get(w_gate_up.device.type, _QUANT_CHUNK_BYTES["cuda"])
    n = max(1, budget // max(1, 4 * 3 * (I2 // 2) * H))
    return [slice(e, min(e + n, E)) for e in range(0, E, n)]


class Fp8ExpertsCache:
    """The FP8 serving copy of an expert layer's masters (``quantize_experts_fp8`` of both stacks),
    remade once per optimizer step, as ``Fp8WeightCache`` is for a dense weight: the trainer's
    forwards, the server and the weight sync read the same codes until a master changes.

        cache = Fp8ExpertsCache(layer.gate_up, layer.down)   # fp32 nn.Parameters (E, 2I, H), (E, H, I)
        y = cache.experts(x, ids, weights)                   # moe_experts_fp8 with the masters
    """

    def __init__(self, master_gate_up: torch.Tensor, master_down: torch.Tensor):
        from ..fp8.op import QuantizedCache

        check_tensor("master_gate_up", master_gate_up, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
        check_tensor("master_down", master_down, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
        self.master_gate_up, self.master_down = master_gate_up, master_down
        self._cache = QuantizedCache((master_gate_up, master_down), quantize_experts_fp8)

    @property
    def quantizations(self) -> int:
        return self._cache.quantizations

    def get(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gu_codes, gu_scale, d_codes, d_scale): what the server reads."""
        return self._cache.get()

    def invalidate(self) -> None:
        self._cache.invalidate()

    def invalidate_after(self, optimizer: torch.optim.Optimizer):
        return self._cache.invalidate_after(optimizer)

    def experts(self, x, ids, weights, *, limit=None, lora=None) -> torch.Tensor:
        gate_up, down = (m if m.requires_grad else None for m in (self.master_gate_up, self.master_down))
        return moe_experts_fp8(x, ids, weights, *self.get(), master_gate_up=gate_up, master_down=down, limit=limit,
                               lora=lora)


def dequantize_experts_fp8(gu_codes, gu_scale, d_codes, d_scale, dtype=torch.float32):
    """``quantize_experts_fp8``'s layout -> (w_gate_up (E, 2I, H), w_down (E, H, I)) in dtype,
    each element dtype(fl32(code * scale))."""
    I = gu_codes.shape[1] // 2
    nbi = cdiv(I, BLOCK)
    gu = torch.empty(gu_codes.shape, dtype=dtype, device=gu_codes.device)
    d = torch.empty(d_codes.shape, dtype=dtype, device=d_codes.device)
    for e in _expert_chunks(gu_codes):
        gu[e, :I] = dequantize_weight(gu_codes[e, :I], gu_scale[e, :nbi], dtype)
        gu[e, I:] = dequantize_weight(gu_codes[e, I:], gu_scale[e, nbi:], dtype)
        d[e] = dequantize_weight(d_codes[e], d_scale[e], dtype)
    return gu, d


def quantize_experts_mxfp4(w_gate_up: torch.Tensor, w_down: torch.Tensor):
    """Expert stacks -> MXFP4 (``mxfp4.py``: E2M1 codes two per byte, low nibble first, an E8M0
    scale per 32 along K), DeepSeek-V4's expert format: w_gate_up (E, 2I, H) -> gu_codes
    (E, 2I, H/2) uint8, gu_scales (E, 2I, H/32) uint8; w_down (E, H, I) -> (E, H, I/2), (E, H, I/32).
    Rows are quantized alone, so the fused [gate | up] stack is the two matrices' codes stacked."""
    check_tensor("w_gate_up", w_gate_up, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
    check_tensor("w_down", w_down, dtypes=FLOAT_DTYPES, ndim=3, contiguous=False)
    return (*quantize_mxfp4(w_gate_up), *quantize_mxfp4(w_down))


def dequantize_experts_mxfp4(gu_codes, gu_scales, d_codes, d_scales, dtype=torch.float32):
    """``quantize_experts_mxfp4``'s layout -> (w_gate_up, w_down) in dtype, exact."""
    return dequantize_mxfp4(gu_codes, gu_scales, dtype), dequantize_mxfp4(d_codes, d_scales, dtype)


_FORMATS = {"fp8": (experts_fp8_fwd, dequantize_experts_fp8), "mxfp4": (experts_mxfp4_fwd, dequantize_experts_mxfp4)}


class _QuantizedExperts(torch.autograd.Function):
    """Straight-through, as ``fp8_linear``: the quantizers count as the identity, so the
    backward is ``_experts_bwd`` at the dequantized weights rounded to x.dtype; the weight
    gradients go to the masters (their dtype), never to the codes."""

    @staticmethod
    def forward(ctx, fmt, x, ids, weights, master_gu, master_d, gu_codes, gu_scale, d_codes, d_scale, limit,
                la, lb, lc, ld, scale):
        ctx.save_for_backward(x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, la, lb, lc, ld)
        ctx.fmt, ctx.limit, ctx.scale = fmt, limit, scale
        ctx.master_dtypes = (None if master_gu is None else master_gu.dtype, None if master_d is None else master_d.dtype)
        lora = _lora_of((la, lb, lc, ld), scale)
        return _FORMATS[fmt][0](x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, limit, lora)

    @staticmethod
    def backward(ctx, dy):
        x, ids, weights, gu_codes, gu_scale, d_codes, d_scale, *lt = ctx.saved_tensors
        lora = _lora_of(lt, ctx.scale)
        stacks = _quantized_stacks(ctx.fmt, (gu_codes, gu_scale, d_codes, d_scale), x.dtype)
        gu_dt, d_dt = ctx.master_dtypes
        need_w = gu_dt is not None or d_dt is not None
        dx, dw, dgu_w, dd_w, dl = _experts_bwd(x, ids, weights, stacks, dy, ctx.limit, lora, need_w)
        return (None, dx.to(x.dtype), None, dw.to(weights.dtype), None if gu_dt is None else dgu_w.to(gu_dt),
                None if d_dt is None else dd_w.to(d_dt), None, None, None, None, None, *_lora_grads(lora, dl), None)


def _check_masters(master_gate_up, master_down, E: int, I: int, H: int) -> None:
    for name, m, want in (("master_gate_up", master_gate_up, (E, 2 * I, H)), ("master_down", master_down, (E, H, I))):
        if m is not None and tuple(m.shape) != want:
            raise ValueError(f"{name} has shape {tuple(m.shape)}; its codes need {want}")


def moe_experts_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gu_codes: torch.Tensor,
                    gu_scale: torch.Tensor, d_codes: torch.Tensor, d_scale: torch.Tensor, *,
                    master_gate_up: torch.Tensor | None = None, master_down: torch.Tensor | None = None,
                    limit: float | None = None, lora=None) -> torch.Tensor:
    """``moe_experts`` on FP8 experts (GLM-5): the routed sum in fp32.

    gu_codes / gu_scale / d_codes / d_scale: ``quantize_experts_fp8``'s layout (the codes the
    server reads: quantize the masters once per optimizer step).  ``master_gate_up`` (E, 2I, H)
    and ``master_down`` (E, H, I): the weights those codes quantize, which get the
    straight-through gradients (their values are never read); None: frozen.  Differentiable
    w.r.t. x and weights too.  x is quantized per token in 1x128 groups, the SwiGLU output per
    row likewise; rounding points in ``cpu.experts_fwd_fp8_cpu``."""
    _check_tokens(x, ids, weights)
    for name, t in (("gu_codes", gu_codes), ("d_codes", d_codes)):
        check_tensor(name, t, dtypes=(FP8_DTYPE,), ndim=3)
    for name, t in (("gu_scale", gu_scale), ("d_scale", d_scale)):
        check_tensor(name, t, dtypes=(torch.float32,), ndim=3)
    check_same_device(x=x, ids=ids, weights=weights, gu_codes=gu_codes, gu_scale=gu_scale, d_codes=d_codes,
                      d_scale=d_scale)
    T, H = x.shape
    E, I2, H2 = gu_codes.shape
    I = I2 // 2
    if H2 != H or I2 % 2 or tuple(d_codes.shape) != (E, H, I):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, gu_codes {tuple(gu_codes.shape)} "
                         f"(want (E, 2I, {H})), d_codes {tuple(d_codes.shape)} (want (E, {H}, I))")
    want_gu, want_d = (E, 2 * cdiv(I, BLOCK), cdiv(H, BLOCK)), (E, cdiv(H, BLOCK), cdiv(I, BLOCK))
    if tuple(gu_scale.shape) != want_gu or tuple(d_scale.shape) != want_d:
        raise ValueError(f"expert scales: gu_scale {tuple(gu_scale.shape)} (want {want_gu}: gate's 128-row blocks, "
                         f"then up's), d_scale {tuple(d_scale.shape)} (want {want_d})")
    _check_masters(master_gate_up, master_down, E, I, H)
    _check_routing(ids, weights, T, E)
    _check_lora(lora, E, H, I, x)
    return _QuantizedExperts.apply("fp8", x, ids, weights, master_gate_up, master_down, gu_codes, gu_scale, d_codes,
                                   d_scale, limit, *_lora_args(lora))


def moe_experts_mxfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gu_codes: torch.Tensor,
                      gu_scales: torch.Tensor, d_codes: torch.Tensor, d_scales: torch.Tensor, *,
                      master_gate_up: torch.Tensor | None = None, master_down: torch.Tensor | None = None,
                      limit: float | None = None, lora=None) -> torch.Tensor:
    """``moe_experts`` on MXFP4 experts (DeepSeek-V4, ``quantize_experts_mxfp4``'s layout): the
    routed sum in fp32, the bits of ``moe_experts`` at the exactly decoded weights (computed
    packed on CUDA).  The backward decodes the weights (to x.dtype); masters, when given, get
    the straight-through gradients, else the experts are frozen (DeepSeek-V4 trains LoRA on
    them).  Scales may be uint8 or float8_e8m0fnu bytes."""
    _check_tokens(x, ids, weights)
    check_tensor("gu_codes", gu_codes, dtypes=(torch.uint8,), ndim=3)
    check_tensor("d_codes", d_codes, dtypes=(torch.uint8,), ndim=3)
    check_tensor("gu_scales", gu_scales, dtypes=E8M0_DTYPES, ndim=3)
    check_tensor("d_scales", d_scales, dtypes=E8M0_DTYPES, ndim=3)
    check_same_device(x=x, ids=ids, weights=weights, gu_codes=gu_codes, gu_scales=gu_scales, d_codes=d_codes,
                      d_scales=d_scales)
    T, H = x.shape
    E, I2, Hh = gu_codes.shape
    I = I2 // 2
    check_mx_shape("x", H)
    check_mx_shape("d_codes (the expert width)", 2 * d_codes.shape[-1])
    if 2 * Hh != H or I2 % 2 or tuple(d_codes.shape) != (E, H, I // 2):
        raise ValueError(f"expert shapes do not fit: x {tuple(x.shape)}, gu_codes {tuple(gu_codes.shape)} "
                         f"(want (E, 2I, {H // 2})), d_codes {tuple(d_codes.shape)} (want (E, {H}, I/2))")
    want_gu, want_d = (E, I2, H // 32), (E, H, I // 32)
    if tuple(gu_scales.shape) != want_gu or tuple(d_scales.shape) != want_d:
        raise ValueError(f"expert scales: gu_scales {tuple(gu_scales.shape)} (want {want_gu}), "
                         f"d_scales {tuple(d_scales.shape)} (want {want_d}): one per 32 along K")
    _check_masters(master_gate_up, master_down, E, I, H)
    _check_routing(ids, weights, T, E)
    gu_scales, d_scales = (s.view(torch.uint8) for s in (gu_scales, d_scales))
    _check_lora(lora, E, H, I, x)
    return _QuantizedExperts.apply("mxfp4", x, ids, weights, master_gate_up, master_down, gu_codes, gu_scales,
                                   d_codes, d_scales, limit, *_lora_args(lora))


def moe_combine(parts, dtype: torch.dtype) -> torch.Tensor:
    """Sum the contributions (routed sum, shared expert, ...), each (T, H), in
    the given logical order by the FP64 pairwise tree, rounded once to dtype."""
    return tree_reduce(list(parts), dtype)
