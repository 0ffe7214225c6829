"""Run a test script under Triton's interpreter (``TRITON_INTERPRET=1``) in a
fresh process: the interpreter is chosen when Triton is imported, so the
tests that check a kernel's source on CPU tensors cannot run it in-process."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest


# A script's first lines for kernels that use exp / rsqrt (libdevice's on CUDA, which are torch's
# CUDA ops') or round fp32 to bf16, so an interpreted kernel is compared with the torch path on its
# structure (trees, masks, slots), not on numpy's math: numpy's fp32 exp differs from torch's in the
# last bit on about a third of arguments, the interpreter truncates to bf16 where CUDA and torch
# round to nearest even, and its float tl.sum starts from +0.0 (-0.0 + -0.0 -> +0.0) where a
# compiled reduction starts from its first element (a tree level's pair then sums as on the GPU,
# signed zeros included).
TORCH_MATH = r"""
import numpy as np
import torch
import triton.language as tl
from triton.runtime import interpreter as _it

for _name, _fn in (("create_exp", torch.exp), ("create_rsqrt", torch.rsqrt)):
    setattr(_it.InterpreterBuilder, _name, lambda self, arg, fn=_fn: self.unary_op(
        arg, lambda a: fn(torch.from_numpy(np.array(a, copy=True))).numpy()))
_cast = _it.InterpreterBuilder.cast_impl
def _cast_rne(self, src, dst_type):
    if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
        t = torch.from_numpy(np.array(src.data, copy=True)).to(torch.bfloat16)
        return _it.TensorHandle(t.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
    return _cast(self, src, dst_type)
_it.InterpreterBuilder.cast_impl = _cast_rne
_np_sum = _it.ReduceOps.sum
_it.ReduceOps.sum = lambda self, x: (self.to_tensor(np.add.reduce(
    x.handle.data, axis=self.axis, keepdims=self.keep_dims, initial=-0.0), x.dtype)
    if x.handle.data.dtype.kind == "f" else _np_sum(self, x))
"""


# Put before every interpreted script.  The interpreter re-patches triton.language on every nested jit call
# (each level of a tree, each tl.sum): test_gdn.py's decode script took 40 s, 18 s with this.  Within one launch
# a module once patched stays patched, so patch each once per launch (the values computed are the same).
ONE_PATCH_A_LAUNCH = r"""
import inspect as _inspect

import triton.language as _tl
from triton.runtime import interpreter as _it

_patched, _langs_of, _patch_lang, _grid_call = set(), {}, _it._patch_lang, _it.GridExecutor.__call__


def _patch_once(fn):
    langs = _langs_of.get(fn)
    if langs is None:
        mods = fn.__globals__.values()
        langs = _langs_of[fn] = {id(m) for m in mods if _inspect.ismodule(m) and m in (_tl, _tl.core)}
    if langs <= _patched:
        return _it._LangPatchScope()
    _patched.update(langs)
    return _patch_lang(fn)


def _grid_once(self, *a, **kw):
    _patched.clear()
    return _grid_call(self, *a, **kw)


_it._patch_lang, _it.GridExecutor.__call__ = _patch_once, _grid_once
"""


def run_interpreted(script: str, *, timeout: int = 600, expect: str | None = None, interpret: bool = True) -> str:
    """Run ``script`` (Python source) interpreted; it fails the calling test
    when the script exits non-zero (an assertion inside it) or, with
    ``expect``, when its output does not end with that line.  -> its stdout.
    ``interpret=False``: compiled instead (a GPU test of the same script), from a
    file, since ``triton.jit`` reads its kernels' source."""
    pytest.importorskip("triton")
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(ONE_PATCH_A_LAUNCH + script if interpret else script)
        f.flush()
        run = subprocess.run([sys.executable, f.name], env={**os.environ, "TRITON_INTERPRET": "1" if interpret else "0"},
                             capture_output=True, text=True, timeout=timeout)
    ok = run.returncode == 0 and (expect is None or run.stdout.strip().endswith(expect))
    assert ok, f"exit {run.returncode}\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    return run.stdout
