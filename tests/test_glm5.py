"""glm5_sparse_fp8's own contract: trainer == server prefill == chunked prefill == decode with a top-32
selection far below 1,000+-token sequences, the same selected positions on both sides at every full
indexer layer and token (ties included: the indexer's exact-0.0 plateaus), shared layers, the routed
experts as extras.  The generic rows (preemption, overlap, sync, FP8, checkpoints, the ladder) are
tests/test_models.py's; parity with transformers is tests/test_glm5_parity.py's."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from model_cases import assert_lora_step_keeps_k3_zero, assert_trainer_matches, make_pair, prompts_of, rich

from alignzoo import SamplingParams
from alignzoo.models import glm5_sparse_fp8 as glm5
from alignzoo.models.capture import Recorder

NAME = "glm5_sparse_fp8"


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return make_pair(NAME, dtype=torch.bfloat16, seed=3)


def selections(rec: Recorder, layers) -> dict:
    return {L: rec.rows[f"layer.{L}.indexer.selected"] for L in layers}


def test_a_long_mixed_batch_keeps_the_contract(pair):
    """A 1,100-token prompt beside short ones, top-32 selection, every sampling transform: the sampled
    bits are the trainer's and the server prefill's, and both sides selected the same positions at
    every full indexer layer and token."""
    cfg = pair.config
    assert cfg.index_topk == 32 and cfg.indexer_types == ("full", "shared", "full", "shared")
    prompts = prompts_of([1100, 77, 300], cfg.vocab_size, seed=5)
    sps = rich(3, [9, 14, 6], seed=2)
    outs = pair.server.generate(prompts, sps)
    assert_trainer_matches(pair, prompts, sps, outs)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lens = [len(p) for p in prompts]
    srv, trn = Recorder(seqs), Recorder(seqs)
    with srv.attached_server(pair.server):
        pair.server.score(seqs, lens, sps)
    with torch.no_grad(), trn.attached_trainer(pair.trainer):
        pair.trainer.logprobs(seqs, lens, sps)
    assert not srv.conflicts and not trn.conflicts
    got, want = selections(srv, cfg.indexer_layers), selections(trn, cfg.indexer_layers)
    for L in cfg.indexer_layers:
        # the server never feeds a sequence's last token; the trainer selects for it too
        assert set(got[L]) == {(i, t) for i, s in enumerate(seqs) for t in range(len(s) - 1)}, L
        for k, row in got[L].items():
            assert torch.equal(row, want[L][k]), (L, k)
    # far rows select 32 real positions, not pads; row p < 31 sees every position up to itself
    far = want[0][(0, 1000)]
    assert far.shape == (32,) and bool((far >= 0).all()) and bool((far.diff() > 0).all()) and int(far[-1]) <= 1000
    assert want[0][(1, 10)].tolist() == list(range(11)) + [-1] * 21


@pytest.fixture(scope="module")
def one_prefill(pair):
    seqs = prompts_of([1100, 131], pair.config.vocab_size, seed=8)
    sps = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.1, seed=2)]
    return seqs, sps, pair.server.score(seqs, [1, 1], sps)


@pytest.mark.parametrize("chunk", [63, 64, 65, 257])
def test_a_prefill_split_into_chunks_is_one_prefill(pair, one_prefill, chunk):
    """Chunked prefill: each chunk's rows select among keys an earlier chunk wrote to the paged
    indexer pool and attend to latent rows from earlier chunks; the log-probs equal one prefill's."""
    seqs, sps, ref = one_prefill
    lps = pair.server.score(seqs, [1, 1], sps, chunk_tokens=chunk)
    for i, (a, b) in enumerate(zip(lps, ref)):
        assert torch.equal(a, b), (chunk, i)


