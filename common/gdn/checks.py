"""Ladder rungs 1-2 and accuracy for Gated DeltaNet (``alignzoo check gdn``).

The delta rule is not row-wise (a row reads its sequence's past), so rung 2
compares sequences: each alone against the same sequence in batches (all,
reversed, with empty padding rows), split by a chunked prefill at several
offsets, and decoded one token a step beside other sequences and padding
rows.  The conv1d the same way; l2norm is row-wise (``rung2_rows``)."""
from __future__ import annotations

import torch

from ..ladder import RungResult, accuracy, bitwise_equal, rung1_repeat, rung2_rows
from .naive import conv1d_ref, gdn_ref, l2norm_ref
from .op import conv1d_fwd, gdn_cache, gdn_fwd, l2norm_fwd


def make_inputs(lens, Hk, Hv, K, V, device, seed=0):
    """Qwen3.5-like GDN inputs: l2-normalized q (scaled K^-0.5) and k, g = -A softplus(a), beta = sigmoid(b)."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = l2norm_fwd(torch.randn(T, Hk, K, generator=gen)) * K ** -0.5
    k = l2norm_fwd(torch.randn(T, Hk, K, generator=gen))
    v = torch.randn(T, Hv, V, generator=gen)
    A = torch.rand(Hv, generator=gen) * 0.6 + 0.01
    g = -A * torch.log1p(torch.exp(torch.randn(T, Hv, generator=gen) - 1))
    beta = 1 / (1 + torch.exp(-torch.randn(T, Hv, generator=gen)))
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return [t.to(device) for t in (q, k, v, g, beta)], cu


def _take(xs, idx):
    return [t[idx] for t in xs]


def _rows(cu, order, device):
    idx = torch.cat([torch.arange(cu[b], cu[b + 1]) for b in order]).to(device)
    ncu = [0]
    for b in order:
        ncu.append(ncu[-1] + cu[b + 1] - cu[b])
    return idx, ncu


def _gdn_batches(xs, cu, ref, device) -> RungResult:
    B = len(cu) - 1
    compared = differing = 0
    fails = []
    for label, order in [("alone", None), ("reversed", list(range(B - 1, -1, -1))), ("pairs", None)]:
        groups = [[b] for b in range(B)] if label == "alone" else \
            [order] if order else [[b, (b + 1) % B] for b in range(B)]
        for grp in groups:
            idx, ncu = _rows(cu, grp, device)
            o = gdn_fwd(*_take(xs, idx), torch.tensor(ncu, device=device))
            for i, b in enumerate(grp):
                compared += 1
                if not bitwise_equal(o[ncu[i] : ncu[i + 1]], ref[cu[b] : cu[b + 1]]):
                    differing += 1
                    fails.append(f"{label}: sequence {b}")
    return RungResult("gdn", 2, "sequences alone / reversed / in pairs", differing == 0, compared, differing,
                      "; ".join(fails[:4]))


def _gdn_serving(xs, cu, ref, device) -> RungResult:
    """The longest sequence prefilled to each split, then the rest by a second
    prefill (slot a) and one token a step beside a padding row (slot b)."""
    b = max(range(len(cu) - 1), key=lambda i: cu[i + 1] - cu[i])
    L, s0 = cu[b + 1] - cu[b], cu[b]
    Hk, K = xs[1].shape[1:]
    Hv, V = xs[2].shape[1:]
    compared = differing = 0
    fails = []
    for split in (1, 37, 63, 64, 65, 130):
        if split >= L:
            continue
        cache = gdn_cache(3, Hk, Hv, K, V, device)
        pre = torch.arange(s0, s0 + split, device=device)
        idx = torch.cat([pre, pre])
        o = gdn_fwd(*_take(xs, idx), torch.tensor([0, split, 2 * split], device=device),
                    start_positions=torch.zeros(2, dtype=torch.long, device=device), cache=cache,
                    slots=torch.tensor([0, 2], device=device))
        got_a, got_b = [o[:split]], [o[split:]]
        rest = torch.arange(s0 + split, s0 + L, device=device)
        got_a.append(gdn_fwd(*_take(xs, rest), torch.tensor([0, L - split], device=device),
                             start_positions=torch.tensor([split], device=device), cache=cache,
                             slots=torch.tensor([0], device=device)))
        for p in range(split, min(L, split + 70)):
            idx = torch.tensor([s0 + p, 0], device=device)
            o = gdn_fwd(*_take(xs, idx), torch.tensor([0, 1, 2], device=device),
                        start_positions=torch.tensor([p, 0], device=device), cache=cache,
                        slots=torch.tensor([2, -1], device=device))
            got_b.append(o[:1])
        n_b = sum(t.shape[0] for t in got_b)
        for label, got, n in (("prefill", got_a, L), ("decode", got_b, n_b)):
            compared += 1
            if not bitwise_equal(torch.cat(got), ref[s0 : s0 + n]):
                differing += 1
                fails.append(f"{label} split {split}")
    return RungResult("gdn", 2, "chunked prefill / decode vs whole", differing == 0, compared, differing,
                      "; ".join(fails[:4]))


def _conv_batches(x, w, cu, ref, device) -> RungResult:
    B = len(cu) - 1
    compared = differing = 0
    tail = torch.zeros(B, 3, x.shape[1], dtype=x.dtype, device=device)
    for b in range(B):
        idx, ncu = _rows(cu, [b], device)
        alone = conv1d_fwd(x[idx], w, torch.tensor(ncu, device=device))
        n = ncu[1]
        cut = n // 2
        first = conv1d_fwd(x[idx[:cut]], w, torch.tensor([0, cut], device=device), tail=tail,
                           slots=torch.tensor([b], device=device), start_positions=torch.tensor([0], device=device))
        steps = [conv1d_fwd(x[idx[p : p + 1]], w, torch.tensor([0, 1], device=device), tail=tail,
                            slots=torch.tensor([b], device=device), start_positions=torch.tensor([p], device=device))
                 for p in range(cut, n)]
        for got in (alone, torch.cat([first] + steps)):
            compared += 1
            differing += not bitwise_equal(got, ref[cu[b] : cu[b + 1]])
    return RungResult("conv1d", 2, "alone / split + decode vs batch", differing == 0, compared, differing)


def ladder(device: torch.device) -> list[RungResult]:
    cpu = device.type == "cpu"
    lens = [1, 63, 64, 65, 200, 700] if cpu else [1, 63, 64, 65, 1000, 2100]
    Hk, Hv, K, V = (2, 4, 32, 20) if cpu else (2, 4, 128, 128)
    xs, cu = make_inputs(lens, Hk, Hv, K, V, device)
    cu_t = torch.tensor(cu, device=device)
    ref = gdn_fwd(*xs, cu_t)
    out = [
        rung1_repeat("gdn", gdn_fwd, *xs, cu_t),
        _gdn_batches(xs, cu, ref, device),
        _gdn_serving(xs, cu, ref, device),
    ]
    gen = torch.Generator().manual_seed(1)
    C = 3 * 32
    x = torch.randn(cu[-1], C, generator=gen).to(device, torch.bfloat16)
    w = (torch.randn(C, 4, generator=gen) * 0.5).to(device, torch.bfloat16)
    y = conv1d_fwd(x, w, cu_t)
    out += [rung1_repeat("conv1d", conv1d_fwd, x, w, cu_t), _conv_batches(x, w, cu, y, device)]
    raw = torch.randn(300, Hk, K, generator=gen).to(device, torch.bfloat16)
    out += [rung1_repeat("l2norm", l2norm_fwd, raw), rung2_rows("l2norm", l2norm_fwd, (raw,))]
    o64, _ = gdn_ref(*[t.cpu() for t in xs], cu)
    out += [
        accuracy("gdn", ref.cpu(), o64, 2e-6, "fp32 vs float64 recurrent"),
        accuracy("conv1d", y.cpu(), conv1d_ref(x.cpu(), w.cpu(), cu), 8e-3, "bf16 vs float64"),
        accuracy("l2norm", l2norm_fwd(raw).cpu(), l2norm_ref(raw.cpu()), 1e-6, "bf16 in, fp32 vs float64"),
    ]
    return out
