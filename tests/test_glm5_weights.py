"""GLM-5 (``glm5_sparse_fp8``) config and weights against transformers' ``GlmMoeDsaForCausalLM``.

A tiny random model built from ``Glm5Config.preset("tiny").to_hf()`` and written by ``save_pretrained``
(experts one tensor each, as the released checkpoints) is read into our names, written back and loaded
by transformers again; an FP8 block checkpoint written the way GLM-5-FP8 is (e4m3 codes + fp32
``weight_scale_inv`` per 128x128 block on every linear but the indexer's weights_proj and the router)
is read as its codes and scales and written back byte for byte.  The model is not registered yet.
"""
from __future__ import annotations

import json
import logging

import alignzoo
import pytest
import torch
from alignzoo.common.fp8 import quantize_weight_fp8
from alignzoo.common.rope import RopeSpec
from alignzoo.common.rope.table import Yarn
from alignzoo.models.glm5_sparse_fp8 import weights as glm5
from alignzoo.models.glm5_sparse_fp8.config import PRESETS, Fp8BlockQuant, Glm5Config
from alignzoo.weights import (
    FP8_BLOCK128,
    CheckpointError,
    DequantizedSource,
    HFCheckpoint,
    WeightMismatchError,
    quantize_for_save,
    save_hf_checkpoint,
)

transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file

TINY = Glm5Config.preset("tiny")
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
              "modules_to_not_convert": ["lm_head", "indexers_proj"]}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers (torch.equal takes no float8, and tells -0.0 from 0.0 this way)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def hf_model(dtype: torch.dtype):
    """A seeded tiny GlmMoeDsaForCausalLM with every vector moved off its init (norms 1, biases 0), so
    a swapped or dropped 1-D tensor shows."""
    torch.manual_seed(0)
    model = transformers.GlmMoeDsaForCausalLM(transformers.GlmMoeDsaConfig(**TINY.to_hf("float32"))).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.dim() == 1 and "rotary_emb" not in name:
                t.copy_(torch.rand(t.shape, generator=g) + 0.5 if name.endswith("weight") else torch.randn(t.shape, generator=g) * 0.1)
    return model.to(dtype)


@pytest.fixture(scope="module", params=DTYPES)
def saved(request, tmp_path_factory):
    """(dtype, the transformers model, its save_pretrained directory)."""
    dtype = request.param
    model = hf_model(dtype)
    path = tmp_path_factory.mktemp(f"glm5-{str(dtype)[6:]}")
    model.save_pretrained(path)
    return dtype, model, path


def reference(model, cfg=TINY) -> dict[str, torch.Tensor]:
    """Our names built by hand from transformers' in-memory parameters (experts already stacked there as
    gate_up_proj (E, 2I, H) and down_proj (E, H, I)): independent of weights.hf_names."""
    sd = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"],
           "lm_head.weight": sd["lm_head.weight"]}
    for i in range(cfg.num_layers):
        L, A, X, p = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.self_attn.indexer.", f"layers.{i}."
        out |= {p + "attn_norm.weight": sd[L + "input_layernorm.weight"],
                p + "mlp_norm.weight": sd[L + "post_attention_layernorm.weight"]}
        out |= {p + f"attn.{ours}.weight": sd[A + f"{hf}.weight"] for ours, hf in (
            ("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj"), ("kv_a", "kv_a_proj_with_mqa"),
            ("kv_a_norm", "kv_a_layernorm"), ("kv_b", "kv_b_proj"), ("o", "o_proj"))}
        if cfg.indexer_types[i] == "full":
            out |= {p + f"indexer.{n}": sd[X + n] for n in ("wq_b.weight", "wk.weight", "k_norm.weight",
                                                          "k_norm.bias", "weights_proj.weight")}
        if cfg.mlp_layer_types[i] == "dense":
            out |= {p + "mlp.gate_up.weight": torch.cat([sd[L + "mlp.gate_proj.weight"], sd[L + "mlp.up_proj.weight"]]),
                    p + "mlp.down.weight": sd[L + "mlp.down_proj.weight"]}
        else:
            S = L + "mlp.shared_experts."
            out |= {p + "moe.gate.weight": sd[L + "mlp.gate.weight"],
                    p + "moe.correction_bias.weight": sd[L + "mlp.gate.e_score_correction_bias"],
                    p + "moe.gate_up.weight": sd[L + "mlp.experts.gate_up_proj"],
                    p + "moe.down.weight": sd[L + "mlp.experts.down_proj"],
                    p + "moe.shared_gate_up.weight": torch.cat([sd[S + "gate_proj.weight"], sd[S + "up_proj.weight"]]),
                    p + "moe.shared_down.weight": sd[S + "down_proj.weight"]}
    return {k: v.detach() for k, v in out.items()}


