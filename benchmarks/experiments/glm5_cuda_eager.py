"""glm5_sparse_fp8 on a CUDA device before it has Triton kernels: the indexer and the sparse attention
run their element-wise paths on CUDA tensors, so decode runs eager (``cuda_graphs=False``).  Checks
trainer == server prefill == chunked prefill == the sampled bits on long mixed batches, bf16 and
unified FP8, and reports whether decode-graph capture works yet.

    python benchmarks/experiments/glm5_cuda_eager.py --json out.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch

import alignzoo
from alignzoo import SamplingParams

DEVICE = "cuda"
TABLE = [(0.9, 40, 0.9, 0.05), (1.3, 0, 0.8, 0.0), (0.6, 7, 1.0, 0.1), (0.0, 0, 1.0, 0.0)]


def sharpen(trainer, seed: int) -> None:
    g = torch.Generator(device=trainer.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            if p.dim() == 1 and "correction" not in name and "bias" not in name:
                p.uniform_(0.5, 1.5, generator=g)
            elif p.dim() > 1 and p.dtype != torch.float8_e4m3fn:
                p.mul_(3.0)


def case(name: str, lens, new: int, *, config, fp8: bool, chunk: int) -> dict:
    t0 = time.time()
    pair = alignzoo.load_pair("glm5_sparse_fp8", config=config, device=DEVICE, dtype=torch.bfloat16, seed=1, fp8=fp8,
                              cuda_graphs=False)
    sharpen(pair.trainer, 2)
    pair.sync()
    g = torch.Generator().manual_seed(3)
    vocab = pair.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]
    sps = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_new_tokens=new, seed=i, ignore_eos=True)
           for i, (t, k, p, m) in enumerate(TABLE[i % len(TABLE)] for i in range(len(lens)))]
    t1 = time.time()
    outs = pair.server.generate(prompts, sps)
    t_gen = time.time() - t1
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    plens = [len(p) for p in prompts]
    with torch.no_grad():
        lp_t = [x.cpu() for x in pair.trainer.logprobs(seqs, plens, sps)]
    lp_s = pair.server.score(seqs, plens, sps)
    lp_c = pair.server.score(seqs, plens, sps, chunk_tokens=chunk)
    res = {"case": name, "config": config if isinstance(config, str) else "glm-5-h200 per-layer shapes, 2 layers, 8 experts", "fp8": fp8, "lens": list(lens), "new": new, "chunk": chunk,
           "errors": [o.error for o in outs if o.error],
           "trainer_eq_sampled": all(torch.equal(a, o.logprobs) for a, o in zip(lp_t, outs)),
           "prefill_eq_sampled": all(torch.equal(a.cpu(), o.logprobs) for a, o in zip(lp_s, outs)),
           "chunked_eq_sampled": all(torch.equal(a.cpu(), o.logprobs) for a, o in zip(lp_c, outs)),
           "tokens": sum(len(o.tokens) for o in outs), "generate_s": round(t_gen, 1),
           "total_s": round(time.time() - t0, 1)}
    print(json.dumps(res), flush=True)
    return res


def graphs() -> dict:
    """Decode graphs: a 4,000-token prompt beside short ones, graph decode == eager decode == trainer."""
    try:
        kw = dict(device=DEVICE, dtype=torch.bfloat16, seed=1, max_batch_size=8)
        pair = alignzoo.load_pair("glm5_sparse_fp8", **kw)
        eager = alignzoo.load_pair("glm5_sparse_fp8", cuda_graphs=False, **kw)
        for p in (pair, eager):
            sharpen(p.trainer, 2)
            p.sync()
        g = torch.Generator().manual_seed(4)
        prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in (4000, 333, 17)]
        sps = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.01, max_new_tokens=n, seed=n,
                              ignore_eos=True) for n in (60, 40, 30)]
        t0 = time.time()
        outs = pair.server.generate(prompts, sps)
        t_graph = time.time() - t0
        t0 = time.time()
        ref = eager.server.generate(prompts, sps)
        t_eager = time.time() - t0
        seqs = [p + o.tokens for p, o in zip(prompts, outs)]
        with torch.no_grad():
            lp = [x.cpu() for x in pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps)]
        res = {"case": "cuda_graphs", "ok": True, "captured": pair.server.runner.graphs is not None,
               "graph_eq_eager": all(a.tokens == b.tokens and torch.equal(a.logprobs, b.logprobs)
                                     for a, b in zip(outs, ref)),
               "trainer_eq_graph": all(torch.equal(a, o.logprobs) for a, o in zip(lp, outs)),
               "graph_generate_s": round(t_graph, 2), "eager_generate_s": round(t_eager, 2)}
    except Exception as e:
        res = {"case": "cuda_graphs", "ok": False, "error": f"{type(e).__name__}: {str(e)[:400]}"}
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--real", action="store_true", help="also a 2-layer model at GLM-5's per-layer shapes")
    args = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    out["cases"].append(case("tiny-bf16", [4100, 333, 65, 1], 24, config="tiny", fp8=False, chunk=1000))
    out["cases"].append(case("tiny-fp8", [4100, 333, 65, 1], 24, config="tiny", fp8=True, chunk=777))
    out["cases"].append(graphs())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if args.real:
        from alignzoo.models.glm5_sparse_fp8 import PRESETS

        real = PRESETS["glm-5-h200"].replace(num_layers=2, layer_types=("indexed_attention",) * 2,
                                             indexer_types=("full", "shared"), mlp_layer_types=("dense", "sparse"),
                                             n_routed_experts=8, vocab_size=4099, max_position=8192)
        out["cases"].append(case("glm5-shapes-2l-fp8", [4096, 500], 8, config=real, fp8=True, chunk=1500))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
