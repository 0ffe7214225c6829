"""Sampling transforms: temperature -> top-k -> top-p -> min-p, a seeded draw,
and the trainer's replay of the drawn token's log-probability.

The per-row program (each row reads only its own logits and parameters):

1. temperature: s = fl(l / T) (IEEE division).  T == 0 is greedy: the row runs
   with T = 1, top_k = 1 and no top-p/min-p, so the support is the argmax
   (ties -> smaller id), and its log-prob is exactly 0.0 (a point mass).
2. sort: by (s descending, id ascending) through distinct int64 keys
   (``rules.order_keys``): v[0] >= v[1] >= ..., ties to the smaller id.
   Only positions below every row's k' (step 4) are ever read, so when the
   rows' largest k' is small (<= ``_HEAD_MAX``) only that sorted head is
   formed -- the same positions with the same keys, because the keys of a
   row are distinct (any correct selection agrees): on the CPU by
   ``torch.topk`` of the keys, on CUDA from ``torch.topk`` of the raw logits
   with an id-order scan where a tie straddles the cut, without keys for the
   whole row (``kernel.sorted_head_triton``).  CUDA's full sort is a stable
   descending sort of s itself, the keys' permutation with half their bits
   (``kernel.sorted_values_triton``).
3. weights e[i] = exp(v[i] - v[0]) and fixed-order inclusive prefix sums S[i]
   over sorted positions (order: cpu.py / kernel.py docstrings).
4. top-k: k' = top_k if 0 < top_k < V else V (0 or >= V is off); the first k'
   sorted positions survive (ties at the cut go to the smaller id);
   Z_k = S[k' - 1].
5. top-p on the top-k-renormalised distribution (vLLM's order): position i
   survives iff its exclusive prefix is below p, i.e. n_p = 1 + first i with
   S[i] >= fl(top_p * Z_k).  top_p == 1.0 is off (not a threshold: absorbed
   tail terms would otherwise cut tokens).
6. min-p: position i survives iff e[i] >= min_p, i.e. p_i >= min_p * p_max.
   A ratio to the maximum does not change under renormalisation, so it is the
   same before or after top-k/top-p; min_p == 0 keeps everything.
   Every cut is "first failing position", so the support is always a prefix
   of the sorted row: n = min(k', n_p, n_min_p) >= 1.
7. Z = S[n - 1], log Z once; a token at sorted position i < n has
   lp = fl(fl(v[i] - v[0]) - log Z); outside the support lp = -inf
   (``rules.chosen_logprob``).
8. draw: u = uniform01(seed, step) (a hash of the request's own seed and
   step); token = sorted position first i < n with S[i] > fl(u * Z)
   (inverse CDF over the support in sorted order).

Rows without a cut (not greedy; top-k, top-p and min-p off: ``uncut_rows``)
keep every token, so their log-prob needs no sorted order: it is
lp = fl(fl(s_tok - v0) - log Z_id) with v0 the row's largest s (exact in any
order) and Z_id = sum of exp(s[j] - v0) over token ids in a fixed order:
chunks of ``UNCUT_CHUNK`` ids, each by the pairwise tree (x[2m] + x[2m+1],
level by level), the chunk sums added left to right (``uncut_logprobs``; the
CUDA kernel builds the same tree with reshape/split).  The sampler still
draws by step 8 (its sorted walk), then reports this lp for such a row; the
replay of such a row forms no sort at all (a full sort of 151936-wide rows
costs a third of a qwen3-0.6b trainer step).  Every token is
in the support: last_key is INT64_MAX.

Why this order: it is vLLM's (temperature, top-k, top-p on the renormalised
top-k set, min-p as a ratio to the max), each step a function of the
distribution the previous one left, so a reader can replay it by hand.

The replay (``sampling_logprobs``) runs steps 1-7 on the trainer's logits with
the same code, then step 7 for the given tokens: same support, same sums,
same ``chosen_logprob`` -> the sampler's bits.  Its gradient is that of the
log-softmax over the kept support (the support choice is not differentiated):
d lp / d l_j = ([j == tok] - [j in support] p_j) / T, zero for greedy rows.

CPU and CUDA each keep every promise above; they need not match each other
(different exp, log and scan trees), except ``uniform01`` and the sort key,
which are the same bits everywhere.
"""
from __future__ import annotations

import torch

