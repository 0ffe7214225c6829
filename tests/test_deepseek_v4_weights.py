"""deepseek_v4_mhc_mxfp4's weight names: transformers' ``DeepseekV4ForCausalLM`` state dict and the same tensors
under DeepSeek's release names (one tensor per expert, ``mtp.*`` layers beside) read into the same tensors of
ours, and ours save back as transformers saves them; bad tables and stray tensors are named."""
from __future__ import annotations

import logging

import pytest
import torch

from alignzoo.models.deepseek_v4_mhc_mxfp4 import weights as W
from alignzoo.models.deepseek_v4_mhc_mxfp4.config import PRESETS
from alignzoo.weights import CheckpointError
from alignzoo.weights.name_map import WeightMismatchError

modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_config = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

CFG = PRESETS["tiny"]


@pytest.fixture(scope="module")
def hf_state():
    d = CFG.to_hf()
    for k in ("architectures", "model_type"):
        d.pop(k)
    torch.manual_seed(0)
    model = modeling.DeepseekV4ForCausalLM(hf_config.DeepseekV4Config(**d))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for k, v in sd.items():  # non-trivial values everywhere (zeros / ones at init would hide a mix-up)
        if v.is_floating_point():
            v.copy_(torch.randn(v.shape, generator=torch.Generator().manual_seed(len(k))))
    g = torch.Generator().manual_seed(1)
    for i in CFG.hash_layers:
        sd[f"model.layers.{i}.mlp.gate.tid2eid"] = torch.randint(0, CFG.n_routed_experts, sd[
            f"model.layers.{i}.mlp.gate.tid2eid"].shape, generator=g)
    return sd


def _release(sd):
    """The same tensors under DeepSeek's names: experts unstacked into w1 / w3 / w2, plus an mtp layer."""
    out, I = {}, CFG.moe_intermediate_size
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            i = k.split(".")[2]
            for e in range(v.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w1.weight"] = v[e, :I].clone()
                out[f"layers.{i}.ffn.experts.{e}.w3.weight"] = v[e, I:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            i = k.split(".")[2]
            for e in range(v.shape[0]):
                out[f"layers.{i}.ffn.experts.{e}.w2.weight"] = v[e].clone()
        else:
            name = W.hf_to_release(k)
            assert name is not None and W.release_to_hf(name) == k, k
            out[name] = v
    out["mtp.0.attn.wq_a.weight"] = torch.zeros(3, 3)
    return out


def test_transformers_names_round_trip(hf_state):
    ours = W.from_hf(dict(hf_state), CFG, torch.float32)
    assert set(ours) == set(W.expected(CFG, torch.float32))
    assert ours["layers.0.moe.tid2eid.weight"].dtype == torch.int64
    assert ours["layers.1.attn.sinks"].dtype == torch.float32
    back = W.to_hf(ours, CFG)
    assert set(back) == set(hf_state)
    for k, v in hf_state.items():
        assert torch.equal(back[k], v.to(back[k].dtype)), k


def test_release_names_read_into_the_same_tensors(hf_state, caplog):
    want = W.from_hf(dict(hf_state), CFG, torch.bfloat16)
    release = _release(hf_state)
    assert W.is_release(release) and not W.is_release(hf_state)
    with caplog.at_level(logging.INFO, logger="alignzoo.models"):
        got = W.from_hf(release, CFG, torch.bfloat16)
    assert "multi-token-prediction" in caplog.text
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    assert got["layers.1.moe.gate_up.weight"].dtype == torch.bfloat16
    assert got["layers.1.moe.gate.weight"].dtype == torch.bfloat16 and got["layers.1.attn.sinks"].dtype == torch.float32


def test_bad_tables_and_stray_tensors_are_named(hf_state):
    sd = dict(hf_state)
    table = sd["model.layers.0.mlp.gate.tid2eid"].clone()
    table[5, 1] = CFG.n_routed_experts
    sd["model.layers.0.mlp.gate.tid2eid"] = table
    with pytest.raises(CheckpointError, match=r"layers.0.moe.tid2eid.weight\[5, 1\] = 9 is not an expert"):
        W.from_hf(sd, CFG)
    sd = dict(hf_state)
    sd["model.layers.0.mlp.gate.tid2eid"] = sd["model.layers.0.mlp.gate.tid2eid"].float()
    with pytest.raises(CheckpointError, match="tid2eid is stored as torch.float32"):
        W.from_hf(sd, CFG)
    sd = dict(hf_state)
    sd["model.layers.1.self_attn.extra.weight"] = torch.zeros(2)
    del sd["model.layers.1.self_attn.sinks"]
    with pytest.raises(WeightMismatchError, match="(?s)1 missing, 1 unexpected.*self_attn.sinks.*extra.weight"):
        W.from_hf(sd, CFG)
