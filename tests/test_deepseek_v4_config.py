"""deepseek_v4_mhc_mxfp4's config against transformers' ``DeepseekV4Config``: every preset round-trips through
config.json, transformers reads our file with the same derived fields, and the release's legacy keys fold in."""
from __future__ import annotations

import pytest

from alignzoo.models.deepseek_v4_mhc_mxfp4.config import CSA, HCA, PRESETS, SLIDING, DeepseekV4Config, V4Quant
from alignzoo.weights import CheckpointError

transformers = pytest.importorskip("transformers")
DeepseekV4HF = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4").DeepseekV4Config


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_round_trip_and_transformers_reads_them(preset):
    cfg = PRESETS[preset].replace(quantization=V4Quant())
    d = cfg.to_hf()
    assert DeepseekV4Config.from_hf(d) == cfg
    hf = DeepseekV4HF(**{k: v for k, v in d.items() if k not in ("architectures", "model_type")})
    assert list(hf.layer_types) == list(cfg.layer_types)
    assert list(hf.mlp_layer_types) == list(cfg.mlp_layer_types)
    assert hf.compress_rates == dict(cfg.compress_rates)
    assert hf.qk_rope_head_dim == cfg.qk_rope_head_dim
    assert hf.rope_parameters["compress"]["rope_theta"] == cfg.compress_rope_theta
    assert hf.rope_parameters["main"]["rope_type"] == "default"
    assert DeepseekV4Config.from_hf(hf.to_dict()) == cfg


def test_defaults_are_transformers_defaults():
    hf = DeepseekV4HF()
    ours = DeepseekV4Config()
    assert list(hf.layer_types) == list(ours.layer_types) and list(hf.mlp_layer_types) == list(ours.mlp_layer_types)
    for theirs, mine in (("num_hidden_layers", "num_layers"), ("num_attention_heads", "num_heads"),
                         ("head_dim", "head_dim"), ("q_lora_rank", "q_lora_rank"), ("o_groups", "o_groups"),
                         ("index_topk", "index_topk"), ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
                         ("sliding_window", "sliding_window"), ("n_routed_experts", "n_routed_experts"),
                         ("num_experts_per_tok", "num_experts_per_tok"), ("swiglu_limit", "swiglu_limit"),
                         ("routed_scaling_factor", "routed_scaling_factor"), ("vocab_size", "vocab_size")):
        assert getattr(hf, theirs) == getattr(ours, mine), theirs


def test_release_legacy_keys_fold_in():
    d = PRESETS["tiny"].to_hf()
    del d["layer_types"], d["mlp_layer_types"], d["compress_rates"]
    d.update(compress_ratios=[128, 4, 0, 4], compress_rate_hca=16, num_hash_layers=1, expert_dtype="fp4",
             quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "scale_fmt": "ue8m0"})
    cfg = DeepseekV4Config.from_hf(d)
    assert cfg.layer_types == (HCA, CSA, SLIDING, CSA)
    assert dict(cfg.compress_rates) == {CSA: 4, HCA: 16}
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "moe")
    assert cfg.quantization == V4Quant(scale_fmt="ue8m0", expert_dtype="fp4")
    assert [cfg.rate(i) for i in range(4)] == [16, 4, 0, 4]


def test_bad_configs_are_named():
    with pytest.raises(ValueError, match="layer_types has 2 entries"):
        PRESETS["tiny"].replace(layer_types=(CSA, HCA))
    with pytest.raises(ValueError, match="o_groups"):
        PRESETS["tiny"].replace(o_groups=7)
    with pytest.raises(NotImplementedError, match="scoring_func"):
        PRESETS["tiny"].replace(scoring_func="softmax")
    d = PRESETS["tiny"].to_hf()
    d["compress_ratios"], d["layer_types"] = [0, 4, 64, 4], None
    with pytest.raises(CheckpointError, match="compress_ratios has \\[64\\]"):
        DeepseekV4Config.from_hf(d, where="x/config.json")
    d = PRESETS["tiny"].to_hf()
    d["num_key_value_heads"] = 2
    with pytest.raises(NotImplementedError, match="num_key_value_heads"):
        DeepseekV4Config.from_hf(d)
    with pytest.raises(NotImplementedError, match="expert_dtype"):
        V4Quant(expert_dtype="int4")
