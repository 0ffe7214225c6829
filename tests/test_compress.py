"""DeepSeek-V4's KV compressors (C4 with overlap, C128 without): the trainer's packed rows, the
server's rows built in one prefill, in chunks split at every offset of a group and token by token
have the same bits, in any batch; accuracy against float64 and transformers' HCA, CSA and indexer
compressors (stateless and across calls with their caches); gradients against float64 autograd;
bad input named.

transformers' rows are matched to a few fp32 ulps (rel. error ~8e-8), not bitwise: ATen's CPU softmax
takes exp from its own vectorized exp, not torch.exp's MKL VML (a 2-slot softmax already differs in 140
of 4000 values), and its window sum's order depends on the shape (a single (1, 8, 40) window differs from
left to right in 6 of 40 channels).  Only the row positions and the -inf / zero padding are exact."""
from __future__ import annotations

import random
import types

import pytest
import torch

from alignzoo.common.compress import (compress, compress_ref, compress_state_fields, compress_step, group_ends,
                                      ring_len, visible_rows)
from alignzoo.common.kv_cache.pools import StatePool
from alignzoo.common.ladder import rel_err
from alignzoo.common.rmsnorm import rmsnorm
from alignzoo.common.rope import RopeSpec, rope

CASES = [(4, True, 20), (4, False, 24), (8, False, 40), (8, True, 12)]  # (rate, overlap, D); 8 stands in for 128
CASE_IDS = ["c4_overlap_D20", "c4_D24", "c8_D40", "c8_overlap_D12"]


