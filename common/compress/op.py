"""DeepSeek-V4's KV compressors: launchers, autograd and the public functions.

Both forms run one launcher, ``compress_fwd``, and in it one per-group routine
(``cpu.group_rows``; order and rounding points in ``cpu.py``), so a row has the same bits
whether the trainer builds it from a packed batch or the server builds it across any number
of steps:

* trainer, ``compress``: packed sequences from position 0 -> every complete group's row.
* server, ``compress_step``: each sequence continues from its state slot at its start position;
  the slot keeps a ring of the sequence's last B = rate (C128) or 2 * rate (C4: this group and
  the previous one, whose first D channels the next row reads) kv and gate rows, so a group may
  be split across calls anywhere (chunked prefill, decode).  A row is emitted by the token that
  completes its group (position p with (p + 1) % rate == 0).

Not in the op: ``kv_norm`` and the "compress" RoPE.  The model applies them to the rows with the
project's row-wise ops, ``rmsnorm`` (trainer) / ``rmsnorm_fwd`` (server) and ``rope`` /
``rope_fwd`` at ``positions`` (the group's first token, w * rate), which give a row the same bits
wherever it sits, so a row is created identically on both sides.  (kv_norm's weight is fp32 in
transformers: with bf16 kv the model needs an RMSNorm that rounds once to bf16.)

CUDA graphs: ``compress_step`` with ``at=None`` (decode) has fixed shapes given T and N and no host
reads: the window of every token is gathered (rows of tokens that close no group are zeroed, the
model's RatePool slot mapping skips them), the ring update is a fixed-shape gather plus
``scatter_slots`` (a padding sequence's slot -1 writes nothing).  Eager prefill passes
``at = group_ends(...)[0]`` (a host read) to build only the closed groups' rows.
On CUDA the rows come from one Triton launch (``kernel.py``) that reads the slots in place, in
``cpu.py``'s order; the ring update and the backward are the element-wise torch ops on any device.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

from .._validate import FLOAT_DTYPES, check_int, check_same_device, check_tensor
from .cpu import compress_bwd_cpu, compress_rows_cpu, ring_update

_INDEX_DTYPES = (torch.int32, torch.int64)


def ring_len(rate: int, overlap: bool) -> int:
    """Rows a state slot keeps: the open group, and with overlap the previous group too."""
    return 2 * rate if overlap else rate


def compress_state_fields(rate: int, channels: int, *, overlap: bool, dtype: torch.dtype):
    """A StatePool's fields for one compressor: the last ``ring_len`` kv and gate rows (C channels,
    the projections' width: 2 * D with overlap), row of position q at index q % ring_len."""
    B = ring_len(rate, overlap)
    return {"ring_kv": ((B, channels), dtype), "ring_gate": ((B, channels), dtype)}


def visible_rows(positions: torch.Tensor, rate: int) -> torch.Tensor:
    """How many compressed rows a query at ``positions`` sees: row w iff w < (p + 1) // rate
    (transformers' ``block_bias``; the row of p's own group once p completes it)."""
    return torch.div(positions + 1, rate, rounding_mode="floor")


def group_ends(cu_seqlens: torch.Tensor, rate: int, start_positions: torch.Tensor | None = None):
    """The groups this call completes (a host read; eager use) -> (at (G,) int64: the packed index of
    each group's last token, positions (G,) int64: its first token's position, cu_rows (N + 1,) int64:
    each sequence's groups in order)."""
    dev = cu_seqlens.device
    cu = cu_seqlens.long()
    N = cu.shape[0] - 1
    starts = torch.zeros(N, dtype=torch.long, device=dev) if start_positions is None else start_positions.long()
    first = torch.div(starts, rate, rounding_mode="floor")  # row w completes at (w + 1) * rate - 1 >= start
    counts = (torch.div(starts + (cu[1:] - cu[:-1]), rate, rounding_mode="floor") - first).clamp(min=0)
    cu_rows = torch.zeros(N + 1, dtype=torch.long, device=dev)
    cu_rows[1:] = torch.cumsum(counts, 0)
    G = int(cu_rows[-1])
    seq = torch.repeat_interleave(torch.arange(N, device=dev), counts, output_size=G)
    w = first[seq] + torch.arange(G, device=dev) - cu_rows[seq]
    at = cu[seq] + (w + 1) * rate - 1 - starts[seq]
    return at, w * rate, cu_rows


