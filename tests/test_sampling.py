"""sampling: seeded draws, batch invariance (bitwise), replay == sampler
(bitwise), ties, greedy, distribution, accuracy and gradients vs float64,
checks that can fail, bad input."""
import functools
import math

import numpy as np
import pytest
import torch
from interpreted import run_interpreted

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.sampling import (
    SamplingParams,
    head_width,
    sampling_logprobs_ref,
    transformed_logprobs_ref,
    params_to_tensors,
    sample,
    sample_fwd,
    sampling_logprobs,
    sampling_logprobs_fwd,
    transformed_logprobs_fwd,
    uniform01,
)
from alignzoo.common.sampling.checks import PARAM_NAMES, random_case
from alignzoo.common.sampling.cpu import support_cpu
from alignzoo.common.sampling.op import _prepare
from alignzoo.common.sampling.rules import key_ids, key_values, order_keys

QWEN_VOCAB = 151936  # not a multiple of 256


def _params(c):
    return {n: c[n] for n in PARAM_NAMES}


def _rows(c):
    return (c["logits"], *_params(c).values(), c["seed"], c["step"])


def _launch_configs(device):
    return [{}, {"row_chunk": 4}, {"row_chunk": 1}]


def _uniform_case(B, V, device, *, t=1.0, k=0, p=1.0, m=0.0, seed=0, spread=2.0):
    """Random logits, one parameter set for every row, seeds 0..B-1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g) * spread
    case = {"logits": logits, "temperature": torch.full((B,), float(t)), "top_k": torch.full((B,), k),
            "top_p": torch.full((B,), float(p)), "min_p": torch.full((B,), float(m)),
            "seed": torch.arange(B), "step": torch.full((B,), 7)}
    return {n: x.to(device) for n, x in case.items()}


def _assert_same_support(got_lp, ref_lp, device):
    """The fp32 support is the float64 reference's.  On CUDA (tl.exp / tl.log
    are approximations, ~1e-6 relative) a row may differ by its one edge token
    when a top-p or min-p cut falls within that error of the threshold."""
    got, ref = torch.isfinite(got_lp).cpu(), torch.isfinite(ref_lp)
    if device.type == "cpu":
        assert torch.equal(got, ref)
        return
    diff = (got != ref).sum(1)
    assert bool((diff <= 1).all()) and int((diff > 0).sum()) <= max(1, got.shape[0] // 10), diff


# --- rungs 1 and 2 -----------------------------------------------------------

def test_head_hint_rounded_up_keeps_the_bits(device):
    """The engine's sampler graphs round the batch's head width up to 64,
    1024 or V (``SampleGraphs.head_class``): any head >= every row's k' gives
    the same draws and replays, on either path (partial head or full sort)."""
    from alignzoo.common.engine.model_runner import SampleGraphs

    B, V = 6, 3000
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(B, V, generator=g) * 3).to(device)
    t = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 1.0], device=device)
    k = torch.tensor([3, 20, 0, 7, 1, 15], device=device)
    p = torch.tensor([0.9, 1.0, 1.0, 0.5, 1.0, 0.95], device=device)
    m = torch.tensor([0.0, 0.05, 0.0, 0.0, 0.0, 0.1], device=device)
    seed, step = torch.arange(B, device=device) * 7919, torch.arange(B, device=device)
    head = head_width(t.cpu(), k.cpu(), V)
    hc = SampleGraphs.head_class
    assert head == 20 and hc(head, V) == 64 and hc(1, V) == 64 and hc(65, V) == 1024 and hc(V, V) == V
    assert hc(1000, 1024) == 1024 and hc(600, 700) == 700 and hc(30, 40) == 40
    with pytest.raises(ValueError, match="head must be >= 1"):
        hc(0, V)
    with pytest.raises(ValueError, match="head must be >= 1"):
        sample_fwd(logits, t, k, p, m, seed, step, head=0)
    ref = sample_fwd(logits, t, k, p, m, seed, step, head=head)
    for h in (64, 1024, 2999, V):
        got = sample_fwd(logits, t, k, p, m, seed, step, head=h)
        assert torch.equal(got[0], ref[0]) and bitwise_equal(got[1], ref[1]), h
        lp = sampling_logprobs_fwd(logits, ref[0], t, k, p, m, head=h)[0]
        assert bitwise_equal(lp, ref[1]), h


def test_sorted_head_gives_the_full_sorts_bits(device, monkeypatch):
    """A block whose largest top-k is small sorts only that head of the keys
    (torch.topk); draws, replays and the transformed distribution must have
    the full sort's bits -- with greedy rows, ties and top-p / min-p cuts."""
    import alignzoo.common.sampling.op as op

    g = torch.Generator().manual_seed(11)
    B, V = 9, 5003
    logits = (torch.randn(B, V, generator=g) * 3).round(decimals=1)  # many ties
    t = torch.tensor([0.7, 1.0, 0.0, 1.3, 0.9, 1.0, 1.0, 0.5, 1.1])
    k = torch.tensor([50, 1, 0, 7, 300, 2, 50, 64, 13])  # greedy row: top_k off, k' = 1
    p = torch.tensor([0.9, 1.0, 1.0, 0.5, 0.99, 1.0, 0.3, 1.0, 0.95])
    m = torch.tensor([0.0, 0.0, 0.0, 0.05, 0.001, 0.0, 0.0, 0.2, 0.01])
    logits, t, k, p, m = (x.to(device) for x in (logits, t, k, p, m))
    seed, step = torch.arange(B, device=device), torch.full((B,), 3, device=device)
    widths = []
    if device.type == "cuda":  # CUDA forms its head from the logits (kernel.sorted_head_triton)
        import alignzoo.common.sampling.kernel as owner
        name = "sorted_head_triton"
    else:
        owner, name = op, "sorted_head"
    real = getattr(owner, name)

    def record(*args):
        out = real(*args)
        widths.append(out.shape[1])
        return out

    monkeypatch.setattr(owner, name, record)
    if device.type == "cuda":  # its full sort sorts the values (kernel.FULL_SORT): all V positions
        real_values = owner.sorted_values_triton

        def record_values(*args):
            widths.append(V)
            return real_values(*args)

        monkeypatch.setattr(owner, "sorted_values_triton", record_values)

    def run():
        tok, lp = sample_fwd(logits, t, k, p, m, seed, step)
        return tok, lp, sampling_logprobs_fwd(logits, tok, t, k, p, m)[0], transformed_logprobs_fwd(logits, t, k, p, m)

    head = run()
    assert widths and set(widths) == {300}
    monkeypatch.setattr(op, "_HEAD_MAX", 0)  # every block sorts the whole vocabulary
    full = run()
    assert set(widths[-1:]) == {V}
    for a, b in zip(head, full):
        assert torch.equal(a, b)
    assert torch.equal(head[1], head[2])  # and the replay is still the sampler
    monkeypatch.setattr(op, "_HEAD_MAX", 1024)
    # the engine's hint, computed from host copies (no device read): the same width and bits
    hint = head_width(t.cpu(), k.cpu(), V)
    assert hint == 300
    widths.clear()
    assert all(torch.equal(a, b) for a, b in zip(sample_fwd(logits, t, k, p, m, seed, step, head=hint), head[:2]))
    assert torch.equal(sampling_logprobs_fwd(logits, head[0], t, k, p, m, head=hint)[0], head[2])
    assert widths == [300, 300]


# --- CUDA's head from torch.topk of the logits ----------------------------------

CUT_KINDS = ("ulp/3", "rounded", "-inf", "+-0", "ulp/0.7", "greedy", "random")


def _ulp_pair(tau: float) -> tuple[float, float]:
    """Adjacent fp32 logits x < y with fl(x / tau) == fl(y / tau): topk ranks y
    first, the keys tie them and rank the smaller id first."""
    tau_t, x = torch.tensor(tau), torch.tensor(6.0)
    while True:
        y = torch.nextafter(x, torch.tensor(math.inf))
        if torch.equal(x / tau_t, y / tau_t):
            return x.item(), y.item()
        x = y


