"""The chunk-parallel Triton forward (``chunk_kernel.gdn_chunk_triton``, the GPU
trainer / prefill) gives the row-by-row scan's bits and the torch path's: the
output and every cache field it writes, under Triton's interpreter on the CPU
(mixed lengths, continuations from mid-chunk, padding, GVA, odd K and V, the
trainer form, other launch knobs) and, gpu-marked, at Qwen3.5-35B-A3B's shapes."""
from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted
from test_gdn import _INTERPRETED_PRELUDE, Inputs

from alignzoo.common.gdn import gdn_cache, gdn_fwd

# torch in the chunk launcher's namespace with every scratch buffer NaN-filled (_ck.torch = _NanScratch())
_NAN_SCRATCH = r"""
class _NanScratch:
    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*a, **kw):
        return torch.empty(*a, **kw).fill_(float("nan"))

    @staticmethod
    def empty_like(*a, **kw):
        return torch.empty_like(*a, **kw).fill_(float("nan"))
"""

_INTERPRETED_CHUNK = _INTERPRETED_PRELUDE + _NAN_SCRATCH + r"""
from alignzoo.common.gdn import chunk_kernel as _ck
from alignzoo.common.gdn import cpu
from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
from alignzoo.common.gdn.kernel import gdn_scan_triton

# rows of several at a time (a launch knob: the same bits, fewer interpreted steps)
FAST = dict(bi=64, bw=64, br=64, bs=64, bro=64, bvo=64)
FIELDS = ("k", "g_cum", "x", "v_new")


def same(a, b):
    return torch.equal(a.nan_to_num(1e30), b.nan_to_num(1e30)) and torch.equal(a.isnan(), b.isnan())


def case(Hk, Hv, K, V, lens, calls, seed, scan=True, **knobs):
    # calls: engine steps of items (sequence, start, rows, slot); slot -1: a padding sequence.
    # scan=False: against cpu.chunked only (test_gdn.py's scan test holds scan == cpu)
    xs = inputs(seed, sum(lens), Hk, Hv, K, V)
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    o_ref = cpu.chunked(*xs, cu, [0] * len(lens))
    nslots = 1 + max(x[3] for items in calls for x in items)
    caches = {be: nan_cache(Hk, Hv, K, V) for be in ("cpu", "scan", "chunk")}
    for c in caches.values():
        for name, t in c.items():
            c[name] = t[:1].expand(nslots, *t.shape[1:]).clone()
    rows_ok = {}  # slot -> rows of its open chunk that hold values
    for items in calls:
        idx = torch.cat([torch.arange(cu[b] + s, cu[b] + s + n) for b, s, n, _ in items])
        ncu = [0]
        for _, _, n, _ in items:
            ncu.append(ncu[-1] + n)
        st = [s for _, s, _, _ in items]
        sl = [x for *_, x in items]
        args = [t[idx].contiguous() for t in xs]
        dev = [torch.tensor(ncu), torch.tensor(st), torch.tensor(sl)]
        o_cpu = cpu.chunked(*args, ncu, st, cache=caches["cpu"], slots=sl)
        o_chunk = gdn_chunk_triton(*args, *dev, caches["chunk"], **knobs)
        if scan:
            assert torch.equal(o_chunk, gdn_scan_triton(*args, *dev, caches["scan"])), items
        for i, (b, s, n, slot) in enumerate(items):
            a, e = ncu[i], ncu[i + 1]
            if slot < 0:
                assert not o_chunk[a:e].any(), items
                continue
            assert torch.equal(o_chunk[a:e], o_cpu[a:e]) and torch.equal(o_chunk[a:e], o_ref[cu[b] + s : cu[b] + s + n])
            if n:
                rows_ok[slot] = (s + n - 1) % 64 + 1
        for slot in range(nslots):
            if slot not in rows_ok:  # never written
                assert all(same(caches["chunk"][f][slot], caches["cpu"][f][slot]) for f in caches["chunk"]), slot
                continue
            m = rows_ok[slot]
            for be in ("cpu", "scan") if scan else ("cpu",):
                ref = caches[be]
                assert torch.equal(caches["chunk"]["state"][slot], ref["state"][slot]), (items, slot, be)
                assert int(caches["chunk"]["n"][slot]) == int(ref["n"][slot]), (items, slot, be)
                for f in FIELDS:
                    assert torch.equal(caches["chunk"][f][slot, :m], ref[f][slot, :m]), (items, slot, be, f)
    # the trainer form: a fresh scratch cache, every sequence from position 0
    ar = torch.arange(len(lens))
    o_tr = gdn_chunk_triton(*xs, torch.tensor(cu), torch.zeros_like(ar), ar, gdn_cache(len(lens), Hk, Hv, K, V),
                            **knobs)
    assert torch.equal(o_tr, o_ref)


# one sequence split at several offsets in one batch, then the rest of each (GVA, Hv = 2 Hk)
case(1, 2, 24, 20, [100], seed=3, scan=False, calls=[
    [(0, 0, s, i) for i, s in enumerate((1, 37, 64, 65))],
    [(0, s, 100 - s, i) for i, s in enumerate((1, 37, 64, 65))],
], **FAST)
# odd K and V (not powers of two: padded lanes, two V tiles, a column tile mixing u and w), two qk heads
case(2, 4, 24, 40, [70, 5], seed=4, calls=[[(0, 0, 40, 1), (1, 0, 5, 0)], [(0, 40, 30, 1)]], **FAST)

# the kernels' trees load their leaves unmasked: from here every scratch buffer is NaN-filled (the cases
# above ran on torch.empty's), so rows past a piece's end and clamped columns must still reach no stored value
_ck.torch = _NanScratch()
# mixed lengths across several chunks beside a padding sequence, then continuations from
# mid-chunk (into the next chunk, within the chunk, from a boundary, empty) and more padding
case(1, 2, 24, 20, [1, 63, 64, 65, 200], seed=2, calls=[
    [(4, 0, 70, 2), (0, 0, 1, 4), (0, 0, 1, -1), (1, 0, 63, 0), (2, 0, 64, 1), (3, 0, 10, 3)],
    [(3, 10, 55, 3), (4, 70, 3, 2), (1, 0, 1, -1), (2, 64, 0, 1)],
    [(4, 73, 127, 2)],
], **FAST)
# the GPU's launch knobs, and others (two state K-tiles, four rows a step, solve blocks of two rows: every
# level of left siblings; o in the state kernel, then in the output kernel)
case(1, 2, 24, 20, [100], seed=5, calls=[[(0, 0, 30, 0)], [(0, 30, 70, 0)]], fused=True)
case(1, 2, 24, 40, [75], seed=6, calls=[[(0, 0, 40, 0)], [(0, 40, 35, 0)]], bv=16, bw=16, br=4, bks=8, bi=8, bs=2,
     bro=4, bvo=8, fused=False)
print("ok")
"""