# ---------------------------------------------------------------- bf16 / fp32 checkpoints
def test_read_into_our_names_equals_transformers_parameters(saved):
    dtype, model, path = saved
    ours = glm5.from_hf(path, TINY, dtype=dtype)
    want = glm5.expected(TINY, dtype)
    assert ours.keys() == want.keys()
    for name, (shape, dt) in want.items():
        assert tuple(ours[name].shape) == shape and ours[name].dtype == dt, name
    ref = reference(model)
    assert ref.keys() == ours.keys()
    for name, t in ours.items():  # the router stays FP32: its bf16 values upcast exactly
        assert same(t, ref[name].to(t.dtype)), name
    assert ours["layers.1.moe.gate.weight"].dtype == ours["layers.1.moe.correction_bias.weight"].dtype == torch.float32
    # the per-layer kinds: no indexer on shared layers, no experts on the dense one
    assert "layers.1.indexer.wk.weight" not in ours and "layers.2.indexer.wk.weight" in ours
    assert "layers.0.moe.gate_up.weight" not in ours and "layers.0.mlp.gate_up.weight" in ours


def test_to_hf_of_from_hf_is_the_checkpoint_bit_for_bit(saved):
    dtype, _, path = saved
    stored = load_file(path / "model.safetensors")
    assert "model.layers.1.mlp.experts.8.up_proj.weight" in stored  # transformers saves experts one tensor each
    back = glm5.to_hf(glm5.from_hf(path, TINY, dtype=dtype), TINY)
    assert back.keys() == stored.keys()
    for name, t in stored.items():
        fp32 = name.endswith(("mlp.gate.weight", "e_score_correction_bias", "indexer.weights_proj.weight"))
        assert same(back[name], t) or (fp32 and same(back[name].to(t.dtype), t)), name
    # the fused in-memory layout (experts.gate_up_proj) reads the same
    fused = {k: v for k, v in stored.items() if ".experts." not in k}
    ref = reference(hf_model(dtype))
    for i in TINY.sparse_layers:
        fused[f"model.layers.{i}.mlp.experts.gate_up_proj"] = ref[f"layers.{i}.moe.gate_up.weight"]
        fused[f"model.layers.{i}.mlp.experts.down_proj"] = ref[f"layers.{i}.moe.down.weight"]
    nm = glm5.name_map(TINY)
    ours = nm.from_hf(fused, glm5.expected(TINY, dtype))
    assert same(ours["layers.3.moe.gate_up.weight"], ref["layers.3.moe.gate_up.weight"])
    assert "model.layers.3.mlp.experts.gate_up_proj" in nm.to_hf(ours)  # written back as it was read