def _cut_rows(B: int, V: int, head: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, V) logits and (B,) temperatures, rows of ``CUT_KINDS`` in turn, with
    ties at the cut of a ``head``-wide sorted head: head - 1 tokens above
    y, y, x with x on the smallest of the three ids, an ulp pair x < y that
    one division ties (equal logits under greedy), so topk keeps both y and
    the head needs x; ties everywhere; five finite logits and -inf; +-0.0
    around three positives; plain random rows."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g)
    temp = torch.rand(B, generator=g) * 1.4 + 0.3
    above = min(head, V - 2) - 1
    for r in range(B):
        kind, row = CUT_KINDS[r % len(CUT_KINDS)], logits[r]
        if kind in ("ulp/3", "ulp/0.7", "greedy"):
            temp[r] = {"ulp/3": 3.0, "ulp/0.7": 0.7, "greedy": 0.0}[kind]
            x, y = _ulp_pair(float(temp[r])) if kind != "greedy" else (6.0, 6.0)
            ids = torch.randperm(V, generator=g)[:above + 3]
            row.clamp_(max=5.0)
            row[ids[:above]] = 20.0 + torch.rand(above, generator=g)
            a, c1, c2 = ids[above:].sort().values
            row[a], row[c1], row[c2] = x, y, y
        elif kind == "rounded":
            row.mul_(4).round_()
        elif kind == "-inf":
            row[torch.randperm(V, generator=g)[5:]] = float("-inf")
        elif kind == "+-0":
            zero = torch.where(torch.rand(V, generator=g) < 0.5, -0.0, 0.0)
            row.copy_(torch.where(row > 0, zero, row))
            row[torch.randperm(V, generator=g)[:3]] = 1.0 + torch.rand(3, generator=g)
    return logits, temp


def _check_cuda_head(device, V: int, B: int, heads) -> None:
    """For each head: ``kernel.sorted_head_triton`` == ``op.sorted_head`` of the
    full keys (without building them when head < V and head <= op._HEAD_MAX;
    larger heads take the full sort), and ``rows_triton``'s draw
    and replays (drawn tokens, random tokens) with that head == with the full
    sort (head = V) through the same support kernel; the replay's key (from
    the logit) gives ``rules.chosen_logprob``'s bits.  On CUDA, or on CPU
    tensors under TRITON_INTERPRET=1."""
    import contextlib
    from unittest import mock

    from alignzoo.common.sampling import kernel, op
    from alignzoo.common.sampling.op import sorted_head
    from alignzoo.common.sampling.rules import chosen_logprob

    for head in heads:
        logits, temp = _cut_rows(B, V, head, seed=V + head)
        keys = order_keys(logits / torch.where(temp == 0, torch.ones_like(temp), temp)[:, None])
        g = torch.Generator().manual_seed(head)
        k = torch.randint(1, min(head, V) + 1, (B,), generator=g)
        p = torch.where(torch.rand(B, generator=g) < 0.5, 1.0, torch.rand(B, generator=g) * 0.98 + 0.02)
        m = torch.where(torch.rand(B, generator=g) < 0.5, 0.0, torch.rand(B, generator=g) * 0.2)
        seed, step = torch.randint(-(2**62), 2**62, (B,), generator=g), torch.randint(0, 5000, (B,), generator=g)
        others = torch.randint(0, V, (B,), generator=g)
        l, t, k, p, m, seed, step, others = (x.to(device) for x in (logits, temp, k, p, m, seed, step, others))

        no_keys = mock.patch.object(kernel, "order_keys_triton", side_effect=AssertionError("(B, V) keys"))
        with no_keys if head < V and head <= op._HEAD_MAX else contextlib.nullcontext():
            got = kernel.sorted_head_triton(l, t, head)
            runs = [kernel.rows_triton(l, t, k, p, m, seed, step, None, head)]
            runs += [kernel.rows_triton(l, t, k, p, m, None, None, tok, head) for tok in (runs[0][0], others)]
        assert torch.equal(got.cpu(), sorted_head(keys, head)), f"V={V} head={head}"
        full = kernel.rows_triton(l, t, k, p, m, seed, step, None, V)
        fulls = [full] + [kernel.rows_triton(l, t, k, p, m, None, None, tok, V) for tok in (full[0], others)]
        for run, ref in zip(runs, fulls):
            assert all(bitwise_equal(a, b) for a, b in zip(run, ref)), f"V={V} head={head}"
        for tok, lp, v0, logz, last in runs:
            key_tok = keys.gather(1, tok.cpu()[:, None]).squeeze(1)
            assert bitwise_equal(lp.cpu(), chosen_logprob(key_tok, v0.cpu(), logz.cpu(), last.cpu(), temp == 0))
        assert bitwise_equal(runs[1][1], runs[0][1])  # the replay is the sampler


def _support_reference(logits, temperature, top_k, top_p, min_p, seed, step, block=4096):
    """The support kernel's passes written plainly in numpy fp32 (one row at a
    time, every chunk, no early exit): under TRITON_INTERPRET=1 tl.exp,
    tl.cumsum and tl.log are numpy's, so the kernel must give these bits."""
    from alignzoo.common.sampling.op import _prepare
    from alignzoo.common.sampling.rules import chosen_logprob, key_values, order_keys, uniform01

    greedy, tau, k, p, m = _prepare(temperature, top_k, top_p, min_p, logits.shape[1])
    keys = order_keys(logits / tau[:, None])
    skeys = torch.sort(keys, dim=-1).values
    u = uniform01(seed, step).numpy()
    toks, logzs, lasts = [], [], []
    for b in range(logits.shape[0]):
        n_k = int(k[b])
        v = key_values(skeys[b]).numpy()
        e = np.exp(v[:n_k] - v[0]).astype(np.float32)
        S = np.empty(n_k, np.float32)
        carry = np.float32(0.0)
        for c in range(0, n_k, block):
            S[c:c + block] = carry + np.cumsum(e[c:c + block], dtype=np.float32)
            carry = S[min(c + block, n_k) - 1]
        low = np.nonzero((np.arange(n_k) >= 1) & (e < np.float32(m[b])))[0]
        n = int(low[0]) if low.size else n_k
        if float(p[b]) < 1.0:
            hit = np.nonzero(S[:n] >= np.float32(p[b]) * S[n_k - 1])[0]
            n = min(n, int(hit[0]) + 1) if hit.size else n
        z = S[n - 1]
        hit = np.nonzero(S[:n] > np.float32(u[b]) * z)[0]
        pick = int(hit[0]) if hit.size else n - 1
        toks.append(skeys[b, pick]); lasts.append(skeys[b, n - 1]); logzs.append(np.log(z))
    key_tok, last = torch.stack(toks), torch.stack(lasts)
    logz = torch.tensor(np.array(logzs, dtype=np.float32))
    v0 = key_values(skeys[:, 0])
    return key_tok & 0xFFFFFFFF, chosen_logprob(key_tok, v0, logz, last, greedy), v0, logz, last


def _check_support_against_reference(V: int, seed: int) -> None:
    """``rows_triton`` (draw) on CPU tensors == ``_support_reference``, for rows
    that take each path of the kernel's passes: a top-p cut in chunk 0 and in
    a later chunk, a min-p cut alone, no cut at all, a top-k cut, greedy."""
    from alignzoo.common.sampling import kernel

    g = torch.Generator().manual_seed(seed)
    B = 8
    logits = torch.randn(B, V, generator=g) * 3
    logits[1] = torch.randn(V, generator=g) * 0.01  # flat: a 0.9 top-p cut lands past chunk 0 when V > 4096
    logits[6] = logits[6].round()  # ties
    temperature = torch.rand(B, generator=g) + 0.3
    temperature[7] = 0.0  # greedy
    top_k = torch.tensor([0, 0, 0, 0, V // 3, 0, 0, 0])
    top_p = torch.tensor([0.5, 0.9, 1.0, 1.0, 0.8, 1e-6, 0.95, 1.0])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.01, 0.0, 0.1, 0.0])
    seed_t, step = torch.randint(-(2**62), 2**62, (B,), generator=g), torch.randint(0, 10**6, (B,), generator=g)
    got = kernel.rows_triton(logits, temperature, top_k, top_p, min_p, seed_t, step, None, V)
    ref = _support_reference(logits, temperature, top_k, top_p, min_p, seed_t, step)
    for name, a, b in zip(("token", "lp", "v0", "logz", "last"), got, ref):
        assert bitwise_equal(a, b) if a.is_floating_point() else torch.equal(a, b), (V, seed, name)


PATH_KINDS = ("flat", "tail", "ties", "-inf", "+-0", "plateau", "greedy", "denormal", "random", "half -inf")


