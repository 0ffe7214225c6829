"""qwen35_gdn beyond the tests every model runs: the checkpoints transformers writes for it (experts one
tensor each, or fused as the release ships them; the multimodal model's language model under its own
prefix, beside a vision tower), its log-probs against transformers' in fp32 and bf16, another
architecture refused, its layer types (a list, or a full-attention interval), the Gated DeltaNet state
across a prefill split into odd chunks, and the routed experts the server returns as per-token extras.

Trainer == server, preemption, overlap, CUDA graphs, sync, our checkpoints through transformers (fp32
log-probs within 1e-4 on sharpened weights), bad config.json files, the CLI check and the misaligned
server: tests/test_models.py.  Router replay: tests/test_router_replay.py; LoRA on the experts:
tests/test_experts_lora.py; the GDN kernels split at every offset: tests/test_gdn.py.
"""
from __future__ import annotations

import logging

import pytest
import torch
from model_cases import assert_trainer_matches, make_pair, prompts_of, rich

import alignzoo
from alignzoo import SamplingParams
from alignzoo.models import loading
from alignzoo.models.capture import Recorder
from alignzoo.models.qwen35_gdn import SPEC, Qwen35GdnConfig
from alignzoo.models.qwen35_gdn import weights as qwen35
from alignzoo.weights import CheckpointError, HFCheckpoint

transformers = pytest.importorskip("transformers")

# Odd sizes, GVA (4 value heads over 2 key heads), top-3 of 7 experts; the interval puts attention at layer 2.
TEXT = dict(vocab_size=211, hidden_size=72, num_hidden_layers=3, full_attention_interval=3, num_attention_heads=3,
            num_key_value_heads=1, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=24, linear_value_head_dim=20, num_experts=7, num_experts_per_tok=3,
            moe_intermediate_size=40, shared_expert_intermediate_size=48, max_position_embeddings=2048)
# Attention first and two GDN layers in a row: not the interval's pattern, so a side that read it would part.
LAYERS = ("full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention")


def saved(d) -> dict[str, torch.Tensor]:
    with HFCheckpoint(d) as ckpt:
        return {n: ckpt.get(n) for n in ckpt.keys()}


@pytest.fixture(scope="module")
def hf_text(tmp_path_factory):
    """transformers' Qwen3_5MoeForCausalLM, its norms moved off their init (a swapped one must show), saved."""
    torch.manual_seed(0)
    model = transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**TEXT)).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.empty_like(p).uniform_(-0.4, 0.4))
    d = tmp_path_factory.mktemp("qwen3_5_moe_text")
    model.save_pretrained(d)
    return model, d


@pytest.fixture(scope="module")
def pair():
    """A sharpened bf16 pair on the tiny sizes with ``LAYERS``."""
    return make_pair("qwen35_gdn", config=SPEC.presets["tiny"].replace(num_layers=len(LAYERS), layer_types=LAYERS))


