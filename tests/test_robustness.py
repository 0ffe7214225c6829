"""Bad input gets a clear error, loses nothing, and the server keeps serving.

One test group per class of the adversarial sweep (issue 20): a request whose
step fails is dropped alone (the others' bits unchanged, no page kept);
non-finite weights never reach the server (checkpoint load, sync); sync
verifies before it writes and recovers by itself; SamplingParams refuses what
the trainer could not replay; configs are validated; ``score`` beside streamed
generation waits for pages instead of failing.  All on the tiny qwen3 pair.
"""
from __future__ import annotations

import json

import pytest
import torch
from interpreted import run_interpreted
from model_cases import assert_same
from safetensors.torch import load_file, save_file

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.engine import Engine
from alignzoo.sync import EndStateMismatch, NonFiniteWeights, Publisher, Receiver
from alignzoo.sync.checksum import checksums_and_nonfinite, tensor_checksum
from alignzoo.weights import CheckpointError

SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, max_new_tokens=8, seed=11),
      SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=12, seed=12),
      SamplingParams(temperature=0.0, max_new_tokens=6)]


@pytest.fixture(scope="module")
def pair():
    pair = alignzoo.load_pair("qwen3", config="tiny", device="cpu", num_pages=32, freeze_gc=False)
    with torch.no_grad():  # sharper distributions than the 0.02 init: the transforms bite
        for p in pair.trainer.parameters():
            if p.dim() > 1:
                p.mul_(3.0)
    pair.sync()
    return pair


def prompts_of(lens, seed=0, vocab=151):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


PROMPTS = prompts_of([5, 70, 33])


def engine(pair, **kw) -> Engine:
    return Engine(pair.server.model, **{"num_pages": 16, "freeze_gc": False, **kw})


@pytest.fixture(scope="module")
def refs(pair):
    """Each good request alone in a fresh engine."""
    return [engine(pair).generate([p], sp)[0] for p, sp in zip(PROMPTS, SP)]


def broken(sp: SamplingParams, **fields) -> SamplingParams:
    """``sp`` with fields past its checks: a request whose step raises inside the engine."""
    for k, v in fields.items():
        object.__setattr__(sp, k, v)
    return sp


def snapshot(weights):
    return {n: t.clone() for n, t in weights.items()}


def same(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)


# ------------------------------------------------ 1. one bad request never poisons the engine
@pytest.mark.parametrize("kw,match", [
    ({"top_k": 2**70}, "top_k .*fit in int64"),
    ({"max_new_tokens": 2**63}, "max_new_tokens .*fit in int64"),
    ({"stop_token_ids": (3, 2**63)}, "stop_token_ids .*fit in int64"),
    ({"stop_token_ids": 5}, "stop_token_ids must be a sequence"),
], ids=["top_k", "max_new_tokens", "stop_token_ids", "stop_not_a_sequence"])
def test_sampling_params_refuse_what_int64_cannot_hold(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kw)


@pytest.mark.parametrize("overlap", [False, True], ids=["read_every_step", "overlap"])
def test_a_request_whose_step_fails_is_dropped_alone(pair, refs, overlap):
    eng = engine(pair, overlap=overlap)
    bad = broken(SamplingParams(max_new_tokens=6), top_k=2**70)  # params_to_tensors overflows at every step
    outs = eng.generate([PROMPTS[0], [7, 8, 9], PROMPTS[1], PROMPTS[2]], [SP[0], bad, SP[1], SP[2]])
    assert outs[1].finish_reason == "error" and "Overflow" in outs[1].error, outs[1].error
    for got, want in zip(outs[:1] + outs[2:], refs):
        assert_same(got, want)
    assert eng.block_manager.num_free == eng.num_pages and not eng.has_unfinished()
    for got, want in zip(eng.generate(PROMPTS, SP), refs):  # and the engine keeps serving
        assert_same(got, want)