from .._validate import check_same_device, check_tensor
from .._host import cdiv
from ..tree.cpu import left_to_right, pad_to, pairwise_tree
from .cpu import support_cpu
from .rules import chosen_logprob, key_ids, key_values, order_keys, token_keys, uniform01

# Rows per launch by default: bounds the (rows, V) int64 key buffers of the
# CPU path and of CUDA's full sort (keys, sorted keys, sort indices; the value
# sort's fp32 values and int64 ids are smaller) to ~1.5 GiB; CUDA's head path
# writes only (rows, ~head + 1) buffers besides torch.topk's own.  A
# launch-shape knob only: rows never interact.
_ROW_ELEMS = 1 << 26
# Largest top-k served by a partial selection (torch.topk) instead of a full
# sort of the vocabulary.  Bit-neutral (the keys are distinct), but on CUDA it
# also bounds the candidate tile one program of _head_keys_kernel holds
# (next_power_of_2(kernel.key_row_stride(head + 1)) lanes; a 262144-wide one
# did not compile).
_HEAD_MAX = 1024
UNCUT_CHUNK = 4096  # token ids per chunk of an uncut row's Z_id (part of its order)
INT64_MAX = 2**63 - 1


def partial_head(head: int, V: int) -> bool:
    """Whether a block of rows forms only its sorted head (else a full sort)."""
    return head < V and head <= _HEAD_MAX