# ---------------------------------------------------------------- checkpoints
def test_from_hf_reads_what_transformers_writes_and_to_hf_gives_it_back(hf_text):
    """transformers saves one tensor per expert and keeps them fused in memory (the release's layout):
    both read into the same tensors, bit for bit; ``to_hf`` writes the fused layout, every tensor the
    model's own, and reads back into ours."""
    model, d = hf_text
    cfg = Qwen35GdnConfig.from_hf(d)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention")
    assert (cfg.gdn_v_heads, cfg.gdn_k_dim, cfg.num_experts, cfg.rope.rotary_dim) == (4, 24, 7, 8)
    ours = qwen35.from_hf(d, cfg, dtype=torch.float32)
    assert {n: (tuple(t.shape), t.dtype) for n, t in ours.items()} == qwen35.expected(cfg, torch.float32)
    hf = {n: p.detach() for n, p in model.named_parameters()}
    assert any(".experts.gate_up_proj" in n for n in hf)  # the fused layout, in memory
    from_memory = qwen35.from_hf(hf, cfg, dtype=torch.float32)
    assert sorted(from_memory) == sorted(ours)
    for n, t in ours.items():
        assert torch.equal(from_memory[n], t), n
    L = "model.layers.{}."
    assert torch.equal(ours["layers.2.moe.gate_up.weight"], hf[L.format(2) + "mlp.experts.gate_up_proj"])
    assert torch.equal(ours["layers.0.gdn.in_proj.weight"], torch.cat(
        [hf[L.format(0) + f"linear_attn.in_proj_{p}.weight"] for p in ("qkv", "z", "b", "a")]))
    assert ".mlp.experts.0.up_proj.weight" in " ".join(saved(d))  # one tensor per expert, on disk
    back = qwen35.to_hf(ours, cfg)
    assert sorted(back) == sorted(hf)
    for n, t in hf.items():
        assert torch.equal(back[n], t), n
    again = qwen35.from_hf(back, cfg, dtype=torch.float32)
    assert all(torch.equal(again[n], t) for n, t in ours.items())


def hf_logprobs(model, seqs) -> list[torch.Tensor]:
    with torch.no_grad():
        return [torch.log_softmax(model(s[None]).logits[0, :-1].float(), -1).gather(1, s[1:, None])[:, 0] for s in seqs]


def test_logprobs_against_transformers(hf_text):
    """transformers' checkpoint, 600 tokens beside short ones.  fp32: max |d logprob| <= 1e-5 (measured
    9.5e-7).  bf16: within 3e-2 of transformers in bf16 (measured 1.1e-2; the two round activations at
    other points), and our bf16 error against the fp32 model at most twice transformers' own plus 1e-3
    (measured 7.3e-3 against its 1.1e-2)."""
    model, d = hf_text
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, TEXT["vocab_size"], (n,), generator=g) for n in (600, 77, 2)]
    r32 = hf_logprobs(model, seqs)
    r16 = hf_logprobs(transformers.Qwen3_5MoeForCausalLM.from_pretrained(d, dtype=torch.bfloat16).eval(), seqs)
    cfg = loading.resolve_config(SPEC, d)
    with torch.no_grad():
        got32 = loading.build_trainer(SPEC, cfg, d, dtype=torch.float32).logprobs(seqs, [1] * len(seqs))
        got16 = loading.build_trainer(SPEC, cfg, d, dtype=torch.bfloat16).logprobs(seqs, [1] * len(seqs))
    for i, (a32, a16, b32, b16) in enumerate(zip(got32, got16, r32, r16)):
        assert (a32 - b32).abs().max() <= 1e-5, i
        assert (a16 - b16).abs().max() <= 3e-2, i
        assert (a16 - b32).abs().max() <= 2 * (b16 - b32).abs().max() + 1e-3, i


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_a_multimodal_checkpoint_loads_its_language_model(hf_text, tmp_path, caplog, tie):
    """Qwen3_5MoeForConditionalGeneration keeps the text model under ``model.language_model.`` and its
    config under ``text_config``, beside a vision tower: the same config, the same tensors and the same
    trainer as the text-only checkpoint, the vision tower left out and named in the log."""
    text_model, text_dir = hf_text
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=24, out_hidden_size=TEXT["hidden_size"],
                  num_position_embeddings=16, patch_size=4, temporal_patch_size=1, spatial_merge_size=1)
    mm = transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(
        text_config=TEXT, vision_config=vision, tie_word_embeddings=tie))
    with torch.no_grad():
        mm.model.language_model.load_state_dict(text_model.model.state_dict())
        if not tie:
            mm.lm_head.weight.copy_(text_model.lm_head.weight)
    mm.save_pretrained(tmp_path)
    names = list(saved(tmp_path))
    assert any(n.startswith("model.visual.") for n in names)
    assert qwen35.checkpoint_prefix(names) == "model.language_model."
    assert qwen35.checkpoint_prefix(saved(text_dir)) == "model."

    cfg = Qwen35GdnConfig.from_hf(tmp_path)
    assert cfg == Qwen35GdnConfig.from_hf(text_dir).replace(tie_word_embeddings=tie)
    with caplog.at_level(logging.INFO, logger="alignzoo.models"):
        ours = qwen35.from_hf(tmp_path, cfg, dtype=torch.float32)
    assert "left out" in caplog.text and "model.visual." in caplog.text
    want = qwen35.from_hf(text_dir, cfg.replace(tie_word_embeddings=False), dtype=torch.float32)
    if tie:
        del want["lm_head.weight"]
    assert sorted(ours) == sorted(want) and ("lm_head.weight" in ours) == (not tie)
    for n, t in want.items():
        assert torch.equal(ours[n], t), n
    trainer = loading.build_trainer(SPEC, loading.resolve_config(SPEC, tmp_path), tmp_path, dtype=torch.float32)
    params = dict(trainer.named_parameters())
    assert sorted(params) == sorted(want) and all(torch.equal(params[n], t) for n, t in want.items())


