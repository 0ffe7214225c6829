"""Where the matmul's default launch may pick the Gluon kernel: ``graph_launches()``.

Inside the block, default launches may pick the Gluon kernel
(``kernel.launch_config``): for work that a CUDA graph captures, where only
device time is replayed.  Enter it for the eager warm-up before a capture
too, so the Gluon kernels compile outside the capture (a kernel's first
launch loads its module, which the CUDA driver refuses while a stream
captures).

Outside it the defaults keep Triton's kernels: a Gluon launch costs more
Python per call (five descriptors with layouts, and their binding), enough to
halve eager batch-1 prefill (benchmarks/results/2026-11-30-h200-engine.md).
The schedule never changes a bit.
"""
from __future__ import annotations

import contextlib

_DEPTH = [0]


@contextlib.contextmanager
def graph_launches():
    _DEPTH[0] += 1
    try:
        yield
    finally:
        _DEPTH[0] -= 1


def graph_launches_active() -> bool:
    return _DEPTH[0] > 0
