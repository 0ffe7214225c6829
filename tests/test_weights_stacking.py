"""MoE checkpoints: per-expert tensors stacked (and fused) into our (E, ., .) weights and unstacked on
save, fusion along any dim, one of several checkpoint layouts.

The expert names and the in-memory layout come from transformers' own Qwen3.5-MoE (which saves one
tensor per expert and keeps ``experts.gate_up_proj`` (E, 2I, H) = cat(gate, up) along dim 1).
"""
from __future__ import annotations

import pytest
import torch
from alignzoo.weights import HFCheckpoint, NameMap, WeightMismatchError, save_hf_checkpoint
from alignzoo.weights.name_map import Fuse, OneOf, Stack

E, I, H = 4, 24, 32


def expert(p: str, prefix: str = "model.layers.{}.mlp.experts") -> Stack:
    return Stack(f"{prefix}.{{expert}}.{p}.weight", E)


def moe_map(others=(), count: int = E) -> NameMap:
    """Experts per-expert (transformers' save) or fused (Qwen3.5's release), plus identity entries."""
    gate, up, down = (Stack(f"model.layers.{{}}.mlp.experts.{{expert}}.{p}_proj.weight", count)
                      for p in ("gate", "up", "down"))
    return NameMap({
        "layers.{}.experts.gate_up.weight": OneOf([Fuse((gate, up), dim=1), "model.layers.{}.mlp.experts.gate_up_proj"]),
        "layers.{}.experts.down.weight": OneOf([down, "model.layers.{}.mlp.experts.down_proj"]),
        **{k: k for k in others},
    }, name="qwen3_5_moe")


def moe_expected(layers=(0,), dtype=torch.float32, others=None) -> dict:
    out = {}
    for i in layers:
        out[f"layers.{i}.experts.gate_up.weight"] = ((E, 2 * I, H), dtype)
        out[f"layers.{i}.experts.down.weight"] = ((E, H, I), dtype)
    return out | (others or {})


def per_expert_sd(seed: int = 0, layers=(0,)) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in layers:
        for j in range(E):
            for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                sd[f"model.layers.{i}.mlp.experts.{j}.{p}_proj.weight"] = torch.randn(*shape, generator=g)
    return sd


# ---------------------------------------------------------------- stacking against transformers
@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """A 2-layer Qwen3.5-MoE (GDN + full attention) saved by transformers: one tensor per expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(hidden_size=H, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, moe_intermediate_size=I, shared_expert_intermediate_size=I, num_experts=E,
                               num_experts_per_tok=2, vocab_size=64, linear_num_key_heads=2, linear_num_value_heads=2,
                               linear_key_head_dim=8, linear_value_head_dim=8,
                               layer_types=["linear_attention", "full_attention"])
    model = Qwen3_5MoeForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    d = tmp_path_factory.mktemp("qwen3_5_moe")
    model.save_pretrained(d)
    return model, d


def test_stacked_experts_match_transformers_and_save_back(hf_moe, tmp_path):
    model, d = hf_moe
    with HFCheckpoint(d) as ckpt:
        names = ckpt.keys()
        others = {n: (ckpt.shape(n), torch.float32) for n in names if ".mlp.experts." not in n}
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names  # transformers saves one tensor per expert
    nm = moe_map(others)
    ours = nm.from_hf(d, moe_expected((0, 1), others=others))
    params = dict(model.named_parameters())
    for i in (0, 1):
        assert torch.equal(ours[f"layers.{i}.experts.gate_up.weight"], params[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(ours[f"layers.{i}.experts.down.weight"], params[f"model.layers.{i}.mlp.experts.down_proj"])

    hf = nm.to_hf(ours)
    assert set(hf) == set(names)
    up = hf["model.layers.0.mlp.experts.2.up_proj.weight"]
    assert up.untyped_storage().data_ptr() == ours["layers.0.experts.gate_up.weight"].untyped_storage().data_ptr()
    save_hf_checkpoint(tmp_path, model.config.to_dict(), hf)
    loaded = type(model).from_pretrained(tmp_path, dtype=torch.float32)
    back = dict(loaded.named_parameters())
    assert set(back) == set(params)
    for n, p in params.items():
        assert torch.equal(back[n], p), n


def test_fused_release_layout_is_read_and_written_as_found(hf_moe, tmp_path):
    """Qwen3.5's released checkpoints hold experts.gate_up_proj (E, 2I, H): the second option."""
    model, _ = hf_moe
    sd = {n: p.detach() for n, p in model.named_parameters() if ".mlp.experts." in n and n.startswith("model.layers.0")}
    assert set(sd) == {"model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"}
    nm = moe_map()
    ours = nm.from_hf(sd, moe_expected())
    assert torch.equal(ours["layers.0.experts.gate_up.weight"], sd["model.layers.0.mlp.experts.gate_up_proj"])
    hf = nm.to_hf(ours)
    assert set(hf) == set(sd) and all(torch.equal(hf[k], sd[k]) for k in sd)
    assert nm.hf_names("layers.0.experts.down.weight") == ("model.layers.0.mlp.experts.down_proj",)


