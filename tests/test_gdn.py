"""Gated DeltaNet: the trainer's whole sequences, the server's chunked prefill split
anywhere and its token-by-token decode give the same bits (outputs and the FP32
state at every 64 boundary) in any batch; accuracy against the float64 recurrent
form and transformers; gradients against float64 autograd; planted breaks; the
Triton decode step's source interpreted; the conv1d + SiLU with its tail; l2norm."""
from __future__ import annotations

import random

import pytest
import torch
from interpreted import TORCH_MATH, run_interpreted

from alignzoo.common.gdn import (conv1d, conv1d_fwd, conv1d_ref, conv1d_state_fields, cpu, gdn, gdn_cache, gdn_fwd,
                                 gdn_ref, gdn_state_fields, l2norm_fwd, l2norm_ref)
from alignzoo.common.kv_cache.pools import StatePool
from alignzoo.common.ladder import rel_err

LENS = [1, 63, 64, 65, 200, 1030]


class Inputs:
    """A packed batch of q, k (T, Hk, K), v (T, Hv, V), g, beta (T, Hv) with
    Qwen3.5's preprocessing: l2norm, q * K^-0.5, g = -A softplus(a), beta = sigmoid(b)."""

    def __init__(self, lens, Hk=2, Hv=4, K=24, V=20, seed=0, device="cpu"):
        gen = torch.Generator().manual_seed(seed)
        T = sum(lens)
        self.lens, self.Hk, self.Hv, self.K, self.V = list(lens), Hk, Hv, K, V
        self.q_raw = torch.randn(T, Hk, K, generator=gen)
        self.k_raw = torch.randn(T, Hk, K, generator=gen)
        self.v = torch.randn(T, Hv, V, generator=gen)
        A = torch.rand(Hv, generator=gen) * 0.6 + 0.01
        self.g = -A * torch.log1p(torch.exp(torch.randn(T, Hv, generator=gen) - 1))
        self.beta = 1 / (1 + torch.exp(-torch.randn(T, Hv, generator=gen)))
        self.q = l2norm_fwd(self.q_raw) * K ** -0.5
        self.k = l2norm_fwd(self.k_raw)
        self.cu = [0]
        for n in lens:
            self.cu.append(self.cu[-1] + n)
        for name in ("q_raw", "k_raw", "v", "g", "beta", "q", "k"):
            setattr(self, name, getattr(self, name).to(device))
        self.device = torch.device(device)

    def cu_t(self):
        return torch.tensor(self.cu, device=self.device)

    def trainer(self):
        """-> (o (T, Hv, V), [per sequence: (len // 64, Hv, K, V) boundary states])."""
        o, st = gdn_fwd(self.q, self.k, self.v, self.g, self.beta, self.cu_t(), return_states=True)
        per, i = [], 0
        for n in self.lens:
            per.append(st[i : i + n // 64])
            i += n // 64
        return o, per

    def cache(self, slots, garbage=True):
        c = gdn_cache(slots, self.Hk, self.Hv, self.K, self.V, self.device)
        if garbage:  # a slot's old contents: a sequence at position 0 must not read them
            for t in c.values():
                t.fill_(float("nan") if t.is_floating_point() else 5)
        return c

    def call(self, items, cache, pads=(), host=False, **kw):
        """One engine step: items [(seq, start, n, slot)], padding rows (slot -1,
        position 0, one token) inserted before the indices in ``pads``; ``host``:
        pass the layout's host lists too, as the engine does.  -> [o (n, Hv, V) per item]."""
        rows, cu, starts, slots, where = [], [0], [], [], []
        pads = sorted(pads)
        for i, (b, s, n, slot) in enumerate(items):
            while pads and pads[0] <= i:
                pads.pop(0)
                rows.append(torch.tensor([0]))
                cu.append(cu[-1] + 1), starts.append(0), slots.append(-1), where.append(None)
            rows.append(torch.arange(self.cu[b] + s, self.cu[b] + s + n))
            cu.append(cu[-1] + n), starts.append(s), slots.append(slot), where.append(i)
        for _ in pads:
            rows.append(torch.tensor([0]))
            cu.append(cu[-1] + 1), starts.append(0), slots.append(-1), where.append(None)
        idx = torch.cat(rows).to(self.device)
        dev = self.device
        if host:
            kw["host"] = (cu, starts, slots)
        o = gdn_fwd(self.q[idx], self.k[idx], self.v[idx], self.g[idx], self.beta[idx], torch.tensor(cu, device=dev),
                    start_positions=torch.tensor(starts, device=dev), cache=cache,
                    slots=torch.tensor(slots, device=dev), **kw)
        out = [None] * len(items)
        for j, i in enumerate(where):
            if i is not None:
                out[i] = o[cu[j] : cu[j + 1]]
        return out


def _state_ok(cache, slot, pos_end, states) -> bool:
    """The slot's state is the boundary state at floor(pos_end / 64) (zeros
    before the first) and n == pos_end % 64."""
    c = pos_end // 64
    want = states[c - 1] if c else torch.zeros_like(cache["state"][slot])
    return torch.equal(cache["state"][slot], want) and int(cache["n"][slot]) == pos_end % 64


# ------------------------------------------------------------------ the contract


def test_prefill_split_at_every_offset():
    """One 140-token sequence, split at 1..130 (all splits in one batch, slots
    shuffled): both halves equal the trainer's rows, the states after each half
    equal its boundary states, and every split leaves the same open chunk."""
    inp = Inputs([140])
    o_ref, (states,) = inp.trainer()
    splits = list(range(1, 131))
    slots = torch.randperm(len(splits), generator=torch.Generator().manual_seed(1)).tolist()
    cache = inp.cache(len(splits))
    first = inp.call([(0, 0, s, slots[i]) for i, s in enumerate(splits)], cache)
    for i, s in enumerate(splits):
        assert torch.equal(first[i], o_ref[:s]), s
        assert _state_ok(cache, slots[i], s, states), s
    rest = inp.call([(0, s, 140 - s, slots[i]) for i, s in enumerate(splits)], cache)
    for i, s in enumerate(splits):
        assert torch.equal(rest[i], o_ref[s:]), s
        assert _state_ok(cache, slots[i], 140, states), s
    n = 140 % 64
    for name in ("k", "g_cum", "x", "v_new"):
        first_rows = cache[name][slots[0], :n]
        assert all(torch.equal(cache[name][sl, :n], first_rows) for sl in slots), name


def test_decode_from_every_offset_inside_a_chunk():
    """64 copies prefilled to 64..127 tokens, then decoded one token a step in
    one batch of 64 rows (a finished copy's row becomes padding, slot -1) to 136:
    every output and, after every step, every slot's state equal the trainer's."""
    L = 136
    inp = Inputs([L], seed=1)
    o_ref, (states,) = inp.trainer()
    cache = inp.cache(64)
    pre = inp.call([(0, 0, 64 + o, 63 - o) for o in range(64)], cache)
    assert all(torch.equal(p, o_ref[: 64 + o]) for o, p in enumerate(pre))
    for step in range(L - 64):
        items, pads, who = [], [], []
        for o in range(64):
            pos = 64 + o + step
            if pos < L:
                items.append((0, pos, 1, 63 - o))
                who.append(o)
            else:
                pads.append(len(items))
        got = inp.call(items, cache, pads)
        for (_, pos, _, slot), out in zip(items, got):
            assert torch.equal(out, o_ref[pos : pos + 1]), (step, pos)
            assert _state_ok(cache, slot, pos + 1, states), (step, pos)


def _random_schedule(inp, seed, *, preempt=True, check_states=True):
    """An engine-like run: sequences join at random steps; half the steps are
    decode batches (one token per running sequence, with padding rows), the
    others mixed (each running sequence takes one token or a chunk of 1..130,
    cut anywhere); one sequence is preempted and
    recomputed from position 0 in another slot.  -> (outputs equal, states equal)."""
    rng = random.Random(seed)
    o_ref, states = inp.trainer()
    B = len(inp.lens)
    cache = inp.cache(B + 2)
    free = list(range(B + 2))
    rng.shuffle(free)
    join = [rng.randrange(0, 6) for _ in range(B)]
    done, slot = [0] * B, [None] * B
    victim, preempted = max(range(B), key=lambda b: inp.lens[b]), not preempt
    ok_o = ok_s = True
    step = 0
    while any(done[b] < inp.lens[b] for b in range(B)):
        items, decode_step = [], rng.random() < 0.6
        for b in range(B):
            if join[b] > step or done[b] >= inp.lens[b]:
                continue
            if slot[b] is None:
                slot[b] = free.pop()
            n = 1 if decode_step or rng.random() < 0.3 else rng.randint(1, 130)
            items.append((b, done[b], min(n, inp.lens[b] - done[b]), slot[b]))
        step += 1
        if not items:
            continue
        rng.shuffle(items)
        decode = all(n == 1 for _, _, n, _ in items)
        pads = [rng.randrange(0, len(items) + 1) for _ in range(rng.randint(0, 2))] if decode else []
        got = inp.call(items, cache, pads)
        for (b, s, n, sl), out in zip(items, got):
            ok_o &= torch.equal(out, o_ref[inp.cu[b] + s : inp.cu[b] + s + n])
            if check_states:
                ok_s &= _state_ok(cache, sl, s + n, states[b])
            done[b] = s + n
        if not preempted and done[victim] > 70:
            preempted = True
            free.insert(0, slot[victim])  # its slot goes back, to be reused by someone
            slot[victim], done[victim] = free.pop(), 0  # recomputed from position 0 in another slot
    return ok_o, ok_s


@pytest.mark.parametrize("K", [24, 32], ids=["K24", "K32"])
def test_mixed_batches_joins_padding_preemption(K):
    inp = Inputs(LENS, K=K, seed=K)
    ok_o, ok_s = _random_schedule(inp, seed=K)
    assert ok_o and ok_s


def test_host_lists_stand_in_for_the_device_reads():
    """The engine's host lists (``ForwardBatch.host``) in place of the device reads: the same o and
    every cache field, on a step of fresh, continued and mid-chunk sequences beside padding rows."""
    inp = Inputs([300, 70, 129, 5])
    first = [(0, 0, 150, 3), (1, 0, 70, 0), (2, 0, 64, 2), (3, 0, 5, 1)]
    then = [(0, 150, 150, 3), (2, 64, 65, 2)]
    runs = []
    for host in (False, True):
        cache = inp.cache(4)
        o = inp.call(first, cache, pads=(1,), host=host) + inp.call(then, cache, pads=(0, 2), host=host)
        runs.append((o, cache))
    (o0, c0), (o1, c1) = runs
    assert all(torch.equal(a, b) for a, b in zip(o0, o1))
    for name in c0:
        assert torch.equal(c0[name].nan_to_num(7.0), c1[name].nan_to_num(7.0)), name


def test_position_zero_ignores_the_slot():
    """NaN/garbage in a slot: a prefill or a decode at position 0 reads none of it."""
    inp = Inputs([70, 1])
    o_ref, _ = inp.trainer()
    cache = inp.cache(2)
    a, b = inp.call([(0, 0, 70, 1), (1, 0, 1, 0)], cache)
    assert torch.equal(a, o_ref[:70]) and torch.equal(b, o_ref[70:])
    cache = inp.cache(2)
    (b,) = inp.call([(1, 0, 1, 1)], cache)
    assert torch.equal(b, o_ref[70:]) and not cache["state"][1].isnan().any()


def test_cache_fields_fit_a_state_pool():
    fields = gdn_state_fields(2, 4, 24, 20)
    pool = StatePool(fields={**fields, **conv1d_state_fields(10, torch.bfloat16)}, layers=2)
    caches = pool.allocate(3, "cpu")
    ref = gdn_cache(3, 2, 4, 24, 20)
    assert set(ref) == {"state", "k", "g_cum", "x", "v_new", "n"}
    for name, t in ref.items():
        assert caches[0][name].shape == t.shape and caches[0][name].dtype == t.dtype, name
    assert caches[1]["conv_tail"].shape == (3, 3, 10)
    inp = Inputs([100])
    o_ref, _ = inp.trainer()
    cache = {n: caches[1][n] for n in fields}
    a = inp.call([(0, 0, 40, 2)], cache)[0]
    b = inp.call([(0, 40, 60, 2)], cache)[0]
    assert torch.equal(torch.cat([a, b]), o_ref)


# ------------------------------------------------------------------ planted breaks


def _small_contract(inp):
    """Prefill 70 then decode to 140 and a prefill split at 100: all equal the trainer?"""
    o_ref, _ = inp.trainer()
    cache = inp.cache(2)
    outs = inp.call([(0, 0, 70, 0), (0, 0, 100, 1)], cache)
    outs += inp.call([(0, 100, 40, 1)], cache)
    for p in range(70, 140):
        outs += inp.call([(0, p, 1, 0)], cache)
    got = [torch.cat([outs[0]] + outs[3:]), torch.cat(outs[1:3])]
    return all(torch.equal(x, o_ref) for x in got)


def test_planted_batch_dependent_sum_order_is_caught(monkeypatch):
    """A tree that sums large tensors (the trainer's, a whole chunk at once) left
    to right and small ones (decode's) pairwise breaks the contract: caught."""
    inp = Inputs([140], seed=3)
    assert _small_contract(inp)
    tree = cpu.tree_sum

    def by_size(x, dim):
        if x.numel() < 1 << 14:
            return tree(x, dim)
        acc = x.select(dim, 0)
        for i in range(1, x.shape[dim]):
            acc = acc + x.select(dim, i)
        return acc

    monkeypatch.setattr(cpu, "tree_sum", by_size)
    assert not _small_contract(inp)


def test_planted_decode_with_another_order_is_caught(monkeypatch):
    """Decode summing the open chunk's rows left to right (a fixed order, but
    not the trainer's tree) is caught; so is decode storing v_new rounded."""
    inp = Inputs([140], seed=4)
    real, tree = cpu.decode_step, cpu.tree_sum

    def left_to_right(x, dim):
        acc = x.select(dim, 0)
        for i in range(1, x.shape[dim]):
            acc = acc + x.select(dim, i)
        return acc

    def decode_l2r(*a):
        cpu.tree_sum = left_to_right
        try:
            return real(*a)
        finally:
            cpu.tree_sum = tree

    monkeypatch.setattr(cpu, "decode_step", decode_l2r)
    assert not _small_contract(inp)

    def decode_bf16_rows(q, k, v, g, beta, pos, slots, cache):
        o = real(q, k, v, g, beta, pos, slots, cache)
        cache["v_new"].copy_(cache["v_new"].bfloat16().float())
        return o

    monkeypatch.setattr(cpu, "decode_step", decode_bf16_rows)
    assert not _small_contract(inp)


# ------------------------------------------------------------------ accuracy and gradients


@pytest.mark.parametrize("K", [24, 32], ids=["K24", "K32"])
def test_accuracy_vs_float64_recurrent(K):
    """||o - o64|| / ||o64|| and each boundary state against the float64 token-by-token recurrence."""
    inp = Inputs(LENS, K=K)
    o, states = inp.trainer()
    ref, _ = gdn_ref(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu)
    assert rel_err(o, ref) < 2e-6  # measured 2.6e-7
    for b, n in enumerate(LENS):
        for c in range(n // 64):
            s = inp.cu[b]
            e = s + 64 * (c + 1)
            _, S = gdn_ref(inp.q[s:e], inp.k[s:e], inp.v[s:e], inp.g[s:e], inp.beta[s:e], [0, e - s])
            assert rel_err(states[b][c], S[0]) < 2e-6, (b, c)


def test_matches_transformers():
    """transformers' torch_chunk_gated_delta_rule and torch_recurrent_gated_delta_rule
    (fp32, GVA, 192 and 250 tokens): the same math as ours (outputs and final state)."""
    tq = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    for L in (192, 250):
        inp = Inputs([L], seed=L)
        o, (states,) = inp.trainer()
        args = (inp.q_raw[None], inp.k_raw[None], inp.v[None], inp.g[None], inp.beta[None])
        for fn in (tq.torch_chunk_gated_delta_rule, tq.torch_recurrent_gated_delta_rule):
            ho, hs = fn(*args, output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert rel_err(o, ho[0]) < 3e-6, (fn.__name__, L)
            if L % 64 == 0:
                assert rel_err(states[-1], hs[0]) < 3e-6, (fn.__name__, L)


def test_gradients_vs_float64():
    """Gradients of q, k (before the l2norm), v, g and beta through the trainer's
    forward against float64 autograd of the recurrent reference."""
    inp = Inputs([1, 63, 65, 130], seed=5)
    K = inp.K
    dy = torch.randn(sum(inp.lens), inp.Hv, inp.V, generator=torch.Generator().manual_seed(6))

    def grads(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (inp.q_raw, inp.k_raw, inp.v, inp.g, inp.beta)]
        qr, kr, v, g, beta = leaves
        if dtype == torch.float64:
            o, _ = fn(l2norm_ref(qr) * K ** -0.5, l2norm_ref(kr), v, g, beta, inp.cu)
        else:
            o = fn(l2norm_fwd(qr) * K ** -0.5, l2norm_fwd(kr), v, g, beta, inp.cu_t())
        (o * dy.to(dtype)).sum().backward()
        return [t.grad for t in leaves]

    ours = grads(torch.float32, gdn)
    ref = grads(torch.float64, gdn_ref)
    for name, a, b in zip(("q", "k", "v", "g", "beta"), ours, ref):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def test_matmul_form_is_the_function_and_its_gradient():
    """``backward.gdn_matmul`` (what the Triton path's backward differentiates): the exact path's
    values to fp32 rounding, and gradients of q, k, v, g, beta against float64 autograd of the
    recurrence, over many chunks, a sequence cut mid-chunk and GVA with odd K, V."""
    from alignzoo.common.gdn.backward import gdn_matmul

    inp = Inputs([1, 63, 64, 65, 200, 333], seed=11)
    o = gdn_matmul(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t())
    assert rel_err(o, gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t())) < 3e-6
    dy = torch.randn(o.shape, generator=torch.Generator().manual_seed(12))

    def grads(dtype, fn):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
        out = fn(*leaves, inp.cu_t())
        ((out[0] if isinstance(out, tuple) else out) * dy.to(dtype)).sum().backward()
        return [t.grad for t in leaves]

    for name, a, b in zip(("q", "k", "v", "g", "beta"), grads(torch.float32, gdn_matmul), grads(torch.float64, gdn_ref)):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))
    # strong decay: exp(G_63 - G_j) <= 1 and the masked E are 0, so nothing overflows into the gradient
    g = (inp.g * 200).detach().requires_grad_()
    gdn_matmul(inp.q, inp.k, inp.v, g, inp.beta, inp.cu_t()).sum().backward()
    assert torch.isfinite(g.grad).all()


def test_gradients_stay_finite_under_strong_decay():
    """A chunk cut short by the sequence's end, with a decay strong enough that
    exp(G_i - G_j) of a discarded row past the end would overflow: the masked
    products must not carry inf into the backward (0 * inf = NaN)."""
    inp = Inputs([70, 130], seed=8)
    g = (inp.g * 200).detach().requires_grad_()  # G reaches about -1000 within a chunk
    q = l2norm_fwd(inp.q_raw) * inp.K ** -0.5
    v = inp.v.detach().requires_grad_()
    o = gdn(q, l2norm_fwd(inp.k_raw), v, g, inp.beta, inp.cu_t())
    o.sum().backward()
    assert torch.isfinite(o).all() and torch.isfinite(g.grad).all() and torch.isfinite(v.grad).all()


def test_l2norm_rows_and_accuracy():
    tq = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    x = torch.randn(300, 3, 24).bfloat16()
    y = l2norm_fwd(x)
    assert y.dtype == torch.float32
    assert all(torch.equal(l2norm_fwd(x[i : i + 1]), y[i : i + 1]) for i in (0, 57, 299))
    assert torch.equal(l2norm_fwd(x.flip(0)), y.flip(0))
    assert rel_err(y, l2norm_ref(x)) < 1e-6
    assert rel_err(y, tq.l2norm(x.float())) < 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_l2norm_gradient_vs_float64(dtype):
    """The closed-form backward against float64 autograd, with a zero row (gradient dy / sqrt(eps))."""
    x = torch.randn(50, 2, 24).to(dtype)
    x[3, 1] = 0
    dy = torch.randn(50, 2, 24)
    xl, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    (l2norm_fwd(xl) * dy).sum().backward()
    (l2norm_ref(xr) * dy.double()).sum().backward()
    assert torch.equal(l2norm_fwd(x), l2norm_fwd(xl).detach())  # the graded forward's bits
    assert rel_err(xl.grad.float(), xr.grad) < (1e-6 if dtype == torch.float32 else 8e-3)


# ------------------------------------------------------------------ conv1d


def _conv_inputs(lens, C=40, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(sum(lens), C, generator=g).to(dtype), (torch.randn(C, 4, generator=g) * 0.5).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_conv1d_split_decode_and_batches(dtype):
    """Whole sequences == split prefill (every split 1..8 and a long one) ==
    decode one token a step, in shuffled slots with padding rows; the tail
    after each call is the last three inputs (zeros before position 0)."""
    lens = [1, 2, 3, 5, 70]
    x, w = _conv_inputs(lens, dtype=dtype)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    y_ref = conv1d_fwd(x, w, torch.tensor(cu))
    for b in range(len(lens)):  # a sequence alone
        assert torch.equal(conv1d_fwd(x[cu[b] : cu[b + 1]], w, torch.tensor([0, lens[b]])), y_ref[cu[b] : cu[b + 1]])
    for split in list(range(1, 9)) + [40]:
        tail = torch.full((6, 3, x.shape[1]), float("nan"), dtype=dtype)
        got = [[] for _ in lens]
        pos = [0] * len(lens)
        sl = [4, 0, 5, 2, 1]
        while any(p < n for p, n in zip(pos, lens)):
            live = [b for b in range(len(lens)) if pos[b] < lens[b]]
            take = {b: (split if pos[b] == 0 else 1) for b in live}
            take = {b: min(t, lens[b] - pos[b]) for b, t in take.items()}
            rows = [torch.arange(cu[b] + pos[b], cu[b] + pos[b] + take[b]) for b in live] + [torch.tensor([0])]
            ccu = [0]
            for b in live:
                ccu.append(ccu[-1] + take[b])
            ccu.append(ccu[-1] + 1)
            y = conv1d_fwd(x[torch.cat(rows)], w, torch.tensor(ccu), tail=tail,
                           slots=torch.tensor([sl[b] for b in live] + [-1]),
                           start_positions=torch.tensor([pos[b] for b in live] + [0]))
            for i, b in enumerate(live):
                got[b].append(y[ccu[i] : ccu[i + 1]])
                pos[b] += take[b]
                last = x[cu[b] + max(0, pos[b] - 3) : cu[b] + pos[b]]
                want = torch.cat([torch.zeros(3 - len(last), x.shape[1], dtype=dtype), last])
                assert torch.equal(tail[sl[b]], want), (split, b)
        for b in range(len(lens)):
            assert torch.equal(torch.cat(got[b]), y_ref[cu[b] : cu[b + 1]]), (split, b)


def test_conv1d_vs_transformers_and_float64():
    tq = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    lens = [7, 130]
    for dtype, bound in ((torch.bfloat16, 8e-3), (torch.float32, 1e-6)):
        x, w = _conv_inputs(lens, dtype=dtype, seed=2)
        y = conv1d_fwd(x, w, torch.tensor([0, 7, 137]))
        assert rel_err(y, conv1d_ref(x, w, [0, 7, 137])) < bound
        for s, e in ((0, 7), (7, 137)):
            ht = tq.causal_conv1d_fn(x[s:e].t()[None].contiguous(), w, None, activation="silu")[0].t()
            assert rel_err(y[s:e], ht) < bound, dtype
            if dtype == torch.bfloat16:  # the same rounding points: measured bitwise equal (torch 2.13 CPU)
                assert (y[s:e] != ht).float().mean() < 1e-3


def test_conv1d_gradients_vs_float64():
    x, w = _conv_inputs([5, 64], dtype=torch.float32, seed=3)
    dy = torch.randn(69, x.shape[1])
    grads = []
    for dtype, fn in ((torch.float32, conv1d), (torch.float64, conv1d_ref)):
        xl, wl = x.detach().to(dtype).requires_grad_(), w.detach().to(dtype).requires_grad_()
        (fn(xl, wl, torch.tensor([0, 5, 69]) if fn is conv1d else [0, 5, 69]) * dy.to(dtype)).sum().backward()
        grads.append((xl.grad, wl.grad))
    assert rel_err(grads[0][0], grads[1][0]) < 1e-6 and rel_err(grads[0][1], grads[1][1]) < 1e-6
    xl = x.clone().requires_grad_()
    assert torch.equal(conv1d(xl, w, torch.tensor([0, 5, 69])).detach(), conv1d_fwd(x, w, torch.tensor([0, 5, 69])))


def test_bad_input():
    inp = Inputs([10])
    cu = inp.cu_t()
    with pytest.raises(ValueError, match="multiple"):
        gdn_fwd(inp.q, inp.k, inp.v[:, :3], inp.g[:, :3], inp.beta[:, :3], cu)
    with pytest.raises(ValueError, match="need a cache"):
        gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, cu, start_positions=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="slots and start_positions"):
        gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, cu, cache=inp.cache(1))
    one = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="need a cache"):
        gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, cu, host=([0, 10], [0], [0]))
    with pytest.raises(ValueError, match="host lists must be"):
        gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, cu, start_positions=one, slots=one, cache=inp.cache(1),
                host=([0, 10], [0, 0], [0]))
    with pytest.raises(ValueError, match="weight"):
        conv1d_fwd(torch.zeros(4, 6), torch.zeros(6, 3), torch.tensor([0, 4]))