def _inputs(lens, rate, overlap, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    C = 2 * D if overlap else D
    T = sum(lens)
    kv = torch.randn(T, C, generator=g).to(dtype)
    gate = (2 * torch.randn(T, C, generator=g)).to(dtype)
    pb = torch.randn(rate, C, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return kv, gate, pb, cu


def _serve(kv, gate, pb, cu, chunks, rate, overlap, *, every, seed=0):
    """Feed each sequence to compress_step in calls (chunks[i]: its chunk sizes; call k takes chunk k
    of every sequence, 0 once it has run out), in shuffled NaN-filled slots, beside a padding sequence
    (slot -1).  Returns each sequence's rows in order (n_i, D)."""
    rng = random.Random(seed)
    N = len(chunks)
    C = kv.shape[1]
    D = C // (2 if overlap else 1)
    fields = compress_state_fields(rate, C, overlap=overlap, dtype=kv.dtype)
    S = N + 2
    dev = kv.device
    state = StatePool(fields, layers=1).allocate(S, dev)[0]
    for t in state.values():
        t.fill_(float("nan"))
    slot_of = rng.sample(range(S), N)
    lens = (cu[1:] - cu[:-1]).tolist()
    done = [0] * N
    rows = [[None] * (lens[i] // rate) for i in range(N)]
    for k in range(max(len(c) for c in chunks)):
        take = [c[k] if k < len(c) else 0 for c in chunks]
        order = list(range(N))
        rng.shuffle(order)
        parts_kv, parts_g, n_tok, starts, slots = [], [], [], [], []
        for i in order:
            s = int(cu[i]) + done[i]
            parts_kv.append(kv[s : s + take[i]])
            parts_g.append(gate[s : s + take[i]])
            n_tok.append(take[i])
            starts.append(done[i])
            slots.append(slot_of[i])
        pad_kv = torch.randn(1, C).to(device=dev, dtype=kv.dtype)  # slot -1: reads slot 0 as if at 0, writes nothing
        parts_kv.append(pad_kv), parts_g.append(pad_kv), n_tok.append(1), starts.append(0), slots.append(-1)
        ck = torch.cat(parts_kv)
        cg = torch.cat(parts_g)
        ccu = torch.tensor([0, *torch.tensor(n_tok).cumsum(0).tolist()], dtype=torch.int32, device=dev)
        st = torch.tensor(starts, device=dev)
        sl = torch.tensor(slots, dtype=torch.int32, device=dev)
        if every:
            out = compress_step(ck, cg, pb, ccu, st, sl, state, rate=rate, overlap=overlap)
            assert out.shape == (ck.shape[0], D)
            for b, i in enumerate(order):
                for t in range(n_tok[b]):
                    p = starts[b] + t
                    r = out[int(ccu[b]) + t]
                    if (p + 1) % rate == 0:
                        rows[i][(p + 1) // rate - 1] = r
                    else:
                        assert not r.any()
        else:
            at, pos, cu_rows = group_ends(ccu, rate, st)
            out = compress_step(ck, cg, pb, ccu, st, sl, state, rate=rate, overlap=overlap, at=at)
            for b, i in enumerate(order):
                for g in range(int(cu_rows[b]), int(cu_rows[b + 1])):
                    rows[i][int(pos[g]) // rate] = out[g]
        for b, i in enumerate(order):
            done[i] += n_tok[b]
    return [torch.stack(r) if r else kv.new_zeros(0, D) for r in rows]


def _split(rows, cu_rows):
    return [rows[int(a) : int(b)] for a, b in zip(cu_rows[:-1], cu_rows[1:])]


@pytest.mark.parametrize("every", [True, False], ids=["every_token", "closed_groups"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rate,overlap,D", CASES, ids=CASE_IDS)
def test_server_rows_equal_trainer_rows(rate, overlap, D, dtype, every):
    S = ring_len(rate, overlap)
    L = 3 * rate + 3
    # sequence o is split once at offset o of its second group (o = 0..S: every offset of a window)
    lens = [L + (o % 3) for o in range(S + 1)] + [rate - 1, 2 * rate]
    kv, gate, pb, cu = _inputs(lens, rate, overlap, D, dtype)
    rows, positions, cu_rows = compress(kv, gate, pb, cu, rate=rate, overlap=overlap)
    want = _split(rows, cu_rows)
    assert [len(w) for w in want] == [n // rate for n in lens]
    assert torch.equal(positions, torch.cat([torch.arange(n // rate) * rate for n in lens]))
    rng = random.Random(1)
    random_chunks = []
    for n in lens:
        c = []
        while sum(c) < n:
            c.append(min(rng.choice([0, 1, 2, rate - 1, rate + 1, 2 * rate + 1]), n - sum(c)))
        random_chunks.append(c)
    schedules = {
        "one_prefill": [[n] for n in lens],
        "split_at_every_offset": [[rate + o, n - rate - o] for o, n in enumerate(lens[: S + 1])]
                                 + [[n] for n in lens[S + 1 :]],
        "token_by_token": [[1] * n for n in lens],
        "random_chunks": random_chunks,
    }
    for name, chunks in schedules.items():
        got = _serve(kv, gate, pb, cu, chunks, rate, overlap, every=every)
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.equal(g, w), f"{name}: sequence {i}"


@pytest.mark.parametrize("rate,overlap,D", CASES[:3], ids=CASE_IDS[:3])
def test_rows_do_not_depend_on_the_batch(rate, overlap, D):
    lens = [37, 5, 64, 1, 23]
    kv, gate, pb, cu = _inputs(lens, rate, overlap, D)
    rows, _, cu_rows = compress(kv, gate, pb, cu, rate=rate, overlap=overlap)
    for i, w in enumerate(_split(rows, cu_rows)):
        s, e = int(cu[i]), int(cu[i + 1])
        alone, _, _ = compress(kv[s:e], gate[s:e], pb, torch.tensor([0, e - s]), rate=rate, overlap=overlap)
        assert torch.equal(alone, w)
    perm = [3, 0, 4, 2, 1]
    pk = torch.cat([kv[int(cu[i]) : int(cu[i + 1])] for i in perm])
    pg = torch.cat([gate[int(cu[i]) : int(cu[i + 1])] for i in perm])
    pcu = torch.tensor([0, *torch.tensor([lens[i] for i in perm]).cumsum(0).tolist()])
    prow, _, pcr = compress(pk, pg, pb, pcu, rate=rate, overlap=overlap)
    got = dict(zip(perm, _split(prow, pcr)))
    for i, w in enumerate(_split(rows, cu_rows)):
        assert torch.equal(got[i], w)


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rate,overlap,D", CASES, ids=CASE_IDS)
def test_rows_match_float64(rate, overlap, D, dtype, bound):
    kv, gate, pb, cu = _inputs([63, 8, 41], rate, overlap, D, dtype)
    rows, positions, _ = compress(kv, gate, pb, cu, rate=rate, overlap=overlap)
    ref, ref_pos = compress_ref(kv, gate, pb, cu, rate=rate, overlap=overlap)
    assert rows.dtype == dtype and torch.equal(positions, ref_pos)
    assert rel_err(rows, ref) < bound


@pytest.mark.parametrize("rate,overlap,D", CASES[:3], ids=CASE_IDS[:3])
def test_gradients_match_float64_autograd(rate, overlap, D):
    kv, gate, pb, cu = _inputs([29, 3, 18], rate, overlap, D)
    leaves = [t.clone().requires_grad_() for t in (kv, gate, pb)]
    rows, _, _ = compress(*leaves, cu, rate=rate, overlap=overlap)
    dy = torch.randn(rows.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(rows, leaves, dy)
    ref_leaves = [t.double().requires_grad_() for t in (kv, gate, pb)]
    ref, _ = compress_ref(*ref_leaves, cu, rate=rate, overlap=overlap)
    want = torch.autograd.grad(ref, ref_leaves, dy.double())
    for name, g, w in zip(("kv", "gate", "position_bias"), got, want):
        assert g.dtype == torch.float32 and rel_err(g, w) < 2e-6, name


def test_rate_128_short():
    lens = [300, 129]
    kv, gate, pb, cu = _inputs(lens, 128, False, 8, seed=5)
    rows, positions, cu_rows = compress(kv, gate, pb, cu, rate=128, overlap=False)
    assert positions.tolist() == [0, 128, 0]
    assert rel_err(rows, compress_ref(kv, gate, pb, cu, rate=128, overlap=False)[0]) < 2e-6
    got = _serve(kv, gate, pb, cu, [[127, 2, 100, 71], [1, 128]], 128, False, every=True)
    for g, w in zip(got, _split(rows, cu_rows)):
        assert torch.equal(g, w)


def test_visible_rows_is_transformers_block_bias_rule():
    rate = 4
    p = torch.arange(20)
    vis = visible_rows(p, rate)
    entries = torch.arange(5)
    hf_mask = entries[None, :] >= ((p + 1) // rate)[:, None]  # transformers' -inf entries
    assert torch.equal(entries[None, :] < vis[:, None], ~hf_mask)


# ------------------------------------------------------------------ transformers parity

def _hf(rates=(4, 8)):
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = DeepseekV4Config(
        hidden_size=16, head_dim=24, qk_rope_head_dim=8, index_head_dim=40, index_n_heads=2, q_lora_rank=8,
        num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
        compress_rates={"compressed_sparse_attention": rates[0], "heavily_compressed_attention": rates[1]},
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                         "beta_fast": 32, "beta_slow": 1},
    )
    torch.manual_seed(0)
    hca, csa = m.DeepseekV4HCACompressor(cfg), m.DeepseekV4CSACompressor(cfg)
    with torch.no_grad():
        for mod in (hca, csa):
            for name, p in mod.named_parameters():
                p.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.5)
    return m, cfg, hca, csa


def _ours(comp, hidden, rate, overlap, spec):
    """Our rows for one module (kv_proj/gate_proj run by transformers' Linear: the same kv bits),
    then kv_norm and the compress RoPE with the project's ops -> (B, n, D)."""
    B, T, _ = hidden.shape
    kv = comp.kv_proj(hidden).reshape(B * T, -1)
    gate = comp.gate_proj(hidden).reshape(B * T, -1)
    cu = torch.arange(B + 1) * T
    rows, positions, _ = compress(kv, gate, comp.position_bias, cu, rate=rate, overlap=overlap)
    rows = rmsnorm(rows, comp.kv_norm.weight, comp.kv_norm.variance_epsilon)
    rows = rope(rows[:, None, :].contiguous(), positions, spec)[:, 0]
    return rows.view(B, T // rate, -1)


@torch.no_grad()
def test_matches_transformers_compressors_stateless_and_cached():
    m, cfg, hca, csa = _hf()
    spec = RopeSpec.from_hf(cfg, rope_key="compress", max_position=4096)
    assert spec.yarn is not None
    B, T = 2, 37
    hidden = torch.randn(B, T, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    q_res = torch.randn(B, T, cfg.q_lora_rank, generator=torch.Generator().manual_seed(2))
    captured = []
    scorer = csa.indexer.scorer
    orig = scorer.forward
    scorer.forward = lambda q, ckv, h: (captured.append(ckv), orig(q, ckv, h))[1]

    def run(mod, cache, s, e):
        pos = torch.arange(s, e)[None].expand(B, -1)
        out = mod(hidden[:, s:e], q_res[:, s:e], pos, cache, 0)[0]
        return out[:, 0]

    want_hca = _ours(hca, hidden, 8, False, spec)
    want_csa = _ours(csa, hidden, 4, True, spec)
    want_idx = _ours(csa.indexer, hidden, 4, True, spec)
    # stateless: every complete window of the whole sequence
    for got, want in ((run(hca, None, 0, T), want_hca), (run(csa, None, 0, T), want_csa), (captured[-1], want_idx)):
        assert got.shape == want.shape and rel_err(got, want) < 4e-7
    # their caches across calls split inside groups: the same rows
    hc = types.SimpleNamespace(layers=[m.DeepseekV4HCACache(cfg)])
    cc = types.SimpleNamespace(layers=[m.DeepseekV4CSACache(cfg)])
    cuts = [0, 5, 6, 19, 30, T]
    for s, e in zip(cuts[:-1], cuts[1:]):
        got_hca, got_csa = run(hca, hc, s, e), run(csa, cc, s, e)
    for got, want in ((got_hca, want_hca), (got_csa, want_csa), (captured[-1], want_idx)):
        assert got.shape == want.shape and rel_err(got, want) < 4e-7


@torch.no_grad()
def test_matches_transformers_hca_at_rate_128():
    m, cfg, hca, _ = _hf(rates=(4, 128))
    spec = RopeSpec.from_hf(cfg, rope_key="compress", max_position=4096)
    hidden = torch.randn(1, 260, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    got = hca(hidden, None, torch.arange(260)[None], None, 0)[0][:, 0]
    want = _ours(hca, hidden[:, :256], 128, False, spec)
    assert got.shape == want.shape and rel_err(got, want) < 4e-7


# ------------------------------------------------------------------ bad input

def test_bad_input_is_named():
    kv, gate, pb, cu = _inputs([9, 4], 4, True, 6)
    kw = dict(rate=4, overlap=True)
    with pytest.raises(ValueError, match="rate"):
        compress(kv, gate, pb, cu, rate=0, overlap=True)
    with pytest.raises(ValueError, match="even"):
        compress(kv[:, :11].contiguous(), gate[:, :11].contiguous(), pb[:, :11].contiguous(), cu, **kw)
    with pytest.raises(ValueError, match="gate"):
        compress(kv, gate[:, :6], pb, cu, **kw)
    with pytest.raises(ValueError, match="position_bias"):
        compress(kv, gate, pb[:3], cu, **kw)
    with pytest.raises(TypeError, match="position_bias"):
        compress(kv, gate, pb.double(), cu, **kw)
    with pytest.raises(ValueError, match="cu_seqlens"):
        compress(kv, gate, pb, torch.tensor([0, 9, 12]), **kw)
    state = StatePool(compress_state_fields(4, 12, overlap=True, dtype=torch.float32), layers=1).allocate(3, "cpu")[0]
    st, sl = torch.zeros(2, dtype=torch.long), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="ring_gate"):
        compress_step(kv, gate, pb, cu, st, sl, {"ring_kv": state["ring_kv"]}, **kw)
    with pytest.raises(ValueError, match="ring_kv"):
        compress_step(kv, gate, pb, cu, st, sl, {**state, "ring_kv": state["ring_kv"][:, :4]}, **kw)
    with pytest.raises(ValueError, match="slots"):
        compress_step(kv, gate, pb, cu, st, sl[:1], state, **kw)


# ------------------------------------------------------------------ the Triton kernel

_INTERPRETED_ROWS = r"""
import torch
from alignzoo.common.compress import compress_state_fields, compress_step, group_ends
from alignzoo.common.compress.cpu import compress_rows_cpu
from alignzoo.common.compress.kernel import compress_rows_triton

for rate, overlap, D, dtype, block_d in [(4, True, 12, torch.bfloat16, 8), (8, False, 20, torch.float32, None)]:
    g = torch.Generator().manual_seed(rate + D)
    C = 2 * D if overlap else D
    lens = [2 * rate + 1, rate - 1, 2 * rate]
    T = sum(lens)
    kv = torch.randn(T, C, generator=g).to(dtype)
    gate = (2 * torch.randn(T, C, generator=g)).to(dtype)
    pb = torch.randn(rate, C, generator=g)
    cu = torch.tensor([0, 2 * rate + 1, 3 * rate, T])
    kw = dict(rate=rate, overlap=overlap)
    at = group_ends(cu, rate)[0]
    want = compress_rows_cpu(kv, gate, pb, cu, at, **kw)
    assert torch.equal(compress_rows_triton(kv, gate, pb, cu, at, block_d=block_d, **kw), want), "trainer rows"
    # the server: the first part of each sequence fills shuffled NaN slots, the rest reads them
    (B, _), = set(s for s, _ in compress_state_fields(rate, C, overlap=overlap, dtype=dtype).values())
    state = {n: torch.full((5, B, C), float("nan"), dtype=dtype) for n in ("ring_kv", "ring_gate")}
    slots = torch.tensor([3, 0, 4])
    cut = [rate + 1, 1, rate - 1]
    part = lambda x, a, b: torch.cat([x[int(cu[i]) + a[i] : int(cu[i]) + b[i]] for i in range(3)])
    zero, ends = [0, 0, 0], [int(cu[i + 1] - cu[i]) for i in range(3)]
    compress_step(part(kv, zero, cut), part(gate, zero, cut), pb, torch.tensor([0, *torch.tensor(cut).cumsum(0)]),
                  torch.zeros(3, dtype=torch.long), slots, state, **kw)
    rest = [e - c for e, c in zip(ends, cut)]
    ck, cg = part(kv, cut, ends), part(gate, cut, ends)
    ccu = torch.tensor([0, *torch.tensor(rest).cumsum(0)])
    sk = dict(starts=torch.tensor(cut), slots=slots, ring_kv=state["ring_kv"], ring_gate=state["ring_gate"], **kw)
    every = torch.arange(ck.shape[0]) if overlap else torch.arange(0)  # once: interpreting is slow
    for at in (every, group_ends(ccu, rate, torch.tensor(cut))[0]):
        want = compress_rows_cpu(ck, cg, pb, ccu, at, **sk)
        got = compress_rows_triton(ck, cg, pb, ccu, at, block_d=block_d, **sk)
        assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0)), "server rows"
print("ok")
"""


def test_rows_kernel_has_the_cpu_bits_interpreted():
    """The Triton kernel the server and trainer run on CUDA, interpreted on CPU tensors (torch's exp and bf16
    rounding patched in): the CPU path's bits for the trainer's rows and for the server's rows read across a
    shuffled ring, every token and closed groups, fp32 and bf16, one and several channel blocks."""
    from interpreted import TORCH_MATH, run_interpreted

    run_interpreted(TORCH_MATH + _INTERPRETED_ROWS, expect="ok")


@pytest.mark.gpu
@pytest.mark.parametrize("rate,overlap,D", [(4, True, 512), (128, False, 512)], ids=["c4_D512", "c128_D512"])
def test_rows_on_cuda_equal_trainer_server_and_torch_path(rate, overlap, D):
    """On the GPU: the kernel's rows have the bits of the element-wise path run on CUDA tensors, and the server's
    token-by-token rows those of the trainer's."""
    from alignzoo.common.compress.cpu import compress_rows_cpu

    lens = [3 * rate + 1, 2 * rate]
    kv, gate, pb, cu = (t.cuda() for t in _inputs(lens, rate, overlap, D, torch.bfloat16))
    rows, _, cu_rows = compress(kv, gate, pb, cu, rate=rate, overlap=overlap)
    assert torch.equal(rows, compress_rows_cpu(kv, gate, pb, cu, group_ends(cu, rate)[0], rate=rate, overlap=overlap))
    got = _serve(kv, gate, pb, cu, [[1] * n for n in lens], rate, overlap, every=True)
    assert all(torch.equal(g, w) for g, w in zip(got, _split(rows, cu_rows)))


@pytest.mark.gpu
def test_decode_step_replays_in_a_cuda_graph():
    """The server's decode step (at=None) captured once in a CUDA graph and replayed a token a step, finished
    sequences kept as padding (slot -1), gives the trainer's rows: fixed shapes, no host reads."""
    rate, overlap, D = 4, True, 512
    lens = [3 * rate + 1, 2 * rate]
    kv, gate, pb, cu = (t.cuda() for t in _inputs(lens, rate, overlap, D, torch.bfloat16))
    rows, _, cu_rows = compress(kv, gate, pb, cu, rate=rate, overlap=overlap)
    N, C = len(lens), kv.shape[1]
    state = {n: torch.zeros(N, *s, dtype=d, device="cuda")
             for n, (s, d) in compress_state_fields(rate, C, overlap=overlap, dtype=kv.dtype).items()}
    x_kv, x_g = kv.new_zeros(N, C), gate.new_zeros(N, C)
    pos, slots, ccu = (torch.zeros(N, dtype=torch.long, device="cuda"), torch.arange(N, device="cuda"),
                       torch.arange(N + 1, device="cuda"))
    step = lambda: compress_step(x_kv, x_g, pb, ccu, pos, slots, state, rate=rate, overlap=overlap)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernel outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    got = [[] for _ in lens]
    for p in range(max(lens)):
        for i, n in enumerate(lens):
            x_kv[i], x_g[i] = kv[int(cu[i]) + min(p, n - 1)], gate[int(cu[i]) + min(p, n - 1)]
        pos.fill_(p)
        slots.copy_(torch.tensor([i if p < n else -1 for i, n in enumerate(lens)]))
        graph.replay()
        for i, n in enumerate(lens):
            if p < n and (p + 1) % rate == 0:
                got[i].append(out[i].clone())
    for g, w in zip(got, _split(rows, cu_rows)):
        assert torch.equal(torch.stack(g), w)