def test_another_architecture_is_refused(tmp_path):
    """A Qwen3 (dense) checkpoint: the config, the name map and load_pair each say what it is."""
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16)).save_pretrained(tmp_path)
    match = r"checkpoint is qwen3 \(Qwen3ForCausalLM\), not Qwen3.5-MoE"
    with pytest.raises(CheckpointError, match=match):
        Qwen35GdnConfig.from_hf(tmp_path)
    with pytest.raises(CheckpointError, match=match):
        qwen35.from_hf(tmp_path, SPEC.presets["tiny"])
    with pytest.raises(CheckpointError, match=match):
        alignzoo.load_pair("qwen35_gdn", checkpoint=tmp_path, device="cpu")


# ---------------------------------------------------------------- layer types
@pytest.mark.parametrize("layers,interval", [(7, 3), (9, None), (5, 1)], ids=["7-every-3", "9-default-4", "5-all"])
def test_layer_types_from_the_interval_are_transformers(layers, interval):
    """A config.json without ``layer_types``: ours from ``full_attention_interval`` (4 when absent) are
    the ones transformers derives."""
    kw = {} if interval is None else {"full_attention_interval": interval}
    sizes = {k: v for k, v in TEXT.items() if k != "full_attention_interval"} | {"num_hidden_layers": layers}
    want = transformers.Qwen3_5MoeTextConfig(**sizes, **kw).layer_types
    hf = SPEC.presets["tiny"].replace(num_layers=layers, layer_types=want).to_hf()
    del hf["layer_types"]
    assert Qwen35GdnConfig.from_hf({**hf, **kw}).layer_types == tuple(want)


def test_layer_types_are_honoured_on_both_sides(pair):
    """``LAYERS`` (attention first, not the interval's pattern) shape the trainer's blocks, the name
    map, the server's pools, and trainer == server on a 700-token sequence beside short ones."""
    cfg = pair.config
    assert cfg.layer_types == LAYERS and cfg.attn_layers == (0, 3) and cfg.gdn_layers == (1, 2, 4)
    assert [hasattr(b, "gdn") for b in pair.trainer.layers] == [t == "linear_attention" for t in LAYERS]
    names = qwen35.expected(cfg, torch.bfloat16)
    assert {i for i in range(len(LAYERS)) if f"layers.{i}.gdn.conv.weight" in names} == set(cfg.gdn_layers)
    assert {i for i in range(len(LAYERS)) if f"layers.{i}.attn.qkv.weight" in names} == set(cfg.attn_layers)
    pools = pair.server.model.cache_pools()
    assert (pools["kv"].layers, pools["gdn"].layers) == (2, 3)
    prompts = prompts_of([700, 5, 131], cfg.vocab_size, seed=2)
    sps = rich(3, 13, seed=4)
    assert_trainer_matches(pair, prompts, sps, pair.server.generate(prompts, sps))


