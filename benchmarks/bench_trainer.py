"""The trainer's forward + backward of chosen-token log-probs, against transformers on the same weights.

One step of each side over the same ``--seqs`` x ``--len`` random tokens (prompt length 1, so every
later token is scored):

  aligned       ``trainer.logprobs(seqs, [1] * n)`` (packed, temperature 1, no transforms),
                ``-sum(log-probs).backward()``;
  hf            transformers' class of the model (``Qwen3ForCausalLM``, ``Qwen3_5MoeForCausalLM`` with its
                torch Gated DeltaNet where fla is not installed; sdpa attention, eager, bf16) on the same weights, the equal-length
                sequences as one (n, len) batch: ``log_softmax(logits.float())`` gathered at the next
                tokens, the same loss and backward: what a plain transformers RL trainer computes;
  hf+liger      the same model after ``apply_liger_kernel_to_qwen3`` (or the model's; a row that says so
                where Liger has none) (its RMSNorm, SwiGLU and RoPE
                kernels, and its fused linear cross-entropy: ``model(ids, labels=ids).loss`` times the
                token count, which never holds the logits; the gradient of the same sum).

Tok/s counts every token of every sequence; peak memory is ``max_memory_allocated`` over one step,
in all and beyond the weights and gradients held before it.  The weights are ours
(seeded init), handed to transformers through our name map, so a side-by-side log-prob
difference (``max|d|``) says the two models are the same one.  Each side runs ``--warm`` untimed
steps (compiles, cuBLAS heuristics), then the median of ``--steps`` timed ones.

    python benchmarks/bench_trainer.py                                  # CPU smoke run, tiny preset
    python benchmarks/bench_trainer.py --device cuda --config qwen3-0.6b --seqs 8 --len 2048 --profile DIR
    python benchmarks/bench_trainer.py --device cuda --config qwen35_gdn/qwen3.5-35b-a3b-4l --seqs 2 --len 2048

``--profile DIR`` writes DIR/trainer_profile_<config>.md: the aligned step under torch.profiler,
its GPU time by op (forward and backward kernels), and the host time of the step.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SIDES = ("aligned", "hf", "hf+liger")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def _time(step, device: torch.device, warm: int, steps: int) -> tuple[float, int | None, int | None]:
    """(median seconds of ``steps`` calls after ``warm`` untimed ones, the peak bytes of one step
    beyond what was held before it (weights, gradients), the peak bytes in all)."""
    for _ in range(warm):
        step()
    base = _peak_reset(device)
    step()
    total = _peak(device)
    peak = None if total is None else total - base
    times = []
    for _ in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), peak, total


def make_tokens(vocab: int, seqs: int, length: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (seqs, length), generator=g)


def split_config(config: str) -> tuple[str, str]:
    """"qwen35_gdn/qwen3.5-35b-a3b-4l" -> (model, preset); a bare preset is qwen3's."""
    model, _, preset = config.rpartition("/")
    return model or "qwen3", preset


def _spec(model: str):
    from alignzoo.models import model_module

    return model_module(model).SPEC


def build_aligned(config: str, device: torch.device, length: int, num_layers: int | None = None):
    from alignzoo.models import loading

    spec = _spec(split_config(config)[0])
    cfg = loading.resolve_config(spec, None, split_config(config)[1])
    changes = {"max_position": max(cfg.max_position, length)}
    if num_layers:
        changes["num_layers"] = num_layers
    cfg = cfg.replace(**changes)
    return loading.build_trainer(spec, cfg, device=device, dtype=torch.bfloat16, seed=0), cfg


def aligned_step(trainer, tokens: torch.Tensor):
    seqs = list(tokens)
    lens = [1] * len(seqs)

    def step():
        lps = trainer.logprobs(seqs, lens)
        (-torch.cat(lps).sum()).backward()
        trainer.zero_grad(set_to_none=False)  # gradients stay allocated, as in a training loop

    return step