def _tied(pair, how: str):
    """A copy of the pair's weights whose indexer scores tie: "zero" (weights_proj = 0: every score
    exactly 0.0) or "plateau" (wk = 0 and a k_norm bias: every key the same before RoPE, most scores 0)."""
    t = pair.trainer
    with torch.no_grad():
        for L in pair.config.indexer_layers:
            ix = t.layers[L].indexer
            if how == "zero":
                ix.weights_proj.weight.zero_()
            else:
                ix.wk.weight.zero_()
                ix.k_norm.bias.copy_(torch.linspace(-1.0, 1.0, ix.k_norm.bias.numel()))
    pair.sync()


@pytest.mark.parametrize("how", ["zero", "plateau"])
def test_ties_go_to_the_smaller_position_on_both_sides(how):
    """Scores built to tie: the same selection on both sides at every token, the smallest positions
    winning an all-zero row, and K3 == 0 across a mixed batch."""
    torch.set_num_threads(1)
    pair = make_pair(NAME, dtype=torch.bfloat16, seed=4)
    _tied(pair, how)
    cfg = pair.config
    prompts = prompts_of([1030, 45], cfg.vocab_size, seed=9)
    sps = rich(2, 7, seed=5)
    outs = pair.server.generate(prompts, sps)
    assert_trainer_matches(pair, prompts, sps, outs)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    srv, trn = Recorder(seqs), Recorder(seqs)
    with srv.attached_server(pair.server):
        pair.server.score(seqs, [1, 1], sps)
    with torch.no_grad(), trn.attached_trainer(pair.trainer):
        pair.trainer.logprobs(seqs, [1, 1], sps)
    got, want = selections(srv, cfg.indexer_layers), selections(trn, cfg.indexer_layers)
    for L in cfg.indexer_layers:
        assert len(got[L]) == sum(len(s) - 1 for s in seqs), L
        for k, row in got[L].items():
            assert torch.equal(row, want[L][k]), (L, k)
    if how == "zero":
        assert want[0][(0, 900)].tolist() == list(range(32))


def test_routed_experts_are_the_trainers_routing(pair):
    """The extras hold the MoE layers only (the dense first layer has no router), in layer order: the
    trainer's own routing of every fed token, bit for bit."""
    cfg = pair.config
    moe = cfg.sparse_layers
    assert moe == (1, 2, 3)
    prompts = prompts_of([1040, 33], cfg.vocab_size, seed=12)
    sps = rich(2, [5, 11], seed=6)
    outs = pair.server.generate(prompts, sps)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    rec = Recorder(seqs)
    with torch.no_grad(), rec.attached_trainer(pair.trainer):
        pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps)
    for i, (s, o) in enumerate(zip(seqs, outs)):
        fed = range(len(s) - 1)
        ids = torch.stack([torch.stack([rec.rows[f"layer.{j}.moe.router.ids"][i, t] for j in moe]) for t in fed])
        assert o.extras["routed_experts"].shape == (len(s) - 1, len(moe), cfg.num_experts_per_tok)
        assert torch.equal(o.extras["routed_experts"], ids.to(torch.int32)), i
    # replaying the server's routing gives the trainer the sampled bits
    with torch.no_grad():
        lps = pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps, replay=[o.extras for o in outs])
    for o, lp in zip(outs, lps):
        assert torch.equal(lp, o.logprobs)


