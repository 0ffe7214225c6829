"""Publish/apply timings at qwen3-8b shapes (8.2B parameters, 16.4 GB bf16).

    python benchmarks/bench_sync.py                 # bf16, on CUDA
    python benchmarks/bench_sync.py --fp8           # the layer matrices as float8 codes + scales
    python benchmarks/bench_sync.py --device cpu --small
    python benchmarks/bench_sync.py --adam 1e-6 [--fp8]  # weights from FP32 masters after Adam steps

Holds four copies of the weights on the device: trainer, shadow, server,
and (for full payloads) the payload; ``--adam`` adds the FP32 masters (twice
the bf16 size).
"""
from __future__ import annotations

import argparse
import time

import torch

from alignzoo.sync import Publisher, Receiver, tensor_checksum, weights_checksum
from alignzoo.sync.layout import as_int


def qwen3_like(device, fp8: bool, small: bool) -> dict[str, torch.Tensor]:
    V, H, I, L, Q, KV = (1519, 256, 768, 2, 256, 64) if small else (151936, 4096, 12288, 36, 4096, 1024)
    shapes = {"embed.weight": (V, H), "lm_head.weight": (V, H), "norm.weight": (H,)}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update({p + "q.weight": (Q, H), p + "k.weight": (KV, H), p + "v.weight": (KV, H), p + "o.weight": (H, Q),
                       p + "gate.weight": (I, H), p + "up.weight": (I, H), p + "down.weight": (H, I),
                       p + "in_norm.weight": (H,), p + "post_norm.weight": (H,), p + "q_norm.weight": (128,),
                       p + "k_norm.weight": (128,)})
    w = {}
    for n, s in shapes.items():
        if fp8 and len(s) == 2 and n.startswith("layers"):
            w[n] = torch.randint(0, 256, s, dtype=torch.uint8, device=device).view(torch.float8_e4m3fn)
            w[n + "_scale_inv"] = torch.rand(-(-s[0] // 128), -(-s[1] // 128), device=device)
        else:
            w[n] = torch.randn(s, device=device, dtype=torch.bfloat16)
    return w


def from_masters(masters: dict[str, torch.Tensor], W: dict[str, torch.Tensor]) -> float:
    """Requantize the shipped weights from the FP32 masters, as the trainer does
    once per optimizer step: bf16 by rounding, FP8 matrices by 128x128 blocks.
    -> the fraction of shipped elements (codes; scales not counted) whose bits changed."""
    from alignzoo.common.fp8 import quantize_weight_fp8

    changed = total = 0
    for n, m in masters.items():
        old = W[n].clone()
        if n + "_scale_inv" in W:
            codes, scale_inv = quantize_weight_fp8(m)
            W[n].copy_(codes)
            W[n + "_scale_inv"].copy_(scale_inv)
        else:
            W[n].copy_(m)
        changed += int((as_int(old) != as_int(W[n])).sum())
        total += old.numel()
    return changed / total


def adam_step(masters: dict[str, torch.Tensor], lr: float, seed: int) -> None:
    """An Adam step on every master: with fresh moments the update m/sqrt(v) is
    g/|g|, so each element moves by lr in a random direction."""
    g = torch.Generator(device=next(iter(masters.values())).device).manual_seed(seed)
    for m in masters.values():
        m.add_(torch.randn(m.shape, device=m.device, generator=g).sign_(), alpha=-lr)


def touch(weights: dict[str, torch.Tensor], frac: float, seed: int = 1) -> None:
    """Flip one bit in a random ``frac`` of the rows of every matrix (all of every tensor at frac 1)."""
    for n, t in weights.items():
        if frac >= 1:
            as_int(t).bitwise_xor_(1)
        elif t.dim() == 2:
            g = torch.Generator(device=t.device).manual_seed(seed)
            rows = torch.randperm(t.shape[0], device=t.device, generator=g)[: max(1, int(t.shape[0] * frac))]
            as_int(t)[rows, 0] ^= 1


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--fp8", action="store_true")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--adam", type=float, default=None, metavar="LR",
                    help="weights requantized from FP32 masters after Adam steps of this lr (instead of bit flips)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def timed(f):
        sync()
        t = time.perf_counter()
        r = f()
        sync()
        return r, time.perf_counter() - t

    W = qwen3_like(dev, args.fp8, args.small)
    print(f"{len(W)} tensors, {sum(t.numel() * t.element_size() for t in W.values()) / 2**30:.2f} GiB on {dev}")
    S = {n: torch.zeros_like(t) for n, t in W.items()}
    pub, rx = Publisher(lambda: W), Receiver(S)

    def ship():
        """One publish, then its apply: -> (payload stats, publish s, apply + end-state check s)."""
        p, tp = timed(pub.publish)
        return p.stats, tp, timed(lambda: rx.apply(p))[1]

    if args.adam is not None:
        masters = {n: (torch.randn(t.shape, device=dev) * 0.02) for n, t in W.items() if not n.endswith("_scale_inv")}
        from_masters(masters, W)
        _, tp, ta = ship()
        print(f"first (full) publish + apply {tp + ta:.3f} s")
        for step in range(1, 4):
            adam_step(masters, args.adam, seed=step)
            frac, tq = timed(lambda: from_masters(masters, W))
            stats, tp, ta = ship()
            print(f"Adam step {step} (lr {args.adam:g}): {100 * frac:.3f}% of elements changed; "
                  f"requantize (+ diff count) {tq:.3f} s, publish {tp:.3f} s, "
                  f"apply + end-state check {ta:.3f} s, publish + apply {tp + ta:.3f} s | {stats}")
        assert weights_checksum(S) == weights_checksum(W)
        return
    for _ in range(2):
        print(f"weights_checksum: {timed(lambda: weights_checksum(W))[1]:.3f} s")
    for label, frac in [("first (full)", None), ("nothing changed", 0), ("0.1% of rows", 0.001),
                        ("1% of rows", 0.01), ("everything", 1.0), ("0.1% of rows", 0.001)]:
        if frac:
            touch(W, frac)
        stats, tp, ta = ship()
        print(f"{label:16s} publish {tp:.3f} s, apply + end-state check {ta:.3f} s | {stats}")
    rx.verify_end_state = False
    touch(W, 0.01, seed=2)
    p = pub.publish()
    print(f"1% of rows: apply without the end-state check {timed(lambda: rx.apply(p))[1]:.3f} s")
    assert weights_checksum(S) == weights_checksum(W)
    if dev.type == "cuda":
        x = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device=dev)
        for dt in (torch.uint8, torch.bfloat16, torch.float32, torch.int64):
            assert tensor_checksum(x.view(dt)) == tensor_checksum(x.view(dt).cpu()), dt
        print("tensor_checksum: CUDA == CPU")


if __name__ == "__main__":
    main()
