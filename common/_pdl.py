"""Programmatic dependent launch (PDL) for the forward kernels on Hopper.

A kernel launched with PDL may be launched, and run its programs up to
``wait_prior``, while the kernel before it in the stream is still draining;
``wait_prior`` (PTX ``griddepcontrol.wait``) then blocks until that kernel
has finished and its writes are visible.  Every PDL kernel calls it as its
first statement, before any global load or store, so nothing it reads or
writes can race the previous kernel: the same programs run the same
arithmetic on the same inputs, and only the launch latency between kernels
is hidden.  In a CUDA graph the dependency is kept as a programmatic edge.

The kernels never call ``gdc_launch_dependents``: the next kernel launches as
this one's programs exit, so its waiting programs cannot take SM slots from
this kernel's later ones.

``pdl_options(device)`` gives a launch's keyword arguments: the ``PDL``
constexpr and Triton's ``launch_pdl`` together (never one without the other),
on CUDA devices of compute capability >= 9 with a Triton that has both;
``ALIGNZOO_PDL`` = 0 turns it off, 2 also triggers the next launch right
after the wait (for measurement).  Elsewhere (CPU, the interpreter) ``PDL`` is False and the
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
    """First statement of a PDL kernel: wait for the previous kernel's end
    (PDL >= 1); PDL == 2 then lets the next kernel launch at once."""
    if PDL:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


_OFF = {"PDL": False}
_ENABLED: dict[int, bool] = {}


def _triton_has_pdl() -> bool:
    if gdc_wait is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


def pdl_options(device: torch.device) -> dict:
    """Keyword arguments that launch a PDL-ready kernel with PDL where it is available."""
    level = int(os.environ.get("ALIGNZOO_PDL", "1"))
    if device.type != "cuda" or not level or os.environ.get("TRITON_INTERPRET"):
        return _OFF
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _ENABLED:
        _ENABLED[idx] = torch.cuda.get_device_capability(idx)[0] >= 9 and _triton_has_pdl()
    return {"PDL": level, "launch_pdl": True} if _ENABLED[idx] else _OFF