# ------------------------------------------------------------------ the Triton decode step

# Both interpreted scripts start here: the inputs, and NaN-filled cache slots (a kernel that reads a
# row or state it has not written shows).
_INTERPRETED_PRELUDE = TORCH_MATH + r"""
from alignzoo.common.gdn import gdn_cache, gdn_fwd, l2norm_fwd


def inputs(seed, T, Hk, Hv, K, V):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm_fwd(torch.randn(T, Hk, K, generator=gen)) * K ** -0.5
    k = l2norm_fwd(torch.randn(T, Hk, K, generator=gen))
    v = torch.randn(T, Hv, V, generator=gen)
    g = -torch.rand(T, Hv, generator=gen) * 0.5
    beta = torch.rand(T, Hv, generator=gen)
    return q, k, v, g, beta


def nan_cache(Hk, Hv, K, V):
    c = gdn_cache(4, Hk, Hv, K, V)
    for t in c.values():
        t.fill_(float("nan") if t.is_floating_point() else 7)
    return c
"""

_INTERPRETED = _INTERPRETED_PRELUDE + r"""
from alignzoo.common.gdn import cpu
from alignzoo.common.gdn.kernel import gdn_decode_triton

Hk, Hv, K, V = 2, 4, 24, 20
lens, pre, slot_of = [68, 132, 6], [60, 125, 0], [3, 0, 2]
T = sum(lens)
q, k, v, g, beta = inputs(0, T, Hk, Hv, K, V)
cu = [0]
for n in lens:
    cu.append(cu[-1] + n)
ref = gdn_fwd(q, k, v, g, beta, torch.tensor(cu))
caches = []
for _ in range(3):  # the CPU step, the kernels, the kernels with 4-lane K subtrees and 2 state groups
    c = nan_cache(Hk, Hv, K, V)
    idx = torch.cat([torch.arange(cu[b], cu[b] + pre[b]) for b in (0, 1)])
    gdn_fwd(q[idx], k[idx], v[idx], g[idx], beta[idx], torch.tensor([0, pre[0], pre[0] + pre[1]]),
            start_positions=torch.zeros(2, dtype=torch.long), cache=c, slots=torch.tensor([3, 0]))
    caches.append(c)

def same(a, b):
    return torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30)) and torch.equal(a.isnan(), b.isnan())

for step in range(5):  # crosses row 63 (sequence 0 at 63, sequence 1 at 127) and position 0 (sequence 2)
    rows, pos, sl = [], [], []
    for b in range(3):
        rows.append(cu[b] + pre[b] + step); pos.append(pre[b] + step); sl.append(slot_of[b])
    rows.insert(1, 0); pos.insert(1, 9); sl.insert(1, -1)  # a padding row
    ri = torch.tensor(rows)
    args = [t[ri].contiguous() for t in (q, k, v, g, beta)] + [torch.tensor(pos), torch.tensor(sl)]
    o_cpu = cpu.decode_step(*args, caches[0])
    o_tri = gdn_decode_triton(*args, caches[1])
    o_q4 = gdn_decode_triton(*args, caches[2], bkq=4, state_groups=2)
    for name in caches[0]:
        assert same(caches[0][name], caches[1][name]) and same(caches[0][name], caches[2][name]), (step, name)
    for i, r in enumerate(rows):
        if sl[i] >= 0:
            assert torch.equal(o_tri[i], o_cpu[i]) and torch.equal(o_tri[i], ref[r]), (step, i)
            assert torch.equal(o_q4[i], o_cpu[i]), (step, i)
    assert torch.equal(o_tri[1], torch.zeros_like(o_tri[1]))
print("ok")
"""