def test_chunk_kernel_interpreted():
    """gdn_chunk_triton under the interpreter == gdn_scan_triton == cpu.chunked ==
    the trainer's rows: o (padding rows 0) and, per slot, state, n and the open
    chunk's k, g_cum, x, v_new rows from NaN-filled slots (slots never written
    stay as the scan leaves them), then the trainer form; every scratch buffer
    NaN-filled in three of the five cases (the trees read leaves unmasked)."""
    run_interpreted(_INTERPRETED_CHUNK, expect="ok")


# ------------------------------------------------------------------ GPU (not run on the CPU CI)

_QWEN35 = dict(Hk=16, Hv=32, K=128, V=128)


def _engine_call(inp, items, cache, fn):
    """items [(seq, start, n, slot)] through fn (gdn_chunk_triton / gdn_scan_triton)."""
    dev = inp.device
    idx = torch.cat([torch.arange(inp.cu[b] + s, inp.cu[b] + s + n) for b, s, n, _ in items]).to(dev)
    cu = [0]
    for _, _, n, _ in items:
        cu.append(cu[-1] + n)
    st = torch.tensor([s for _, s, _, _ in items], device=dev)
    sl = torch.tensor([x for *_, x in items], device=dev)
    args = [t[idx].contiguous() for t in (inp.q, inp.k, inp.v, inp.g, inp.beta)]
    return fn(*args, torch.tensor(cu, device=dev), st, sl, cache)


def _caches_equal(a, b, slot, m):
    return (torch.equal(a["state"][slot], b["state"][slot]) and int(a["n"][slot]) == int(b["n"][slot])
            and all(torch.equal(a[f][slot, :m], b[f][slot, :m]) for f in ("k", "g_cum", "x", "v_new")))


