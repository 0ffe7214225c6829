"""Hugging Face checkpoint reading/writing and the qwen3 name map, against real transformers checkpoints."""
from __future__ import annotations

import json
import logging
import shutil
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from alignzoo.models.qwen3 import weights as qwen3
from alignzoo.weights import (
    CheckpointError,
    HFCheckpoint,
    NameMap,
    WeightMismatchError,
    read_hf_config,
    save_hf_checkpoint,
)

LAYERS = 3
SIZES = dict(hidden_size=72, num_hidden_layers=LAYERS, num_attention_heads=3, num_key_value_heads=1,
             head_dim=24, intermediate_size=100, vocab_size=211)


def ours_cfg(tie: bool) -> SimpleNamespace:
    return SimpleNamespace(vocab_size=211, hidden_size=72, intermediate_size=100, num_layers=LAYERS, num_heads=3,
                           num_kv_heads=1, head_dim=24, tie_word_embeddings=tie)


def tiny_qwen3(tie: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(1 + tie)
    model = Qwen3ForCausalLM(Qwen3Config(**SIZES, tie_word_embeddings=tie))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()  # norms too: an all-ones weight would hide a swapped name
    return model


@pytest.fixture(scope="module")
def hf_models():
    return {tie: tiny_qwen3(tie) for tie in (True, False)}


@pytest.fixture(scope="module")
def hf_dirs(hf_models, tmp_path_factory):
    """{(tie, sharded): checkpoint dir} written by transformers' save_pretrained."""
    dirs = {}
    for tie, model in hf_models.items():
        for sharded in (False, True):
            d = tmp_path_factory.mktemp(f"qwen3_tie{int(tie)}_shard{int(sharded)}")
            model.save_pretrained(d, max_shard_size="40KB" if sharded else "1GB")
            dirs[tie, sharded] = d
    return dirs


CASES = [pytest.param(tie, sharded, id=f"{'tied' if tie else 'untied'}-{'sharded' if sharded else 'single'}")
         for tie in (True, False) for sharded in (False, True)]


@pytest.mark.parametrize("tie, sharded", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_from_hf_matches_state_dict(hf_models, hf_dirs, tie, sharded, dtype):
    sd = {k: v.to(dtype) for k, v in hf_models[tie].state_dict().items()}
    if sharded:
        assert (hf_dirs[tie, sharded] / "model.safetensors.index.json").is_file()
    ours = qwen3.from_hf(hf_dirs[tie, sharded], ours_cfg(tie), dtype=dtype)

    assert set(ours) == set(qwen3.expected(ours_cfg(tie), dtype))
    assert ("lm_head.weight" in ours) == (not tie)
    want = {"embed.weight": sd["model.embed_tokens.weight"], "norm.weight": sd["model.norm.weight"]}
    if not tie:
        want["lm_head.weight"] = sd["lm_head.weight"]
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        want |= {
            f"layers.{i}.attn_norm.weight": sd[p + "input_layernorm.weight"],
            f"layers.{i}.qkv.weight": torch.cat([sd[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]),
            f"layers.{i}.q_norm.weight": sd[p + "self_attn.q_norm.weight"],
            f"layers.{i}.k_norm.weight": sd[p + "self_attn.k_norm.weight"],
            f"layers.{i}.o.weight": sd[p + "self_attn.o_proj.weight"],
            f"layers.{i}.mlp_norm.weight": sd[p + "post_attention_layernorm.weight"],
            f"layers.{i}.gate_up.weight": torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]]),
            f"layers.{i}.down.weight": sd[p + "mlp.down_proj.weight"],
        }
    assert set(want) == set(ours)
    for name, t in ours.items():
        assert t.dtype == dtype and t.is_contiguous(), name
        assert torch.equal(t, want[name]), name


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("max_shard_bytes", [30_000, 2**30], ids=["sharded", "single"])
def test_round_trip_through_transformers(hf_models, hf_dirs, tmp_path, tie, max_shard_bytes):
    ours = qwen3.from_hf(hf_dirs[tie, False], ours_cfg(tie), dtype=torch.float32)
    hf = qwen3.to_hf(ours, ours_cfg(tie))
    assert ("lm_head.weight" in hf) == (not tie)
    files = save_hf_checkpoint(tmp_path, read_hf_config(hf_dirs[tie, False]), hf, max_shard_bytes=max_shard_bytes)

    if max_shard_bytes < 2**30:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
        assert sorted(set(index["weight_map"].values())) == files
        assert index["metadata"]["total_size"] == sum(t.nbytes for t in hf.values())
    else:
        assert files == ["model.safetensors"]
        assert not (tmp_path / "model.safetensors.index.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    loaded = Qwen3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    original = dict(hf_models[tie].named_parameters())
    params = dict(loaded.named_parameters())
    assert set(params) == set(original)
    for name, p in params.items():
        assert torch.equal(p, original[name]), name
    if tie:
        assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()


def broken_state_dict(model):
    """An untied checkpoint with one tensor missing, one unexpected and two mis-shaped."""
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    del sd["model.layers.1.self_attn.k_proj.weight"]
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(3)
    sd["model.layers.2.mlp.down_proj.weight"] = sd["model.layers.2.mlp.down_proj.weight"][:, :99]
    sd["model.layers.0.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"][:98]
    return sd


@pytest.mark.parametrize("on_disk", [True, False], ids=["dir", "dict"])
def test_mismatch_lists_every_problem_at_once(hf_models, hf_dirs, tmp_path, on_disk):
    sd = broken_state_dict(hf_models[False])
    source = sd
    if on_disk:
        save_hf_checkpoint(tmp_path, read_hf_config(hf_dirs[False, False]), sd, max_shard_bytes=50_000)
        source = tmp_path
    with pytest.raises(WeightMismatchError) as info:
        qwen3.from_hf(source, ours_cfg(False), dtype=torch.float32)
    e, msg = info.value, str(info.value)
    assert "1 missing, 1 unexpected, 2 mis-shaped" in msg
    assert "model.layers.1.self_attn.k_proj.weight (part of layers.1.qkv.weight)" in msg
    assert "model.layers.0.self_attn.extra.weight" in msg
    assert "model.layers.2.mlp.down_proj.weight: expected (72, 100), found (72, 99)" in msg
    assert "model.layers.0.mlp.up_proj.weight: expected (100, 72), found (98, 72)" in msg
    assert (len(e.missing), len(e.unexpected), len(e.misshaped)) == (1, 1, 2)


def test_untied_checkpoint_requires_lm_head(hf_models):
    sd = dict(hf_models[False].state_dict())
    del sd["lm_head.weight"]
    with pytest.raises(WeightMismatchError, match=r"(?s)missing \(1\):\n  lm_head.weight\n.*tie_word_embeddings false"):
        qwen3.from_hf(sd, ours_cfg(False), dtype=torch.float32)


def test_tolerated_extras_are_logged(hf_models, caplog):
    """A tied checkpoint that still stores lm_head, and a rotary inv_freq buffer, load with a debug note."""
    model = hf_models[True]
    sd = dict(model.state_dict())
    sd["lm_head.weight"] = model.lm_head.weight.detach().clone()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(12)
    with caplog.at_level(logging.DEBUG, logger="alignzoo.weights.name_map"):
        ours = qwen3.from_hf(sd, ours_cfg(True), dtype=torch.float32)
    assert "lm_head.weight" not in ours
    assert "lm_head.weight" in caplog.text and "rotary_emb.inv_freq" in caplog.text


def test_tied_name_falls_back_to_embedding(hf_models):
    sd = dict(hf_models[True].state_dict())
    sd.pop("lm_head.weight", None)
    cfg = ours_cfg(True)
    nm = NameMap({"embed.weight": "model.embed_tokens.weight", "lm_head.weight": "lm_head.weight"},
                 tied={"lm_head.weight": "embed.weight"}, tie_word_embeddings=True)
    shape = (cfg.vocab_size, cfg.hidden_size)
    sd = {k: sd[k] for k in ["model.embed_tokens.weight"]}
    out = nm.from_hf(sd, {"embed.weight": (shape, torch.float32), "lm_head.weight": (shape, torch.float32)})
    assert torch.equal(out["lm_head.weight"], sd["model.embed_tokens.weight"])
    assert list(nm.to_hf(out)) == ["model.embed_tokens.weight"]


def test_fused_sizes_recorded_when_not_given():
    hf = {"a.0.q": torch.randn(5, 4), "a.0.k": torch.randn(3, 4), "a.1.q": torch.randn(5, 4), "a.1.k": torch.randn(3, 4)}
    nm = NameMap({"l.{}.qk": ("a.{}.q", "a.{}.k")})
    with pytest.raises(KeyError, match="no split sizes"):
        nm.to_hf({"l.0.qk": torch.randn(8, 4)})
    ours = nm.from_hf(hf, {f"l.{i}.qk": ((8, 4), torch.float32) for i in range(2)})
    back = nm.to_hf(ours)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(WeightMismatchError, match=r"cat\(a.0.q, a.0.k\) for l.0.qk: expected 9 rows, found 8"):
        nm.from_hf(hf, {"l.0.qk": ((9, 4), torch.float32), "l.1.qk": ((8, 4), torch.float32)})
    with pytest.raises(KeyError, match="no HF name for 1 tensor"):
        nm.from_hf(hf, {"l.0.qkv": ((8, 4), torch.float32)})


def test_llama_checkpoint_refused(tmp_path):
    LlamaForCausalLM(LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=40, vocab_size=64)).save_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match=r"checkpoint is llama \(LlamaForCausalLM\), not qwen3"):
        qwen3.from_hf(tmp_path, ours_cfg(False))