def test_triton_decode_kernel_interpreted():
    """The decode kernels' source under Triton's interpreter gives the CPU
    decode step's bits (every cache field, NaN-filled slots included) and the
    trainer's outputs: rows 60..64 and 125..129 (two chunk ends), a sequence at
    position 0 and a padding row."""
    run_interpreted(_INTERPRETED, expect="ok")


_INTERPRETED_SCAN = _INTERPRETED_PRELUDE + r"""
Hk, Hv, K, V = 1, 2, 24, 20
lens = [130, 7, 3]
T = sum(lens)
xs = inputs(1, T, Hk, Hv, K, V)
cu = [0, 130, 137, 140]
caches = {be: nan_cache(Hk, Hv, K, V) for be in ("torch", "triton")}
# call 1: A 0..69, a padding sequence, B 0..4; call 2: A 70..129 (from mid-chunk, across 127), B 5..6
calls = [([(0, 0, 70, 1), (2, 0, 3, -1), (1, 0, 5, 3)]), ([(1, 5, 2, 3), (0, 70, 60, 1)])]
for items in calls:
    idx = torch.cat([torch.arange(cu[b] + s, cu[b] + s + n) for b, s, n, _ in items])
    ncu = torch.tensor([0] + list(np.cumsum([n for _, _, n, _ in items])))
    st = torch.tensor([s for _, s, _, _ in items])
    sl = torch.tensor([x for *_, x in items])
    outs = {be: gdn_fwd(*[t[idx] for t in xs], ncu, start_positions=st, cache=caches[be], slots=sl, backend=be)
            for be in caches}
    for i, (b, s, n, slot) in enumerate(items):
        if slot < 0:
            continue
        a, e = int(ncu[i]), int(ncu[i + 1])
        assert torch.equal(outs["torch"][a:e], outs["triton"][a:e]), (items, i)
        r = (s + n) % 64
        ct, cg = caches["torch"], caches["triton"]
        assert torch.equal(ct["state"][slot], cg["state"][slot]) and int(cg["n"][slot]) == r, (items, i)
        for name in ("k", "g_cum", "x", "v_new"):
            assert torch.equal(ct[name][slot, :r], cg[name][slot, :r]), (items, i, name)
tc = torch.tensor([0, 3, 5])
small = [t[:5] for t in xs]
assert torch.equal(gdn_fwd(*small, tc, backend="triton"), gdn_fwd(*small, tc, backend="torch"))
print("ok")
"""


