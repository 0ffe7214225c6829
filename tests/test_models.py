"""The tests every registered model gets (``alignzoo.models.available_models()``), on its preset
from ``model_cases.py``: recompute after preemption, CUDA-graph decode vs eager, overlapped
decode vs reading every step, the sync after an optimizer step, the checkpoint round trip
(ours and transformers'), ``alignzoo check MODEL``, and a misaligned server caught by the ladder.

Every bitwise promise is a ``torch.equal``; sequences run past several 64-token pages (300
tokens) in mixed batches, with temperature, top-k, top-p and min-p together.
"""
import glob
import json
import os
import re
from dataclasses import replace

import pytest
import torch
from model_cases import assert_same, assert_trainer_matches, case, make_pair, prompts_of, rich

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.engine import Engine
from alignzoo.models import available_models, loading, model_module

MODELS = available_models()


@pytest.fixture(params=MODELS, ids=MODELS)
def name(request) -> str:
    return request.param


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # the ladder at 300 tokens: 6 s on one thread, 48 s on two of a busy 2-core machine (OpenMP spins)
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _spy_launches(eng) -> list[bool]:
    """Record, per launch of the engine's runner, whether it was launched ahead of the previous step's read."""
    seen, real = [], eng.runner.launch

    def spy(chunks, cache, **kw):
        seen.append(kw.get("tokens") is not None)
        return real(chunks, cache, **kw)
    eng.runner.launch = spy
    return seen


def test_preemption_recomputes_the_same_bits(name, device):
    """Requests join mid-decode and a small cache (9 pages; the row's ``preempt_pages``) forces preemption:
    the recomputed requests keep the trainer's bits and those of each request alone in a roomy engine."""
    pair = make_pair(name, device, num_pages=case(name).preempt_pages)
    eng = pair.server
    prompts = prompts_of([200, 90, 130, 31], pair.config.vocab_size, seed=5)
    sps = [SamplingParams(temperature=1.0, top_k=50, top_p=0.95, min_p=0.01, max_new_tokens=70, seed=s)
           for s in range(4)]
    ids, done = [], {}
    for i, (p, sp) in enumerate(zip(prompts, sps)):
        ids.append(eng.add_request(p, sp))
        for _ in range(3 + 5 * i):  # the next request joins mid-decode
            done |= {c.request_id: c for c in eng.step()}
    while eng.has_unfinished():
        done |= {c.request_id: c for c in eng.step()}
    assert eng.num_preemptions > 0
    outs = [done[i] for i in ids]
    assert_trainer_matches(pair, prompts, sps, outs)
    roomy = Engine(eng.model, num_pages=64)
    for i, (p, sp, o) in enumerate(zip(prompts, sps, outs)):
        assert_same(o, roomy.generate([p], sp)[0], f"request {i} alone")


def _late_stop(tokens: list[int]) -> int:
    """A token that first appears at 3/4 of ``tokens`` or later (a stop there, not earlier)."""
    for j in range(3 * len(tokens) // 4, len(tokens)):
        if tokens[j] not in tokens[:j]:
            return tokens[j]
    return tokens[-1]


def test_overlap_on_and_off_give_the_same_bits(name, device):
    """Decode steps launched before the previous step's tokens are read give the bits of an engine
    that reads every step, in a small cache that preempts (6 pages; the row's ``overlap_cache``), with
    chunked prefill beside decode rows and requests that stop on a stop token (riding along in a step
    launched ahead) or run to their length."""
    pages, step_tokens = case(name).overlap_cache
    pair = make_pair(name, device, num_pages=pages, max_batch_tokens=step_tokens)
    prompts = prompts_of([300, 5, 77, 130], pair.config.vocab_size, seed=6)
    plain = rich(4, [40, 60, 50, 60], seed=20)
    first = Engine(pair.server.model, num_pages=64, overlap=False).generate(prompts, plain)
    sps = [replace(sp, stop_token_ids=(_late_stop(o.tokens),)) if i % 2 else sp for i, (sp, o) in enumerate(zip(plain, first))]
    reading = Engine(pair.server.model, num_pages=pages, max_batch_tokens=step_tokens, overlap=False)
    seen = {False: _spy_launches(reading), True: _spy_launches(pair.server)}
    want = reading.generate(prompts, sps)
    got = pair.server.generate(prompts, sps)
    assert not any(seen[False]) and sum(seen[True]) > 10
    assert pair.server.num_preemptions > 0 and reading.num_preemptions > 0
    assert [o.finish_reason for o in got] == ["length", "stop", "length", "stop"]
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, f"request {i}")
    assert_trainer_matches(pair, prompts, sps, got)