@pytest.mark.parametrize("overlap", [False, True], ids=["read_every_step", "overlap"])
def test_a_request_failing_mid_decode_is_dropped_alone(pair, refs, overlap):
    """Streamed: a request goes bad after its prefill, so its decode step fails
    (with overlap, the step launched ahead fails); the others keep their bits."""
    eng = engine(pair, overlap=overlap)
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, SP)]
    sick = SamplingParams(max_new_tokens=10, seed=3)
    bad_id = eng.add_request([4, 5, 6], sick)
    done = eng.step() + eng.step() + eng.step()
    broken(sick, top_k=2**70)
    while eng.has_unfinished():
        done += eng.step()
    by_id = {c.request_id: c for c in done}
    assert sorted(by_id) == sorted(ids + [bad_id])
    assert by_id[bad_id].finish_reason == "error" and 1 <= len(by_id[bad_id].tokens) < 10
    assert "Overflow" in by_id[bad_id].error
    for rid, want in zip(ids, refs):
        assert_same(by_id[rid], want)
    assert eng.block_manager.num_free == eng.num_pages


@pytest.mark.parametrize("overlap", [False, True], ids=["read_every_step", "overlap"])
def test_a_step_whose_read_fails_runs_again_alone(pair, refs, overlap):
    """Reading a step's tokens fails (as a device fault would surface) once a
    request is sick: the step's chunks run again one by one (with overlap, the
    step launched from its device tokens too), and only the sick one is dropped."""
    eng = engine(pair, overlap=overlap)
    real, sick = eng.runner.launch, set()

    def launch(chunks, bm, **kw):
        launched = real(chunks, bm, **kw)
        if any(c.seq.id in sick for c in chunks):
            def read():
                raise RuntimeError("device fault")
            launched.read = read
        return launched
    eng.runner.launch = launch
    ids = [eng.add_request(p, sp) for p, sp in zip(PROMPTS, SP)]
    bad_id = eng.add_request([4, 5, 6], SamplingParams(max_new_tokens=10, seed=3))
    done = eng.step() + eng.step() + eng.step()
    sick.add(bad_id)
    while eng.has_unfinished():
        done += eng.step()
    by_id = {c.request_id: c for c in done}
    assert by_id[bad_id].finish_reason == "error" and "device fault" in by_id[bad_id].error
    for rid, want in zip(ids, refs):
        assert_same(by_id[rid], want)
    assert eng.block_manager.num_free == eng.num_pages


POISON = 150