def compress_fwd(kv, gate, position_bias, cu_seqlens, at=None, *, rate: int, overlap: bool, start_positions=None,
                 slots=None, ring_kv=None, ring_gate=None) -> torch.Tensor:
    """The launcher both forms call; no validation.

    kv, gate (T, C); position_bias (rate, C) fp32; cu_seqlens (N + 1,).  ``at`` (G,) packed indices
    of group-closing tokens -> rows (G, D); ``at=None``: every token -> (T, D), zeros where a token
    closes no group.  With ``ring_kv``/``ring_gate`` (S, B, C), ``slots`` (N,) and
    ``start_positions`` (N,): a sequence reads its rows before its start from its slot's ring, then
    the ring (in place) keeps its last B rows; slot -1 is read as slot 0 and written nowhere."""
    if at is None:
        at = torch.arange(kv.shape[0], device=kv.device)
    rows_fn = compress_rows_cpu
    if kv.is_cuda:
        from .kernel import compress_rows_triton as rows_fn
    rows = rows_fn(kv, gate, position_bias, cu_seqlens, at.long(), rate=rate, overlap=overlap, starts=start_positions,
                   slots=slots, ring_kv=ring_kv, ring_gate=ring_gate)
    if ring_kv is not None:  # after the rows: they read the ring as it was before this call
        ring_update(kv, gate, cu_seqlens, start_positions, slots, ring_kv, ring_gate)
    return rows


def compress_bwd(dy, kv, gate, position_bias, cu_seqlens, at, *, rate: int, overlap: bool):
    """Gradients of the trainer's rows -> (dkv (T, C), dgate (T, C), dposition_bias (rate, C));
    formulas in ``cpu.compress_bwd_cpu``."""
    return compress_bwd_cpu(dy.contiguous(), kv, gate, position_bias, cu_seqlens, at.long(), rate=rate,
                            overlap=overlap)


class _CompressFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, kv, gate, position_bias, cu_seqlens, at, rate, overlap):
        ctx.save_for_backward(kv, gate, position_bias, cu_seqlens, at)
        ctx.rate, ctx.overlap = rate, overlap
        return compress_fwd(kv, gate, position_bias, cu_seqlens, at, rate=rate, overlap=overlap)

    @staticmethod
    def backward(ctx, dy):
        kv, gate, pb, cu, at = ctx.saved_tensors
        dkv, dgate, dpb = compress_bwd(dy, kv, gate, pb, cu, at, rate=ctx.rate, overlap=ctx.overlap)
        return dkv, dgate, dpb, None, None, None, None


def _check(kv, gate, position_bias, cu_seqlens, rate, overlap):
    check_int("rate", rate)
    if not isinstance(overlap, bool):
        raise ValueError(f"overlap must be a bool, got {overlap!r}")
    check_tensor("kv", kv, dtypes=FLOAT_DTYPES, ndim=2)
    check_tensor("gate", gate, dtypes=(kv.dtype,), ndim=2)
    if gate.shape != kv.shape:
        raise ValueError(f"gate must have kv's shape {tuple(kv.shape)}, got {tuple(gate.shape)}")
    C = kv.shape[1]
    if C < 1 or (overlap and C % 2):
        raise ValueError(f"kv: {C} channels; with overlap=True they must be 2 * D (even), else D >= 1")
    check_tensor("position_bias", position_bias, dtypes=(torch.float32,), ndim=2)
    if tuple(position_bias.shape) != (rate, C):
        raise ValueError(f"position_bias must be (rate, C) = ({rate}, {C}), got {tuple(position_bias.shape)}")
    check_tensor("cu_seqlens", cu_seqlens, dtypes=_INDEX_DTYPES, ndim=1)
    if cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be (N + 1,) with N >= 1, got shape {tuple(cu_seqlens.shape)}")
    check_same_device(kv=kv, gate=gate, position_bias=position_bias, cu_seqlens=cu_seqlens)


