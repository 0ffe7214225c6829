"""MoE checkpoints: per-expert tensors stacked (and fused) into our (E, ., .) weights and unstacked on
save, fusion along any dim, one of several checkpoint layouts, and quantized formats (FP8 with fp32
or E8M0 scales, MXFP4: packed E2M1 codes with E8M0 scales per 32 along K) read as float masters and
written back.

The expert names and the in-memory layout come from transformers' own Qwen3.5-MoE (which saves one
tensor per expert and keeps ``experts.gate_up_proj`` (E, 2I, H) = cat(gate, up) along dim 1); the
DeepSeek-V4 shaped checkpoint follows its conversion mapping (``layers.{i}.ffn.experts.{j}.w1``,
codes beside a ``.scale``).
"""
from __future__ import annotations

import pytest
import torch

from alignzoo.weights import CheckpointError, HFCheckpoint, NameMap, WeightMismatchError, save_hf_checkpoint
from alignzoo.common.moe.mxfp4 import e2m1_decode, e2m1_encode, e8m0_to_float
from alignzoo.weights.formats import (FP8_BLOCK128, FP8_BLOCK128_E8M0, MXFP4, DequantizedSource, QuantRule,
                                      plan_quantization, quantize_for_save)
from alignzoo.weights.name_map import Fuse, OneOf, Stack

E, I, H = 4, 24, 32


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as integers: torch.equal on these tells -0.0 from 0.0."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


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


# ---------------------------------------------------------------- formats
def test_e2m1_nibbles_values_and_ties():
    # 0x72: low nibble 2 (1.0) is the even index, high 7 (6.0) the odd; 0x9F: -6.0 then -0.5
    assert torch.equal(e2m1_decode(torch.tensor([[0x72, 0x9F]], dtype=torch.uint8)),
                       torch.tensor([[1.0, 6.0, -6.0, -0.5]]))
    q = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.0, -0.3, 0.0, 2.9])
    nib = e2m1_encode(q)
    lo, hi = nib & 0xF, nib >> 4
    got = torch.stack([lo, hi], -1).reshape(-1).tolist()
    assert got == [0, 2, 2, 4, 4, 6, 6, 7, 8, 9, 0, 5]  # ties to the even code, 7.0 saturates, -0.0 keeps its sign
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    want = torch.tensor([2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127, float("nan")])
    assert torch.equal(bits(e8m0_to_float(e)), bits(want))
    assert torch.equal(bits(e8m0_to_float(e.view(torch.float8_e8m0fnu))), bits(want))