def aligned_logprobs(trainer, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return torch.stack(trainer.logprobs(list(tokens), [1] * tokens.shape[0])).float().cpu()


def hf_state(trainer, cfg, model: str = "qwen3") -> dict[str, torch.Tensor]:
    """Our weights named as transformers' model's, copied to the host (the trainer can then go)."""
    tensors = {n: p.detach() for n, p in trainer.named_parameters()}
    return {k: v.to("cpu", copy=True) for k, v in _spec(model).to_hf(tensors, cfg).items()}


def build_hf(cfg, state: dict[str, torch.Tensor], device: torch.device, liger: bool):
    """transformers' class of the checkpoint config (``cfg.to_hf()``'s architecture: Qwen3ForCausalLM,
    Qwen3_5MoeForCausalLM, ...), sdpa attention, bf16, our weights; ``liger``: Liger's
    ``apply_liger_kernel_to_<model_type>`` on it (an ImportError where Liger has none)."""
    import transformers

    hf = cfg.to_hf()
    arch = hf["architectures"][0]
    hf_cfg = transformers.AutoConfig.for_model(hf["model_type"], **{k: v for k, v in hf.items()
                                                                    if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = getattr(transformers, arch)._from_config(hf_cfg, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (getattr(cfg, "tie_word_embeddings", False) and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"transformers' {arch} did not take our weights: missing {missing[:4]}, "
                           f"unexpected {unexpected[:4]}")
    if getattr(cfg, "tie_word_embeddings", False):
        model.tie_weights()
    model.train()
    if liger:
        import liger_kernel.transformers as lk

        name = "apply_liger_kernel_to_" + hf["model_type"].removesuffix("_text")
        if not hasattr(lk, name):
            raise ImportError(f"liger_kernel {getattr(lk, '__version__', '')} has no {name}".replace("  ", " "))
        getattr(lk, name)(model=model)
    return model


def hf_step(model, tokens: torch.Tensor, liger: bool):
    ids = tokens.to(next(model.parameters()).device)
    n_scored = ids.shape[0] * (ids.shape[1] - 1)

    def step():
        if liger:
            loss = model(input_ids=ids, labels=ids).loss * n_scored  # fused linear CE: mean NLL of the next tokens
        else:
            logits = model(input_ids=ids).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
            loss = -lp.sum()
        loss.backward()
        model.zero_grad(set_to_none=False)

    return step


def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    ids = tokens.to(next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, :-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1).cpu()


def profile_aligned(step, device: torch.device, path: str, title: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    step()
    _sync(device)
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        step()
        _sync(device)
    wall = time.perf_counter() - t0
    from torch.autograd import DeviceType

    def dev_us(e) -> float:
        return float(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0) or 0)

    cuda = device.type == "cuda"
    rows = sorted(prof.key_averages(), key=dev_us if cuda else (lambda e: e.self_cpu_time_total), reverse=True)
    # kernel rows only: an op's Triton kernels count in its own row too
    total = sum(dev_us(e) for e in rows if e.device_type == DeviceType.CUDA) if cuda else None
    lines = [f"# {title}", "", f"One aligned forward + backward under torch.profiler: wall {wall * 1e3:.1f} ms"
             + (f", GPU busy {total / 1e3:.1f} ms (the kernels' self times)" if total else ""), "",
             "| op / kernel | calls | GPU self ms | share of GPU busy | CPU self ms |", "|---|---:|---:|---:|---:|"]
    for e in rows[:40]:
        d = dev_us(e)
        lines.append(f"| `{e.key[:90]}` | {e.count} | {d / 1e3:.2f} | "
                     f"{(d / total * 100 if total else 0):.1f}% | {e.self_cpu_time_total / 1e3:.2f} |")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"profile -> {path}", flush=True)


def measure(config: str, device: torch.device, seqs: int, length: int, *, sides=SIDES, warm: int = 2,
            steps: int = 5, num_layers: int | None = None, profile_dir: str | None = None, emit=None) -> list[dict]:
    """One row per side: tok/s, peak memory, and (hf) the log-prob difference to ``aligned``; ``emit``
    gets each row as it is measured."""
    emit = emit or (lambda row: None)
    trainer, cfg = build_aligned(config, device, length, num_layers)
    tokens = make_tokens(cfg.vocab_size, seqs, length)
    n_tok = seqs * length
    rows, ref = [], None
    base = {"config": config, "seqs": seqs, "len": length, "tokens": n_tok, "layers": cfg.num_layers}
    if "aligned" in sides:
        step = aligned_step(trainer, tokens)
        t, peak, total = _time(step, device, warm, steps)
        ref = aligned_logprobs(trainer, tokens)
        rows.append({**base, "side": "aligned", "s": t, "tok_s": n_tok / t, "peak_bytes": peak, "peak_total_bytes": total})
        emit(rows[-1])
        print(json.dumps(rows[-1]), flush=True)
        if profile_dir:
            profile_aligned(step, device, os.path.join(profile_dir, f"trainer_profile_{config.replace('/', '-')}.md"),
                            f"Aligned trainer profile: {config}, {seqs} x {length} tokens, {cfg.num_layers} layers")
    state = hf_state(trainer, cfg, split_config(config)[0]) if any(s != "aligned" for s in sides) else None
    del trainer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for side in [s for s in sides if s != "aligned"]:
        liger = side == "hf+liger"
        try:
            model = build_hf(cfg, state, device, liger)
        except ImportError as e:
            rows.append({**base, "side": side, "error": f"{type(e).__name__}: {e}"[:300]})
            emit(rows[-1])
            print(json.dumps(rows[-1]), flush=True)
            continue
        t, peak, total = _time(hf_step(model, tokens, liger), device, warm, steps)
        row = {**base, "side": side, "s": t, "tok_s": n_tok / t, "peak_bytes": peak, "peak_total_bytes": total}
        if ref is not None and not liger:
            lp = hf_logprobs(model, tokens)
            row["max_abs_logprob_vs_aligned"] = float((lp.double() - ref.double()).abs().max())
        rows.append(row)
        emit(row)
        print(json.dumps(row), flush=True)
        del model
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def render(rows: list[dict]) -> str:
    out = ["| config | layers | tokens | side | tok/s | vs hf | vs hf+liger | peak GiB | of it beyond weights + grads | max abs Δlogprob vs aligned |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for (cfg, n), group in _groups(rows).items():
        liger = next((r for r in group if r["side"] == "hf+liger" and "tok_s" in r), None)
        hf = next((r for r in group if r["side"] == "hf" and "tok_s" in r), None)
        for r in group:
            if "tok_s" not in r:
                out.append(f"| {cfg} | {r['layers']} | {n} | {r['side']} | not run: {r.get('error', '')[:80]} | | | | | |")
                continue
            peak = " | ".join(f"{r[k] / 2**30:.1f}" if r.get(k) is not None else "-"
                              for k in ("peak_total_bytes", "peak_bytes"))
            vh, vl = (f"{r['tok_s'] / o['tok_s']:.2f}x" if o else "-" for o in (hf, liger))
            d = r.get("max_abs_logprob_vs_aligned")
            out.append(f"| {cfg} | {r['layers']} | {n} | {r['side']} | {r['tok_s']:,.0f} | {vh} | "
                       f"{vl} | {peak} | {'' if d is None else f'{d:.3g}'} |")
    return "\n".join(out)


def _groups(rows):
    g: dict = {}
    for r in rows:
        g.setdefault((r["config"], r["tokens"]), []).append(r)
    return g


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--config", default=None, help="[MODEL/]PRESET: a qwen3 preset, or another model's as "
                    "qwen35_gdn/qwen3.5-35b-a3b-4l (default: tiny on cpu, qwen3-0.6b on cuda)")
    ap.add_argument("--seqs", type=int, default=None, help="sequences (default 8; cpu 2)")
    ap.add_argument("--len", type=int, default=None, help="tokens per sequence (default 2048; cpu 64)")
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the preset")
    ap.add_argument("--sides", default=",".join(SIDES))
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--profile", default=None, metavar="DIR")
    ap.add_argument("--json", default=None, help="append the rows to this JSON-lines file")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    cpu = dev.type == "cpu"
    config = a.config or ("tiny" if cpu else "qwen3-0.6b")
    sides = tuple(s for s in a.sides.split(",") if s)
    bad = set(sides) - set(SIDES)
    if bad:
        ap.error(f"--sides: unknown {sorted(bad)}; choose from {', '.join(SIDES)}")

    def emit(row):
        if a.json:
            with open(a.json, "a") as f:
                f.write(json.dumps(row) + "\n")

    rows = measure(config, dev, a.seqs or (2 if cpu else 8), a.len or (64 if cpu else 2048), sides=sides,
                   warm=a.warm, steps=a.steps, num_layers=a.layers, profile_dir=a.profile, emit=emit)
    print(render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