@pytest.mark.gpu
@pytest.mark.parametrize("overlap", [False, True], ids=["overlap-off", "overlap-on"])
def test_cuda_graph_decode_matches_eager(name, overlap):
    """The row's GPU preset (random weights) and a long sequence: trainer == server prefill ==
    eager decode == CUDA-graph decode, decode steps launched ahead (``overlap``) or not."""
    c = case(name)
    if not c.cuda_graphs:
        pytest.skip(f"{name} does not capture decode graphs yet (its kernels read the batch on the host)")
    kw = dict(config=c.gpu_preset, device="cuda", max_batch_size=8, kv_cache_bytes=8 << 30, **c.load_kw)
    pair = alignzoo.load_pair(name, overlap=overlap, **kw)
    eager = alignzoo.load_pair(name, cuda_graphs=False, **kw)
    assert pair.server.runner.graphs is not None and eager.server.runner.graphs is None
    longest = min(4000, pair.config.max_position - 100)
    prompts = prompts_of([longest, 333, 17], pair.config.vocab_size, seed=4)
    sps = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.01, max_new_tokens=n, seed=n)
           for n in (100, 60, 30)]
    outs = pair.server.generate(prompts, sps)
    for i, (o, e) in enumerate(zip(outs, eager.server.generate(prompts, sps))):
        assert_same(o, e, f"request {i}")
    assert_trainer_matches(pair, prompts, sps, outs)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_sync_after_an_optimizer_step(name, device, fp8):
    """Three Adam steps with the embedding and the first layer frozen: each step changes the trainer,
    the sync ships exactly the tensors that changed (frozen ones never), the server then holds the
    trainer's bytes, and the completions sampled at the new version have K3 == 0."""
    if fp8 and not case(name).fp8:
        pytest.skip(f"{name} has no unified FP8 path")
    pair = make_pair(name, device, fp8=fp8, seed=1)
    t = pair.trainer
    frozen = ("embed.", "layers.0.")
    for n, p in t.named_parameters():
        if n.startswith(frozen):
            p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in t.parameters() if p.requires_grad], lr=3e-3)
    prompts = prompts_of([300, 40, 9], pair.config.vocab_size)
    lens = [len(p) for p in prompts]
    sps = rich(3, 16, seed=3)
    outs = pair.server.generate(prompts, sps)
    for _ in range(3):
        assert_trainer_matches(pair, prompts, sps, outs)
        v = pair.server.weight_version
        seqs = [p + o.tokens for p, o in zip(prompts, outs)]
        before = {n: w.clone() for n, w in t.forward_weights().items()}
        lps = t.logprobs(seqs, lens, sps)
        (-sum(lp[torch.isfinite(lp)].sum() for lp in lps)).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            stale = t.logprobs(seqs, lens, sps)
        assert any(not torch.equal(a.cpu(), o.logprobs) for a, o in zip(stale, outs))  # the step moved the trainer
        after = t.forward_weights()
        changed = {n for n in after if not torch.equal(after[n], before[n])}
        assert changed and not any(n.startswith(frozen) for n in changed)
        assert pair.sync() == v + 1
        s = pair.last_sync
        assert s.tensors_changed == len(changed) and 0 < s.bytes_shipped < s.bytes_full
        assert pair.weights_match()
        outs = pair.server.generate(prompts, sps)
        assert all(o.weight_version == v + 1 for o in outs)
    assert_trainer_matches(pair, prompts, sps, outs)
    if fp8:  # the server runs the FP8 GEMM on the trainer's codes
        w = pair.server.model.weights
        codes = [n for n, x in w.items() if x.dtype == torch.float8_e4m3fn]
        assert codes and all(w[n + "_scale_inv"].dtype == torch.float32 for n in codes)