def _path_rows(B: int, V: int, seed: int) -> dict[str, torch.Tensor]:
    """(B, V) logits and per-row parameters, rows of ``PATH_KINDS`` in turn,
    that send every pass of the support kernel past chunk 0 of the sorted
    row: a flat row (top-p 0.95 cuts ~95% in), a peak over a long tail of
    tiny weights (Z near 1: a changed association of its sum shows in log Z),
    ties everywhere, five finite logits among -inf, +-0.0, a plateau of
    ~1.5 chunks that min-p near 1 cuts after, greedy rows, denormal logits,
    plain random rows, half the row -inf.  top_k cycles through off, 1, V, >V
    and widths at and around the 4096-position chunk; top_p through tiny,
    0.95, 1.0, 0.5; min_p through 0, near 1 and small."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, V, generator=g)
    temp = torch.rand(B, generator=g) * 1.4 + 0.3
    top_k = torch.tensor([0, 0, 1, V, V + 5, 4096, 4097, 0, 8193, 0, 5000, 0, 0])[torch.arange(B) % 13]
    top_p = torch.tensor([0.95, 1.0, 0.95, 1e-6, 0.5, 0.95, 1.0])[torch.arange(B) % 7]
    min_p = torch.tensor([0.0, 0.0, 0.999, 0.0, 0.05, 0.0, 0.9999, 0.0, 0.0, 0.001, 0.0])[torch.arange(B) % 11]
    for r in range(B):
        kind, row = PATH_KINDS[r % len(PATH_KINDS)], logits[r]
        if kind == "flat":
            row.mul_(0.01)
        elif kind == "tail":
            row.mul_(0.5).sub_(12.0)
            row[int(torch.randint(0, V, (1,), generator=g))] = 0.0
            temp[r] = 1.0
        elif kind == "ties":
            row.mul_(4).round_().div_(4)
        elif kind == "-inf":
            row[torch.randperm(V, generator=g)[5:]] = float("-inf")
        elif kind == "+-0":
            zero = torch.where(torch.rand(V, generator=g) < 0.5, -0.0, 0.0)
            row.copy_(torch.where(row > -1, zero, row))
            row[torch.randperm(V, generator=g)[:3]] = 1.0 + torch.rand(3, generator=g)
        elif kind == "plateau":
            row.sub_(8.0)
            row[torch.randperm(V, generator=g)[:min(V, 6000)]] = 5.0 + torch.rand(min(V, 6000), generator=g) * 1e-5
            min_p[r], top_p[r] = 0.9999, 1.0
        elif kind == "greedy":
            temp[r] = 0.0
        elif kind == "denormal":
            row.copy_(torch.where(row > 0, 1e-40, -1e-40) * row.abs().round())
            row[: min(V, 3)] = torch.tensor([1e-45, -1e-45, 0.0])[: min(V, 3)]
        elif kind == "half -inf":
            row[torch.randperm(V, generator=g)[: V // 2]] = float("-inf")
    return {"logits": logits, "temperature": temp, "top_k": top_k, "top_p": top_p, "min_p": min_p,
            "seed": torch.randint(-(2**62), 2**62, (B,), generator=g), "step": torch.randint(0, 5000, (B,), generator=g),
            "others": torch.randint(0, V, (B,), generator=g)}


def _check_full_sort_paths(device, V: int, B: int, seed: int, variants=(("values", True),)) -> None:
    """The full sort's paths (``kernel.rows_triton``'s ``sort`` "keys" or
    "values", ``prepass`` off or on) against today's (int64 keys, chunks
    walked from chunk 0): the same token, lp, v0, log Z and last key bits,
    for the draw and for replays of the drawn tokens and of random ones, on
    ``_path_rows``.  Also ``sorted_values_triton`` == the sorted keys' values
    and ids.  On CUDA, or on CPU tensors under TRITON_INTERPRET=1."""
    from alignzoo.common.sampling import kernel

    c = {n: x.to(device) for n, x in _path_rows(B, V, seed).items()}
    args = [c[n] for n in ("logits", "temperature", "top_k", "top_p", "min_p")]
    keys = kernel.sorted_head_triton(c["logits"], c["temperature"], V)  # (B, V): today's sorted keys
    vals, ids = kernel.sorted_values_triton(c["logits"], c["temperature"])
    assert vals.shape[1] == ids.shape[1] == kernel.key_row_stride(V)
    assert torch.equal(ids[:, :V], key_ids(keys)), f"V={V} B={B}: the value sort's permutation"
    assert bitwise_equal(vals[:, :V], key_values(keys)), f"V={V} B={B}"
    assert bool((ids[:, V:] >= V).all()) and bool((vals[:, V:] == float("-inf")).all())

    def run(sort, prepass):
        draw = kernel.rows_triton(*args, c["seed"], c["step"], None, V, sort=sort, prepass=prepass)
        return [draw] + [kernel.rows_triton(*args, None, None, tok, V, sort=sort, prepass=prepass)
                         for tok in (draw[0], c["others"])]

    ref = run("keys", False)
    for sort, prepass in variants:
        for got, want, what in zip(run(sort, prepass), ref, ("draw", "replay", "replay of others")):
            for name, a, b in zip(("token", "lp", "v0", "logz", "last"), got, want):
                assert bitwise_equal(a, b), f"V={V} B={B} sort={sort} prepass={prepass} {what}: {name}"
    assert bitwise_equal(ref[1][1], ref[0][1])  # the replay is the sampler


def _fold_is_visible(V: int, B: int, seed: int) -> bool:
    """Whether ``_path_rows`` has rows whose log Z (numpy fp32, the
    interpreter's arithmetic) changes when the chunks' carry chain is
    re-associated, both ways tried: last chunk's partial first, and pairs of
    partials summed before they reach the carry.  Then a prepass that folded
    its partials in such an order would fail ``_check_full_sort_paths``."""
    from alignzoo.common.sampling.op import _prepare

    c = _path_rows(B, V, seed)
    greedy, tau, k, p, m = _prepare(c["temperature"], c["top_k"], c["top_p"], c["min_p"], V)
    v = key_values(torch.sort(order_keys(c["logits"] / tau[:, None]), dim=-1).values).numpy()
    seen = set()
    for b in range(B):
        n_k = int(k[b])
        e = np.exp(v[b, :n_k] - v[b, 0]).astype(np.float32)
        parts = [np.cumsum(e[i:i + 4096], dtype=np.float32)[-1] for i in range(0, n_k, 4096)]
        pairs = [np.float32(sum(parts[i:i + 2], np.float32(0))) for i in range(0, len(parts), 2)]
        fold = lambda xs: functools.reduce(lambda a, x: np.float32(a + x), xs, np.float32(0))  # noqa: E731
        for name, other in (("reversed", parts[::-1]), ("pairs", pairs)):
            if np.log(fold(other)) != np.log(fold(parts)):
                seen.add(name)
    return seen == {"reversed", "pairs"}


_INTERPRETED_HEAD = """
import sys
sys.path.insert(0, {tests!r})
from test_sampling import _check_cuda_head
{calls}
"""


def test_cuda_head_is_the_full_sorts_head_interpreted():
    """kernel.py's head path (torch.topk of the logits, _head_keys_kernel's
    tie scan) run by Triton's interpreter on CPU tensors: the full sort's
    sorted head and rows, with ties straddling the cut (ulp pairs tied by
    tau = 3 and 0.7, equal logits, -inf rows, +-0.0), greedy rows, heads 1
    to V, odd V, in CI (``test_gpu_cuda_head_is_the_full_sorts_head`` at
    the real vocabulary)."""
    import os

    calls = ["_check_cuda_head('cpu', 1000, 8, (1, 7, 50, 999, 1000))",
             "_check_cuda_head('cpu', 4099, 9, (1, 50, 1024, 4098, 4099))"]
    run_interpreted(_INTERPRETED_HEAD.format(tests=os.path.dirname(__file__), calls="\n".join(calls)))


def test_support_kernel_passes_equal_a_plain_reference_interpreted():
    """kernel.py's ``_support_kernel`` (its passes stop at the first chunk with
    a top-p or draw hit, and skip the Z pass where pass 1 or 2 read Z) run by
    Triton's interpreter: its tokens and bits equal ``_support_reference``,
    the passes written plainly in numpy, every chunk, no early exit.  V up to
    three 4096-wide chunks, the last one partial."""
    import os

    calls = [f"_check_support_against_reference({V}, {seed})" for V in (97, 5000, 9000) for seed in (0, 1)]
    run_interpreted(_INTERPRETED_HEAD.format(tests=os.path.dirname(__file__), calls="\n".join(calls)).replace(
        "import _check_cuda_head", "import _check_support_against_reference"))


ALL_PATHS = (("values", True), ("keys", True), ("values", False))


def _run_interpreted(calls: list[str]) -> None:
    import os

    run_interpreted(_INTERPRETED_HEAD.format(tests=os.path.dirname(__file__), calls="\n".join(calls)).replace(
        "import _check_cuda_head", "import _check_full_sort_paths, ALL_PATHS"))


def test_full_sort_paths_are_todays_bits_interpreted():
    """The full sort as fp32 values (stable descending torch.sort) and pass 1
    as per-chunk partials folded by the support kernel, each alone and
    together, against today's int64 key sort with the chunks walked from
    chunk 0, under Triton's interpreter: every output bit, for draws and
    replays, at V = 97 (one chunk, partials forced), 4099 (a 3-position last
    chunk), 9000 and 20011 (3 and 5 chunks), batch 1, 2, 7 and 64, rows of
    ``_path_rows`` (ties, -inf, +-0.0, denormals, greedy, cuts past chunk 0,
    top_k at chunk borders).  At V = 20011 a fold of the partials in another
    order changes some row's log Z (``_fold_is_visible``), so a changed fold
    fails here (checked: folding each group's sum into the carry fails it,
    at V = 20011; with groups of 16, a fold reversed within groups failed it
    at V = 9000 and the V = 151936 test).  The interpreter folds
    FOLD_INTERPRETED = 2 partials a step, the GPU 16 (same bits)."""
    assert _fold_is_visible(20011, 2, 1)
    _run_interpreted(["_check_full_sort_paths('cpu', 97, 7, 0, ALL_PATHS)",
                      "_check_full_sort_paths('cpu', 20011, 2, 1, ALL_PATHS)",
                      "_check_full_sort_paths('cpu', 9000, 7, 4)",
                      "_check_full_sort_paths('cpu', 4099, 1, 3)",
                      "_check_full_sort_paths('cpu', 97, 64, 5, ((None, True),))"])


@pytest.mark.slow
def test_full_sort_paths_are_todays_bits_at_qwen_vocab_interpreted():
    """As above at V = 151936 (38 chunks): a flat row with top-p 0.95 (the
    engine benchmark's sampling; the cut and the draw ~36 chunks in) and a
    peak over a long tail whose log Z shows a re-associated fold."""
    assert _fold_is_visible(151936, 2, 2)
    _run_interpreted(["_check_full_sort_paths('cpu', 151936, 2, 2)"])


@pytest.mark.parametrize("B,V", [pytest.param(13, 1000, id="B13-V1000"), pytest.param(3, QWEN_VOCAB, id="B3-V151936")])
def test_rows_invariant_to_batch_order_padding_and_launch(device, B, V):
    c = random_case(B, V, device, seed=V)
    configs = _launch_configs(device) if V < 10_000 else [{}, {"row_chunk": 1}]
    sizes = (1, 2, 5) if B > 5 else (1,)
    assert rung1_repeat("sampling", sample_fwd, *_rows(c)).passed
    r = rung2_rows("sampling", sample_fwd, _rows(c), configs=configs, batch_sizes=sizes)
    assert r.passed, r.detail
    tokens, lps = sample_fwd(*_rows(c))
    r = rung2_rows("sampling", sampling_logprobs_fwd, (c["logits"], tokens, *_params(c).values()),
                   configs=configs, batch_sizes=sizes)
    assert r.passed, r.detail
    for i in (0, B // 2, B - 1):  # the same promise, torch.equal row by row
        one = sample_fwd(*(x[i:i + 1] for x in _rows(c)))
        assert torch.equal(one[0], tokens[i:i + 1]) and bitwise_equal(one[1], lps[i:i + 1])


def test_a_request_gets_the_same_token_in_any_slot_of_any_batch(device):
    """One request (its logits, parameters, seed, step) dropped into unrelated
    batches at every slot: same token, same log-prob bits."""
    V = 1000
    req = random_case(1, V, device, seed=11)
    req["top_k"][0], req["top_p"][0], req["min_p"][0], req["temperature"][0] = 200, 0.9, 0.01, 0.8
    alone = sample_fwd(*_rows(req))
    for trial, B in enumerate((2, 9, 32)):
        others = random_case(B, V, device, seed=100 + trial)
        for slot in (0, B // 2, B - 1):
            batch = {n: torch.cat([others[n][:slot], req[n], others[n][slot + 1:]]) for n in req}
            tok, lp = sample_fwd(*_rows(batch))
            assert tok[slot] == alone[0][0] and bitwise_equal(lp[slot:slot + 1], alone[1])


# --- the seeded draw ---------------------------------------------------------

def test_seeded_draws_are_reproducible_and_follow_seed_and_step(device):
    c = _uniform_case(64, 1000, device, t=1.0, spread=0.5)  # a flat distribution: draws spread out
    first = sample_fwd(*_rows(c))
    again = sample_fwd(*_rows(c))
    assert torch.equal(first[0], again[0]) and bitwise_equal(first[1], again[1])
    c2 = dict(c, step=c["step"] + 1)
    assert (sample_fwd(*_rows(c2))[0] != first[0]).float().mean() > 0.9
    c3 = dict(c, seed=c["seed"] + 1000)
    assert (sample_fwd(*_rows(c3))[0] != first[0]).float().mean() > 0.9


def test_uniform01_is_a_pure_exact_function_of_seed_and_step(device):
    N = 20000
    seed = torch.arange(N, device=device) - 3
    step = torch.full((N,), 12, device=device)
    u = uniform01(seed, step)
    assert u.dtype == torch.float32 and bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u * 2**24, (u * 2**24).round())  # 24-bit, exact in fp32
    perm = torch.randperm(N, device=device)
    assert torch.equal(uniform01(seed[perm], step[perm]), u[perm])
    assert torch.equal(uniform01(seed[:1], step[:1]), u[:1])
    # roughly uniform: Kolmogorov-Smirnov distance below the 1% critical value 1.63/sqrt(N)
    us = u.double().sort().values.cpu()
    ks = (torch.arange(1, N + 1, dtype=torch.float64) / N - us).abs().max().item()
    assert ks < 1.63 / math.sqrt(N)
    # extreme int64 seeds and steps are fine
    big = torch.tensor([-(2**63), 2**63 - 1, 0], device=device)
    assert bool(((uniform01(big, big) >= 0) & (uniform01(big, big) < 1)).all())


# --- replay == sampler, bitwise ------------------------------------------------

REPLAY_CASES = [  # (id, temperature, top_k, top_p, min_p)
    ("temperature", 0.7, 0, 1.0, 0.0),
    ("greedy", 0.0, 0, 1.0, 0.0),
    ("top_k=1", 1.0, 1, 1.0, 0.0),
    ("top_k=37", 1.0, 37, 1.0, 0.0),
    ("top_k=V", 1.0, 1000, 1.0, 0.0),
    ("top_k>V", 1.0, 5000, 1.0, 0.0),
    ("top_p=1e-6", 1.0, 0, 1e-6, 0.0),
    ("top_p=0.6", 1.0, 0, 0.6, 0.0),
    ("top_p=1.0", 1.3, 0, 1.0, 0.0),
    ("min_p=0", 1.0, 0, 1.0, 0.0),
    ("min_p=0.1", 1.0, 0, 1.0, 0.1),
    ("min_p=0.999", 1.0, 0, 1.0, 0.999),
    ("all four", 0.8, 50, 0.9, 0.02),
    ("all four, tight", 1.5, 20, 0.3, 0.5),
]


@pytest.mark.parametrize("name,t,k,p,m", REPLAY_CASES, ids=[c[0] for c in REPLAY_CASES])
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
def test_replay_equals_sampler_bitwise(device, name, t, k, p, m, ties):
    B, V = 24, 1000
    c = _uniform_case(B, V, device, t=t, k=k, p=p, m=m, seed=1, spread=1.0)
    if ties:  # exact ties everywhere, including at the maximum and at the cuts
        c["logits"] = (c["logits"] * 2).round() / 2
    tokens, lps = sample_fwd(*_rows(c))
    replay = sampling_logprobs(c["logits"], tokens, **_params(c))
    assert bitwise_equal(replay, lps)
    assert bool(torch.isfinite(lps).all())
    # every token of every row: the replay of any token equals the row's transformed distribution
    lp_all = transformed_logprobs_fwd(c["logits"], *_params(c).values())
    assert bitwise_equal(lp_all.gather(1, tokens[:, None]).squeeze(1), lps)
    other = torch.randint(0, V, (B,), device=device)
    assert bitwise_equal(sampling_logprobs(c["logits"], other, **_params(c)), lp_all.gather(1, other[:, None]).squeeze(1))
    # the support is the float64 reference's
    ref = transformed_logprobs_ref(c["logits"].cpu(), *[x.cpu() for x in _params(c).values()])
    _assert_same_support(lp_all, ref, device)


def _no_sort(*a, **k):
    raise AssertionError("an uncut row was sorted")


def test_uncut_rows_replay_without_a_sort_in_any_batch(device, monkeypatch):
    """Rows without a cut (top-k, top-p, min-p off) take log Z from a fixed-order
    sum in id order: the replay forms no sort, a row's bits do not depend on the
    batch (alone, reversed, among rows with cuts), and they are the sampler's."""
    from alignzoo.common.sampling import kernel, op

    B, V = 9, 2 * op.UNCUT_CHUNK + 77  # three chunks, the last ragged
    c = _uniform_case(B, V, device, seed=4, spread=3.0)
    c["temperature"] = torch.linspace(0.5, 1.5, B, device=device)
    c["logits"][2, ::5] = float("-inf")  # banned tokens
    c["logits"][3, :100] = -0.0
    tokens = torch.randint(0, V, (B,), device=device)
    tokens[2] = 5  # a banned one: -inf
    with monkeypatch.context() as mp:
        for mod, name in ((op, "sorted_head"), (kernel, "sorted_values_triton"), (kernel, "sorted_head_triton")):
            mp.setattr(mod, name, _no_sort)
        lp = sampling_logprobs(c["logits"], tokens, **_params(c))
        alone = torch.cat([sampling_logprobs(c["logits"][i:i + 1], tokens[i:i + 1],
                                             **{n: x[i:i + 1] for n, x in _params(c).items()}) for i in range(B)])
        rev = sampling_logprobs(c["logits"].flip(0), tokens.flip(0), **{n: x.flip(0) for n, x in _params(c).items()})
    assert bitwise_equal(lp, alone) and bitwise_equal(lp, rev.flip(0))
    assert lp[2] == float("-inf") and bool(torch.isfinite(lp[torch.arange(B) != 2]).all())
    ref = sampling_logprobs_ref(c["logits"].cpu(), tokens.cpu(), *[x.cpu() for x in _params(c).values()])
    fin = torch.isfinite(ref)
    assert rel_err(lp.cpu()[fin], ref[fin]) < 1e-5
    # among rows with cuts, interleaved: the same bits; the sampler reports them for its draws
    cut = _uniform_case(B, V, device, k=40, p=0.9, m=0.01, seed=5, spread=3.0)
    mixed = {n: torch.stack([c[n], cut[n]], 1).flatten(0, 1) for n in c}
    tok2 = torch.stack([tokens, tokens], 1).flatten()
    got = sampling_logprobs(mixed["logits"], tok2, **_params(mixed))
    assert bitwise_equal(got[0::2], lp)
    assert bitwise_equal(got[1::2], sampling_logprobs(cut["logits"], tokens, **_params(cut)))
    drawn, lps = sample_fwd(*_rows(mixed))
    assert bitwise_equal(sampling_logprobs(mixed["logits"], drawn, **_params(mixed)), lps)
    lp_all = transformed_logprobs_fwd(mixed["logits"], *_params(mixed).values())
    assert bitwise_equal(lp_all.gather(1, drawn[:, None]).squeeze(1), lps)


def test_uncut_rows_sum_in_their_fixed_order(device):
    """Z_id is the chunks' pairwise trees added left to right: adding the same
    exp terms in another order (here one left-to-right pass) gives other bits."""
    from alignzoo.common.sampling import op

    c = _uniform_case(64, 3 * op.UNCUT_CHUNK + 5, device, seed=6, spread=4.0)
    tokens = torch.zeros(64, dtype=torch.int64, device=device)
    lp, v0, logz, _ = op.uncut_logprobs(c["logits"], c["temperature"], tokens)
    assert bitwise_equal(v0, c["logits"].amax(1))
    e = torch.exp(c["logits"].cpu() - v0.cpu()[:, None])
    naive = torch.log(torch.cumsum(e, 1)[:, -1])
    if device.type == "cpu":
        tree = op.pairwise_tree(op.pad_to(e, 1, 4 * op.UNCUT_CHUNK, 0.0).view(64, 4, -1))
        assert bitwise_equal(logz, torch.log(((tree[:, 0] + tree[:, 1]) + tree[:, 2]) + tree[:, 3]))
        assert not bitwise_equal(logz, naive)
    assert rel_err(logz.cpu(), naive) < 1e-6


def test_replay_equals_sampler_all_four_at_qwen_vocab(device):
    c = random_case(4, QWEN_VOCAB, device, seed=5)
    tokens, lps = sample_fwd(*_rows(c))
    assert bitwise_equal(sampling_logprobs(c["logits"], tokens, **_params(c)), lps)


# --- tie rules, greedy, edges ----------------------------------------------------

def test_ties_go_to_the_smaller_token_id(device):
    l = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, -0.0, 0.0]], device=device)

    def support(t, k, p, m):
        P = [torch.tensor([x], dtype=d, device=device) for x, d in
             ((t, torch.float32), (k, torch.int64), (p, torch.float32), (m, torch.float32))]
        return torch.isfinite(transformed_logprobs_fwd(l, *P)[0]).nonzero().flatten().tolist()

    assert support(0.0, 0, 1.0, 0.0) == [1]  # greedy
    assert support(1.0, 1, 1.0, 0.0) == [1]
    assert support(1.0, 2, 1.0, 0.0) == [1, 2]  # id 4 ties with 2 but is larger
    assert support(1.0, 3, 1.0, 0.0) == [1, 2, 4]
    assert support(1.0, 0, 1e-6, 0.0) == [1]
    assert support(1.0, 0, 1.0, 1.0) == [1, 2, 4]  # min_p 1: every maximum
    assert support(1.0, 6, 1.0, 0.0) == [0, 1, 2, 3, 4, 5]  # -0.0 and +0.0 tie: smaller id first
    keys = order_keys(torch.tensor([[0.0, -0.0, float("-inf"), 1e-45, -1e-45, 2.0]]))
    assert key_ids(keys.sort(dim=-1).values).flatten().tolist() == [5, 3, 0, 1, 4, 2]