def compress(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, cu_seqlens: torch.Tensor, *,
             rate: int, overlap: bool):
    """The trainer's compressor over packed sequences, each from position 0.

    kv, gate:      (T, C) bf16 or fp32, the kv_proj / gate_proj outputs; C = D (C128, overlap=False)
                   or 2 * D (C4 and the indexer's compressor, overlap=True: [:D] feeds the next
                   group, [D:] its own)
    position_bias: (rate, C) fp32
    cu_seqlens:    (N + 1,) int, 0 = cu[0] <= ... <= cu[N] = T
    returns        (rows (G, D) in kv's dtype, before kv_norm and RoPE; positions (G,) int64, the
                   RoPE position of each row (its group's first token); cu_rows (N + 1,) int64):
                   every complete group of each sequence in order; a trailing partial group gives none.
    Differentiable in kv, gate and position_bias.  Reads cu_seqlens on the host.
    """
    _check(kv, gate, position_bias, cu_seqlens, rate, overlap)
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != kv.shape[0] or any(b < a for a, b in zip(cu[:-1], cu[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {kv.shape[0]}, got {cu}")
    at, positions, cu_rows = group_ends(cu_seqlens, rate)
    rows = _CompressFn.apply(kv, gate, position_bias, cu_seqlens, at, rate, overlap)
    return rows, positions, cu_rows


def compress_step(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, cu_seqlens: torch.Tensor,
                  start_positions: torch.Tensor, slots: torch.Tensor, state: Mapping[str, torch.Tensor], *,
                  rate: int, overlap: bool, at: torch.Tensor | None = None) -> torch.Tensor:
    """The server's compressor: each sequence's new tokens continue its state slot.

    kv, gate, position_bias: as ``compress``; cu_seqlens (N + 1,) this call's tokens per sequence
    (any number: a prefill, a chunk split anywhere, inside a group too, or one decode token);
    start_positions (N,) each sequence's first new position (0: the slot is not read);
    slots (N,) its state slot (-1: a padding sequence, nothing written);
    state: {"ring_kv", "ring_gate"} (S, ring_len, C) in kv's dtype (``compress_state_fields``),
    updated in place.
    at=None: returns (T, D), row t the group token t completes (its position p has
    (p + 1) % rate == 0: row index (p + 1) // rate - 1, RoPE position p + 1 - rate), zeros
    elsewhere; fixed shapes, no host reads (CUDA-graph decode).  at (G,) from
    ``group_ends(cu_seqlens, rate, start_positions)[0]``: those groups' rows (G, D) only
    (prefill).  Rows come before kv_norm and RoPE and have the bits ``compress`` gives the same group.
    """
    _check(kv, gate, position_bias, cu_seqlens, rate, overlap)
    N = cu_seqlens.shape[0] - 1
    for name, t in (("start_positions", start_positions), ("slots", slots)):
        check_tensor(name, t, dtypes=_INDEX_DTYPES, ndim=1)
        if t.shape[0] != N:
            raise ValueError(f"{name} must be (N,) = ({N},) like cu_seqlens, got {tuple(t.shape)}")
    missing = {"ring_kv", "ring_gate"} - set(state)
    if missing:
        raise ValueError(f"state lacks {sorted(missing)} (see compress_state_fields)")
    ring_kv, ring_gate = state["ring_kv"], state["ring_gate"]
    want = (ring_len(rate, overlap), kv.shape[1])
    for name, t in (("ring_kv", ring_kv), ("ring_gate", ring_gate)):
        check_tensor(f"state[{name!r}]", t, dtypes=(kv.dtype,), ndim=3)
        if tuple(t.shape[1:]) != want:
            raise ValueError(f"state[{name!r}] must be (S, {want[0]}, {want[1]}) for rate {rate}, "
                             f"overlap={overlap}; got {tuple(t.shape)}")
    if at is not None:
        check_tensor("at", at, dtypes=_INDEX_DTYPES, ndim=1)
    check_same_device(kv=kv, start_positions=start_positions, slots=slots, ring_kv=ring_kv, ring_gate=ring_gate, at=at)
    return compress_fwd(kv, gate, position_bias, cu_seqlens, at, rate=rate, overlap=overlap,
                        start_positions=start_positions, slots=slots, ring_kv=ring_kv, ring_gate=ring_gate)