def canonical_mxfp4(shape, seed=0):
    """Codes with a +-6 or +-4 in every 32-group (so the quantizer picks the same exponent) and scales."""
    *lead, N, K = shape
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (*lead, N, K // 2), dtype=torch.uint8, generator=g)
    groups = codes.view(*lead, N, K // 32, 16)
    groups[..., 0] = (groups[..., 0] & 0xF0) | torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[
        torch.randint(0, 4, groups[..., 0].shape, generator=g)]
    scales = torch.randint(110, 140, (*lead, N, K // 32), dtype=torch.uint8, generator=g)
    return codes, scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_mxfp4_round_trip(dtype):
    codes, scales = canonical_mxfp4((3, 5, 96))
    w = MXFP4.dequantize(codes, scales, dtype)
    assert w.shape == (3, 5, 96) and w.dtype == dtype
    assert torch.equal(w.float(), MXFP4.dequantize(codes, scales))  # bf16 holds every E2M1 x 2^k
    c, s = MXFP4.quantize(w)
    assert c.dtype == s.dtype == torch.uint8
    assert torch.equal(c, codes) and torch.equal(s, scales)  # canonical codes come back byte for byte

    # representable but not canonical (a group topping at 3.0): another exponent, the same values
    small = codes & 0x55  # nibbles 0..5 only: |values| <= 3
    c, s = MXFP4.quantize(MXFP4.dequantize(small, scales, dtype))
    assert not torch.equal(s, scales)
    assert torch.equal(bits(MXFP4.dequantize(c, s, dtype)), bits(MXFP4.dequantize(small, scales, dtype)))

    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    c, s = MXFP4.quantize(x)
    err = (MXFP4.dequantize(c, s) - x.float()).abs()
    assert bool((err <= e8m0_to_float(s).repeat_interleave(32, -1)).all())  # half the widest step (4 -> 6) x scale
    with pytest.raises(ValueError, match=r"w1: holds 7 NaN/Inf"):
        MXFP4.quantize(torch.where(torch.arange(64) == 5, float("inf"), x), name="w1")
    with pytest.raises(ValueError, match=r"K % 32 == 0 .* K=48"):
        MXFP4.quantize(torch.zeros(2, 48))


def test_fp8_formats_round_trip():
    from alignzoo.common.fp8 import dequantize_weight_fp8, quantize_weight_fp8

    g = torch.Generator().manual_seed(4)
    raw = torch.randint(0, 256, (2, 200, 300), dtype=torch.uint8, generator=g)
    raw[(raw & 0x7F) == 0x7F] = 0  # no NaN codes
    raw[:, ::128, ::128] = 0x7E  # 448 in every 128x128 block: canonical
    codes = raw.view(torch.float8_e4m3fn)
    e = torch.randint(110, 140, (2, 2, 3), dtype=torch.uint8, generator=g)
    w = FP8_BLOCK128_E8M0.dequantize(codes, e)
    c, s = FP8_BLOCK128_E8M0.quantize(w)
    assert torch.equal(bits(c), raw) and torch.equal(s, e)
    # fp32 scales (HF weight_scale_inv) are the common.fp8 quantizer's, one matrix of a stack at a time
    scale_inv = torch.rand(2, 2, 3, generator=g) + 0.5
    w = FP8_BLOCK128.dequantize(codes, scale_inv)
    assert torch.equal(bits(w[1]), bits(dequantize_weight_fp8(codes[1], scale_inv[1])))
    nan = torch.where(torch.rand(raw.shape, generator=g) < 0.01, raw | 0x7F, raw).view(torch.float8_e4m3fn)
    for cs in (codes, nan):  # the whole stack in one product: each matrix's bits, NaN codes included
        assert torch.equal(bits(FP8_BLOCK128.dequantize(cs, scale_inv)),
                           bits(torch.stack([dequantize_weight_fp8(c, s) for c, s in zip(cs, scale_inv)])))
    c, s = FP8_BLOCK128.quantize(w)
    c1, s1 = quantize_weight_fp8(w[1])
    assert torch.equal(bits(c[1]), bits(c1)) and torch.equal(s[1], s1)
    with pytest.raises(CheckpointError, match=r"x.scale: expected \(2, 2, 3\) for fp8_block128_e8m0 codes x"):
        FP8_BLOCK128_E8M0.dequantize(codes, e[:, :1], name="x", scale_name="x.scale")
    with pytest.raises(CheckpointError, match=r"x: stored as bfloat16; mxfp4 codes are uint8 or int8"):
        MXFP4.dequantize(torch.zeros(2, 16, dtype=torch.bfloat16), e, name="x")


# ---------------------------------------------------------------- a DeepSeek-V4 shaped checkpoint
V4_RULES = (
    QuantRule(MXFP4, suffix="weight", scale_suffix="scale", pattern=r"\.experts\.\d+\.w[123]\.weight$",
              codes_dtype=torch.int8, scales_dtype=torch.float8_e8m0fnu),
    QuantRule(FP8_BLOCK128_E8M0, suffix="weight", scale_suffix="scale", pattern=r"\.attn\.\w+\.weight$",
              scales_dtype=torch.float8_e8m0fnu),
)


def v4_checkpoint(layers=(0, 1)) -> dict[str, torch.Tensor]:
    """Experts w1/w3 (I, H) and w2 (H, I) as int8 E2M1 pairs + E8M0 scales, a dense e4m3 linear with
    128x128 E8M0 scales, a bf16 norm: what DeepSeek-V4 stores (names before transformers' renames)."""
    out = {}
    g = torch.Generator().manual_seed(9)
    for i in layers:
        for j in range(E):
            for w, shape in (("w1", (I, 64)), ("w3", (I, 64)), ("w2", (64, I * 4))):
                c, s = canonical_mxfp4(shape, seed=100 * i + 10 * j + int(w[1]))
                out[f"layers.{i}.ffn.experts.{j}.{w}.weight"] = c.view(torch.int8)
                out[f"layers.{i}.ffn.experts.{j}.{w}.scale"] = s.view(torch.float8_e8m0fnu)
        raw = torch.randint(0, 126, (130, 64), dtype=torch.uint8, generator=g)
        raw[0, 0] = raw[128, 0] = 0x7E
        out[f"layers.{i}.attn.wq_a.weight"] = raw.view(torch.float8_e4m3fn)
        out[f"layers.{i}.attn.wq_a.scale"] = torch.randint(120, 130, (2, 1), dtype=torch.uint8, generator=g).view(
            torch.float8_e8m0fnu)
        out[f"layers.{i}.attn_norm.weight"] = torch.randn(64, generator=g).bfloat16()
    return out


def v4_map() -> NameMap:
    ex = "layers.{}.ffn.experts.{expert}"
    return NameMap({
        "layers.{}.experts.gate_up.weight": Fuse((Stack(ex + ".w1.weight", E), Stack(ex + ".w3.weight", E)), dim=1),
        "layers.{}.experts.down.weight": Stack(ex + ".w2.weight", E),
        "layers.{}.wq_a.weight": "layers.{}.attn.wq_a.weight",
        "layers.{}.attn_norm.weight": "layers.{}.attn_norm.weight",
    }, name="deepseek_v4")


def v4_expected(dtype) -> dict:
    return {k: (s, dtype) for i in (0, 1) for k, s in {
        f"layers.{i}.experts.gate_up.weight": (E, 2 * I, 64), f"layers.{i}.experts.down.weight": (E, 64, 4 * I),
        f"layers.{i}.wq_a.weight": (130, 64), f"layers.{i}.attn_norm.weight": (64,)}.items()}


def test_quantized_experts_load_as_masters_and_save_back_bytewise(tmp_path):
    stored = v4_checkpoint()
    save_hf_checkpoint(tmp_path / "in", {"model_type": "deepseek_v4"}, stored)
    nm = v4_map()
    with HFCheckpoint(tmp_path / "in") as ckpt:
        src = DequantizedSource(ckpt, V4_RULES)
        assert not any(k.endswith(".scale") for k in src.keys())  # noqa: SIM118 (a source, not a dict)
        ours = nm.from_hf(src, v4_expected(torch.bfloat16))
        plan = dict(src.stored)
    gu = ours["layers.1.experts.gate_up.weight"]
    for j in range(E):
        w3 = MXFP4.dequantize(stored[f"layers.1.ffn.experts.{j}.w3.weight"], stored[f"layers.1.ffn.experts.{j}.w3.scale"])
        assert torch.equal(gu[j, I:], w3.bfloat16())  # transformers' gate_up_proj = cat(w1, w3) along dim 1
    assert torch.equal(ours["layers.0.wq_a.weight"],
                       FP8_BLOCK128_E8M0.dequantize(stored["layers.0.attn.wq_a.weight"],
                                                    stored["layers.0.attn.wq_a.scale"], torch.bfloat16))
    assert plan["layers.0.ffn.experts.3.w2.weight"].format is MXFP4 and len(plan) == 2 * (3 * E + 1)

    hf = quantize_for_save(nm.to_hf(ours), plan)
    save_hf_checkpoint(tmp_path / "out", {"model_type": "deepseek_v4"}, hf)
    with HFCheckpoint(tmp_path / "out") as ckpt:
        assert set(ckpt.keys()) == set(stored)
        for k, t in stored.items():
            got = ckpt.get(k)
            assert got.dtype == t.dtype and torch.equal(bits(got), bits(t)), k

    # a fresh save (nothing loaded) picks the quantized names by pattern
    fresh = plan_quantization(nm.to_hf(ours), V4_RULES)
    assert fresh.keys() == plan.keys() and fresh["layers.0.ffn.experts.0.w1.weight"].codes_dtype == torch.int8
    with pytest.raises(ValueError, match="without a pattern"):
        plan_quantization(["x.weight"], (QuantRule(MXFP4),))


def test_quantized_pairs_that_do_not_fit_are_named():
    stored = v4_checkpoint(layers=(0,))
    stored["layers.0.ffn.experts.1.w2.scale"] = stored["layers.0.ffn.experts.1.w2.scale"][:, :2]
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.experts.1.w2.scale: expected \(64, 3\) for mxfp4 codes "
                                              r"layers.0.ffn.experts.1.w2.weight \(64, 48\)"):
        v4_map().from_hf(DequantizedSource(stored, V4_RULES), {k: v for k, v in v4_expected(torch.float32).items()
                                                               if k.startswith("layers.0")})
    stored = v4_checkpoint(layers=(0,))
    stored["layers.0.ffn.experts.2.w1.weight"] = stored["layers.0.ffn.experts.2.w1.weight"].to(torch.int16)
    with pytest.raises(CheckpointError, match=r"layers.0.ffn.experts.2.w1.weight: stored as int16; mxfp4 codes"):
        DequantizedSource(stored, V4_RULES)
    # without the rules, the codes are integers the name map refuses to cast
    with pytest.raises(CheckpointError, match=r"not stored as floating point .*layers.0.ffn.experts.0.w1.weight"):
        NameMap({"w": "layers.0.ffn.experts.0.w1.weight"}, ignore=[r"."]).from_hf(
            v4_checkpoint(layers=(0,)), {"w": ((I, 32), torch.float32)})


def test_default_rule_still_reads_hf_fp8():
    from alignzoo.common.fp8 import dequantize_weight_fp8, quantize_weight_fp8

    w = torch.randn(130, 260, generator=torch.Generator().manual_seed(6))
    codes, scale_inv = quantize_weight_fp8(w)
    src = DequantizedSource({"x.weight": codes, "x.weight_scale_inv": scale_inv, "n.weight": torch.ones(3)})
    assert src.keys() == ["x.weight", "n.weight"] and src.shape("x.weight") == (130, 260)
    assert torch.equal(src.get("x.weight"), dequantize_weight_fp8(codes, scale_inv))
    assert quantize_for_save({"x.weight": src.get("x.weight")}, src.stored)["x.weight_scale_inv"].dtype == torch.float32