# ---------------------------------------------------------------- the GDN state across chunks
@pytest.fixture(scope="module")
def one_prefill(pair):
    """A 700-token and a 131-token sequence scored in one prefill each, every op's rows recorded."""
    seqs = prompts_of([700, 131], pair.config.vocab_size, seed=8)
    sps = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.1, seed=2)]
    rec = Recorder(seqs)
    with rec.attached_server(pair.server):
        lps = pair.server.score(seqs, [1, 1], sps)
    return seqs, sps, rec, lps


@pytest.mark.parametrize("chunk", [1, 63, 64, 65, 130])
def test_a_prefill_split_into_chunks_is_one_prefill(pair, one_prefill, chunk):
    """Chunked prefill, each step continuing every GDN layer from its slot: every op's rows, each GDN
    state at a 64-token boundary and the log-probs equal one prefill's, bit for bit (1-token chunks
    on the 131-token sequence alone: decode-shaped steps)."""
    seqs, sps, ref, ref_lps = one_prefill
    which = [1] if chunk == 1 else [0, 1]
    rec = Recorder(seqs)
    with rec.attached_server(pair.server):
        lps = pair.server.score([seqs[i] for i in which], [1] * len(which), [sps[i] for i in which],
                                chunk_tokens=chunk)
    assert not rec.conflicts
    for i, lp in zip(which, lps):
        assert torch.equal(lp, ref_lps[i]), i
    states = [n for n in rec.order if n.endswith("gdn.state")]
    assert len(states) == len(pair.config.gdn_layers)
    for name in rec.order:
        got, want = rec.rows[name], ref.rows[name]
        if name in states:  # one prefill leaves only its last boundary: the chunks' must lead there
            for i in which:  # each step files its sequence's state at the last boundary it passed
                n = len(seqs[i])
                ends = [*range(chunk, n, chunk), n]
                assert {k[1] for k in got if k[0] == i} == {e // 64 * 64 for e in ends if e >= 64}, (name, i)
            for k in set(got) & set(want):
                assert torch.equal(got[k], want[k]), (name, k)
            assert set(got) & set(want), name
            continue
        assert set(got) == {k for k in want if k[0] in which}, name
        for k, row in got.items():
            assert torch.equal(row, want[k]), (name, k)


# ---------------------------------------------------------------- per-token extras
def test_routed_experts_are_the_trainers_routing(pair):
    """The server's extras, sampled (decode steps) or scored (one prefill), are the experts and weights
    the trainer's own routers choose for every fed token, bit for bit."""
    prompts = prompts_of([640, 33], pair.config.vocab_size, seed=12)
    sps = rich(2, [24, 41], seed=6)
    outs = pair.server.generate(prompts, sps)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lps, scored = pair.server.score(seqs, [len(p) for p in prompts], sps, return_extras=True)
    rec = Recorder(seqs)
    with torch.no_grad(), rec.attached_trainer(pair.trainer):
        pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps)
    L = pair.config.num_layers
    for i, (s, o, ex) in enumerate(zip(seqs, outs, scored)):
        assert torch.equal(lps[i], o.logprobs), i
        fed = range(len(s) - 1)  # the last token is never fed to the server
        ids = torch.stack([torch.stack([rec.rows[f"layer.{j}.moe.router.ids"][i, t] for j in range(L)]) for t in fed])
        w = torch.stack([torch.stack([rec.rows[f"layer.{j}.moe.router.weights"][i, t] for j in range(L)]) for t in fed])
        for name, want in (("routed_experts", ids.to(torch.int32)), ("routed_weights", w.float())):
            assert o.extras[name].shape == want.shape, (i, name)
            assert torch.equal(o.extras[name], want), (i, name)
            assert torch.equal(ex[name], want), (i, name)
