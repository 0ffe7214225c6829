"""Split decode: one program per segment of the block table against the
default's fewer programs walking several segments each (H200).

    python benchmarks/probe_decode_programs.py [--batches 1,8,64,256] [--ctx 512,2048,8192] [--widths 0,640]

The decode graphs' block table is ``max_position / 64`` pages wide (640 at
Qwen3's 40960 positions) and the split decode's grid follows that width, so
with one program per 1024-position segment a batch of short sequences
launches 40 programs per sequence and kv head, nearly all returning at once.
``kernel.decode_seg_programs`` caps the launch near ``DECODE_PROGRAMS``;
``seg_programs=n_seg`` is the one-per-segment grid.  Per (batch, context,
table width; 0 = just the context's pages): the time of each and their ratio,
after checking both give the same bits (torch.equal on out and lse).
Qwen3-8B heads (Hq 32, Hkv 8, D 128, bf16), pages shuffled, CUDA-graph replay
with L2 flushed (``bench_primitives._time_graph``).
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_primitives import _time_graph  # noqa: E402
from alignzoo.common.attention import kernel as attn  # noqa: E402
from alignzoo.common.attention import paged_attention_fwd  # noqa: E402
from alignzoo.common.kv_cache import PAGE_SIZE, allocate_kv_cache  # noqa: E402

HQ, HKV, D = 32, 8, 128


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", default="512,2048,8192")
    ap.add_argument("--widths", default="0,640")
    a = ap.parse_args()
    print(f"gpu {torch.cuda.get_device_name()}  torch {torch.__version__}  commit {os.environ.get('ALIGNZOO_COMMIT', '?')}"
          f"  DECODE_PROGRAMS {attn.DECODE_PROGRAMS}")
    print("| batch | context | table pages | segments | programs per row | one per segment µs | default µs | ratio | bits |")
    print("|---|---|---|---|---|---|---|---|---|")
    g = torch.Generator(device="cuda").manual_seed(0)
    bad = 0
    for ctx in map(int, a.ctx.split(",")):
        for B in map(int, a.batches.split(",")):
            per = -(-ctx // PAGE_SIZE)
            kc, vc = allocate_kv_cache(B * per, HKV, D, device="cuda")
            kc.normal_(generator=g)
            vc.normal_(generator=g)
            pages = torch.randperm(B * per, device="cuda", generator=g).int().view(B, per)
            q = torch.randn(B, HQ, D, device="cuda", generator=g).bfloat16()
            cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
            lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
            for width in map(int, a.widths.split(",")):
                width = width or per
                if width < per:
                    continue
                table = torch.zeros(B, width, dtype=torch.int32, device="cuda")
                table[:, :per] = pages
                n_seg = -(-width // attn.SEG_BLOCKS)

                def run(sp=None):
                    return paged_attention_fwd(q, kc, vc, cu, lens, table, max_seqlen_q=1, seg_programs=sp)

                o1, l1 = run(n_seg)
                o2, l2 = run()
                same = torch.equal(o1, o2) and torch.equal(l1, l2)
                bad += not same
                t1, t2 = _time_graph(lambda: run(n_seg)), _time_graph(run)
                n_prog = attn.decode_seg_programs(n_seg, B * HKV)
                print(f"| {B} | {ctx} | {width} | {n_seg} | {n_prog} | {1e3 * t1:.1f} | {1e3 * t2:.1f} | {t1 / t2:.2f}x | "
                      f"{'equal' if same else 'DIFFER'} |", flush=True)
            kc = vc = None  # free before the next batch
    print(f"bits: {'all equal' if not bad else f'{bad} configs differ'}")


if __name__ == "__main__":
    main()