def test_triton_scan_kernel_interpreted():
    """The scan kernel (the trainer / prefill on the GPU: each sequence's rows in
    order through the decode's row and state functions) under the interpreter
    equals the torch path: a 70-row prefill across row 63 beside a padding
    sequence, then a continuation from mid-chunk across row 127 (outputs, state,
    n and the open chunk's rows, from NaN-filled slots), and the trainer form."""
    run_interpreted(_INTERPRETED_SCAN, expect="ok")


_INTERPRETED_PROLOGUE = TORCH_MATH + r"""
from alignzoo.common.gdn import cpu
from alignzoo.common.gdn.prologue_kernel import conv1d_triton, l2norm_triton

g = torch.Generator().manual_seed(0)
for dt in (torch.float32, torch.bfloat16):
    C = 300  # two channel tiles, the second partial
    # sequences: one past its tail, a 1-token continuation, an empty one, a padding row (slot -1),
    # a fresh 5-token prompt, a continuation from 64 and a fresh 2-token prompt (zeros in its new tail)
    lens, starts = [70, 1, 0, 2, 5, 33, 2], [0, 5, 3, 1, 0, 64, 0]
    slots = torch.tensor([2, 0, 1, -1, 3, 4, 6])
    cu = torch.tensor([0] + np.cumsum(lens).tolist())
    T = int(cu[-1])
    x = (torch.randn(T, C + 7, generator=g) * 3).to(dt)[:, 3:3 + C]  # a strided column slice, as in_proj's
    w = torch.randn(C, 4, generator=g).to(dt)
    tail = torch.randn(7, 3, C, generator=g).to(dt)
    t_cpu, t_tri = tail.clone(), tail.clone()
    y_cpu = cpu.conv1d_cpu(x, w, cu, t_cpu, slots, torch.tensor(starts))
    y_tri = conv1d_triton(x, w, cu, t_tri, slots, torch.tensor(starts))
    assert torch.equal(y_cpu, y_tri) and torch.equal(t_cpu, t_tri), dt
    assert torch.equal(conv1d_triton(x, w, cu), cpu.conv1d_cpu(x, w, cu)), dt
    for D in (128, 24, 1):
        xx = torch.randn(37, 3, D, generator=g).to(dt)
        xx[0, 0] = 0
        assert torch.equal(l2norm_triton(xx), cpu.l2norm_cpu(xx)), (dt, D)
print("ok")
"""


