"""Reference for the tree: the same pairing written as recursion on a list
of float64 tensors (its bits must equal the CPU path's), and the exact-ish
sum (float64 fsum-style via torch.sum in float64) for accuracy."""
import torch


def tree_reduce_ref(parts: torch.Tensor) -> torch.Tensor:
    xs = [p.double() for p in parts]

    def rec(level):
        if len(level) == 1:
            return level[0]
        pairs = [level[i] + level[i + 1] for i in range(0, len(level) - 1, 2)]
        return rec(pairs + ([level[-1]] if len(level) % 2 else []))

    return rec(xs)