def _row_chunk(row_chunk: int | None, width: int) -> int:
    """Rows per launch: ``row_chunk``, else as many as keep (rows, width) buffers at _ROW_ELEMS."""
    return row_chunk if row_chunk is not None else max(1, _ROW_ELEMS // max(width, 1))


def _effective_k(temperature, top_k, V):
    """k' of step 4 per row: top_k if 0 < top_k < V else V; 1 for greedy rows."""
    k = top_k.to(torch.int64)
    k = torch.where((k > 0) & (k < V), k, torch.full_like(k, V))
    return torch.where(temperature == 0, torch.ones_like(k), k)


def _prepare(temperature, top_k, top_p, min_p, V):
    """Fold greedy rows and the 'off' values into the per-row program's inputs."""
    greedy = temperature == 0
    tau = torch.where(greedy, torch.ones_like(temperature), temperature)
    k = _effective_k(temperature, top_k, V)
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    m = torch.where(greedy, torch.zeros_like(min_p), min_p)
    return greedy, tau, k, p, m


def sorted_head(keys: torch.Tensor, head: int) -> torch.Tensor:
    """The first ``head`` positions of each row's ascending sort of its
    distinct int64 keys (all of them when ``head`` >= V) -> (B, min(head, V)).
    The CPU path's head; ``kernel.sorted_head_triton`` gives the same bits from
    the logits without the (B, V) keys when ``head`` < V."""
    if head >= keys.shape[1]:
        return torch.sort(keys, dim=-1).values
    return torch.topk(keys, head, dim=-1, largest=False, sorted=True).values


def head_width(temperature: torch.Tensor, top_k: torch.Tensor, V: int) -> int:
    """The sorted positions a block of rows can read: its largest k'
    (``_effective_k``), or V when that is above ``_HEAD_MAX`` (a full sort;
    below V, CUDA forms the head from torch.topk of head + 1 logits).
    ``sample_fwd``'s ``head``: computed from host copies of the parameters,
    where they are built, it keeps the sampler free of a device-to-host read,
    so the launch does not wait for the logits and can be graph-captured.
    (Given GPU tensors, it is that one host read.)"""
    k = _effective_k(temperature, top_k, V)
    head = int(k.max()) if k.numel() else V
    return head if head <= _HEAD_MAX else V


def _rows_cpu(logits, temperature, top_k, top_p, min_p, seed, step, tokens, head):
    """Steps 1-8 on a block of CPU rows; tokens None draws, else scores them;
    ``head`` (``head_width``) bounds the sorted positions formed.
    Returns (tokens, lp, v0, logz, last_key), all (B,)."""
    greedy, tau, k, p, m = _prepare(temperature, top_k, top_p, min_p, logits.shape[1])
    keys = order_keys(logits / tau[:, None])  # (B, V)
    skeys = sorted_head(keys, head)  # (B, min(head, V))
    u = uniform01(seed, step) if tokens is None else torch.zeros_like(tau)
    n, logz, pick = support_cpu(skeys, k, p, m, u)
    v0 = key_values(skeys[:, 0])
    last_key = skeys.gather(1, (n - 1)[:, None]).squeeze(1)
    if tokens is None:
        key_tok = skeys.gather(1, pick[:, None]).squeeze(1)
    else:
        key_tok = keys.gather(1, tokens.to(torch.int64)[:, None]).squeeze(1)
    lp = chosen_logprob(key_tok, v0, logz, last_key, greedy)
    return key_ids(key_tok), lp, v0, logz, last_key


def _rows(logits, temperature, top_k, top_p, min_p, seed, step, tokens, row_chunk, head=None):
    """Dispatch on the device; rows in blocks of ``row_chunk`` (bits unchanged).
    ``head``: see ``sample_fwd``; resolved here once for every block."""
    if logits.is_cuda:
        from .kernel import rows_triton as fn
    else:
        fn = _rows_cpu
    R, V = logits.shape
    if head is None:
        head = head_width(temperature, top_k, V)
    elif head < 1:
        raise ValueError(f"head must be >= 1 (a width of sorted positions), got {head}")
    rc = _row_chunk(row_chunk, head + 1 if logits.is_cuda and partial_head(head, V) else V)  # buffer width
    if R <= rc:
        return fn(logits, temperature, top_k, top_p, min_p, seed, step, tokens, head)
    outs = []
    for r in range(0, R, rc):
        sl = slice(r, r + rc)
        outs.append(fn(logits[sl], temperature[sl], top_k[sl], top_p[sl], min_p[sl],
                       None if seed is None else seed[sl], None if step is None else step[sl],
                       None if tokens is None else tokens[sl], head))
    return tuple(torch.cat(t) for t in zip(*outs))


def uncut_rows(temperature, top_k, top_p, min_p, V: int) -> torch.Tensor:
    """(B,) bool: rows whose support is the whole vocabulary (not greedy, top-k/top-p/min-p off)."""
    return (temperature != 0) & ((top_k <= 0) | (top_k >= V)) & (top_p >= 1.0) & (min_p <= 0.0)


def uncut_logprobs(logits, temperature, tokens):
    """The replay of rows without a cut (module docstring): -> (lp, v0, logz, last_key), (B,) each,
    no sort.  A greedy row's temperature counts as 1 (its result is not one to use)."""
    if logits.is_cuda:
        from .kernel import uncut_logprobs_triton

        return uncut_logprobs_triton(logits, temperature, tokens)
    B, V = logits.shape
    rc = _row_chunk(None, V)
    if B > rc:  # rows in blocks (bits unchanged): bounds the (rows, V) temporaries
        outs = [uncut_logprobs(logits[r: r + rc], temperature[r: r + rc], tokens[r: r + rc]) for r in range(0, B, rc)]
        return tuple(torch.cat(t) for t in zip(*outs))
    tau = torch.where(temperature == 0, torch.ones_like(temperature), temperature)
    s = logits / tau[:, None]
    s = torch.where(s == 0, torch.zeros_like(s), s)  # -0.0 -> +0.0, as the keys fold it
    v0 = s.amax(1) if V else torch.full((B,), float("-inf"))
    e = pad_to(torch.exp(s - v0[:, None]), 1, cdiv(V, UNCUT_CHUNK) * UNCUT_CHUNK, 0.0)
    logz = torch.log(left_to_right(pairwise_tree(e.view(B, -1, UNCUT_CHUNK))))  # chunk trees, then in order
    tok = tokens.to(torch.int64)
    last = torch.full((B,), INT64_MAX, dtype=torch.int64)
    lp = chosen_logprob(token_keys(s.gather(1, tok[:, None])[:, 0], tok), v0, logz, last,
                        torch.zeros(B, dtype=torch.bool))
    return lp, v0, logz, last


def sample_fwd(logits, temperature, top_k, top_p, min_p, seed, step, *, row_chunk: int | None = None,
               head: int | None = None):
    """The server's launcher (no validation): -> (tokens (B,) int64, logprobs (B,) fp32).

    ``head``: ``head_width(temperature, top_k, V)`` computed from host copies
    of the parameters (a speed hint that must be that value: it bounds the
    sorted positions the rows read).  None computes it from the device
    tensors, one device-to-host read that waits for the logits' producer."""
    tokens, lp, *_ = _rows(logits, temperature, top_k, top_p, min_p, seed, step, None, row_chunk, head)
    uncut = uncut_rows(temperature, top_k, top_p, min_p, logits.shape[1])  # on the device: no host read
    if not uncut.is_cuda and not bool(uncut.any()):  # host values: a batch of cut rows skips the pass
        return tokens, lp
    return tokens, torch.where(uncut, uncut_logprobs(logits, temperature, tokens)[0], lp)


def sampling_logprobs_fwd(logits, tokens, temperature, top_k, top_p, min_p, *, row_chunk: int | None = None,
                          head: int | None = None, uncut: torch.Tensor | None = None):
    """The replay launcher (no validation): -> (logprobs, v0, logz, last_key), all (T,).

    logprobs has the sampler's bits for the same logits row and parameters;
    the other three are what the backward needs.  ``head``: as ``sample_fwd``'s,
    used when no row is uncut (a mix recomputes it for its cut rows: one host
    read).  ``uncut``: ``uncut_rows`` of the parameters as a host tensor; None
    computes it (one host read when they are on a device).  Uncut rows take
    ``uncut_logprobs`` and no sort; the others the per-row program."""
    if uncut is None:
        uncut = uncut_rows(temperature, top_k, top_p, min_p, logits.shape[1]).cpu()
    n_uncut = int(uncut.sum())
    if n_uncut == 0:
        _, lp, v0, logz, last = _rows(logits, temperature, top_k, top_p, min_p, None, None, tokens, row_chunk, head)
        return lp, v0, logz, last
    if n_uncut == logits.shape[0]:
        return uncut_logprobs(logits, temperature, tokens)
    dev = logits.device
    iu, ic = (torch.nonzero(m).squeeze(1).to(dev) for m in (uncut, ~uncut))
    outs = [uncut_logprobs(logits[iu], temperature[iu], tokens[iu]),
            _rows(logits[ic], temperature[ic], top_k[ic], top_p[ic], min_p[ic], None, None, tokens[ic], row_chunk)[1:]]
    res = []
    for a, b in zip(*outs):
        t = torch.empty(logits.shape[0], dtype=a.dtype, device=dev)
        t[iu], t[ic] = a, b
        res.append(t)
    return tuple(res)


def transformed_logprobs_fwd(logits, temperature, top_k, top_p, min_p, *, row_chunk: int | None = None):
    """(R, V) fp32 log-probs of every token under the transformed distribution
    (-inf outside the support): ``chosen_logprob`` broadcast over the row, so
    entry [r, j] has the bits ``sampling_logprobs`` gives token j of row r."""
    R, V = logits.shape
    zeros = torch.zeros(R, dtype=torch.int64, device=logits.device)
    _, v0, logz, last_key = sampling_logprobs_fwd(logits, zeros, temperature, top_k, top_p, min_p, row_chunk=row_chunk)
    greedy = temperature == 0
    if logits.is_cuda:
        from .kernel import order_keys_triton

        keys = order_keys_triton(logits, temperature)
    else:
        keys = order_keys(logits / torch.where(greedy, torch.ones_like(temperature), temperature)[:, None])
    return chosen_logprob(keys, v0[:, None], logz[:, None], last_key[:, None], greedy[:, None])


def sampling_logprobs_bwd(logits, tokens, temperature, lp, v0, logz, last_key, grad_lp):
    """d lp / d logits: (T, V) fp32, rows of greedy tokens / tokens outside the support are 0."""
    greedy = temperature == 0
    tau = torch.where(greedy, torch.ones_like(temperature), temperature)
    valid = ~greedy & torch.isfinite(lp)
    coef = torch.where(valid, grad_lp.float() / tau, torch.zeros_like(tau))
    tokens = tokens.to(torch.int64)
    if logits.is_cuda:
        from .kernel import replay_bwd_triton

        return replay_bwd_triton(logits, tau, tokens, v0, logz, last_key, coef)
    s = logits / tau[:, None]
    keys = order_keys(s)
    prob = torch.exp((key_values(keys) - v0[:, None]) - logz[:, None])
    prob = torch.where(keys <= last_key[:, None], prob, torch.zeros_like(prob))
    hot = torch.zeros_like(prob).scatter_(1, tokens[:, None], 1.0)
    return coef[:, None] * (hot - prob)


class _SamplingLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, tokens, temperature, top_k, top_p, min_p):
        lp, v0, logz, last_key = sampling_logprobs_fwd(logits, tokens, temperature, top_k, top_p, min_p)
        ctx.save_for_backward(logits, tokens, temperature, lp, v0, logz, last_key)
        return lp

    @staticmethod
    def backward(ctx, grad_lp):
        logits, tokens, temperature, lp, v0, logz, last_key = ctx.saved_tensors
        dl = sampling_logprobs_bwd(logits, tokens, temperature, lp, v0, logz, last_key, grad_lp)
        return dl, None, None, None, None, None