@pytest.mark.gpu
def test_gpu_chunk_equals_scan_qwen35_shapes():
    """Qwen3.5-35B-A3B's GDN (Hk 16, Hv 32, K = V = 128): 4096 and 1500 tokens
    beside a padding row, then a continuation from mid-chunk: the chunk kernel
    and the scan give the same o and cache, bit for bit."""
    from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
    from alignzoo.common.gdn.kernel import gdn_scan_triton

    inp = Inputs([4096, 1500, 1], seed=11, device="cuda", **_QWEN35)
    calls = [[(0, 0, 4096, 0), (2, 0, 1, -1), (1, 0, 1000, 1)], [(1, 1000, 500, 1)]]
    caches = [inp.cache(2), inp.cache(2)]
    for items in calls:
        o_c = _engine_call(inp, items, caches[0], gdn_chunk_triton)
        o_s = _engine_call(inp, items, caches[1], gdn_scan_triton)
        assert torch.equal(o_c, o_s), items
        for b, s, n, slot in items:
            if slot >= 0:
                assert _caches_equal(caches[0], caches[1], slot, (s + n - 1) % 64 + 1), (items, slot)
    o_ref = gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), backend="triton")
    ar = torch.arange(3, device="cuda")
    o_scan = gdn_scan_triton(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), torch.zeros_like(ar), ar,
                             gdn_cache(3, device="cuda", **_QWEN35))
    assert torch.equal(o_ref, o_scan)


@pytest.mark.gpu
def test_gpu_chunk_equals_torch_path(monkeypatch):
    """On CUDA, smaller (Hk 2, Hv 4, K = V = 128, 700 and 130 tokens): the triton
    trainer forward and a prefill split mid-chunk in the trees' form equal the torch
    path's rows, states and open-chunk rows."""
    from alignzoo.common.gdn import kernel

    monkeypatch.setattr(kernel, "MMA", False)
    inp = Inputs([700, 130], Hk=2, Hv=4, K=128, V=128, seed=12, device="cuda")
    o_ref = gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), backend="torch")
    assert torch.equal(gdn_fwd(inp.q, inp.k, inp.v, inp.g, inp.beta, inp.cu_t(), backend="triton"), o_ref)
    caches = {be: inp.cache(2) for be in ("torch", "triton")}
    for items in ([(0, 0, 300, 0), (1, 0, 70, 1)], [(0, 300, 400, 0), (1, 70, 60, 1)]):
        outs = {be: inp.call(items, caches[be], backend=be) for be in caches}
        for (b, s, n, slot), a, t in zip(items, outs["triton"], outs["torch"]):
            assert torch.equal(a, t) and torch.equal(a, o_ref[inp.cu[b] + s : inp.cu[b] + s + n]), (items, b)
            assert _caches_equal(caches["triton"], caches["torch"], slot, (s + n - 1) % 64 + 1), (items, slot)


_SIGNED_ZEROS = _INTERPRETED_PRELUDE + r"""
import os

from alignzoo.common.gdn import cpu
from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
from alignzoo.common.gdn import kernel
from alignzoo.common.gdn.kernel import gdn_decode_triton, gdn_scan_triton

dev = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
Hk, Hv, K, V = (1, 2, 16, 8) if dev == "cpu" else (2, 4, 128, 128)
kernel.MMA = False  # the trees' form (a tensor core's all-zero sum is +0.0, whatever its terms' signs)
xs = [x.to(dev) for x in inputs(3, 77, Hk, Hv, K, V)]
xs[2][:, 0] = -0.0  # head 0: every v row -0.0, so its x, v_new and o are zeros whose signs the pads decide
pre = [x[:73] for x in xs]  # a 70-row and a 3-row prompt, then rows 73.. decode both
t = lambda x: torch.tensor(x, device=dev)
bits = lambda x: x.contiguous().view(torch.int32)
ref_c = gdn_cache(2, Hk, Hv, K, V, dev)
ref = cpu.chunked(*pre, [0, 70, 73], [0, 0], cache=ref_c, slots=[0, 1])
assert not ref[:, 0].any() and ref[:, 1].all()
for fn in (gdn_scan_triton, gdn_chunk_triton):
    c, rc = gdn_cache(2, Hk, Hv, K, V, dev), {n: x.clone() for n, x in ref_c.items()}
    o = fn(*pre, t([0, 70, 73]), t([0, 0]), t([0, 1]), c)
    assert torch.equal(bits(o), bits(ref)), fn.__name__
    for step in range(2):  # positions 70, 71 and 3, 4
        rows = [(0, 6 + step), (1, 3 + step)]  # the open chunk's rows that hold values
        assert torch.equal(bits(c["state"]), bits(rc["state"])), (fn, step)
        assert all(torch.equal(bits(c[n][s, :r]), bits(rc[n][s, :r])) for n in ("x", "v_new", "g_cum")
                   for s, r in rows), (fn, step)
        args = [x[73 + 2 * step : 75 + 2 * step].contiguous() for x in xs] + [t([70 + step, 3 + step]), t([0, 1])]
        assert torch.equal(bits(gdn_decode_triton(*args, c)), bits(cpu.decode_step(*args, rc))), (fn, step)
print("ok")
"""


