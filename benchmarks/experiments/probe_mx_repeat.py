"""Run the MXFP4 experts' launch configs again and again on the GPU: does any config's output change from run
to run, or differ from the default's?  A bit difference that comes and goes is a race or an uninitialised
read, which the contract cannot have, and which one run a config can miss.  The GPU test
``test_mxfp4_gpu_launch_configs_repeat_their_bits`` runs the quiet case; this adds ``--busy``, ``--reps``
and ``--configs``.

    python benchmarks/experiments/probe_mx_repeat.py [--reps 20] [--configs JSON] [--busy]

DeepSeek-V4-Flash's expert shapes, 16 of its 256 experts, 1024 tokens (the GPU test's inputs).  ``--busy``
runs a matmul loop on a second stream meanwhile, so timing moves as it does beside other pytest workers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from alignzoo.common.moe.checks import make_experts
from alignzoo.common.moe.kernel import experts_fwd_mxfp4_triton as fwd
from alignzoo.common.moe.op import quantize_experts_mxfp4

# mirrors MX_LAUNCH_CONFIGS in tests/test_moe_experts.py (test_mxfp4_gpu_launch_configs_repeat_their_bits)
LAUNCH_CONFIGS = (dict(), dict(swap=False), dict(block_m=128, block_n=128, num_warps=8), dict(block_m=128),
                  dict(block_m=256), dict(block_m=256, block_n=128, num_warps=8), dict(bf16x2=False))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--configs", default=None,
                    help="a JSON list of experts_fwd_mxfp4_triton knob dicts (default: LAUNCH_CONFIGS)")
    ap.add_argument("--busy", action="store_true", help="a matmul loop on another stream meanwhile")
    ap.add_argument("--out", default="gpu_out")
    a = ap.parse_args(argv)
    x, ids, w, w_gu, w_d = make_experts(1024, 4096, 2048, 16, 6, device="cuda", skew=False)
    q = quantize_experts_mxfp4(w_gu, w_d)
    del w_gu, w_d
    ref = fwd(x, ids, w, *q, 10.0)
    side = torch.cuda.Stream()
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    rows = []
    for cfg in json.loads(a.configs) if a.configs else LAUNCH_CONFIGS:
        if a.busy:
            with torch.cuda.stream(side):
                for _ in range(4 * a.reps):
                    big @ big
        outs = [fwd(x, ids, w, *q, 10.0, **cfg) for _ in range(a.reps)]
        torch.cuda.synchronize()
        differ = [i for i, o in enumerate(outs) if not torch.equal(o, ref)]
        worst = max(float((o - ref).abs().max()) for o in outs)
        rows.append({"config": cfg, "reps": a.reps, "runs_unlike_default": differ, "max_abs": worst})
        print(json.dumps(rows[-1]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "probe_mx_repeat.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "busy": a.busy, "rows": rows}, f, indent=1)
    return 1 if any(r["runs_unlike_default"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
