"""The server's fused q/k RMSNorm + RoPE + KV-cache write: bitwise the unfused
launchers (``rmsnorm_fwd``, ``rope_fwd``, ``write_kv_fwd``) and the trainer's
``rope(rmsnorm(.))``, whatever the batch around a token; accuracy; bad input."""
from __future__ import annotations

import pytest
import torch
from interpreted import run_interpreted

from alignzoo.common.kv_cache import PAGE_SIZE, BlockManager, allocate_kv_cache
from alignzoo.common.ladder import bitwise_equal, rel_err, rows_differing, rung1_repeat, rung2_rows
from alignzoo.common.qk_norm_rope import qk_norm_rope_kv, qk_norm_rope_kv_fwd, qk_norm_rope_ref
from alignzoo.common.qk_norm_rope.checks import BOUND, EPS, run, unfused
from alignzoo.common.rmsnorm import rmsnorm
from alignzoo.common.rope import RopeSpec, rope

BF, F32 = torch.bfloat16, torch.float32
DTYPES = [pytest.param(BF, id="bf16"), pytest.param(F32, id="fp32")]
MAXP = 5000  # the table; positions run past 593, 2048 and 4096
# (Hq, Hkv, D): Qwen3-8B's heads; the tiny preset (head_dim 24: a padded 32-lane row tree, a 12-lane half);
# 6 q heads over 3 kv heads (partial head blocks)
SHAPES = {"8b-H32-8-D128": (32, 8, 128), "tiny-H4-2-D24": (4, 2, 24), "H6-3-D64": (6, 3, 64)}


def _knobs(device):
    """Launch knobs that must not change bits (CUDA only: the CPU path has none)."""
    if device.type != "cuda":
        return [{}]
    return [{}, {"heads_per_program": 1, "num_warps": 1}, {"heads_per_program": 2}, {"heads_per_program": 16, "num_warps": 4}]


