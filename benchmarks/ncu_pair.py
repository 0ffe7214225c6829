"""Run two GEMMs once each at one shape (for ncu): the library default and the Gluon pipelined kernel.

    ncu --section SpeedOfLight --section WarpStateStats python benchmarks/ncu_pair.py [M N K]
"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_ws_matmul import pipe, ws  # noqa: E402
from alignzoo.common.matmul.kernel import matmul_fwd_triton  # noqa: E402

M, N, K = (int(a) for a in (sys.argv[1:4] or (512, 4096, 4096)))
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
for _ in range(2):  # the second round is the one to read (compiled, warm)
    matmul_fwd_triton(x, w)
    pipe(x, w, 128, 3, 128, True)
    ws(x, w, 128, 6, 64, False)
    torch.mm(x, w.t())
torch.cuda.synchronize()