INT_DTYPES = (torch.int32, torch.int64)


def check_sampling_tensors(logits, temperature, top_k, top_p, min_p, seed=None, step=None) -> None:
    """Dtypes, shapes, devices and value ranges of the per-row parameters.
    Reads the values back (one host sync): the public functions call it, the
    ``_fwd`` launchers do not."""
    check_tensor("logits", logits, dtypes=(torch.float32,), ndim=2)
    R, V = logits.shape
    if V < 1:
        raise ValueError(f"logits: vocabulary size is {V}, expected at least 1")
    if V >= 2**31:
        raise ValueError(f"logits: vocabulary size {V} does not fit the int32 token ids of the sort key")
    named = {"temperature": (temperature, (torch.float32,)), "top_k": (top_k, INT_DTYPES),
             "top_p": (top_p, (torch.float32,)), "min_p": (min_p, (torch.float32,))}
    if seed is not None:
        named["seed"] = (seed, (torch.int64,))
        named["step"] = (step, (torch.int64,))
    for name, (t, dtypes) in named.items():
        check_tensor(name, t, dtypes=dtypes, ndim=1)
        if t.shape[0] != R:
            raise ValueError(f"{name} has {t.shape[0]} rows, logits has {R}: one parameter per row")
    check_same_device(logits=logits, **{n: t for n, (t, _) in named.items()})
    bad = {
        "temperature": ~(((temperature == 0) | (temperature >= 1e-5)) & torch.isfinite(temperature)),
        "top_k": top_k < 0,
        "top_p": ~((top_p > 0) & (top_p <= 1)),
        "min_p": ~((min_p >= 0) & (min_p <= 1)),
    }
    rules = {"temperature": "must be 0 (greedy) or a finite value >= 1e-5",
             "top_k": "must be >= 0 (0 or >= vocabulary size means off)",
             "top_p": "must be in (0, 1] (1.0 means off)",
             "min_p": "must be in [0, 1] (0 means off)"}
    for name, mask in bad.items():
        if bool(mask.any()):
            i = int(mask.nonzero()[0, 0])
            vals = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "min_p": min_p}[name]
            raise ValueError(f"{name} {rules[name]}; row {i} has {vals[i].item()}")