def test_prologue_kernels_interpreted():
    """The conv1d + SiLU and l2norm kernels (the server's on CUDA) under the interpreter give the
    torch path's bits, fp32 and bf16: outputs and every slot's new tail, across fresh, continued,
    empty, 1- and 2-token and padding sequences (a dropped position-0 zeroing of a short fresh
    prompt's tail, or a dropped rounding to bf16 before the SiLU, fails it)."""
    run_interpreted(_INTERPRETED_PROLOGUE, expect="ok")


# ------------------------------------------------------------------ GPU (not run on the CPU CI)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_prologue_kernels_equal_torch_path(dtype):
    """On CUDA at Qwen3.5's widths: the server's conv1d and l2norm kernels give the torch path's
    bits (libdevice's exp and rsqrt are torch's CUDA ops'), so the trainer (the torch path, for its
    gradients) and the server agree; 1,500 tokens of five sequences, fresh and continued."""
    from alignzoo.common.gdn import cpu
    from alignzoo.common.gdn.prologue_kernel import conv1d_triton, l2norm_triton

    g = torch.Generator().manual_seed(0)
    lens, starts = [700, 3, 1, 540, 256], [0, 61, 64, 0, 13]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda")
    T, C = sum(lens), 8192
    x = (torch.randn(T, C + 64, generator=g) * 2).to(dtype).cuda()[:, :C]
    w = (torch.randn(C, 4, generator=g) * 0.5).to(dtype).cuda()
    tail = torch.randn(6, 3, C, generator=g).to(dtype).cuda()
    slots, st = torch.tensor([5, 0, 2, 1, 4], device="cuda"), torch.tensor(starts, device="cuda")
    t_cpu, t_tri = tail.clone(), tail.clone()
    assert torch.equal(cpu.conv1d_cpu(x, w, cu, t_cpu, slots, st), conv1d_triton(x, w, cu, t_tri, slots, st))
    assert torch.equal(t_cpu, t_tri)
    q = torch.randn(T, 16, 128, generator=g).to(dtype).cuda()
    assert torch.equal(cpu.l2norm_cpu(q), l2norm_triton(q))