# ---------------------------------------------------------------- index replay
def test_index_replay_gives_the_sampled_bits_and_catches_a_tampered_selection(pair):
    """A request that asks (``SamplingParams(extras=("index_selected",))``) gets each full layer's selection
    of every fed token, the trainer's own; one that does not gets none.  Replayed, the selections give the
    trainer the sampled bits; one position swapped changes the log-probs; a selection the indexer could not
    have made is refused, naming it."""
    cfg = pair.config
    prompts = prompts_of([1050, 90], cfg.vocab_size, seed=21)
    sps = rich(2, [8, 6], seed=3)
    asked = [dataclasses.replace(sps[0], extras=("index_selected",)), sps[1]]
    outs = pair.server.generate(prompts, asked)
    sel = outs[0].extras["index_selected"]
    n = len(prompts[0]) + len(outs[0].tokens)
    assert sel.shape == (n - 1, len(cfg.indexer_layers), cfg.index_topk) and sel.dtype == torch.int32
    assert "index_selected" not in outs[1].extras and "routed_experts" in outs[1].extras
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    rec = Recorder(seqs[:1])
    with torch.no_grad(), rec.attached_trainer(pair.trainer):
        own = pair.trainer.logprobs(seqs[:1], [len(prompts[0])], asked[:1])[0]
    for j, L in enumerate(cfg.indexer_layers):
        rows = rec.rows[f"layer.{L}.indexer.selected"]
        assert all(torch.equal(sel[t, j], rows[(0, t)]) for t in range(n - 1)), L
    assert torch.equal(own, outs[0].logprobs)

    def replayed(s):
        with torch.no_grad():
            return pair.trainer.logprobs(seqs[:1], [len(prompts[0])], asked[:1],
                                         replay=[{"index_selected": s}])[0]
    assert torch.equal(replayed(sel), outs[0].logprobs)
    # the score path returns them too, to whoever asks
    _, scored = pair.server.score(seqs[:1], [len(prompts[0])], asked[:1], return_extras=True)
    assert torch.equal(scored[0]["index_selected"], sel)
    # tampered: the last prompt token's layer-0 selection drops its smallest position for one it did not pick
    t = len(prompts[0]) - 1
    row = sel[t, 0].tolist()
    new = sorted(set(row[1:]) | {next(p for p in range(t + 1) if p not in row)})
    bad = sel.clone()
    bad[t, 0] = torch.tensor(new, dtype=torch.int32)
    assert not torch.equal(replayed(bad), outs[0].logprobs)
    for edit, match in ((lambda s: s[5, 1, 0].fill_(6), "not causal"), (lambda s: s[700, 0, 3].fill_(-7), "out of range"),
                        (lambda s: s[700, 0, :2].copy_(s[700, 0, :2].flip(0)), "not strictly ascending"),
                        (lambda s: s[3, 0, 0].fill_(-1), "not strictly ascending")):
        bad = sel.clone()
        edit(bad)
        with pytest.raises(ValueError, match=match):
            replayed(bad)
    with pytest.raises(ValueError, match=r"want integer \(1057, 2, 32\)"):
        replayed(sel[:-1])


def test_an_unknown_extra_fails_that_request_alone(pair):
    prompts = prompts_of([70, 40], pair.config.vocab_size, seed=2)
    outs = pair.server.generate(prompts, [SamplingParams(max_new_tokens=3, extras=("attention_maps",)),
                                          SamplingParams(max_new_tokens=3)])
    assert outs[0].finish_reason == "error" and "not an on-request extra of this model (it has: index_selected)" in outs[0].error
    assert outs[1].error is None and len(outs[1].tokens) == 3


# ---------------------------------------------------------------- LoRA
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


@pytest.mark.parametrize("fp8,mode,lora", [
    (True, "separate", {"r": 4, "lora_alpha": 8, "target_parameters": EXPERTS}),
    (False, "separate", {"r": 4, "lora_alpha": 8, "target_modules": ["q_a_proj", "kv_a_proj_with_mqa", "o_proj"],
                         "target_parameters": EXPERTS}),
    (False, "merged", {"r": 3, "lora_alpha": 6, "target_modules": ["q_b_proj"], "target_parameters": EXPERTS[1:]}),
], ids=["fp8-experts-separate", "bf16-mla-and-experts-separate", "bf16-merged"])
def test_lora_on_mla_and_on_the_experts_keeps_k3_zero_across_a_step(fp8, mode, lora, tmp_path):
    """LoRA on MLA's projections and inside the routed experts (over FP8 codes that stay frozen with
    fp8=True): sampled bits == the trainer's before and after an Adam step on the adapters; the sync ships
    the adapters only; a PEFT directory written and read back gives the same bits."""
    torch.set_num_threads(1)
    pair = make_pair(NAME, fp8=fp8, lora=lora, lora_mode=mode, seed=2)
    prompts = prompts_of([150, 41], pair.config.vocab_size, seed=3)
    sps = rich(2, 6, seed=1)
    outs = assert_lora_step_keeps_k3_zero(pair, prompts, sps, (".q_b.", ".moe.down.") if mode == "merged" else ())
    pair.save_pretrained(tmp_path, adapter_only=True)
    again = make_pair(NAME, fp8=fp8, lora=lora, lora_mode=mode, seed=2)  # the same sharpened base
    glm5.load_adapter(again, tmp_path)  # its adapters from the PEFT directory, then synced
    for a, b in zip(again.server.generate(prompts, sps), outs):
        assert torch.equal(a.logprobs, b.logprobs)