def test_greedy_is_argmax_with_logprob_zero_and_no_gradient(device):
    B, V = 6, 1000
    c = _uniform_case(B, V, device, t=0.0, k=17, p=0.3, m=0.5)  # other parameters are moot
    c["logits"][0, 10] = c["logits"][0, 900] = c["logits"][0].max() + 1  # tie at the max
    tokens, lps = sample_fwd(*_rows(c))
    assert tokens[0] == 10 and torch.equal(tokens[1:], c["logits"][1:].argmax(1))
    assert bitwise_equal(lps, torch.zeros(B, device=device))
    logits = c["logits"].clone().requires_grad_()
    wrong = (tokens + 1) % V
    lp = sampling_logprobs(logits, torch.cat([tokens[:3], wrong[3:]]), **_params(c))
    assert bitwise_equal(lp[:3], torch.zeros(3, device=device))
    assert bool(torch.isinf(lp[3:]).all() & (lp[3:] < 0).all())
    lp[:3].sum().backward()
    assert not logits.grad.any()


def test_edge_cases_banned_tokens_and_flat_rows(device):
    """-inf logits (banned tokens) are never drawn and replay to -inf; an
    all-equal row draws in id order."""
    B, V = 8, 300
    c = _uniform_case(B, V, device, t=1.0, seed=3)
    c["logits"][:, 50:] = float("-inf")
    c["logits"][1] = 0.0
    c["top_k"][2] = 200  # top-k past the finite tokens
    tokens, lps = sample_fwd(*_rows(c))
    assert bool((tokens[torch.arange(B) != 1] < 50).all()) and bool(torch.isfinite(lps).all())
    assert bitwise_equal(sampling_logprobs(c["logits"], tokens, **_params(c)), lps)
    banned = sampling_logprobs(c["logits"], torch.full((B,), 77, device=device), **_params(c))
    assert bool((banned[torch.arange(B) != 1] == float("-inf")).all())
    assert abs(lps[1].item() + math.log(V)) < 1e-5  # flat row: uniform over V


