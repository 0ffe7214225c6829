"""Compile options that set a kernel's bits, chosen once for every Triton launch of the package.

Each launch passes ``enable_fp_fusion=FP_FUSION`` and a ``num_warps`` itself (``tests/test_launch_options.py``
fails on one that does not), so no bit follows a toolchain default or the environment: Triton's FP-fusion
default is True up to 3.9, flips in 3.10, and ``TRITON_DEFAULT_FP_FUSION`` overrides it per process; ``num_warps``
lays out every ``tl.sum`` and so fixes its order.

Other defaults checked, and why they stay where they are:

- ``tl.dot`` on fp32 operands names its ``input_precision`` ("ieee", or "tf32x3" in the GDN); the default
  (tf32, or ``TRITON_F32_DEFAULT``) is never read.  bf16 and fp8 operands have no such option.
- fp8 ``tl.dot`` leaves ``max_num_imprecise_acc`` to the backend: sm_90's 2**30 lets Hopper's fp8 MMA accumulate
  a whole 128-wide K block in its own precision, and no value a launch may state reproduces it (``tl.dot`` refuses
  one above K; K or less adds fp32 promotions).  The test reads the backend's default instead.
- ``enable_reflect_ftz`` (libdevice's flush of subnormals): the kernels that call libdevice to match torch's CUDA
  ops pass False (the GDN, the router); the others keep Triton's True, which the test reads too.
"""
from __future__ import annotations

FP_FUSION = False  # no mul + add becomes an FMA: each product rounds on its own, as the CPU paths and torch's ops do
