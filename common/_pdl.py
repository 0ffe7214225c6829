"""Programmatic dependent launch (PDL) for the forward kernels on Hopper.

A kernel launched with PDL may be launched, and run its programs up to
``wait_prior``, while the kernel before it in the stream is still draining;
``wait_prior`` (PTX ``griddepcontrol.wait``) then blocks until that kernel
has finished and its writes are visible.  Every PDL kernel calls it as its
first statement, before any global load or store, so nothing it reads or
writes can race the previous kernel: the same programs run the same
arithmetic on the same inputs, and only the launch latency between kernels
is hidden.  In a CUDA graph the dependency is kept as a programmatic edge.

Right after the wait a program lets the next kernel launch
(``griddepcontrol.launch_dependents``).  The next kernel launches only once
every program of this one has started and triggered (or exited), so its
waiting programs take SM slots in this kernel's last wave at the earliest
(the qwen3-8b batch-1 decode graph replays 6% faster than without PDL:
benchmarks/results/2026-11-30-h200-primitives.md).  Launches of more than
``PDL_MAX_ROWS`` rows (tokens) go without it, prefill included.

``pdl_options(device, rows)`` gives a launch's keyword arguments: the ``PDL``
constexpr and Triton's ``launch_pdl`` together (never ``launch_pdl`` without the
constexpr; ``pdl_pair`` compiles a producer with it and launches it plainly),
on CUDA devices of compute capability >= 9 with a Triton that has both, for
at most ``PDL_MAX_ROWS`` rows, unless ``ALIGNZOO_PDL=0``.  Any mix of PDL and
plain launches in a stream is safe: a plain launch waits as always, and a PDL
kernel after a plain one finds it finished at its wait.  Elsewhere (CPU, the interpreter) ``PDL`` is False and the
wait is compiled out.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # an older Triton: pdl_options never turns PDL on
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """First statement of a PDL kernel: wait for the previous kernel's end,
    then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


PDL_MAX_ROWS = 64  # at batch 256 PDL costs 3.8% of the qwen3-8b decode replay (2026-11-30-h200-primitives.md)
_OFF = {"PDL": False}
_ON = {"PDL": True, "launch_pdl": True}
_TRIGGER = {"PDL": True}  # compiled with the wait and the trigger, launched plainly: see pdl_pair
_ENABLED: dict[int, bool] = {}


def _triton_has_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_options(device: torch.device, rows: int) -> dict:
    """Keyword arguments that launch a PDL-ready kernel over ``rows`` rows
    (tokens) with PDL where it is available and measured to help."""
    if (device.type != "cuda" or rows > PDL_MAX_ROWS or os.environ.get("ALIGNZOO_PDL", "1") == "0"
            or os.environ.get("TRITON_INTERPRET")):
        return _OFF
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ENABLED:
        _ENABLED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9 and _triton_has_pdl()
    return _ON if _ENABLED[idx] else _OFF


def pdl_pair(device: torch.device, rows: int) -> tuple[dict, dict]:
    """Launch options of a producer kernel and the consumer right after it
    (the split matmul and its merge): ``pdl_options`` for both up to
    ``PDL_MAX_ROWS`` rows; above, the consumer alone is PDL-launched, and the
    producer is compiled with ``wait_prior`` but launched plainly.  Its wait
    then finds the kernel before it finished (a plain launch starts after
    it), and its trigger lets the consumer launch during its last wave, where
    the consumer's programs wait for its end (the k/v split at M = 256 runs 6% faster)."""
    if pdl_options(device, 1) is _OFF:
        return _OFF, _OFF
    return (_ON, _ON) if rows <= PDL_MAX_ROWS else (_TRIGGER, _ON)