def test_stack_and_fuse_bitwise_in_bf16():
    sd = per_expert_sd(1)
    nm = moe_map()
    ours = nm.from_hf(sd, moe_expected(dtype=torch.bfloat16))
    gu = ours["layers.0.experts.gate_up.weight"]
    for j in range(E):
        assert torch.equal(gu[j, :I], sd[f"model.layers.0.mlp.experts.{j}.gate_proj.weight"].bfloat16())
        assert torch.equal(gu[j, I:], sd[f"model.layers.0.mlp.experts.{j}.up_proj.weight"].bfloat16())
        assert torch.equal(ours["layers.0.experts.down.weight"][j], sd[f"model.layers.0.mlp.experts.{j}.down_proj.weight"].bfloat16())
    back = nm.to_hf(ours)
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k].bfloat16()) for k in sd)


def test_missing_misshaped_and_extra_experts_are_named():
    sd = per_expert_sd(2)
    del sd["model.layers.0.mlp.experts.2.up_proj.weight"]
    sd["model.layers.0.mlp.experts.4.down_proj.weight"] = torch.zeros(H, I)  # a fifth expert
    for j in range(E):
        del sd[f"model.layers.0.mlp.experts.{j}.down_proj.weight"]
    with pytest.raises(WeightMismatchError) as info:
        moe_map().from_hf(sd, moe_expected())
    e, msg = info.value, str(info.value)
    assert e.missing == ["model.layers.0.mlp.experts.2.up_proj.weight (expert 2 of layers.0.experts.gate_up.weight)",
                         "model.layers.0.mlp.experts.{0..3}.down_proj.weight (all 4 experts of layers.0.experts.down.weight)"]
    assert e.unexpected == ["model.layers.0.mlp.experts.4.down_proj.weight"]
    assert "no layout is complete" in msg and "model.layers.0.mlp.experts.down_proj" in msg

    sd = per_expert_sd(2)
    sd["model.layers.0.mlp.experts.1.gate_proj.weight"] = torch.zeros(I, H + 1)
    with pytest.raises(WeightMismatchError) as info:
        moe_map().from_hf(sd, moe_expected())
    assert info.value.misshaped == [("model.layers.0.mlp.experts.1.gate_proj.weight: expected (24, 32), found (24, 33) "
                                     "(expert 1 of layers.0.experts.gate_up.weight (4, 48, 32))")]
    with pytest.raises(WeightMismatchError, match=r"stacks 4"):
        moe_map(count=E - 1).from_hf(per_expert_sd(2), moe_expected())


def test_to_hf_refuses_a_stack_of_the_wrong_size():
    nm = moe_map()
    with pytest.raises(ValueError, match=r"layers.0.experts.down.weight \(3, 32, 24\) stacks 3 experts, .* has 4"):
        nm.to_hf({"layers.0.experts.down.weight": torch.zeros(3, H, I)})


def test_fuse_along_the_last_dim_and_split_back():
    g = torch.Generator().manual_seed(3)
    hf = {f"a.{i}.{p}": torch.randn(5, n, generator=g) for i in range(2) for p, n in (("x", 3), ("y", 4))}
    nm = NameMap({"l.{}.xy": Fuse(("a.{}.x", "a.{}.y"), dim=-1)})
    with pytest.raises(KeyError, match="no split sizes"):
        nm.to_hf({"l.0.xy": torch.zeros(5, 7)})
    ours = nm.from_hf(hf, {f"l.{i}.xy": ((5, 7), torch.float32) for i in range(2)})
    assert torch.equal(ours["l.1.xy"], torch.cat([hf["a.1.x"], hf["a.1.y"]], dim=1))
    back = nm.to_hf(ours)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    with pytest.raises(WeightMismatchError, match=r"cat\(a.0.x, a.0.y\) for l.0.xy: expected 8 along dim 1, found 7"):
        nm.from_hf(hf, {"l.0.xy": ((5, 8), torch.float32), "l.1.xy": ((5, 7), torch.float32)})

    sized = NameMap({"l.{}.xy": Fuse(("a.{}.x", "a.{}.y"), dim=1, sizes=(3, 4))})
    assert torch.equal(sized.to_hf({"l.0.xy": ours["l.0.xy"]})["a.0.y"], hf["a.0.y"])
    with pytest.raises(WeightMismatchError, match=r"a.0.y: expected \(5, 4\), found \(5, 3\) \(part of l.0.xy"):
        NameMap({"l.{}.xy": Fuse(("a.{}.x", "a.{}.y"), dim=1, sizes=(4, 4))}).from_hf(
            {"a.0.x": torch.zeros(5, 4), "a.0.y": torch.zeros(5, 3)}, {"l.0.xy": ((5, 8), torch.float32)})
    with pytest.raises(ValueError, match="has 8 along dim 1"):
        sized.to_hf({"l.0.xy": torch.zeros(5, 8)})
