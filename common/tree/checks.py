"""Ladder rungs 1-2 and accuracy for the reduction tree."""
import torch

from ..ladder import accuracy, rung1_repeat, rung2_rows
from .op import tree_reduce_fwd


def ladder(device: torch.device) -> list:
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(7, 301, 130, generator=g).to(device, torch.bfloat16)  # 7 = odd: one carried up

    def by_rows(x, **launch):  # rows along dim 0 for rung 2: (T, N, H) -> (T, H)
        return tree_reduce_fwd(x.transpose(0, 1).contiguous(), torch.bfloat16, **launch)

    rows = parts.transpose(0, 1).contiguous()
    configs = [{}] if device.type == "cpu" else [{}, {"block": 64}]
    return [
        rung1_repeat("tree", tree_reduce_fwd, parts, torch.bfloat16),
        rung2_rows("tree", by_rows, (rows,), configs=configs),
        accuracy("tree", tree_reduce_fwd(parts, torch.float32), parts.double().sum(0), 1e-7),
    ]