@pytest.mark.gpu
@pytest.mark.parametrize("backend,mma", [("torch", None), ("triton", False), ("triton", True)],
                         ids=["torch", "triton-trees", "triton-mma"])
def test_gpu_decode_equals_trainer(backend, mma, monkeypatch):
    """On CUDA: each backend's (and Triton form's) trainer, chunked prefill and decode give the
    same bits, 300 tokens, decode from every offset of chunk 1; the torch path and the Triton
    trees give each other's bits, the MMA form its own (its boundary states from its prefill)."""
    from alignzoo.common.gdn import kernel

    monkeypatch.setattr(kernel, "MMA", bool(mma))
    inp = Inputs([300], K=128, V=128, Hk=2, Hv=4, seed=7, device="cuda")
    o_ref, (states,) = inp.trainer()
    o_tr = gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), backend=backend)
    if mma:
        assert rel_err(o_tr, o_ref) < 1e-5 and not torch.equal(o_tr, o_ref)
        o_ref, states = o_tr, []
        for c in range(1, 300 // 64 + 1):
            sc = inp.cache(1)
            inp.call([(0, 0, 64 * c, 0)], sc, backend=backend)
            states.append(sc["state"][0].clone())
    assert torch.equal(o_tr, o_ref)
    cache = inp.cache(64)
    pre = inp.call([(0, 0, 64 + o, o) for o in range(64)], cache, backend=backend)
    assert all(torch.equal(p, o_ref[: 64 + o]) for o, p in enumerate(pre))
    for step in range(300 - 127):
        items = [(0, 64 + o + step, 1, o) for o in range(64) if 64 + o + step < 300]
        got = inp.call(items, cache, backend=backend)
        for (_, pos, _, slot), out in zip(items, got):
            assert torch.equal(out, o_ref[pos : pos + 1]), (backend, pos)
            assert _state_ok(cache, slot, pos + 1, states), (backend, pos)


@pytest.mark.gpu
def test_gpu_triton_decode_replays_from_a_cuda_graph():
    inp = Inputs([200], K=128, V=128, seed=8, device="cuda")
    o_ref = gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t())  # the Triton trainer's rows
    cache = inp.cache(4)
    inp.call([(0, 0, 100, 2)], cache)
    idx = torch.tensor([100], device="cuda")
    bufs = [t[idx].clone() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
    pos, sl = torch.tensor([100], device="cuda"), torch.tensor([2], device="cuda")
    cu = torch.tensor([0, 1], device="cuda")
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    scratch = {n: t.clone() for n, t in cache.items()}
    gdn_fwd(*bufs, cu, start_positions=pos, cache=scratch, slots=sl)  # warm up (compile) outside the graph
    with torch.cuda.graph(graph):
        out = gdn_fwd(*bufs, cu, start_positions=pos, cache=cache, slots=sl)
    for p in range(100, 200):
        for b, t in zip(bufs, (inp.q, inp.k, inp.v, inp.g, inp.beta)):
            b.copy_(t[p : p + 1])
        pos.fill_(p)
        graph.replay()
        assert torch.equal(out, o_ref[p : p + 1]), p


def test_ladder():
    from alignzoo.common.gdn.checks import ladder

    rows = ladder(torch.device("cpu"))
    assert rows and all(r.passed for r in rows), [(r.check, r.detail) for r in rows if not r.passed]


@pytest.mark.gpu
def test_gpu_trainer_triton_forward_matmul_backward(monkeypatch):
    """gdn on CUDA: the Triton forward (MMA form) is the torch path's function to fp32 rounding, and
    with the trees its bits; its backward (the matmul form's autograd) gives the exact path's
    gradients to fp32 rounding, and repeats."""
    from alignzoo.common.gdn import kernel

    inp = Inputs([1, 63, 65, 300, 1000], K=128, V=128, seed=9, device="cuda")
    outs = []
    for backend in ("triton", "torch", "triton"):
        leaves = [t.detach().clone().requires_grad_() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
        o = gdn(*leaves, inp.cu_t(), backend=backend)
        o.square().sum().backward()
        outs.append([o.detach()] + [t.grad for t in leaves])
    assert rel_err(outs[0][0], outs[1][0]) < 1e-5
    monkeypatch.setattr(kernel, "MMA", False)
    assert torch.equal(gdn(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), backend="triton"), outs[1][0])
    for name, a, b in zip(("q", "k", "v", "g", "beta"), outs[0][1:], outs[1][1:]):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))  # TF32 matmuls would miss by ~1e-3
    assert all(torch.equal(a, b) for a, b in zip(outs[0], outs[2]))