def test_signed_zeros_interpreted():
    """-0.0 pads every tree, so a zero keeps the torch path's sign through the scan, the chunk
    kernel and decode (bit patterns, not ==): on the GPU Triton 3.6 compiles a -0.0 literal as +0.0."""
    run_interpreted(_SIGNED_ZEROS, expect="ok")


@pytest.mark.gpu
def test_gpu_signed_zeros_match_torch_path():
    """The same script compiled on CUDA against the torch path there (the trees' form)."""
    run_interpreted(_SIGNED_ZEROS, expect="ok", interpret=False)


_MMA = _INTERPRETED_PRELUDE + _NAN_SCRATCH + r"""
# The MMA form (the GPU's default): the state's products as tl.dot.  Interpreted, a dot is numpy's
# matmul, whose sums follow the host's BLAS and the tile's shape; in its place a row-local dot (the
# products added in K order in float64, one rounding), which has the property the GPU's tf32x3 dot
# was measured to have: a row's result depends on that row and the other operand alone.
import os

from alignzoo.common.gdn import chunk_kernel as _ck
from alignzoo.common.gdn import cpu
from alignzoo.common.gdn.chunk_kernel import gdn_chunk_triton
from alignzoo.common.gdn.kernel import gdn_decode_triton, gdn_scan_triton

dev = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
if dev == "cpu":
    def _row_local_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        x, y = a.data.astype(np.float64), b.data.astype(np.float64)
        acc = np.zeros((x.shape[0], y.shape[1]))
        for k in range(x.shape[1]):
            acc = acc + x[:, k : k + 1] * y[k : k + 1, :]
        return _it.TensorHandle((acc.astype(np.float32) + d.data).astype(np.float32), d.dtype.scalar)

    _it.InterpreterBuilder.create_dot = _row_local_dot
    _ck.torch = _NanScratch()  # every scratch buffer NaN: a stale row must reach no product
Hk, Hv, K, V = (1, 2, 24, 20) if dev == "cpu" else (16, 32, 128, 128)
FAST = dict(bi=64, bw=64, bs=64, bro=64, bvo=64) if dev == "cpu" else {}  # fewer interpreted steps, the same bits
lens = [200, 70, 5]
xs = [x.to(dev) for x in inputs(5, sum(lens), Hk, Hv, K, V)]
cu = [0, 200, 270, 275]
t = lambda x: torch.tensor(x, device=dev)
ar = t(list(range(3)))
o_tr = gdn_chunk_triton(*xs, t(cu), ar * 0, ar, gdn_cache(3, Hk, Hv, K, V, dev), mma=True, **FAST)  # trainer form
o_cpu = cpu.chunked(*xs, cu, [0, 0, 0])
err = ((o_tr.double() - o_cpu.double()).norm() / o_cpu.double().norm()).item()
assert 0 < err < 1e-5, err  # another order of the same sums (0: the switch did nothing)
if dev == "cuda":  # the trainer form unfused and through the scan (interpreted, the calls below cover both)
    assert torch.equal(o_tr, gdn_chunk_triton(*xs, t(cu), ar * 0, ar, gdn_cache(3, Hk, Hv, K, V, dev), mma=True,
                                              fused=False))
    assert torch.equal(o_tr, gdn_scan_triton(*xs, t(cu), ar * 0, ar, gdn_cache(3, Hk, Hv, K, V, dev), mma=True))


def nan_slots():
    c = gdn_cache(3, Hk, Hv, K, V, dev)
    for x in c.values():
        x.fill_(float("nan") if x.is_floating_point() else 7)
    return c


# prefill 0..69 / 0..4 beside a padding row, then from mid-chunk across row 127, then decode both across
# row 191 (chunk, scan and fused=False caches), every output against the trainer form's rows
calls = [[(0, 0, 70, 0), (2, 0, 1, -1), (1, 0, 5, 1)], [(0, 70, 120, 0), (1, 5, 2, 1)]]
runs = {"chunk": dict(fn=gdn_chunk_triton, kw=FAST), "out": dict(fn=gdn_chunk_triton, kw={**FAST, "fused": False}),
        "scan": dict(fn=gdn_scan_triton, kw={})}
caches = {name: nan_slots() for name in runs}
for items in calls:
    idx = torch.cat([torch.arange(cu[b] + s, cu[b] + s + n) for b, s, n, _ in items]).to(dev)
    ncu = [0]
    for _, _, n, _ in items:
        ncu.append(ncu[-1] + n)
    args = [x[idx].contiguous() for x in xs] + [t(ncu), t([s for _, s, _, _ in items]), t([x for *_, x in items])]
    outs = {name: r["fn"](*args, caches[name], mma=True, **r["kw"]) for name, r in runs.items()}
    for i, (b, s, n, slot) in enumerate(items):
        if slot >= 0:
            for name, o in outs.items():
                assert torch.equal(o[ncu[i] : ncu[i + 1]], o_tr[cu[b] + s : cu[b] + s + n]), (items, name)
for step in range(190, 200):
    rows = [step, 200 + 7 + step - 190]
    args = [x[t(rows)].contiguous() for x in xs] + [t([step, 7 + step - 190]), t([0, 1])]
    for name, c in caches.items():
        o = gdn_decode_triton(*args, c, mma=True)
        assert torch.equal(o, o_tr[t(rows)]), (step, name)
for name in ("out", "scan"):
    for f in ("state", "k", "g_cum", "x", "v_new"):
        assert torch.equal(caches[name][f][:2, :8] if f != "state" else caches[name][f][:2],
                           caches["chunk"][f][:2, :8] if f != "state" else caches["chunk"][f][:2]), (name, f)
print("ok")
"""


