"""Tile shapes of the attention backward's two kernels, timed against SDPA's flash backward (H200).

    . benchmarks/gpu_env.sh && python benchmarks/bench_attention_bwd_tiles.py [--json FILE]

The backward's bits only have to repeat run to run, so ``kernel.bwd_config`` is free to pick any
(block_m query rows, block_n KV positions, warps, stages) for ``_attn_bwd_dq_kernel`` and
``_attn_bwd_dkdv_kernel``.  This sweeps both kernels at the trainer's packed shapes (qwen3-0.6b:
8 x 2048 tokens, 16 / 8 heads; qwen3-8b: 2 x 2048, 32 / 8; head_dim 128, bf16), one override at a
time on top of the default, with the SDPA flash backward of the same tensors timed in the same run.
Each row checks its gradients: twice the same bits, and within 2e-2 (bf16) of the default's.
Times are triton's do_bench medians; the dq / dkdv columns launch only that kernel's config change
(the other kernel at its default), so a row's total is the whole backward.
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SHAPES = {"qwen3-0.6b 8x2048": ([2048] * 8, 16, 8), "qwen3-8b 2x2048": ([2048] * 2, 32, 8)}
D = 128
DQ = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
      for m, n, w, s in itertools.product((64, 128), (32, 64), (4, 8), (2, 3)) if not (m == 128 and w == 4)]
DKDV = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
        for m, n, w, s in itertools.product((32, 64), (64, 128), (4, 8), (2, 3)) if not (n == 128 and w == 4)]


def _inputs(lens, hq, hkv, seed=0):
    from alignzoo.common.attention import attention_fwd

    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, hq, D, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(T, hkv, D, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(T, hkv, D, generator=g, device="cuda", dtype=torch.bfloat16)
    do = torch.randn(T, hq, D, generator=g, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32, device="cuda")
    o, lse = attention_fwd(q, k, v, cu, max_seqlen=max(lens))
    return q, k, v, o, lse, do, cu


def _sdpa_ms(q, k, v, do, B, S):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def bhsd(x):
        return x.view(B, S, x.shape[1], D).transpose(1, 2).detach().requires_grad_(True)

    qs, ks, vs = bhsd(q), bhsd(k), bhsd(v)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
    dob = do.view(B, S, q.shape[1], D).transpose(1, 2)
    return triton.testing.do_bench(lambda: torch.autograd.grad(out, (qs, ks, vs), dob, retain_graph=True),
                                   warmup=10, rep=60, return_mode="median")


def main(argv=None):
    from alignzoo.common.attention.kernel import attention_bwd_triton, bwd_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--default-only", action="store_true", help="time the default against SDPA, no sweep")
    args = ap.parse_args(argv)
    default = bwd_config(D)
    print(f"default: {default}", flush=True)
    report = {"default": default, "shapes": {}}
    for name in args.shapes.split(","):
        lens, hq, hkv = SHAPES[name]
        q, k, v, o, lse, do, cu = _inputs(lens, hq, hkv)
        S = max(lens)

        def run(dq_cfg=None, dkdv_cfg=None):
            return attention_bwd_triton(q, k, v, o, lse, do, cu, S, 0, D ** -0.5, dq_cfg=dq_cfg, dkdv_cfg=dkdv_cfg)

        ref = run()
        base_ms = triton.testing.do_bench(run, warmup=10, rep=60, return_mode="median")
        sdpa = _sdpa_ms(q, k, v, do, len(lens), S)
        rows = []
        print(f"{name}: default {base_ms:.3f} ms, sdpa flash backward {sdpa:.3f} ms ({sdpa / base_ms:.2f}x)", flush=True)
        for kind, cfgs in () if args.default_only else (("dq", DQ), ("dkdv", DKDV)):
            for cfg in cfgs:
                kw = {f"{kind}_cfg": cfg}
                row = {"kernel": kind, **cfg}
                try:
                    a, b = run(**kw), run(**kw)
                    row["repeats"] = all(torch.equal(x, y) for x, y in zip(a, b))
                    row["maxdiff"] = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, ref))
                    row["ms"] = triton.testing.do_bench(lambda: run(**kw), warmup=10, rep=60, return_mode="median")
                    row["vs_sdpa"] = sdpa / row["ms"]
                except Exception as e:  # a shape that does not compile (shared memory) is a row that says so
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                rows.append(row)
                print(f"  {kind:4} m{cfg['block_m']:<4} n{cfg['block_n']:<4} w{cfg['num_warps']} s{cfg['num_stages']}  "
                      + (f"{row['ms']:.3f} ms  {row['vs_sdpa']:.2f}x sdpa  repeats {row['repeats']}  "
                         f"maxdiff {row['maxdiff']:.2e}" if "ms" in row else row["error"]), flush=True)
        report["shapes"][name] = {"default_ms": base_ms, "sdpa_ms": sdpa, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
