"""One call each of the default GEMM as graphs run it (Gluon where it picks it), Triton's kernel at that tile and cuBLAS, for ncu.

    ncu -k 'regex:_mm_|nvjet' --launch-skip 3 --launch-count 3 --section SpeedOfLight \\
        --section WarpStateStats python benchmarks/ncu_pair.py [M N K]

Session 8 read its Gluon kernel's issued instructions and stall reasons this
way (records ...-session8-ncu-run6.txt, -run7.txt).
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_gluon_matmul import triton_same_tile  # noqa: E402
from alignzoo.common.matmul import graph_launches  # noqa: E402
from alignzoo.common.matmul.kernel import launch_config, matmul_fwd_triton  # noqa: E402

M, N, K = (int(a) for a in (sys.argv[1:4] or (512, 4096, 4096)))
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
for _ in range(2):  # the second round is the one to read (compiled, warm)
    with graph_launches():
        matmul_fwd_triton(x, w)
    triton_same_tile(x, w, launch_config(M, N, K))
    torch.mm(x, w.t())
torch.cuda.synchronize()
