"""Batch-invariant primitives shared by every model.

One folder per op (matmul, rmsnorm, rope, swiglu, lm_head, sampling, tree,
attention, kv_cache, mhc and compress (DeepSeek-V4's hyper-connections and KV
compressors), and qk_norm_rope: the server's fused q/k RMSNorm + RoPE + KV
write): a Triton kernel for CUDA, a CPU path that is batch-invariant by
construction, a float64 reference, launchers, an autograd Function and one
public function.  ``ladder`` holds the rung 1-2 checks and
``checks`` the registry behind ``alignzoo check``.
"""

from ._mkl import warm_vml

warm_vml()  # before any CPU path: a concurrent first call of an MKL VML function can pick a wrong kernel