def sample(logits, temperature, top_k, top_p, min_p, seed, step):
    """Draw one token per row under the transformed distribution.

    logits: (B, V) fp32.  temperature, top_p, min_p: (B,) fp32; top_k: (B,)
    int32/int64; seed, step: (B,) int64 (the request's seed and its decode
    step).  Returns (tokens (B,) int64, logprobs (B,) fp32), the log-prob of
    each drawn token under the distribution it was drawn from.  A row's
    result depends only on its own logits, parameters, seed and step.
    """
    check_sampling_tensors(logits, temperature, top_k, top_p, min_p, seed, step)
    with torch.no_grad():
        return sample_fwd(logits, temperature, top_k, top_p, min_p, seed, step)


def sampling_logprobs(logits, tokens, temperature, top_k, top_p, min_p):
    """FP32 log-probs of given tokens under the transformed distribution.

    logits: (T, V) fp32 (may require grad); tokens: (T,) int64/int32 in
    [0, V); parameters as in ``sample``.  Returns (T,) fp32, bitwise equal to
    what ``sample`` returned for the same logits row, parameters and token;
    -inf for a token outside the support.  Differentiable w.r.t. logits.
    """
    check_sampling_tensors(logits, temperature, top_k, top_p, min_p)
    check_tensor("tokens", tokens, dtypes=INT_DTYPES, ndim=1)
    if tokens.shape[0] != logits.shape[0]:
        raise ValueError(f"tokens has {tokens.shape[0]} rows, logits has {logits.shape[0]}")
    check_same_device(logits=logits, tokens=tokens)
    if tokens.numel() and bool(((tokens < 0) | (tokens >= logits.shape[1])).any()):
        raise ValueError(f"tokens must be in [0, {logits.shape[1]}) (the vocabulary); got min {int(tokens.min())}, max {int(tokens.max())}")
    return _SamplingLogprobs.apply(logits, tokens, temperature, top_k, top_p, min_p)