# --- distribution sanity -----------------------------------------------------------

DIST_CASES = [
    ("plain", 1.0, 0, 1.0, 0.0),
    ("all four", 0.8, 9, 0.85, 0.05),
    ("top_p", 1.3, 0, 0.7, 0.0),
    ("min_p", 0.6, 0, 1.0, 0.1),
]


@pytest.mark.parametrize("vary", ["seed", "step"])
@pytest.mark.parametrize("name,t,k,p,m", DIST_CASES, ids=[c[0] for c in DIST_CASES])
def test_empirical_frequencies_follow_the_transformed_distribution(device, name, t, k, p, m, vary):
    """N = 20000 draws of one row (seeds 0..N-1, or steps 0..N-1 of one seed).
    Bound per token: |f - p| <= 4.5 sqrt(p (1 - p) / N) + 1/N (4.5 sigma of a
    binomial frequency); tokens outside the support: frequency exactly 0."""
    N, V = 20000, 12
    g = torch.Generator().manual_seed(7)
    row = torch.randn(1, V, generator=g) * 1.5
    c = _uniform_case(N, V, device, t=t, k=k, p=p, m=m)
    c["logits"] = row.expand(N, V).contiguous().to(device)
    if vary == "step":
        c["seed"], c["step"] = torch.full_like(c["seed"], 12345), torch.arange(N, device=device)
    tokens, _ = sample_fwd(*_rows(c))
    freq = torch.bincount(tokens.cpu(), minlength=V).double() / N
    prob = transformed_logprobs_ref(row, *[x[:1].cpu() for x in _params(c).values()])[0].exp()
    bound = 4.5 * (prob * (1 - prob) / N).sqrt() + 1.0 / N
    assert bool(((freq - prob).abs() <= bound).all()), (freq, prob)
    assert bool((freq[prob == 0] == 0).all())


