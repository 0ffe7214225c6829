"""The gated delta rule as a conventional serving stack runs it: the vendor baseline.

Neither the trainer's bits nor batch-invariant by design: what the aligned engine is measured
against (``models/qwen35_gdn/serve_vendor.py``).  On CUDA:

- decode (one token per sequence): the per-token recurrent update S = S·exp(g);
  v' = β(v − Sᵀk); S += k v'ᵀ; o = Sᵀq, one program per (sequence, value head, 8 value columns)
  with the state tile in registers, read and written in place at the sequence's slot: fla's
  ``fused_recurrent_gated_delta_rule`` kernel with a slot index, as SGLang's decode runs it;
- prefill: fla's ``chunk_gated_delta_rule`` (bf16 q/k/v, the slot's state in, the final state
  written back) where fla is installed, else the aligned path.

Off CUDA (the CPU tests) every shape runs the aligned ``gdn_fwd``: the vendor servers there differ
from the aligned ones in their projections, norms, router and experts, not here.  Only ``state``
of the slot's cache is kept; the aligned open-chunk rows are neither read nor written.
"""
from __future__ import annotations

import functools
import importlib.util

import torch

from .op import gdn_fwd


@functools.cache
def has_fla() -> bool:
    return importlib.util.find_spec("fla") is not None


def gdn_vendor_fwd(q, k, v, g, beta, cu_seqlens, *, start_positions, cache, slots) -> torch.Tensor:
    """``gdn_fwd``'s serving call (with a cache) the vendor's way -> o (T, HV, V) fp32.  q is
    L2-normalized and scaled by K^-0.5 already (fla's scale is 1 here)."""
    if not q.is_cuda:
        return gdn_fwd(q, k, v, g, beta, cu_seqlens, start_positions=start_positions, cache=cache, slots=slots)
    B = cu_seqlens.shape[0] - 1
    state = cache["state"]
    if q.shape[0] == B:
        from .vendor_kernel import recurrent_decode

        return recurrent_decode(q.contiguous(), k.contiguous(), v.contiguous(), g.contiguous(), beta.contiguous(),
                                slots.long(), state)
    if not has_fla():
        return gdn_fwd(q, k, v, g, beta, cu_seqlens, start_positions=start_positions, cache=cache, slots=slots)
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cont = start_positions > 0
    h0 = None  # every sequence from position 0: fla starts from zeros, no state is read
    if bool(cont.any()):  # a prefill is not captured: the host read is fine
        h0 = torch.where(cont[:, None, None, None], state[slots.long().clamp(min=0)], 0.0)
    dt = torch.bfloat16
    with torch.no_grad():
        o, ht = chunk_gated_delta_rule(q.to(dt)[None], k.to(dt)[None], v.to(dt)[None], g.float()[None],
                                       beta.float()[None], scale=1.0, initial_state=h0, output_final_state=True,
                                       cu_seqlens=cu_seqlens.long())
    keep = slots >= 0
    state[slots[keep].long()] = ht[keep].float()
    return o[0].float()