def test_sync_ships_only_the_changed_block(name, device):
    """One element changed in one 64-row block: that block alone ships (its rows and its index)."""
    pair = make_pair(name, device)
    assert pair.weights_match()
    v = pair.server.weight_version
    last = f"layers.{pair.config.num_layers - 1}."
    pname, p = min((n, p) for n, p in pair.trainer.named_parameters()
                   if n.startswith(last) and p.dim() == 2 and p.shape[0] > 64)
    with torch.no_grad():
        p[64 + (p.shape[0] - 65) // 2, :5] += 1.0  # inside the second row block
    assert not pair.weights_match()
    assert pair.sync() == v + 1
    s = pair.last_sync
    rows = min(64, p.shape[0] - 64)
    assert (s.blocks_changed, s.tensors_changed) == (1, 1), pname
    assert s.bytes_shipped == 8 + rows * p.shape[1] * p.element_size(), (pname, s)
    assert pair.weights_match()
    assert pair.sync() == v + 2 and pair.last_sync.blocks_changed == 0


@pytest.mark.parametrize("shard,dtype", [(None, torch.bfloat16), (60_000, torch.float32)],
                         ids=["one-file-bf16", "sharded-fp32"])
def test_checkpoint_round_trip(name, device, shard, dtype, tmp_path):
    """save_pretrained, then load_pair(checkpoint=): the same tensors and the same log-probs, bit
    for bit, on the trainer and the server; transformers' AutoModelForCausalLM loads the directory
    with every tensor as written, and its fp32 log-probs are within the row's tolerance of ours."""
    c = case(name)
    pair = make_pair(name, device, dtype=dtype)
    pair.save_pretrained(tmp_path, max_shard_bytes=shard)
    files = sorted(glob.glob(os.path.join(tmp_path, "*.safetensors")))
    assert (len(files) > 1) == (shard is not None)
    again = alignzoo.load_pair(name, checkpoint=tmp_path, device=device, dtype=dtype, **c.load_kw)
    ours, theirs = dict(pair.trainer.named_parameters()), dict(again.trainer.named_parameters())
    assert sorted(ours) == sorted(theirs)
    for n, p in ours.items():
        assert torch.equal(p, theirs[n]), n
    prompts = prompts_of([300, 40, 5], pair.config.vocab_size, seed=7)
    sps = rich(3, 12, seed=7)
    outs = again.server.generate(prompts, sps)
    for i, (a, b) in enumerate(zip(pair.server.generate(prompts, sps), outs)):
        assert_same(a, b, f"request {i}")
    assert_trainer_matches(again, prompts, sps, outs)
    if c.hf_atol is None:
        return
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file

    saved = {k: v for f in files for k, v in load_file(f).items()}
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                                 output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    hf_params = dict(hf.named_parameters())
    assert set(saved) <= set(hf.state_dict())
    for n, x in saved.items():
        if n in hf_params:  # a tied lm_head is the embedding
            assert torch.equal(hf_params[n], x.float()), n
    spec = model_module(name).SPEC
    ours32 = loading.build_trainer(spec, loading.resolve_config(spec, tmp_path), tmp_path, dtype=torch.float32)
    seqs = [torch.tensor(p + o.tokens) for p, o in zip(prompts, outs)]
    with torch.no_grad():
        got = ours32.logprobs(seqs, [1] * len(seqs))
        ref = [torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(1, s[1:, None])[:, 0] for s in seqs]
    for g, r in zip(got, ref):
        assert (g - r).abs().max() <= c.hf_atol, float((g - r).abs().max())


@pytest.mark.parametrize("edit,match", [
    (lambda c: c.update(tie_word_embeddings="false"), r": .*tie_word_embeddings"),
    (lambda c: c.pop("hidden_size"), r" lacks hidden_size"),
    (lambda c: c.update(num_attention_heads=0), r": .*num_(attention_)?heads must be a positive int"),
    (lambda c: c.update(rms_norm_eps=float("inf")), r": .*rms_norm_eps must be a finite number > 0"),
], ids=["tie-str", "no-hidden", "zero-heads", "eps-inf"])
def test_a_bad_config_json_is_refused_naming_its_file(name, edit, match, tmp_path):
    """Every model's from_hf: a bad config.json is a CheckpointError that names the file and the field."""
    from alignzoo.weights import CheckpointError

    cfg = model_module(name).SPEC.presets["tiny"].to_hf()
    edit(cfg)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = model_module(name).SPEC
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "config.json")) + match):
        spec.config_cls.from_hf(tmp_path)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_cli_check(name, device, fp8, capsys):
    """``alignzoo check MODEL``: ladder rungs 1-4, every row passes, exit status 0."""
    from alignzoo.cli import main

    c = case(name)
    if fp8 and not c.fp8:
        pytest.skip(f"{name} has no unified FP8 path")
    # 140 tokens: past two pages and deepseek_v4's 40-token window, across C4 / C16 groups; the long contract
    # runs in each model's own tests, this one the CLI's rungs
    argv = ["check", name, "--config", c.preset, "--device", device.type, "--length", "140", "--batch", "3"]
    assert main(argv + ["--fp8"] * fp8) == 0
    out = capsys.readouterr().out
    assert "9/9 checks passed" in out and "FAIL" not in out


def test_ladder_catches_a_misaligned_server(name, device, monkeypatch):
    """The checks can fail: a server whose projections land one ULP off the trainer's (planted:
    torch's ``F.linear`` gives the fixed-order matmul's bits on some BLAS builds at these shapes).
    Rungs 1-2 compare a side with itself and pass; every trainer-vs-server row of rungs 3-4 fails."""
    from alignzoo.models import base, checks

    aligned = base.matmul_fwd

    def one_ulp_up(x, w):
        y = aligned(x, w)
        return torch.nextafter(y, torch.full_like(y, float("inf")))  # no host tensor: a CUDA graph captures it
    monkeypatch.setattr(base, "matmul_fwd", one_ulp_up)
    pair = make_pair(name, device)  # built patched, so the decode graphs are misaligned too
    # every projection is off, so any length shows it: 130 tokens (past two pages) rather than test_cli_check's
    # 260 (rung 3 decodes them one step each: 300 took 20 s on the MoE models)
    rows = checks.run_ladder(pair, length=130, batch=3, new_tokens=20)
    assert {r.check: r.passed for r in rows} == {r.check: r.rung <= 2 for r in rows}
    assert all(r.differing > 0 for r in rows if r.rung >= 3)