# --- accuracy and gradients vs float64 ------------------------------------------------

@pytest.mark.parametrize("B,V", [pytest.param(13, 1000, id="V1000"), pytest.param(2, QWEN_VOCAB, id="V151936")])
def test_accuracy_against_float64(device, B, V):
    """Every token's log-prob over the support vs float64: the supports are the
    same set, and rel err <= 2e-6 (fp32 exp/log, one fixed-order fp32 sum of
    up to 151936 terms, largest first)."""
    c = random_case(B, V, device, seed=21)
    got = transformed_logprobs_fwd(c["logits"], *_params(c).values()).cpu()
    ref = transformed_logprobs_ref(c["logits"].cpu(), *[x.cpu() for x in _params(c).values()])
    _assert_same_support(got, ref, device)
    fin = torch.isfinite(ref) & torch.isfinite(got)
    assert rel_err(got[fin], ref[fin]) < 2e-6
    tokens, lps = sample_fwd(*_rows(c))
    assert rel_err(lps.cpu(), ref.gather(1, tokens.cpu()[:, None]).squeeze(1)) < 2e-6


@pytest.mark.parametrize("B,V", [pytest.param(16, 1000, id="V1000"), pytest.param(2, 20011, id="V20011")])
def test_gradients_against_float64_autograd(device, B, V):
    c = random_case(B, V, device, seed=31)
    tokens, _ = sample_fwd(*_rows(c))
    w = torch.randn(B, device=device)
    logits = c["logits"].clone().requires_grad_()
    (sampling_logprobs(logits, tokens, **_params(c)) * w).sum().backward()
    ref_logits = c["logits"].cpu().double().requires_grad_()
    (sampling_logprobs_ref(ref_logits, tokens.cpu(), *[x.cpu() for x in _params(c).values()]) * w.cpu()).sum().backward()
    assert logits.grad.dtype == torch.float32
    assert rel_err(logits.grad.cpu(), ref_logits.grad) < 1e-5
    # outside the support the gradient is exactly zero
    outside = ~torch.isfinite(transformed_logprobs_fwd(c["logits"], *_params(c).values()))
    assert not logits.grad[outside].any()


# --- the checks can fail ------------------------------------------------------------

def test_check_catches_a_batch_slot_rng():
    """The classic bug: one generator per batch, a uniform per slot."""
    c = random_case(13, 1000, torch.device("cpu"), seed=2)

    def slot_rng(logits, t, k, p, m, seed, step):
        g = torch.Generator().manual_seed(int(seed[0]))
        u = torch.rand(logits.shape[0], generator=g)
        greedy, tau, kk, pp, mm = _prepare(t, k, p, m, logits.shape[1])
        skeys = order_keys(logits / tau[:, None]).sort(dim=-1).values
        return key_ids(skeys.gather(1, support_cpu(skeys, kk, pp, mm, u)[2][:, None]))

    r = rung2_rows("bad", slot_rng, _rows(c), batch_sizes=(1, 2, 5))
    assert not r.passed and r.differing > 0


def test_check_catches_a_batch_dependent_sum_order():
    """A prefix-sum chunk chosen from the batch size regroups the adds."""
    c = random_case(13, 1000, torch.device("cpu"), seed=2)

    def chunk_by_batch(logits, t, k, p, m, seed, step):
        greedy, tau, kk, pp, mm = _prepare(t, k, p, m, logits.shape[1])
        skeys = order_keys(logits / tau[:, None]).sort(dim=-1).values
        return support_cpu(skeys, kk, pp, mm, uniform01(seed, step), chunk=64 if logits.shape[0] < 8 else 256)[1]

    r = rung2_rows("bad", chunk_by_batch, _rows(c), batch_sizes=(1, 2, 5))
    assert not r.passed and r.differing > 0


def test_check_catches_a_replay_with_another_reduction():
    """A replay that sums the support with torch.logsumexp is close but not
    the sampler's bits: the bitwise replay check fails."""
    c = _uniform_case(32, 1000, torch.device("cpu"), t=0.9, k=300, p=0.95, spread=0.7)
    tokens, lps = sample_fwd(*_rows(c))
    lp_all = transformed_logprobs_fwd(c["logits"], *_params(c).values())
    s = c["logits"] / c["temperature"][:, None]
    s_support = torch.where(torch.isfinite(lp_all), s, torch.full_like(s, float("-inf")))
    other = s.gather(1, tokens[:, None]).squeeze(1) - torch.logsumexp(s_support, 1)
    assert rel_err(other, lps) < 1e-6 and not bitwise_equal(other, lps)


def test_cpu_exp_log_do_not_depend_on_position():
    """The CPU path relies on torch.exp/log giving an element the same bits
    wherever it sits (alone, in a vector tail, strided, any thread count)."""
    g = torch.Generator().manual_seed(0)
    for fn, x in ((torch.exp, torch.randn(20011, generator=g) * 30 - 20), (torch.log, torch.rand(20011, generator=g) * 50 + 1e-3)):
        full = fn(x)
        alone = torch.stack([fn(x[i:i + 1])[0] for i in range(0, 600)])
        assert bitwise_equal(alone, full[:600])
        for off in range(0, 33, 3):
            for n in (5, 17, 31, 1001):
                assert bitwise_equal(fn(x[off:off + n].clone()), full[off:off + n])
        assert bitwise_equal(fn(x[:20000].view(200, 100)[:, ::3]), full[:20000].view(200, 100)[:, ::3])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert bitwise_equal(fn(x), full)
        finally:
            torch.set_num_threads(threads)


def test_sort_key_is_exact_and_matches_a_stable_descending_sort(device):
    g = torch.Generator().manual_seed(4)
    s = (torch.randn(5, 3001, generator=g) * 4).round() / 4  # many ties
    s[0, :7] = torch.tensor([float("-inf"), 0.0, -0.0, 1e-45, -1e-45, 3e38, -3e38])
    s = s.to(device)
    keys = order_keys(s)
    assert bitwise_equal(key_values(keys), torch.where(s == 0, torch.zeros_like(s), s))
    skeys = keys.sort(dim=-1).values
    stable = torch.sort(-torch.where(s == 0, torch.zeros_like(s), s), dim=-1, stable=True).indices
    assert torch.equal(key_ids(skeys), stable)


# --- bad input ------------------------------------------------------------------------

def _good(device, B=4, V=50):
    c = _uniform_case(B, V, device)
    return c