def test_pickled_checkpoint_refused(hf_dirs, tmp_path):
    shutil.copy(hf_dirs[False, False] / "config.json", tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"never unpickled")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: pickled checkpoints are refused.*save_pretrained"):
        qwen3.from_hf(tmp_path, ours_cfg(False))


def test_missing_files_named(hf_dirs, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        HFCheckpoint(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        read_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor model.safetensors.index.json"):
        HFCheckpoint(tmp_path)

    d = tmp_path / "ckpt"
    shutil.copytree(hf_dirs[False, True], d)
    shards = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))
    (d / shards[1]).unlink()
    with pytest.raises(FileNotFoundError, match=rf"names 1 shard\(s\) missing .*: {shards[1]}"):
        qwen3.from_hf(d, ours_cfg(False))


def test_index_entry_absent_from_its_shard(hf_dirs, tmp_path):
    shutil.copytree(hf_dirs[False, True], tmp_path, dirs_exist_ok=True)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    wrong = index["weight_map"]["model.embed_tokens.weight"]
    assert index["weight_map"]["model.norm.weight"] != wrong
    index["weight_map"]["model.norm.weight"] = wrong
    index_path.write_text(json.dumps(index))
    with HFCheckpoint(tmp_path) as ckpt:
        with pytest.raises(CheckpointError, match=f"1 tensor\\(s\\) in {wrong}, which does not hold them: model.norm.weight"):
            ckpt.get("model.norm.weight")


def test_save_handles_shared_and_strided_tensors(tmp_path):
    base = torch.arange(24.0).reshape(4, 6)
    tensors = {"a": base, "b": base, "c": base.t(), "d": base[1:3], "e": torch.zeros(0, 3)}
    save_hf_checkpoint(tmp_path, {"model_type": "toy"}, tensors)
    with HFCheckpoint(tmp_path) as ckpt:
        assert set(ckpt.keys()) == set(tensors)
        for k, t in tensors.items():
            assert ckpt.shape(k) == tuple(t.shape) and torch.equal(ckpt.get(k), t), k


def test_resave_replaces_stale_files(tmp_path):
    tensors = {f"w{i}": torch.full((100,), float(i)) for i in range(5)}
    assert len(save_hf_checkpoint(tmp_path, {}, tensors, max_shard_bytes=800)) == 3
    assert save_hf_checkpoint(tmp_path, {}, tensors) == ["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    assert len(save_hf_checkpoint(tmp_path, {}, tensors, max_shard_bytes=400)) == 5
    assert "model.safetensors" not in {p.name for p in tmp_path.iterdir()}
    with HFCheckpoint(tmp_path) as ckpt:
        assert all(torch.equal(ckpt.get(k), t) for k, t in tensors.items())
