"""Where the engine's host time goes in a long decode (cProfile), with overlap on and off (H200).

    python benchmarks/profile_engine_host.py [--batch 256] [--new 256] [--max-position 0] [--overlap on,off]

Per setting: one qwen3 pair of --config (random weights; --max-position 0
keeps the preset's 40960, whose decode block table is 640 pages wide), a
warm-up generate of 64 prompts, then one generate of --batch random
512-token prompts x --new tokens under cProfile.  Prints the wall time and
the top functions by own time and by cumulative time.  Time in
``Event.synchronize`` (``Launched.read``) is the host waiting for the device:
when it dominates, the host is not what limits the step.
"""
import argparse
import cProfile
import io
import os
import pstats
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_engine import load  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="qwen3-8b")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--max-position", type=int, default=0, help="0: the preset's")
    ap.add_argument("--overlap", default="on,off")
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    from alignzoo import SamplingParams

    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}")
    g = torch.Generator().manual_seed(0)
    for overlap in [o == "on" for o in a.overlap.split(",")]:
        pair = load(a.config, max_batch_size=a.batch, max_position=a.max_position or None, overlap=overlap)
        eng = pair.server
        prompts = [torch.randint(0, pair.config.vocab_size, (512,), generator=g).tolist() for _ in range(a.batch)]
        sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=a.new, seed=1, stop_token_ids=())
        eng.generate(prompts[:64], sp)  # warm-up: compiles, pinned blocks
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        t = time.perf_counter()
        prof.enable()
        eng.generate(prompts, sp)
        prof.disable()
        torch.cuda.synchronize()
        print(f"=== overlap={overlap} max_position={pair.config.max_position}: {time.perf_counter() - t:.2f} s for "
              f"{a.batch} x {a.new} tokens (prefill included)", flush=True)
        for key in ("tottime", "cumulative"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.top)
            print("\n".join(s.getvalue().splitlines()[4:]), flush=True)
        del pair, eng
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