BAD = [
    ("logits bf16", lambda c: c.update(logits=c["logits"].bfloat16()), TypeError, "logits has dtype bfloat16"),
    ("logits 1-D", lambda c: c.update(logits=c["logits"][0]), ValueError, "logits must have 2 dimensions"),
    ("logits strided", lambda c: c.update(logits=c["logits"].t().contiguous().t()), ValueError, "logits must be contiguous"),
    ("temperature < 0", lambda c: c["temperature"].__setitem__(1, -0.5), ValueError, "temperature must be 0"),
    ("temperature nan", lambda c: c["temperature"].__setitem__(1, float("nan")), ValueError, "temperature must be 0"),
    ("temperature tiny", lambda c: c["temperature"].__setitem__(1, 1e-8), ValueError, "temperature must be 0"),
    ("temperature f64", lambda c: c.update(temperature=c["temperature"].double()), TypeError, "temperature has dtype float64"),
    ("top_k < 0", lambda c: c["top_k"].__setitem__(2, -1), ValueError, "top_k must be >= 0"),
    ("top_k float", lambda c: c.update(top_k=c["top_k"].float()), TypeError, "top_k has dtype float32"),
    ("top_p 0", lambda c: c["top_p"].__setitem__(0, 0.0), ValueError, r"top_p must be in \(0, 1\]"),
    ("top_p > 1", lambda c: c["top_p"].__setitem__(0, 1.5), ValueError, r"top_p must be in \(0, 1\]"),
    ("min_p < 0", lambda c: c["min_p"].__setitem__(3, -0.1), ValueError, r"min_p must be in \[0, 1\]"),
    ("min_p > 1", lambda c: c["min_p"].__setitem__(3, 1.01), ValueError, r"min_p must be in \[0, 1\]"),
    ("seed int32", lambda c: c.update(seed=c["seed"].int()), TypeError, "seed has dtype int32"),
    ("step rows", lambda c: c.update(step=c["step"][:2]), ValueError, "step has 2 rows, logits has 4"),
    ("top_p 2-D", lambda c: c.update(top_p=c["top_p"][:, None]), ValueError, "top_p must have 1 dimensions"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_clear_error(device, name, mutate, exc, match):
    c = _good(device)
    mutate(c)
    with pytest.raises(exc, match=match):
        sample(c["logits"], c["temperature"], c["top_k"], c["top_p"], c["min_p"], c["seed"], c["step"])
    if name not in ("seed int32", "step rows"):
        with pytest.raises(exc, match=match):
            sampling_logprobs(c["logits"], torch.zeros(c["logits"].shape[0] if c["logits"].dim() else 1,
                                                       dtype=torch.int64, device=device),
                              c["temperature"], c["top_k"], c["top_p"], c["min_p"])


def test_bad_tokens_raise(device):
    c = _good(device)
    with pytest.raises(ValueError, match=r"tokens must be in \[0, 50\)"):
        sampling_logprobs(c["logits"], torch.tensor([0, 1, 50, 2], device=device), **_params(c))
    with pytest.raises(TypeError, match="tokens has dtype float32"):
        sampling_logprobs(c["logits"], torch.zeros(4, device=device), **_params(c))
    with pytest.raises(ValueError, match="tokens has 3 rows"):
        sampling_logprobs(c["logits"], torch.zeros(3, dtype=torch.int64, device=device), **_params(c))


BAD_PARAMS = [
    ({"temperature": -1.0}, ValueError, "temperature must be 0"),
    ({"temperature": "hot"}, TypeError, "temperature must be a float"),
    ({"top_k": -3}, ValueError, "top_k must be >= 0"),
    ({"top_k": 2.5}, TypeError, "top_k must be an int"),
    ({"top_p": 0.0}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"top_p": 1.2}, ValueError, r"top_p must be in \(0, 1\]"),
    ({"min_p": -0.01}, ValueError, r"min_p must be in \[0, 1\]"),
    ({"min_p": 2.0}, ValueError, r"min_p must be in \[0, 1\]"),
    ({"max_new_tokens": 0}, ValueError, "max_new_tokens must be >= 1"),
    ({"seed": 2**64}, ValueError, "seed must fit in int64"),
    ({"stop_token_ids": (1, -2)}, ValueError, "stop_token_ids must be non-negative"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_PARAMS, ids=[next(iter(b[0])) + "=" + repr(next(iter(b[0].values()))) for b in BAD_PARAMS])
def test_sampling_params_validate(kw, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kw)


def test_sampling_params_to_tensors_drive_the_sampler(device):
    ps = [SamplingParams(), SamplingParams(temperature=0.0), SamplingParams(top_k=5, top_p=0.9, min_p=0.05, seed=-7)]
    kw = params_to_tensors(ps, steps=[0, 3, 9], device=device)
    logits = torch.randn(3, 100, device=device)
    tokens, lps = sample(logits, **kw)
    assert tokens[1] == logits[1].argmax() and lps[1] == 0.0
    assert bitwise_equal(sampling_logprobs(logits, tokens, **{n: kw[n] for n in PARAM_NAMES}), lps)


# --- GPU only ---------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_keys_and_uniforms_are_the_cpu_bits():
    """The Triton key kernel (tl.div_rn) gives torch's CPU division bits, and
    the support kernel's integer hash gives rules.uniform01's bits."""
    from alignzoo.common.sampling.kernel import order_keys_triton, uniform01_triton

    c = random_case(8, QWEN_VOCAB, torch.device("cpu"), seed=9)
    greedy, tau, *_ = _prepare(c["temperature"], c["top_k"], c["top_p"], c["min_p"], QWEN_VOCAB)
    gpu = order_keys_triton(c["logits"].cuda(), c["temperature"].cuda()).cpu()
    assert torch.equal(gpu, order_keys(c["logits"] / tau[:, None]))
    seed = torch.cat([torch.tensor([-(2**63), 2**63 - 1, 0, -1]), torch.randint(-(2**62), 2**62, (5000,))])
    step = torch.cat([torch.tensor([2**63 - 1, -(2**63), 0, 1]), torch.randint(0, 2**40, (5000,))])
    assert torch.equal(uniform01_triton(seed.cuda(), step.cuda()).cpu(), uniform01(seed, step))
    assert torch.equal(uniform01(seed.cuda(), step.cuda()).cpu(), uniform01(seed, step))


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64])
def test_gpu_cuda_head_is_the_full_sorts_head(B):
    """The head path's bits at the real vocabulary, rows with ties at the cut
    (B = 1 is an ulp pair tied by tau = 3)."""
    _check_cuda_head(torch.device("cuda"), QWEN_VOCAB, B, (1, 50, 1024, QWEN_VOCAB - 1, QWEN_VOCAB))


@pytest.mark.gpu
def test_gpu_cuda_head_at_odd_vocabulary():
    """V % 16 != 0: the full sort's keys are padded to a 16-multiple row
    stride like the head's (heads 15 and 1023 make head + 1 a multiple of 16,
    50 and 1024 do not), so the support kernel runs one layout for all."""
    _check_cuda_head(torch.device("cuda"), 4099, 9, (1, 15, 50, 1023, 1024, 4098, 4099))


@pytest.mark.gpu
def test_gpu_every_batch_size_gives_the_same_rows():
    dev = torch.device("cuda")
    c = random_case(256, QWEN_VOCAB, dev, seed=13)
    ref = sample_fwd(*_rows(c))
    for M in (1, 3, 8, 64, 65, 127, 255):
        for sl in (slice(0, M), slice(256 - M, 256)):
            got = sample_fwd(*(x[sl] for x in _rows(c)))
            assert torch.equal(got[0], ref[0][sl]) and bitwise_equal(got[1], ref[1][sl]), f"M={M}"


@pytest.mark.gpu
@pytest.mark.parametrize("V,B", [pytest.param(QWEN_VOCAB, b, id=f"V151936-B{b}") for b in (1, 7, 64, 130)]
                         + [pytest.param(4099, b, id=f"V4099-B{b}") for b in (1, 7, 130)]
                         + [pytest.param(V, 7, id=f"V{V}-B7") for V in (97, 1000)])
def test_gpu_full_sort_paths_are_todays_bits(V, B):
    """The fp32 value sort and the chunk partials (each alone and together)
    against today's int64 key sort with chunks walked from chunk 0, on the
    GPU: every output bit of draws and replays on ``_path_rows``.  Rows wider
    than 4096: B = 1, 2..127 and >= 128 take torch's three stable-sort routes
    (one radix sort; a global sort then a sort by row; CUB's segmented sort;
    V = 4099 pads each row with 13 -inf); narrower: a warp merge sort (V =
    97) and a block radix sort (V = 1000), partials forced on."""
    _check_full_sort_paths(torch.device("cuda"), V, B, seed=V + B, variants=ALL_PATHS)


def _compiled_ttgirs(fn) -> list[str]:
    """TTGIR of every specialization of ``fn`` the JIT has compiled on this
    device (Triton's cache layout differs across versions: searched)."""
    out = []
    for entry in getattr(fn, "device_caches", {}).values():
        for part in entry if isinstance(entry, tuple) else (entry,):
            if isinstance(part, dict):
                out += [k.asm["ttgir"] for k in part.values() if "ttgir" in getattr(k, "asm", {})]
    return list(dict.fromkeys(out))


@pytest.mark.gpu
def test_gpu_compiled_scans_have_one_layout():
    """The layouts Triton on the GPU machine really compiled (not the sm_90
    compile of this Triton in CI): every specialization of the support and
    partials kernels that ran in this process -- keys / values, walked /
    partials, draw / replay, PDL off / on, batches 1 to 130 -- has one scan
    and reduction operand layout, sizePerThread 2."""
    from alignzoo.common.sampling import kernel

    for B in (1, 7, 70):
        _check_full_sort_paths(torch.device("cuda"), 9000, B, seed=B, variants=ALL_PATHS)
    found = {name: _compiled_ttgirs(getattr(kernel, name)) for name in ("_support_kernel", "_chunk_partials_kernel")}
    if not all(found.values()):
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    scans = {tuple(_scan_operands(t)) for ts in found.values() for t in ts}
    assert len(scans) == 1, scans
    (ops,) = scans
    assert any(op == "scan" for op, _, _ in ops) and all("sizePerThread = [2]" in lay for _, _, lay in ops), ops
    assert len(found["_support_kernel"]) >= 8, len(found["_support_kernel"])


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_gpu_full_sort_in_a_cuda_graph_is_todays_bits(B):
    """The default full sort (values, partials, PDL at <= 64 rows) captured in
    a CUDA graph and replayed, as the engine's sampler graphs run it: today's
    bits (eager int64 keys, chunks walked), on rows of ``_path_rows``."""
    from alignzoo.common.sampling import kernel

    dev = torch.device("cuda")
    c = {n: x.to(dev) for n, x in _path_rows(B, QWEN_VOCAB, seed=B).items()}
    args = [c[n] for n in ("logits", "temperature", "top_k", "top_p", "min_p", "seed", "step")]
    ref = kernel.rows_triton(*args, None, QWEN_VOCAB, sort="keys", prepass=False)
    kernel.rows_triton(*args, None, QWEN_VOCAB)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel.rows_triton(*args, None, QWEN_VOCAB)
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        for name, a, b in zip(("token", "lp", "v0", "logz", "last"), out, ref):
            assert bitwise_equal(a, b), name