def test_lora_with_fp8_adapts_the_experts_only():
    with pytest.raises(NotImplementedError, match="adapts the FP8 experts only"):
        make_pair(NAME, fp8=True, lora={"r": 2, "lora_alpha": 4, "target_modules": ["o_proj"]}, lora_mode="separate")
    with pytest.raises(NotImplementedError, match="adapts the FP8 experts only"):
        make_pair(NAME, fp8=True, lora={"r": 2, "lora_alpha": 4, "target_parameters": EXPERTS}, lora_mode="merged")


# ---------------------------------------------------------------- FP8 checkpoints
def test_an_fp8_checkpoint_is_served_as_its_own_codes(tmp_path):
    """Unified FP8 from an FP8 block checkpoint: the FP32 masters are code x scale, and the codes and scales
    the trainer quantizes them back into, which the server reads, are the checkpoint's byte for byte, for
    every FP8 weight whose fused parts are whole 128-row blocks (GLM-5's are: 12,288 and 2,048 wide)."""
    import json

    from safetensors.torch import load_file, save_file

    import alignzoo
    from alignzoo.common.fp8 import quantize_weight_fp8
    from alignzoo.models.glm5_sparse_fp8 import weights as glm5_weights

    torch.set_num_threads(1)
    cfg = {"intermediate_size": 256, "moe_intermediate_size": 128}  # fused gate_up parts of whole blocks
    pair = alignzoo.load_pair(NAME, config=cfg, dtype=torch.bfloat16, seed=0)
    pair.save_pretrained(tmp_path / "bf16")
    out = {}
    for n, t in load_file(tmp_path / "bf16" / "model.safetensors").items():
        plain = t.dim() != 2 or n.endswith(("embed_tokens.weight", "lm_head.weight", "weights_proj.weight",
                                             "mlp.gate.weight")) or "norm" in n
        if plain:
            out[n] = t
        else:  # each block its own scale: x3 and a per-row tilt, so no block's maximum sits on 448 by accident
            out[n], out[n + "_scale_inv"] = quantize_weight_fp8(t.float() * torch.linspace(1, 3, t.shape[0])[:, None])
    (tmp_path / "fp8").mkdir()
    save_file(out, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    conf = json.loads((tmp_path / "bf16" / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(conf))
    p8 = alignzoo.load_pair(NAME, checkpoint=tmp_path / "fp8", dtype=torch.bfloat16, fp8=True)
    stored = glm5_weights.from_hf_fp8(tmp_path / "fp8", p8.config)
    served = p8.server.model.weights
    checked = [n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn and n + "_scale_inv" in served]
    assert len(checked) >= 25 and "layers.1.moe.gate_up.weight" in checked and "layers.0.mlp.gate_up.weight" in checked
    for n in checked:
        assert torch.equal(served[n].view(torch.uint8), stored[n].view(torch.uint8)), n
        assert torch.equal(served[n + "_scale_inv"], stored[n + "_scale_inv"]), n
    prompts = prompts_of([140, 33], p8.config.vocab_size, seed=1)
    sps = rich(2, 5, seed=2)
    assert_trainer_matches(p8, prompts, sps, p8.server.generate(prompts, sps))