class PoisonedModel:
    """The tiny server, except that a batch holding a sequence starting with
    POISON raises in the forward (a failure no input check foresaw)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, batch, kv_cache):
        if bool(((batch.positions == 0) & (batch.tokens == POISON)).any()):
            raise ValueError("poisoned prompt")
        return self._model.forward(batch, kv_cache)


def test_a_failing_forward_fails_only_its_request(pair, refs):
    eng = Engine(PoisonedModel(pair.server.model), num_pages=16, freeze_gc=False, max_batch_tokens=64)
    outs = eng.generate([PROMPTS[0], [POISON, 3, 4], PROMPTS[1], PROMPTS[2]], [SP[0], SP[1], SP[1], SP[2]])
    assert outs[1].finish_reason == "error" and "poisoned prompt" in outs[1].error and outs[1].tokens == []
    for got, want in zip(outs[:1] + outs[2:], refs):
        assert_same(got, want)
    assert eng.block_manager.num_free == 16 and not eng.has_unfinished()


def test_score_with_bad_input_raises_value_error_and_holds_no_pages(pair, refs):
    eng = engine(pair)
    seqs = [p + r.tokens for p, r in zip(PROMPTS, refs)]
    lens = [len(p) for p in PROMPTS]
    bad = broken(SamplingParams(), top_k=2**70)
    with pytest.raises(ValueError, match="sequence 1: scoring failed: .*Overflow"):
        eng.score(seqs, lens, [SP[0], bad, SP[2]])
    assert eng.block_manager.num_free == 16
    for lp, r in zip(eng.score(seqs, lens, SP), refs):
        assert torch.equal(lp, r.logprobs)


# ------------------------------------------------ 2. non-finite weights never reach a server
@pytest.fixture(scope="module")
def checkpoint(pair, tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    pair.save_pretrained(d)
    return d


def edited_checkpoint(src, dst, edit):
    """A copy of checkpoint ``src`` in ``dst`` with ``edit(tensors, config)`` applied."""
    dst.mkdir()
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    edit(tensors, config)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config))
    return dst


DOWN = "model.layers.1.mlp.down_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"  # a part of our fused qkv


@pytest.mark.parametrize("name,value", [(DOWN, float("nan")), (K_PROJ, float("inf"))], ids=["nan", "inf_fused"])
def test_checkpoint_with_nan_or_inf_is_refused_naming_the_tensor(checkpoint, tmp_path, name, value):
    def edit(t, _):
        t[name][3, 5] = value
    d = edited_checkpoint(checkpoint, tmp_path / "bad", edit)
    with pytest.raises(CheckpointError, match=rf"{name} holds 1 NaN/Inf value"):
        alignzoo.load_pair("qwen3", checkpoint=d, device="cpu", num_pages=4, freeze_gc=False)


@pytest.mark.parametrize("value", [float("nan"), float("-inf")], ids=["nan", "-inf"])
def test_sync_refuses_non_finite_trainer_weights_and_the_server_keeps_serving(pair, value):
    sp = SamplingParams(temperature=0.7, max_new_tokens=8, seed=5)
    before = pair.server.generate(PROMPTS, sp)
    version, weights = pair.server.weight_version, snapshot(pair.server.model.weights)
    p = dict(pair.trainer.named_parameters())["layers.1.o.weight"]
    keep = p.detach().clone()
    with torch.no_grad():
        p[3, 4] = value
    with pytest.raises(NonFiniteWeights, match=r"'layers\.1\.o\.weight' \(1\).*the server keeps v"):
        pair.sync()
    assert pair.server.weight_version == version and same(pair.server.model.weights, weights)
    for got, want in zip(pair.server.generate(PROMPTS, sp), before):
        assert_same(got, want)
    with torch.no_grad():
        p.copy_(keep)
    assert pair.sync() == version + 1 and pair.weights_match()
    assert pair.last_sync.blocks_changed == 0  # the refused publish left the publisher as it was


def test_receiver_refuses_a_non_finite_payload():
    """Whatever the publisher: a receiver with check_finite writes nothing of a NaN payload."""
    w = {"a": torch.randn(130, 7).bfloat16(), "b": torch.randn(5)}
    server = {n: torch.zeros_like(t) for n, t in w.items()}
    pub, rx = Publisher(lambda: w), Receiver(server, check_finite=True)
    rx.apply(pub.publish())
    w["a"][129, 6] = float("inf")
    w["b"][0] = float("nan")
    kept = snapshot(server)
    with pytest.raises(NonFiniteWeights, match=r"'a' \(1\), 'b' \(1\); nothing was written, the server keeps v1"):
        rx.apply(pub.publish())
    assert same(server, kept) and rx.version == 1


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2]


def test_checksum_counts_nan_and_inf_on_the_way():
    """Every byte pattern of each float dtype, at odd sizes and offsets: the
    count equals torch.isfinite's and the checksum is tensor_checksum's."""
    g = torch.Generator().manual_seed(0)
    for dt in DTYPES:
        size = torch.empty(0, dtype=dt).element_size()
        raw = torch.randint(0, 256, (4099 * size,), dtype=torch.uint8, generator=g)
        for t in (raw.view(dt), raw.view(dt)[1:], raw.view(dt)[: 7]):
            ((cs, bad),) = checksums_and_nonfinite([t])
            want = int((~torch.isfinite(t.float() if size == 1 else t)).sum())
            assert bad == want and cs == tensor_checksum(t), dt
    assert checksums_and_nonfinite([torch.arange(9)]) == [(tensor_checksum(torch.arange(9)), 0)]


def test_checksum_kernel_counts_nan_and_inf_interpreted():
    """The CUDA kernel's source under Triton's interpreter: the same count and checksum as the torch passes."""
    code = ("import torch\nfrom alignzoo.sync import checksum as C\n"
            "g = torch.Generator().manual_seed(1)\n"
            f"for dt in {[str(d) for d in DTYPES]}:\n"
            "    rule = C.nonfinite_rule(getattr(torch, dt.removeprefix('torch.')))\n"
            "    for n in (1, 4095, 4096, 9001):\n"
            "        w = torch.randint(-2**31, 2**31 - 1, (2 * n,), dtype=torch.int32, generator=g)\n"
            "        acc, bad = C._word_sums_triton(w, rule)\n"
            "        assert int(acc) == int(C._word_sum_torch(w)), (dt, n)\n"
            "        assert int(bad) == int(C._nonfinite_torch(w, rule)), (dt, n)\n"
            "print('ok')\n")
    run_interpreted(code, expect="ok")


# ------------------------------------------------ 3. sync recovers
def test_sync_after_an_out_of_band_write_writes_nothing_then_recovers(pair):
    ptrs = {n: t.data_ptr() for n, t in pair.server.model.weights.items()}
    version = pair.server.weight_version
    with torch.no_grad():
        dict(pair.trainer.named_parameters())["layers.0.down.weight"][0, :3] += 1
        pair.server.model.weights["norm.weight"][5] += 1  # out of band: the server is no longer its version
    weights = snapshot(pair.server.model.weights)
    with pytest.raises(EndStateMismatch, match="were not v.* before the apply.*nothing was written"):
        pair.sync()
    assert same(pair.server.model.weights, weights) and pair.server.weight_version == version
    assert pair.sync() > version and pair.weights_match()  # the full resync, by itself
    assert pair.last_sync.blocks_changed == pair.last_sync.blocks_total
    pair.server.generate(PROMPTS[:1], SP[0])
    with torch.no_grad():
        dict(pair.trainer.named_parameters())["layers.0.down.weight"][0, :3] -= 1
    pair.sync()
    assert pair.weights_match() and pair.last_sync.blocks_changed == 1  # deltas again
    assert {n: t.data_ptr() for n, t in pair.server.model.weights.items()} == ptrs  # CUDA graphs keep their pointers


def test_a_payload_damaged_past_its_checksums_writes_nothing(pair, monkeypatch):
    """Data altered and its checksums recomputed: only the end state shows it, and it is checked before writing."""
    publish = pair._publisher.publish

    def damaged(**kw):
        p = publish(**kw)
        d = p.tensors["layers.1.gate_up.weight"]
        d.data.view(torch.int16)[0] ^= 1
        d.checksum = d.compute_checksum()
        p.manifest_hash = p.compute_manifest_hash()
        return p
    monkeypatch.setattr(pair._publisher, "publish", damaged)
    with torch.no_grad():
        dict(pair.trainer.named_parameters())["layers.1.gate_up.weight"][0, 0] += 1
    version, weights = pair.server.weight_version, snapshot(pair.server.model.weights)
    with pytest.raises(EndStateMismatch, match=r"its blocks are damaged; nothing was written, the server keeps v"):
        pair.sync()
    assert same(pair.server.model.weights, weights) and pair.server.weight_version == version
    assert pair._receiver.version == version
    monkeypatch.undo()
    assert pair.sync() > version and pair.weights_match()


def test_sync_full_is_public(pair):
    version = pair.sync(full=True)
    assert pair.last_sync.blocks_changed == pair.last_sync.blocks_total and pair.weights_match()
    assert pair.sync() == version + 1 and pair.last_sync.blocks_changed == 0


# ------------------------------------------------ 4. the trainer replays what the server samples
@pytest.mark.parametrize("kw", [{"temperature": 1e300}, {"top_p": 1e-300}, {"temperature": 3.40282357e38}],
                         ids=["t_inf_in_f32", "p_zero_in_f32", "t_past_f32_max"])
def test_sampling_params_refuse_what_float32_turns_bad(kw):
    with pytest.raises(ValueError, match=f"{next(iter(kw))} must be"):
        SamplingParams(**kw)


EDGES = {"temperature": [1e300, 3.40282357e38, 3.4028235e38, 1e-5, 9.9999999e-6, 0.0],
         "top_p": [1e-300, 1e-46, 1e-40, 1.0],
         "min_p": [1e-300, 1e-40, 1.0]}


def test_the_trainer_scores_whatever_the_server_samples(pair):
    """Every edge value SamplingParams accepts is served and replayed by the
    trainer bit for bit; the ones it refuses are the ones the trainer would."""
    sps = []
    for name, values in EDGES.items():
        for v in values:
            try:
                sps.append(SamplingParams(**{name: v}, max_new_tokens=4, seed=len(sps)))
            except ValueError:
                continue
    assert len(sps) == 8  # 1e300, 3.40282357e38, 9.9999999e-6 and top_p 1e-300, 1e-46 refused
    outs = pair.server.generate([PROMPTS[0]] * len(sps), sps)
    with torch.no_grad():
        lps = pair.trainer.logprobs([PROMPTS[0] + o.tokens for o in outs], [len(PROMPTS[0])] * len(sps), sps)
    for o, lp in zip(outs, lps):
        assert o.error is None and torch.equal(lp, o.logprobs)


# ------------------------------------------------ 5. configs are validated
@pytest.mark.parametrize("fields,match", [
    ({"rms_norm_eps": float("inf")}, "rms_norm_eps must be a finite number > 0"),
    ({"rope_theta": float("inf")}, "rope_theta must be a finite number > 0"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be a bool"),
], ids=["eps_inf", "theta_inf", "tie_str"])
def test_config_fields_are_validated(fields, match):
    with pytest.raises(ValueError, match=match):
        alignzoo.load_pair("qwen3", config=fields, device="cpu", num_pages=4, freeze_gc=False)


def test_config_json_is_validated(checkpoint, tmp_path):
    def untie(_, c):
        c["tie_word_embeddings"] = "false"
    d = edited_checkpoint(checkpoint, tmp_path / "tie", untie)
    with pytest.raises(CheckpointError, match=rf"{d / 'config.json'}: .*tie_word_embeddings must be a bool"):
        alignzoo.load_pair("qwen3", checkpoint=d, device="cpu", num_pages=4, freeze_gc=False)

    def no_hidden(_, c):
        del c["hidden_size"]
    d = edited_checkpoint(checkpoint, tmp_path / "hidden", no_hidden)
    with pytest.raises(CheckpointError, match=rf"{d / 'config.json'} lacks hidden_size"):
        alignzoo.load_pair("qwen3", checkpoint=d, device="cpu", num_pages=4, freeze_gc=False)


def test_an_integer_weight_is_refused_not_cast(checkpoint, tmp_path):
    def to_int(t, _):
        t[DOWN] = t[DOWN].to(torch.int32)
    d = edited_checkpoint(checkpoint, tmp_path / "int", to_int)
    with pytest.raises(CheckpointError, match=rf"not stored as floating point.*{DOWN}"):
        alignzoo.load_pair("qwen3", checkpoint=d, device="cpu", num_pages=4, freeze_gc=False)


@pytest.mark.parametrize("kw,match", [
    ({"kv_cache_bytes": -1}, "kv_cache_bytes must be an int of at least one page of every cache pool"),
    ({"kv_cache_bytes": 0}, "kv_cache_bytes must be an int of at least one page of every cache pool"),
    ({"seed": 2**64}, "seed must be an int that fits in int64"),
], ids=["kv_negative", "kv_zero", "seed"])
def test_load_pair_arguments_are_validated(kw, match):
    with pytest.raises(ValueError, match=match):
        alignzoo.load_pair("qwen3", config="tiny", device="cpu", freeze_gc=False, **kw)


# ------------------------------------------------ 7. score beside streamed generation
def test_score_waits_for_pages_held_by_streamed_generation(pair):
    long = prompts_of([130, 100])
    sps = [SamplingParams(temperature=0.8, max_new_tokens=12, seed=s) for s in (1, 2)]
    alone = [engine(pair, num_pages=6).generate([p], sp)[0] for p, sp in zip(long, sps)]
    seqs = [p + o.tokens for p, o in zip(long, alone)][::-1]
    lens = [len(p) for p in long][::-1]
    want = engine(pair, num_pages=6).score(seqs, lens, sps[::-1])

    eng = engine(pair, num_pages=6)
    ids = [eng.add_request(p, sp) for p, sp in zip(long, sps)]
    done = eng.step() + eng.step()  # the two requests hold 5 of the 6 pages
    assert eng.block_manager.num_free == 1
    for got, w in zip(eng.score(seqs, lens, sps[::-1]), want):  # the longer needs 3 pages
        assert torch.equal(got, w)
    preempted = eng.num_preemptions
    assert preempted >= 1
    with pytest.raises(ValueError, match=r"sequence 0: the request needs 7 pages of the 'kv' cache .* which has 6"):
        eng.score([list(range(1, 101)) * 4 + [1]], [1], sps[0])
    assert eng.num_preemptions == preempted  # refused up front
    while eng.has_unfinished():
        done += eng.step()
    by_id = {c.request_id: c for c in done}
    for rid, a in zip(ids, alone):  # nothing lost, the same bits
        assert_same(by_id[rid], a)
    assert eng.block_manager.num_free == 6