_SAMPLING_TYPES = {"p_skeys": "*i64", "p_svals": "*fp32", "p_sids": "*i64", "p_csum": "*fp32", "p_cmax": "*fp32",
                   "p_cfirst": "*i32", "p_logits": "*fp32", "p_temp": "*fp32", "p_topk": "*i64", "p_topp": "*fp32",
                   "p_minp": "*fp32", "p_seed": "*i64", "p_step": "*i64", "p_tok_in": "*i64", "p_tok": "*i64",
                   "p_lp": "*fp32", "p_v0": "*fp32", "p_logz": "*fp32", "p_last": "*i64"}


def _sampling_kernel(name):
    from alignzoo.common.sampling import kernel

    return getattr(kernel, name)


def _sampling_consts(name, **kw):
    from alignzoo.common.sampling import kernel

    base = {"BLOCK": kernel.BLOCK_V, "VALUES": False, "PDL": False}
    if name == "_support_kernel":
        base.update(DRAW=True, PRE=False, FOLD=kernel.FOLD)
    return {**base, **kw}


def _sampling_ints(name):
    """The kernel's integer arguments the JIT specializes (all but do_not_specialize'd ones)."""
    fn = _sampling_kernel(name)
    dns = {p.name for p in fn.params if p.do_not_specialize}
    return [n for n in fn.arg_names if not n.startswith("p_") and n not in _sampling_consts(name) and n not in dns]


@functools.lru_cache(maxsize=None)
def _sampling_ttgir(name, consts, unaligned=(), ones=(), aligned_extra=()):
    """sm_90 TTGIR of a sampling kernel: pointers and ints aligned as the JIT
    sees them (do_not_specialize'd ints: neither), ``unaligned`` ints % 16 != 0,
    ``ones`` == 1 (a constexpr 1), ``aligned_extra`` aligned although
    do_not_specialize'd (what the JIT would see without it)."""
    from sm90_layouts import sm90_ttgir

    from alignzoo.common.sampling import kernel

    fn = _sampling_kernel(name)
    consts = dict(consts)
    ints = [n for n in fn.arg_names if not n.startswith("p_") and n not in consts]
    types = {**{n: _SAMPLING_TYPES[n] for n in fn.arg_names if n.startswith("p_")}, **{n: "i32" for n in ints}}
    for n in ones:
        del types[n]
        consts[n] = 1
    aligned = {n for n in types if n.startswith("p_")} | set(_sampling_ints(name)) | set(aligned_extra)
    return sm90_ttgir(fn, types, consts, (aligned & set(types)) - set(unaligned), kernel.NUM_WARPS)


def _needs_sm90():
    pytest.importorskip("triton")
    from sm90_layouts import can_compile_sm90

    if not can_compile_sm90():
        pytest.skip("this triton build has no NVIDIA backend")


_SUPPORT_VARIANTS = [  # (VALUES, PRE): today's keys walked from chunk 0, and the default full sort
    pytest.param(False, False, id="keys-walk"), pytest.param(True, True, id="values-partials")]


@pytest.mark.parametrize("values, pre", _SUPPORT_VARIANTS)
def test_support_kernel_layout_ignores_its_integer_arguments(values, pre):
    """The support kernel's sm_90 layouts (and so its scan's association
    order) are the same whatever the divisibility of its integer arguments:
    the JIT specializes them by % 16, and the sorted keys' row stride follows
    the batch (head + 1 on the head path, V on the full sort).  With the
    stride reaching the key loads, strides 1025 and 1040 gave different log Z
    bits on the H200.  Compiled here, no GPU needed."""
    from sm90_layouts import layouts

    _needs_sm90()
    name = "_support_kernel"
    for draw in (True, False):  # the sampler and the replay
        consts = tuple(_sampling_consts(name, DRAW=draw, VALUES=values, PRE=pre).items())
        base = layouts(_sampling_ttgir(name, consts))
        for n in _sampling_ints(name):
            assert layouts(_sampling_ttgir(name, consts, unaligned=(n,))) == base, f"{n} % 16 changes the layouts"
            assert layouts(_sampling_ttgir(name, consts, ones=(n,))) == base, f"{n} == 1 changes the layouts"


@pytest.mark.parametrize("values", [False, True], ids=["keys", "values"])
def test_chunk_partials_layout_ignores_its_integer_arguments(values):
    from sm90_layouts import layouts

    _needs_sm90()
    name = "_chunk_partials_kernel"
    consts = tuple(_sampling_consts(name, VALUES=values).items())
    base = layouts(_sampling_ttgir(name, consts))
    for n in _sampling_ints(name):
        assert layouts(_sampling_ttgir(name, consts, unaligned=(n,))) == base, f"{n} % 16 changes the layouts"
        assert layouts(_sampling_ttgir(name, consts, ones=(n,))) == base, f"{n} == 1 changes the layouts"


def _scan_operands(ttgir: str) -> list[tuple[str, str, str]]:
    """(op, tensor type, layout) of every tt.scan / tt.reduce operand."""
    import re

    defs = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    ops = re.findall(r'"tt\.(reduce|scan)"\(.*?\}\)\s*:\s*\(([^)]*)\)', ttgir, flags=re.S)
    return sorted({(op, shape, defs.get(enc, enc))
                   for op, operands in ops for shape, enc in re.findall(r"tensor<([^,>]*)(?:, (#\w+))?>", operands)})


def test_every_full_sort_path_scans_in_todays_layout():
    """Bit-exactness of the partials and of the value loads rests on this:
    every variant of the support kernel (keys / values, chunks walked /
    partials, draw / replay, PDL off / on) and the partials kernel (keys /
    values) compile to the layouts of today's support kernel (keys, walked),
    the 4096-wide loads and the tl.cumsum operand included: the same scan
    tree, so the same cs bits for a chunk (a load layout of sizePerThread 1
    instead of 2 changed tl.cumsum's association and log Z bits on the
    H200)."""
    from sm90_layouts import layouts

    _needs_sm90()
    today = _sampling_ttgir("_support_kernel", tuple(_sampling_consts("_support_kernel").items()))
    scans = _scan_operands(today)
    assert ("scan", "4096xf32", scans[-1][2]) in scans and "sizePerThread = [2]" in scans[-1][2], scans
    variants = [("_support_kernel", dict(DRAW=d, VALUES=v, PRE=p, PDL=pdl))
                for d in (True, False) for v in (False, True) for p in (False, True) for pdl in (False, True)]
    variants += [("_chunk_partials_kernel", dict(VALUES=v, PDL=pdl)) for v in (False, True) for pdl in (False, True)]
    for name, kw in variants:
        got = _sampling_ttgir(name, tuple(_sampling_consts(name, **kw).items()))
        assert _scan_operands(got) == scans, (name, kw)
        assert layouts(got) == layouts(today), (name, kw)


def test_value_row_stride_is_never_specialized():
    """The sorted values' row stride (2 * SV2) must not be specialized: with
    SV2 % 16 known, the JIT would see 128-byte rows and load 4 values per
    thread (16-byte vectors), a layout other than the keys', so another scan
    tree and other bits than the key path and the head path."""
    from sm90_layouts import layouts

    _needs_sm90()
    for name in ("_support_kernel", "_chunk_partials_kernel"):
        fn = _sampling_kernel(name)
        assert "SV2" in {p.name for p in fn.params if p.do_not_specialize}, name
        consts = tuple(_sampling_consts(name, VALUES=True).items())
        assert layouts(_sampling_ttgir(name, consts, aligned_extra=("SV2",))) != layouts(_sampling_ttgir(name, consts))


def test_sampling_pdl_kernels_wait_first():
    """Every sampling kernel with a PDL constexpr calls ``wait_prior(PDL)``
    first, and launchers pass it only through ``pdl_options`` (as
    tests/test_pdl.py checks for the other ops)."""
    import ast
    import inspect
    import textwrap

    from alignzoo.common.sampling import kernel

    pdl = [obj for attr, obj in vars(kernel).items() if "PDL" in getattr(obj, "arg_names", ()) and attr != "wait_prior"]
    assert {f.fn.__name__ for f in pdl} >= {"_support_kernel", "_chunk_partials_kernel", "_scaled_kernel"}
    for fn in pdl:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]
        assert ast.unparse(body[0]) == "wait_prior(PDL)", fn.fn.__name__
    src = inspect.getsource(kernel)
    assert "launch_pdl" not in src and "PDL=" not in src
