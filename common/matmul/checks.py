"""Ladder rungs 1-2 and accuracy for matmul (``alignzoo check matmul``)."""
import torch

from ..ladder import accuracy, rung1_repeat, rung2_rows
from .naive import matmul_ref
from .op import matmul_fwd


def ladder(device: torch.device) -> list:
    g = torch.Generator().manual_seed(0)
    M, K, N = (48, 1000, 96) if device.type == "cpu" else (300, 4096, 1000)
    x = torch.randn(M, K, generator=g).to(device, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(device, torch.bfloat16)
    configs = [{}, {"row_chunk": 5}] if device.type == "cpu" else [
        {}, {"block_m": 64, "schedule": "split"}, {"block_m": 128, "schedule": "fused", "num_warps": 4},
        {"schedule": "tma_split"}, {"schedule": "tma_split", "block_n": 32, "num_stages": 4}]
    if device.type == "cuda":
        from . import gluon_kernel

        if gluon_kernel.available():  # the kernel CUDA graphs run inside graph_launches(): both forms
            configs += [{"schedule": "gluon"}, {"block_n": 96, "schedule": "gluon_ws"},
                        {"block_n": 128, "block_k": 128, "schedule": "gluon"}, {"schedule": "gluon_ws"}]
    return [
        rung1_repeat("matmul", matmul_fwd, x, w),
        rung2_rows("matmul", matmul_fwd, (x,), shared={"w": w}, configs=configs),
        accuracy("matmul", matmul_fwd(x, w), matmul_ref(x, w), 1e-2),
    ]