def test_our_save_loads_back_into_transformers(saved, tmp_path):
    dtype, model, path = saved
    ours = glm5.from_hf(path, TINY, dtype=dtype)
    save_hf_checkpoint(tmp_path, TINY.to_hf(str(dtype)[6:]), glm5.to_hf(ours, TINY))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=dtype).eval()
    assert type(loaded).__name__ == "GlmMoeDsaForCausalLM"
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for name, t in a.items():
        if "rotary_emb" not in name:
            assert torch.equal(b[name].to(t.dtype), t), name
    if dtype == torch.float32:  # (bf16: `model`'s RoPE inv_freq buffer was cast by .to(), `loaded` builds its own)
        tokens = torch.randint(0, TINY.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            assert torch.equal(model(tokens).logits, loaded(tokens).logits)


def test_mtp_layer_is_left_out_and_a_missing_expert_is_named(saved, caplog):
    dtype, _, path = saved
    stored = load_file(path / "model.safetensors")
    mtp = {f"model.layers.{TINY.num_layers}.eh_proj.weight": torch.zeros(4, 4, dtype=dtype),
           f"model.layers.{TINY.num_layers}.enorm.weight": torch.ones(4, dtype=dtype)}
    with caplog.at_level(logging.INFO, logger="alignzoo.models"):
        ours = glm5.from_hf({**stored, **mtp}, TINY, dtype=dtype)
    assert "MTP layer" in caplog.text and not any(k.startswith(f"layers.{TINY.num_layers}.") for k in ours)
    del stored["model.layers.2.mlp.experts.5.up_proj.weight"]
    with pytest.raises(WeightMismatchError, match=r"model.layers.2.mlp.experts.5.up_proj.weight \(expert 5 of "
                                                   r"layers.2.moe.gate_up.weight\)"):
        glm5.from_hf(stored, TINY, dtype=dtype)


# ---------------------------------------------------------------- FP8 block checkpoints
def is_quantized(name: str) -> bool:
    """What GLM-5-FP8 stores as e4m3: every linear but the indexer's weights_proj and the router."""
    return name.endswith(("_proj.weight", "_proj_with_mqa.weight", "wq_b.weight", "wk.weight")) and \
        not name.endswith("weights_proj.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(directory, {HF name: tensor} as written): codes from quantize_weight_fp8 (common.fp8, 128x128 fp32
    scales), bf16 for the rest but the router, which stays FP32."""
    model = hf_model(torch.bfloat16)
    bf16 = tmp_path_factory.mktemp("glm5-bf16")
    model.save_pretrained(bf16)
    out = {}
    for name, t in load_file(bf16 / "model.safetensors").items():
        if is_quantized(name):
            out[name], out[name + "_scale_inv"] = quantize_weight_fp8(t.float())
        else:
            out[name] = t.float() if name.endswith(("mlp.gate.weight", "e_score_correction_bias")) else t
    path = tmp_path_factory.mktemp("glm5-fp8")
    save_file(out, path / "model.safetensors", metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({**TINY.to_hf(), "quantization_config": FP8_CONFIG}))
    return path, out


def test_fp8_checkpoint_reads_as_its_codes_and_scales(fp8_checkpoint):
    path, stored = fp8_checkpoint
    cfg = Glm5Config.from_hf(path)
    assert cfg.quantization == Fp8BlockQuant("dynamic", ("lm_head", "indexers_proj"))
    assert cfg == TINY.replace(quantization=cfg.quantization)
    ours = glm5.from_hf_fp8(path, cfg, dtype=torch.bfloat16)
    I, nbi = TINY.moe_intermediate_size, 1  # 40 rows: one block of gate, one of up
    # experts: codes stacked (E, 2I, H) with [gate | up] rows, scales the parts' grids side by side
    codes, scales = ours["layers.2.moe.gate_up.weight"], ours["layers.2.moe.gate_up.weight_scale_inv"]
    assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32
    assert codes.shape == (9, 2 * I, 72) and scales.shape == (9, 2 * nbi, 1)
    for e in range(TINY.n_routed_experts):
        ex = f"model.layers.2.mlp.experts.{e}."
        assert same(codes[e, :I], stored[ex + "gate_proj.weight"]) and same(codes[e, I:], stored[ex + "up_proj.weight"])
        assert same(scales[e, :nbi], stored[ex + "gate_proj.weight_scale_inv"])
        assert same(scales[e, nbi:], stored[ex + "up_proj.weight_scale_inv"])
        assert same(ours["layers.2.moe.down.weight"][e], stored[ex + "down_proj.weight"])
        assert same(ours["layers.2.moe.down.weight_scale_inv"][e], stored[ex + "down_proj.weight_scale_inv"])
    # a dense gate_up (200 rows a part: two blocks each, the second partial) keeps each part's grid
    gu_s = ours["layers.0.mlp.gate_up.weight_scale_inv"]
    assert gu_s.shape == (4, 1) and same(gu_s[2:], stored["model.layers.0.mlp.up_proj.weight_scale_inv"])
    assert same(ours["layers.0.attn.kv_a.weight"], stored["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    # what is not FP8 reads as from_hf reads it
    quantized = {k for k in ours if k + "_scale_inv" in ours}
    plain = glm5.from_hf(path, TINY, dtype=torch.bfloat16)
    assert "layers.0.indexer.weights_proj.weight" not in quantized and "layers.0.indexer.wk.weight" in quantized
    for name in plain.keys() - quantized:
        assert same(ours[name], plain[name]), name
    assert len(quantized) == sum(k.endswith("_scale_inv") for k in ours)
    # back to HF names: every tensor as written, byte for byte
    back = glm5.to_hf_fp8(ours, TINY)
    assert back.keys() == stored.keys()
    for name, t in stored.items():  # weights_proj, stored bf16 here, reads as FP32 (it upcasts exactly)
        assert same(back[name], t) or (name.endswith("weights_proj.weight") and same(back[name].to(t.dtype), t)), name


def test_fp8_masters_are_the_fp32_products_and_requantize_to_the_codes(fp8_checkpoint):
    path, stored = fp8_checkpoint
    with HFCheckpoint(path) as ckpt:
        src = DequantizedSource(ckpt)
        masters = glm5.from_hf(src, TINY, dtype=torch.float32)
        plan = dict(src.stored)
    ex = "model.layers.3.mlp.experts.4."
    up = FP8_BLOCK128.dequantize(stored[ex + "up_proj.weight"], stored[ex + "up_proj.weight_scale_inv"])
    assert same(masters["layers.3.moe.gate_up.weight"][4, TINY.moe_intermediate_size:], up)
    # an FP8 checkpoint given directly to from_hf is dequantized the same way
    assert same(glm5.from_hf(path, TINY, dtype=torch.float32)["layers.3.moe.gate_up.weight"],
                masters["layers.3.moe.gate_up.weight"])
    # transformers' own dequantization of the same checkpoint gives the same FP32 bits wherever it places the
    # blocks right: its Fp8Dequantize (5.25) takes the block as rows // scale rows, so a dim past 128 that is no
    # multiple of 128 gets other blocks (kv_b's 144 rows: 72-row blocks), or is refused when it does not divide
    # (GLM-5's 576-row kv_a_proj_with_mqa, 5 scale rows). The released convention, ours: 128, the last partial.
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True))
    ref = reference(hf)
    assert ref.keys() == masters.keys()
    part_shapes = {"attn.kv_b": (144, 36), "mlp.gate_up": (200, 72), "mlp.down": (72, 200)}
    for name, t in masters.items():
        if not any(f".{kind}." in name for kind in part_shapes):
            assert same(t, ref[name]), name
    assert same(masters["layers.0.attn.kv_b.weight"][:72], ref["layers.0.attn.kv_b.weight"][:72])
    assert not same(masters["layers.0.attn.kv_b.weight"][72:128], ref["layers.0.attn.kv_b.weight"][72:128])
    assert tuple(stored["model.layers.0.self_attn.kv_b_proj.weight"].shape) == part_shapes["attn.kv_b"]
    back = quantize_for_save(glm5.to_hf(masters, TINY), plan)
    assert back.keys() == stored.keys()
    for name, t in stored.items():  # codes and scales byte for byte; the bf16 rest came back as FP32 masters
        assert same(back[name] if name in plan or name.endswith("_scale_inv") else back[name].to(t.dtype), t), name


def test_fp8_checkpoint_that_mixes_formats_or_dtypes_is_refused(fp8_checkpoint):
    _, stored = fp8_checkpoint
    mixed = dict(stored)
    name = "model.layers.1.mlp.experts.6.down_proj.weight"
    mixed[name] = FP8_BLOCK128.dequantize(mixed[name], mixed.pop(name + "_scale_inv"), torch.bfloat16)
    with pytest.raises(CheckpointError, match=r"layers.1.moe.down.weight: 8 of its 9 checkpoint tensors are FP8 "
                                              r".*experts.6.down_proj.weight is not"):
        glm5.from_hf_fp8(mixed, TINY)
    wrong = dict(stored)
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    wrong[name] = wrong[name].bfloat16()
    with pytest.raises(CheckpointError, match=rf"{name}: stored as bfloat16; fp8_block128 scales are float32"):
        glm5.from_hf_fp8(wrong, TINY)


# ---------------------------------------------------------------- config
@pytest.mark.parametrize("name", list(PRESETS))
def test_config_round_trips_through_config_json_and_transformers(name, tmp_path):
    cfg = PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf()))
    assert Glm5Config.from_hf(tmp_path) == cfg
    hf = transformers.GlmMoeDsaConfig(**cfg.to_hf())
    assert hf.indexer_types == list(cfg.indexer_types) and hf.mlp_layer_types == list(cfg.mlp_layer_types)
    assert hf.first_k_dense_replace == cfg.first_k_dense_replace and hf.head_dim == cfg.qk_rope_head_dim
    hf.save_pretrained(tmp_path / "hf")  # transformers' own config.json, every default written out
    assert Glm5Config.from_hf(tmp_path / "hf") == cfg


def test_glm5_preset_is_transformers_defaults():
    d = transformers.GlmMoeDsaConfig().to_dict()
    d["architectures"] = ["GlmMoeDsaForCausalLM"]
    assert Glm5Config.from_hf(d) == Glm5Config.preset("glm-5") == Glm5Config()
    h200 = Glm5Config.preset("glm-5-h200")
    assert h200.replace(num_layers=78, n_routed_experts=256, layer_types=d["layer_types"],
                        indexer_types=d["indexer_types"], mlp_layer_types=d["mlp_layer_types"]) == Glm5Config()
    assert set(h200.indexer_types) == set(TINY.indexer_types) == {"full", "shared"}
    assert set(h200.mlp_layer_types) == set(TINY.mlp_layer_types) == {"dense", "sparse"}
    assert TINY.index_topk * 30 <= 1000 and TINY.n_group > 1


def test_derived_layer_lists_rope_and_scales_follow_transformers():
    base = {k: v for k, v in TINY.to_hf().items() if k not in ("indexer_types", "mlp_layer_types")}
    for extra in ({"index_topk_freq": 3, "num_hidden_layers": 9}, {"index_topk_pattern": "FSSF"},
                  {"first_k_dense_replace": 2}):
        d = {**base, **extra}
        if "num_hidden_layers" in extra:
            d["layer_types"] = ["indexed_attention"] * 9
        hf = transformers.GlmMoeDsaConfig(**d)
        cfg = Glm5Config.from_hf(d)
        assert list(cfg.indexer_types) == hf.indexer_types and list(cfg.mlp_layer_types) == hf.mlp_layer_types, extra
    assert TINY.selection_source(3) == 2 and TINY.selection_source(1) == 0 and TINY.indexer_layers == (0, 2)
    yarn = {**TINY.to_hf(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                                               "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                                               "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}
    cfg = Glm5Config.from_hf(yarn)
    assert cfg.rope_yarn == Yarn(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0)
    assert cfg.rope == RopeSpec.from_hf(yarn) and cfg.rope.pairing == "interleaved_to_half"
    assert cfg.indexer_rope == RopeSpec.from_hf(yarn, rotary_slice="first")
    assert Glm5Config.from_hf(cfg.to_hf()) == cfg
    from transformers.modeling_rope_utils import yarn_apply_mscale

    hf = transformers.GlmMoeDsaConfig(**yarn)
    assert cfg.softmax_scale == yarn_apply_mscale(hf.rope_parameters, hf.qk_head_dim ** -0.5) != TINY.softmax_scale
    attn = transformers.models.glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaAttention(hf, 0)
    assert attn.scaling == cfg.softmax_scale and attn.indexer.softmax_scale == cfg.indexer_scale
    assert attn.q_a_layernorm.variance_epsilon == attn.kv_a_layernorm.variance_epsilon == 1e-6  # not rms_norm_eps
    assert attn.indexer.k_norm.eps == 1e-6 and attn.indexer.k_norm.bias is not None


def bad(**changes) -> dict:
    return {**TINY.to_hf(), **changes}


@pytest.mark.parametrize("config, error, message", [
    pytest.param({**bad(), "model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}, CheckpointError,
                 r"checkpoint is qwen3 \(Qwen3ForCausalLM\), not glm_moe_dsa", id="model_type"),
    pytest.param(bad(indexer_types=["full", "shared", "full"]), CheckpointError,
                 r"config.json: Glm5Config.indexer_types has 3 entries for num_layers 4", id="indexer-length"),
    pytest.param(bad(indexer_types=["shared", "full", "full", "shared"]), CheckpointError,
                 r"config.json: Glm5Config.indexer_types\[0\] is 'shared'", id="shared-first"),
    pytest.param(bad(indexer_types=["full", "sparse", "full", "full"]), CheckpointError,
                 r"config.json: Glm5Config.indexer_types: \['sparse'\] not among", id="indexer-kind"),
    pytest.param(bad(index_topk=0), CheckpointError, r"config.json: Glm5Config.index_topk must be a positive int",
                 id="index-topk"),
    pytest.param(bad(num_experts_per_tok=-1), CheckpointError,
                 r"config.json: Glm5Config.num_experts_per_tok must be a positive int", id="experts-topk"),
    pytest.param(bad(num_experts_per_tok=7), CheckpointError,
                 r"num_experts_per_tok 7 > the 6 experts of the topk_group 2 groups", id="topk-past-groups"),
    pytest.param(bad(n_group=2), CheckpointError, r"n_routed_experts 9 is not a multiple of n_group 2", id="groups"),
    pytest.param(bad(mlp_layer_types="dense"), CheckpointError, r"mlp_layer_types must be a list", id="mlp-string"),
    pytest.param(bad(tie_word_embeddings="false"), CheckpointError, r"tie_word_embeddings must be a bool", id="tie"),
    pytest.param(bad(num_key_value_heads=1), CheckpointError, r"num_key_value_heads 1 != num_attention_heads 3",
                 id="kv-heads"),
    pytest.param(bad(index_head_dim=8), CheckpointError, r"index_head_dim 8 < qk_rope_head_dim 16", id="index-dim"),
    pytest.param(bad(quantization_config={"quant_method": "awq"}), NotImplementedError, r"quant_method 'awq'",
                 id="awq"),
    pytest.param(bad(quantization_config={**FP8_CONFIG, "weight_block_size": [1, 128]}), NotImplementedError,
                 r"weight_block_size \[1, 128\]", id="fp8-block"),
    pytest.param(bad(attention_bias=True), NotImplementedError, r"attention_bias", id="attention-bias"),
])
def test_a_bad_config_is_refused_naming_its_file_and_field(tmp_path, config, error, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(error, match=message) as e:
        Glm5Config.from_hf(path)
    if error is CheckpointError:
        assert str(path) in str(e.value)


def test_direct_construction_names_the_field():
    with pytest.raises(ValueError, match=r"Glm5Config.index_topk must be a positive int, got 0"):
        TINY.replace(index_topk=0)
    with pytest.raises(ValueError, match=r"layer_types has 4 entries for num_layers 5: .*give one per layer"):
        TINY.replace(num_layers=5)


def test_registered():
    import alignzoo.models.glm5_sparse_fp8 as package

    assert "glm5_sparse_fp8" in alignzoo.list_models() and package.SPEC.name == "glm5_sparse_fp8"
    assert alignzoo.models.model_module("glm5_sparse_fp8") is package
