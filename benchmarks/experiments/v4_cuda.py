"""deepseek_v4_mhc_mxfp4 on a CUDA device (eager decode: not yet graph-captured): trainer == sampled ==
prefill == chunked prefill on a 4,100-token prompt beside short ones, bf16 experts and MXFP4 experts.

    python benchmarks/experiments/v4_cuda.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_deepseek_v4 import _run  # noqa: E402


def case(config: str, lens, new: int, chunk: int) -> dict:
    t0 = time.time()
    import alignzoo.models.deepseek_v4_mhc_mxfp4 as V4
    from test_deepseek_v4 import sharpen

    pair = V4.load(config=config, device="cuda", dtype=torch.bfloat16, seed=1, cuda_graphs=False)
    sharpen(pair.trainer, 2)
    pair.sync()
    t1 = time.time()
    prompts, sps, outs, seqs = _run(pair, lens, new, seed=3)
    t_gen = time.time() - t1
    plens = [len(p) for p in prompts]
    with torch.no_grad():
        lp_t = [x.cpu() for x in pair.trainer.logprobs(seqs, plens, sps)]
    lp_s = pair.server.score(seqs, plens, sps)
    lp_c = pair.server.score(seqs, plens, sps, chunk_tokens=chunk)
    res = {"case": config, "lens": list(lens), "new": new, "chunk": chunk,
           "trainer_eq_sampled": all(torch.equal(a, o.logprobs) for a, o in zip(lp_t, outs)),
           "prefill_eq_sampled": all(torch.equal(a.cpu(), o.logprobs) for a, o in zip(lp_s, outs)),
           "chunked_eq_sampled": all(torch.equal(a.cpu(), o.logprobs) for a, o in zip(lp_c, outs)),
           "max_diff_trainer": max(float((a - o.logprobs).abs().max()) for a, o in zip(lp_t, outs)),
           "generate_s": round(t_gen, 1), "total_s": round(time.time() - t0, 1)}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--lens", default="4100,333,65,1", help="prompt lengths")
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--configs", default="tiny,tiny-mxfp4")
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for config in args.configs.split(","):
        try:
            out["cases"].append(case(config, lens, args.new, 1000))
        except Exception as e:  # noqa: BLE001 - a first run on a device: report and go on
            out["cases"].append({"case": config, "error": f"{type(e).__name__}: {str(e)[:500]}"})
            print(out["cases"][-1], flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
