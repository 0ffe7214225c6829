"""Host-side integer helpers for the kernel launchers.

``triton.cdiv`` and ``triton.next_power_of_2`` are ``ConstexprFunction``
wrappers in recent Triton (usable inside ``@triton.jit`` code); called from
Python they cost ~12 and ~6 µs each (triton 3.9 on this machine), and a
launcher computes several per launch: ``matmul.launch_config`` spent ~120 µs
of them per call.  These are the same integer functions in plain Python.
Kernel bodies keep ``tl.cdiv``.
"""
from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for integers, b > 0."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, n >= 1 (0 for 0, as triton's)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()