def test_mma_form_interpreted():
    """The MMA form (the state's products as tl.dot, the GPU's default) under the interpreter with a
    row-local dot, from NaN-filled slots and scratch: the chunk kernel fused and with the output
    kernel, the scan and decode across rows 127 and 191 give the trainer form's bits, and the form
    is the torch path's function to 1e-5."""
    run_interpreted(_MMA, expect="ok")


@pytest.mark.gpu
def test_gpu_mma_form_qwen35_shapes():
    """The same script compiled on CUDA at Qwen3.5-35B-A3B's GDN shapes, tf32x3 tensor-core dots."""
    run_interpreted(_MMA, expect="ok", interpret=False)


def test_layout_pieces():
    """The host layout: a mid-chunk start runs its head rows through the scan, the
    rest in 64-row pieces; padding and empty sequences make none."""
    from alignzoo.common.gdn.chunk_kernel import _layout

    heads, pieces, seqs = _layout([0, 10, 210, 211, 211, 300], [60, 0, 0, 5, 64], [0, 1, -1, 2, 3])
    assert heads == [(0, 4)]
    assert pieces == [[4, 6, 0], [10, 64, -1], [74, 64, -1], [138, 64, -1], [202, 8, 1], [211, 64, -1],
                      [275, 25, 3]]
    assert seqs == [(0, 0, 0, 6), (1, 1, 1, 8), (5, 3, 0, 25)]


@pytest.mark.parametrize("lens", [[1], [3, 2], [5, 0, 1, 7], [2, 2, 3], [4, 1, 1, 1, 6]])
def test_device_lists_are_16_byte_aligned(lens):
    """The launch lists are views of one buffer; each must start 16 bytes aligned whatever the
    list lengths, or Triton compiles a new variant of every chunk kernel for a new batch shape."""
    from alignzoo.common.gdn.chunk_kernel import _device_lists

    lists = [list(range(10 * i, 10 * i + n)) for i, n in enumerate(lens)]
    views = _device_lists(lists, "cpu")
    assert [v.tolist() for v in views] == lists
    assert all(v.dtype == torch.int64 and v.data_ptr() % 16 == 0 for v in views)