def _inputs(T, shape, dtype, device, seed=0, pad_cols=0):
    """qkv (T, (Hq + 2 Hkv) D) as a row-strided view when ``pad_cols`` (the
    matmul output may be a slice), norm weights, positions (a run from 0, then
    random up to MAXP)."""
    Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(seed)
    N = (Hq + 2 * Hkv) * D
    qkv = (3 * torch.randn(T, N + pad_cols, generator=g)).to(device, dtype)[:, :N]
    q_w, k_w = ((1 + 0.1 * torch.randn(D, generator=g)).to(device, dtype) for _ in range(2))
    head = torch.arange(T // 2)
    positions = torch.cat([head, torch.randint(0, MAXP, (T - T // 2,), generator=g)]).to(device)
    return qkv, q_w, k_w, positions


def _slots(T, num_pages, device, seed=0, skip=()):
    """Distinct slots scattered over the cache; rows in ``skip`` get -1."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randperm(num_pages * PAGE_SIZE, generator=g)[:T]
    for i in skip:
        s[i] = -1
    return s.to(device)


def _nan_cache(num_pages, Hkv, D, dtype, device):
    kc, vc = allocate_kv_cache(num_pages, Hkv, D, dtype=dtype, device=device)
    return kc.fill_(float("nan")), vc.fill_(float("nan"))


def _both(T, shape, dtype, device, knobs=None, skip=(), pad_cols=0, fused=qk_norm_rope_kv_fwd):
    """(fused q, k_cache, v_cache), (unfused q, k_cache, v_cache) from the same
    inputs into NaN-filled caches; bitwise comparison counts NaN payloads."""
    Hq, Hkv, D = shape
    qkv, q_w, k_w, pos = _inputs(T, shape, dtype, device, pad_cols=pad_cols)
    spec = RopeSpec(D, 1e6, MAXP)
    pages = T // PAGE_SIZE + 3
    slots = _slots(T, pages, device, skip=skip)
    out = []
    for fn, kw in ((fused, knobs or {}), (unfused, {})):
        kc, vc = _nan_cache(pages, Hkv, D, dtype, device)
        q = fn(qkv, q_w, k_w, EPS, pos, spec, kc, vc, slots, Hq, Hkv, **kw)
        out.append((q, kc, vc))
    return out, (qkv, q_w, k_w, pos, spec, slots)


# ---------------------------------------------------------------- fused == unfused


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 7, 300], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_fused_equals_unfused(device, shape, T, dtype):
    """q and the whole cache (written slots and untouched NaN ones) have the
    unfused path's bytes, under every launch knob, with a row-strided qkv and
    padding tokens (slot -1) that must write nothing."""
    skip = (0, T - 1) if T > 1 else ()
    for knobs in _knobs(device):
        for pad_cols in (0, 40):
            (got, want), _ = _both(T, shape, dtype, device, knobs, skip, pad_cols)
            for a, b, what in zip(got, want, ("q", "k_cache", "v_cache")):
                assert bitwise_equal(a, b), (what, knobs, pad_cols)


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_fused_equals_the_trainers_rmsnorm_then_rope(device, shape):
    """The trainer's public (autograd) functions: q == rope(rmsnorm(q)); the
    cache holds rope(rmsnorm(k)) and v's bytes at each token's slot."""
    Hq, Hkv, D = shape
    T = 300
    (got, _), (qkv, q_w, k_w, pos, spec, slots) = _both(T, shape, BF, device)
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    assert bitwise_equal(got[0], rope(rmsnorm(q.reshape(T, Hq, D).contiguous(), q_w, EPS), pos, spec))
    k_want = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), k_w, EPS), pos, spec)
    assert bitwise_equal(got[1].view(-1, Hkv, D)[slots], k_want)
    assert bitwise_equal(got[2].view(-1, Hkv, D)[slots], v.reshape(T, Hkv, D))


def test_long_sequence_as_prefill_chunks_and_decode(device):
    """One 1100-token sequence (positions past 593 and 1024, 18 pages) written
    as one prefill, as uneven chunks, and with its last 40 tokens decoded one by
    one: the same q rows and the same cache bytes, equal to the unfused path's."""
    shape = SHAPES["8b-H32-8-D128"] if device.type == "cuda" else SHAPES["H6-3-D64"]
    Hq, Hkv, D = shape
    T = 1100
    qkv, q_w, k_w, _ = _inputs(T, shape, BF, device)
    pos = torch.arange(T, device=device)
    spec = RopeSpec(D, 1e6, MAXP)
    results = []
    for fn, split in ((unfused, [T]), (qk_norm_rope_kv_fwd, [T]), (qk_norm_rope_kv_fwd, [63, 1, 500, 496] + [1] * 40)):
        bm = BlockManager(20, shuffle_seed=3)
        kc, vc = _nan_cache(20, Hkv, D, BF, device)
        qs, done = [], 0
        for c in split:
            slots = torch.tensor(bm.append("s", c), dtype=torch.int32, device=device)
            qs.append(fn(qkv[done : done + c], q_w, k_w, EPS, pos[done : done + c], spec, kc, vc, slots, Hq, Hkv))
            done += c
        results.append((torch.cat(qs), kc, vc))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert bitwise_equal(a, b)


# ---------------------------------------------------------------- rows do not see the batch


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_rung1_rung2(device, shape):
    """A token's q and cache rows do not depend on the other tokens: reversed,
    shuffled with padding rows, subsets of 1, 2, 3, 7 and 100 tokens, every launch knob."""
    Hq, Hkv, D = shape
    qkv, q_w, k_w, pos = _inputs(200, shape, BF, device)
    shared = dict(q_w=q_w, k_w=k_w, spec=RopeSpec(D, 1e6, MAXP), num_heads=Hq, num_kv_heads=Hkv)
    fused = lambda qkv, p, **kw: run(qk_norm_rope_kv_fwd, qkv, p, **kw)  # noqa: E731
    assert rung1_repeat("qk_norm_rope", fused, qkv, pos, **shared).passed
    r = rung2_rows("qk_norm_rope", fused, [qkv, pos], shared=shared, configs=_knobs(device),
                   batch_sizes=(1, 2, 3, 7, 100))
    assert r.passed, r.detail


# ---------------------------------------------------------------- the checks can fail


def _fused_without_norm_rounding(qkv, q_w, k_w, eps, positions, spec, k_cache, v_cache, slot_mapping, Hq, Hkv):
    """The likeliest fusion slip: the normalised y kept in fp32 and fed to the
    rotation, so its bf16 rounding point (y = dtype(n * w)) is lost."""
    T, D = qkv.shape[0], q_w.shape[0]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)

    def norm_rope(x, w):
        xf = x.float()
        n = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
        y = n * w.float()  # no rounding here
        a, b = y[..., : D // 2], y[..., D // 2 :]
        c, s = (t.to(x.device)[positions.long()][:, None] for t in _table(spec))
        return torch.cat([a * c - b * s, b * c + a * s], -1).to(x.dtype)

    kk = norm_rope(k.reshape(T, Hkv, D), k_w)
    keep = slot_mapping >= 0
    k_cache.view(-1, Hkv, D)[slot_mapping[keep].long()] = kk[keep]
    v_cache.view(-1, Hkv, D)[slot_mapping[keep].long()] = v.reshape(T, Hkv, D)[keep]
    return norm_rope(q.reshape(T, Hq, D), q_w)


def _table(spec):
    from alignzoo.common.rope import rope_table

    return rope_table(spec)


def test_the_comparison_catches_a_lost_rounding_point(device):
    """The bitwise comparison above fails for a fused variant that skips one
    bf16 rounding (and sums with torch's mean): most q rows differ."""
    (got, want), _ = _both(300, SHAPES["8b-H32-8-D128"], BF, device, fused=_fused_without_norm_rounding)
    bad = rows_differing(got[0], want[0])
    assert bad.float().mean() > 0.5
    assert not bitwise_equal(got[1], want[1])
    assert bitwise_equal(got[2], want[2])  # v is a plain copy either way


def test_rung2_catches_a_batch_dependent_variant():
    """A 'decode fast path' that uses the perturbed variant for batches of at
    most 4 tokens is caught by rung 2."""
    shape = SHAPES["tiny-H4-2-D24"]
    Hq, Hkv, D = shape
    qkv, q_w, k_w, pos = _inputs(60, shape, BF, torch.device("cpu"))
    shared = dict(q_w=q_w, k_w=k_w, spec=RopeSpec(D, 1e6, MAXP), num_heads=Hq, num_kv_heads=Hkv)

    def variant(qkv, *args, **kw):
        fn = _fused_without_norm_rounding if qkv.shape[0] <= 4 else qk_norm_rope_kv_fwd
        return fn(qkv, *args, **kw)

    r = rung2_rows("qk_norm_rope", lambda x, p, **kw: run(variant, x, p, **kw), [qkv, pos], shared=shared)
    assert not r.passed and r.differing > 0


# ---------------------------------------------------------------- accuracy, edges, bad input


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
def test_accuracy_vs_float64(device, shape):
    Hq, Hkv, D = shape
    T = 300
    (got, _), (qkv, q_w, k_w, pos, spec, slots) = _both(T, shape, BF, device)
    q_ref, k_ref, v_ref = qk_norm_rope_ref(qkv, q_w, k_w, EPS, pos, spec, Hq, Hkv)
    assert rel_err(got[0], q_ref) <= BOUND
    assert rel_err(got[1].view(-1, Hkv, D)[slots], k_ref) <= BOUND
    assert torch.equal(got[2].view(-1, Hkv, D)[slots].double(), v_ref)


def test_empty_batch(device):
    Hq, Hkv, D = SHAPES["tiny-H4-2-D24"]
    kc, vc = allocate_kv_cache(1, Hkv, D, device=device)
    e = torch.empty(0, dtype=torch.int64, device=device)
    q = qk_norm_rope_kv(torch.empty(0, (Hq + 2 * Hkv) * D, dtype=BF, device=device), torch.ones(D, dtype=BF, device=device),
                        torch.ones(D, dtype=BF, device=device), EPS, e, RopeSpec(D, 1e4, 64), kc, vc, e, Hq, Hkv)
    assert q.shape == (0, Hq, D) and kc.count_nonzero() == 0


def _good_args():
    Hq, Hkv, D = SHAPES["tiny-H4-2-D24"]
    qkv, q_w, k_w, pos = _inputs(5, (Hq, Hkv, D), BF, torch.device("cpu"))
    kc, vc = allocate_kv_cache(2, Hkv, D)
    return dict(qkv=qkv, q_w=q_w, k_w=k_w, eps=EPS, positions=pos % 64, spec=RopeSpec(D, 1e4, 64), k_cache=kc,
                v_cache=vc, slot_mapping=torch.tensor([0, 1, 2, -1, 70]), num_heads=Hq, num_kv_heads=Hkv)


_D = SHAPES["tiny-H4-2-D24"][2]
BAD = {
    "qkv-width": (lambda a: dict(num_heads=3), ValueError, "qkv: width"),
    "qkv-dtype": (lambda a: dict(qkv=a["qkv"].to(torch.int32)), TypeError, "qkv has dtype int32"),
    "qkv-col-stride": (lambda a: dict(qkv=a["qkv"].t().contiguous().t()), ValueError, "unit column stride"),
    "weight-dtype": (lambda a: dict(q_w=a["q_w"].float()), TypeError, "q_w has dtype float32"),
    "k_w-length": (lambda a: dict(k_w=a["k_w"][:-2]), ValueError, "k_w: length"),
    "head-dim-odd": (lambda a: dict(q_w=a["q_w"][:-1], k_w=a["k_w"][:-1]), ValueError, "must be even"),
    "head-dim-wide": (lambda a: dict(q_w=torch.ones(512, dtype=BF), k_w=torch.ones(512, dtype=BF)), ValueError,
                      "at most 256"),
    "cache-dtype": (lambda a: dict(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), TypeError, "never casts"),
    "cache-heads": (lambda a: dict(k_cache=torch.zeros(2, PAGE_SIZE, 1, _D, dtype=BF),
                                   v_cache=torch.zeros(2, PAGE_SIZE, 1, _D, dtype=BF)), ValueError, r"qkv rows are \(Hkv, D\)"),
    "slot-past-cache": (lambda a: dict(slot_mapping=torch.tensor([0, 1, 2, 3, 128])), ValueError, "past the cache"),
    "duplicate-slot": (lambda a: dict(slot_mapping=torch.tensor([0, 1, 2, 2, 5])), ValueError, "same slot twice"),
    "slot-count": (lambda a: dict(slot_mapping=torch.tensor([0, 1])), ValueError, "2 entries for 5 tokens"),
    "positions-length": (lambda a: dict(positions=a["positions"][:3]), ValueError, "positions: length"),
    "position-past-table": (lambda a: dict(positions=a["positions"] + 64), ValueError, "past the RoPE table"),
    "eps": (lambda a: dict(eps=float("nan")), ValueError, "eps must be"),
    "heads-int": (lambda a: dict(num_kv_heads=2.0), ValueError, "num_kv_heads must be a positive int"),
    "spec-type": (lambda a: dict(spec={"rotary_dim": _D}), TypeError, "spec must be a RopeSpec"),
    "spec-interleaved": (lambda a: dict(spec=RopeSpec(_D, 1e4, 64, pairing="interleaved")), NotImplementedError,
                         "'half' pairing"),
    "spec-partial": (lambda a: dict(spec=RopeSpec(8, 1e4, 64)), NotImplementedError, "rotary_dim=8"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input(case):
    change, exc, match = BAD[case]
    args = _good_args()
    with pytest.raises(exc, match=match):
        qk_norm_rope_kv(**{**args, **change(args)})


def test_good_input_passes_the_checks():
    args = _good_args()
    q = qk_norm_rope_kv(**args)
    assert q.shape == (5, 4, _D)
    assert bitwise_equal(q, qk_norm_rope_kv_fwd(**{**args, "k_cache": args["k_cache"].clone(),
                                                   "v_cache": args["v_cache"].clone()}))


# ---------------------------------------------------------------- the Triton source, interpreted on the CPU


_INTERPRETED = """
import torch
from alignzoo.common.kv_cache import allocate_kv_cache
from alignzoo.common.kv_cache.kernel import write_kv_triton
from alignzoo.common.qk_norm_rope.cpu import qk_norm_rope_kv_cpu
from alignzoo.common.qk_norm_rope.kernel import qk_norm_rope_kv_triton
from alignzoo.common.rmsnorm.kernel import rmsnorm_fwd_triton
from alignzoo.common.rope import RopeSpec, rope_table
from alignzoo.common.rope.kernel import rope_rotate_triton

ROT = dict(rot_offset=0, in_interleaved=False, out_interleaved=False, negate_sin=False)


def unfused_kernels(qkv, q_w, k_w, pos, cos, sin, kc, vc, slots, Hq, Hkv):
    T, D = qkv.shape[0], q_w.shape[0]
    q, k, v = qkv.split([Hq * D, Hkv * D, Hkv * D], dim=-1)
    q = rmsnorm_fwd_triton(q.reshape(T * Hq, D).contiguous(), q_w, 1e-6)[0].view(T, Hq, D)
    k = rmsnorm_fwd_triton(k.reshape(T * Hkv, D).contiguous(), k_w, 1e-6)[0].view(T, Hkv, D)
    q, k = rope_rotate_triton(q, pos, cos, sin, **ROT), rope_rotate_triton(k, pos, cos, sin, **ROT)
    write_kv_triton(k, v.reshape(T, Hkv, D).contiguous(), kc, vc, slots)
    return q


def bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


g = torch.Generator().manual_seed(0)
for Hq, Hkv, D, T in ((4, 2, 24, 7), (6, 3, 64, 1), (4, 2, 128, 9)):
    cos, sin = rope_table(RopeSpec(D, 1e6, 5000))
    N = (Hq + 2 * Hkv) * D
    pos = torch.cat([torch.arange(T // 2), torch.randint(2000, 5000, (T - T // 2,), generator=g)])
    slots = torch.randperm(3 * 64, generator=g)[:T]
    slots[T // 2] = -1
    for dtype in (torch.float32, torch.bfloat16):
        qkv = (3 * torch.randn(T, N + 8, generator=g)).to(dtype)[:, :N]
        q_w, k_w = ((1 + 0.1 * torch.randn(D, generator=g)).to(dtype) for _ in range(2))
        args = (qkv, q_w, k_w, 1e-6, pos, cos, sin)
        caches = [tuple(c.fill_(float("nan")) for c in allocate_kv_cache(3, Hkv, D, dtype=dtype)) for _ in range(5)]
        outs = [qk_norm_rope_kv_triton(*args, *caches[i], slots, Hq, Hkv, heads_per_program=bh)
                for i, bh in enumerate((None, 1, 4))]
        outs.append(unfused_kernels(qkv, q_w, k_w, pos, cos, sin, *caches[3], slots, Hq, Hkv))
        if dtype == torch.float32:  # the interpreter's bf16 casts are not the GPU's; fp32 ones are
            outs.append(qk_norm_rope_kv_cpu(*args, *caches[4], slots, Hq, Hkv))
        for i, q in enumerate(outs[1:], 1):
            for a, b in zip((q, *caches[i]), (outs[0], *caches[0])):
                assert torch.equal(bits(a), bits(b)), (Hq, Hkv, D, T, dtype, i)
print("ok")
"""


def test_triton_kernel_equals_the_unfused_kernels_interpreted():
    """The fused kernel's source, run by Triton's interpreter on the CPU, gives
    the bits of the unfused Triton kernels (rmsnorm, rope, kv write; bf16 and
    fp32), of itself under other heads per program, and in fp32 of the CPU
    path: at head_dim 24 (padded tree), 64 and 128, T = 1, 7, 9, positions past
    2048, a row-strided qkv and a skipped slot."""
    run_interpreted(_INTERPRETED, expect="ok")


# ---------------------------------------------------------------- CUDA graphs and PDL (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", ["0", "1"])
@pytest.mark.parametrize("T", [1, 7, 64, 300], ids=lambda t: f"T{t}")
def test_gpu_cuda_graph_equals_eager_and_unfused(T, pdl, monkeypatch):
    """Captured in a CUDA graph and replayed (as decode runs), with PDL off and
    on (on for launches of <= 64 tokens): the fused launch writes the bytes of
    its eager run and of the unfused kernels, eager and graphed."""
    monkeypatch.setenv("ALIGNZOO_PDL", pdl)
    dev = torch.device("cuda")
    shape = SHAPES["8b-H32-8-D128"]
    Hq, Hkv, D = shape
    qkv, q_w, k_w, pos = _inputs(T, shape, BF, dev, pad_cols=16)
    spec = RopeSpec(D, 1e6, MAXP)
    pages = T // PAGE_SIZE + 3
    slots = _slots(T, pages, dev, skip=(T - 1,) if T > 1 else ())
    outs = {}
    for name, fn in (("fused", qk_norm_rope_kv_fwd), ("unfused", unfused)):
        kc, vc = _nan_cache(pages, Hkv, D, BF, dev)
        q = fn(qkv, q_w, k_w, EPS, pos, spec, kc, vc, slots, Hq, Hkv)  # eager (and warm-up)
        gkc, gvc = _nan_cache(pages, Hkv, D, BF, dev)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gq = fn(qkv, q_w, k_w, EPS, pos, spec, gkc, gvc, slots, Hq, Hkv)
        graph.replay()
        torch.cuda.synchronize()
        outs[name] = (q, kc, vc)
        outs[name + " graph"] = (gq, gkc, gvc)
    for name, got in outs.items():
        for a, b in zip(got, outs["unfused"]):
            assert bitwise_equal(a, b), name
