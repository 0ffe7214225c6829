"""Run a test script under Triton's interpreter (``TRITON_INTERPRET=1``) in a
fresh process: the interpreter is chosen when Triton is imported, so the
tests that check a kernel's source on CPU tensors cannot run it in-process."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest


def run_interpreted(script: str, *, timeout: int = 600, expect: str | None = None, interpret: bool = True) -> str:
    """Run ``script`` (Python source) interpreted; it fails the calling test
    when the script exits non-zero (an assertion inside it) or, with
    ``expect``, when its output does not end with that line.  -> its stdout.
    ``interpret=False``: compiled instead (a GPU test of the same script), from a
    file, since ``triton.jit`` reads its kernels' source."""
    pytest.importorskip("triton")
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(script)
        f.flush()
        run = subprocess.run([sys.executable, f.name], env={**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"},
                             capture_output=True, text=True, timeout=timeout)
    ok = run.returncode == 0 and (expect is None or run.stdout.strip().endswith(expect))
    assert ok, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return run.stdout
