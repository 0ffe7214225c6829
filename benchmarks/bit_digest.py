"""sha256 of what a model pair computes, to compare two commits or two toolchains bit for bit.

For each model it builds the seeded pair, samples a mixed batch on the server (prompts of odd lengths past the
64-token pages and chunks), scores the samples on the trainer, takes the backward and one SGD step, syncs, and
scores again.  Every result is hashed on its bytes: the sampled tokens, the server's and the trainer's FP32
log-probs, each gradient, the synced weights' checksum.  K3 == 0 is checked on the way; the digests are what
changes when a kernel's arithmetic changes (a compile option, a toolchain, a tile).

    python benchmarks/bit_digest.py --device cuda --out a.json            # at one commit or toolchain
    python benchmarks/bit_digest.py --compare a.json b.json               # which digests differ

Uses only the public API (``load_pair``, ``generate``, ``logprobs``, ``sync``), so an older tree runs it too.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch

CASES = {
    # name: (model, load_pair keywords)
    "qwen3-tiny": ("qwen3", {"config": "tiny"}),
    "qwen3-tiny-fp8": ("qwen3", {"config": "tiny", "fp8": True}),
    "qwen35_gdn-tiny": ("qwen35_gdn", {"config": "tiny"}),
    "qwen3-0.6b": ("qwen3", {"config": "qwen3-0.6b"}),
}


def digest(t: torch.Tensor) -> str:
    t = t.detach().contiguous().cpu()
    return hashlib.sha256(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"").hexdigest()[:16]


def run_case(model: str, kw: dict, device: str, prompt_lens: list[int], new: int) -> dict:
    import alignzoo
    from alignzoo import SamplingParams

    torch.manual_seed(0)
    pair = alignzoo.load_pair(model, device=device, seed=0, **kw)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, pair.trainer.cfg.vocab_size, (n,), generator=gen).tolist() for n in prompt_lens]
    sp = SamplingParams(temperature=0.8, top_k=50, top_p=0.95, min_p=0.01, max_new_tokens=new, seed=7)
    out: dict[str, str] = {}
    outs = pair.server.generate(prompts, sp)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lens = [len(p) for p in prompts]
    out["tokens"] = digest(torch.tensor([t for o in outs for t in o.tokens]))
    served = torch.cat([o.logprobs for o in outs])
    out["server_logprobs"] = digest(served)
    lps = pair.trainer.logprobs(seqs, lens, sp)
    trained = torch.cat([lp.detach().cpu() for lp in lps])
    out["trainer_logprobs"] = digest(trained)
    out["k3_zero"] = str(torch.equal(trained, served.cpu()))
    loss = -sum(lp.sum() for lp in lps)
    loss.backward()
    for name, p in sorted(pair.trainer.named_parameters()):
        if p.grad is not None:
            out[f"grad.{name}"] = digest(p.grad)
    with torch.no_grad():
        for p in pair.trainer.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-1e-2)
    pair.trainer.zero_grad(set_to_none=True)
    pair.sync()
    from alignzoo.sync import weights_checksum

    out["synced_weights"] = weights_checksum(pair.server.model.weights)[:16]
    out["weights_match"] = str(pair.weights_match())
    again = pair.server.score(seqs, lens, sp)
    out["server_score_after_step"] = digest(torch.cat([s.cpu() for s in again]))
    return out


def compare(a: dict, b: dict) -> int:
    diff = 0
    for case in sorted(set(a["cases"]) | set(b["cases"])):
        da, db = a["cases"].get(case, {}), b["cases"].get(case, {})
        keys = sorted(set(da) | set(db))
        bad = [k for k in keys if da.get(k) != db.get(k)]
        print(f"{case}: {len(keys) - len(bad)}/{len(keys)} digests equal")
        for k in bad:
            print(f"  differs: {k}: {da.get(k)} vs {db.get(k)}")
        diff += len(bad)
    return 1 if diff else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cases", default="qwen3-tiny,qwen3-tiny-fp8,qwen35_gdn-tiny",
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--prompt-lens", default="1,63,65,130,600", help="the batch's prompt lengths (odd, past pages)")
    ap.add_argument("--new", type=int, default=24, help="tokens sampled per prompt")
    ap.add_argument("--out", help="write the digests as JSON here")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="compare two digest files and exit")
    args = ap.parse_args()
    if args.compare:
        a, b = (json.load(open(p)) for p in args.compare)
        return compare(a, b)
    try:
        import triton
    except ImportError:  # a CPU machine without Triton: the CPU paths alone
        triton = None
    res = {"torch": torch.__version__, "triton": getattr(triton, "__version__", None), "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "cases": {}}
    lens = [int(x) for x in args.prompt_lens.split(",")]
    for case in args.cases.split(","):
        model, kw = CASES[case]
        t0 = time.time()
        res["cases"][case] = run_case(model, kw, args.device, lens, args.new)
        print(f"{case}: {len(res['cases'][case])} digests, k3_zero {res['cases'][case]['k3_zero']}, "
              f"{time.time() - t0:.1f} s", file=sys.stderr)
        if args.out:  # after every case: a run cut short keeps what it finished
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
