"""deepseek_v4_mhc_mxfp4's weight names: transformers' ``DeepseekV4ForCausalLM`` state dict and the same tensors
under DeepSeek's release names (one tensor per expert, ``mtp.*`` layers beside) read into the same tensors of
ours, and ours save back as transformers saves them; bad tables and stray tensors are named.  Quantized: a release
checkpoint's MXFP4 experts load as the written bytes and its FP8 linears as code x scale; a model with MXFP4 experts
saves them the release's way, reloads bit for bit and loads in transformers; bad codes and scales are named."""
from __future__ import annotations

import logging
import re

import pytest
import torch

from alignzoo.models.deepseek_v4_mhc_mxfp4 import weights as W
from alignzoo.models.deepseek_v4_mhc_mxfp4.config import PRESETS, V4Quant
from alignzoo.weights import FP8_BLOCK128_E8M0, MXFP4, CheckpointError
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


# ---------------------------------------------------------------- quantized checkpoints (MXFP4 experts, FP8 linears)
MX = PRESETS["tiny-mxfp4"].replace(quantization=V4Quant(scale_fmt="ue8m0", expert_dtype="fp4"))
E8M0 = MXFP4.scale_dtypes[-1]
FP8_LINEARS = re.compile(r"^layers\.\d+\.(attn\..*|ffn\.shared_experts\.w\d)\.weight$")  # the release's FP8 ones


@pytest.fixture(scope="module")
def release_mx(hf_state):
    """A release-named quantized checkpoint of the MX config: FP8 e4m3 linears with E8M0 ``.scale`` per 128x128
    block, each expert int8 codes with float8_e8m0fnu ``.scale`` (random bytes, scales 2^-8..2^2), an mtp layer."""
    g = torch.Generator().manual_seed(2)
    out = {}
    for k, v in _release(hf_state).items():
        m = re.match(r"^layers\.\d+\.ffn\.experts\.\d+\.w\d\.weight$", k)
        if m:
            out[k] = torch.randint(-128, 128, MXFP4.codes_shape(v.shape), generator=g, dtype=torch.int8)
            out[k[: -len("weight")] + "scale"] = torch.randint(119, 130, MXFP4.scales_shape(v.shape), generator=g,
                                                               dtype=torch.uint8).view(E8M0)
        elif FP8_LINEARS.match(k) and v.dim() == 2:
            codes, scales = FP8_BLOCK128_E8M0.quantize(v * 0.05)
            out[k], out[k[: -len("weight")] + "scale"] = codes, scales.view(E8M0)
        else:
            out[k] = v
    return out


def _bytes(t):
    return t.view(torch.uint8)


def test_release_checkpoint_reads_codes_as_written(release_mx, tmp_path):
    """A release checkpoint (directory, loaded by the zoo's build_trainer): every expert's codes and scales land in the
    trainer's buffers equal to the written bytes; each FP8 linear is its code x scale, exact in bf16; read back,
    ``to_hf`` writes the experts under the same names and bytes."""
    from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4
    from alignzoo.weights import save_hf_checkpoint

    save_hf_checkpoint(tmp_path, MX.to_hf(), release_mx)
    t = V4.build_trainer(MX, tmp_path, dtype=torch.bfloat16)
    I = MX.moe_intermediate_size
    for i in range(MX.num_layers):
        stacks = t.layers[i].moe.gate_up, t.layers[i].moe.down
        for e in range(MX.n_routed_experts):
            p = f"layers.{i}.ffn.experts.{e}."
            for stack, rows, w in ((stacks[0], slice(0, I), "w1"), (stacks[0], slice(I, 2 * I), "w3"),
                                   (stacks[1], slice(None), "w2")):
                assert torch.equal(stack.weight[e, rows], _bytes(release_mx[p + w + ".weight"])), p + w
                assert torch.equal(stack.weight_scale[e, rows], _bytes(release_mx[p + w + ".scale"])), p + w
    ours = W.from_hf(release_mx, MX, torch.bfloat16)
    back = W.to_hf(ours, MX)
    fp8 = [k for k in release_mx if FP8_LINEARS.match(k) and k[: -len("weight")] + "scale" in release_mx]
    assert len(fp8) == 46  # 8 a layer, the compressors and indexers
    for k in fp8:
        w = FP8_BLOCK128_E8M0.dequantize(release_mx[k], release_mx[k[: -len("weight")] + "scale"])
        assert back[k].dtype == torch.bfloat16 and torch.equal(back[k].float(), w), k  # exact in bf16
    for k, v in release_mx.items():
        if ".experts." in k:
            assert back[k].dtype == v.dtype and torch.equal(_bytes(back[k]), _bytes(v)), k


def test_bad_quantized_tensors_are_named(release_mx):
    """A scale of the wrong shape, codes stored as float, an FP8 linear's scale of the wrong shape: refused, naming the
    tensor as the checkpoint does."""
    cases = [("layers.1.ffn.experts.4.w1.scale", lambda t: t[:, :1], r"layers\.1\.ffn\.experts\.4\.w1\.scale: "
              r"expected \(32, 2\) for mxfp4 codes layers\.1\.ffn\.experts\.4\.w1\.weight"),
             ("layers.2.ffn.experts.0.w2.weight", lambda t: t.float(), r"layers\.2\.ffn\.experts\.0\.w2\.weight: "
              r"stored as float32; mxfp4 codes are"),
             ("layers.3.attn.wq_a.scale", lambda t: t[:, :0], r"self_attn\.q_a_proj\.scale: expected \(1, 1\)")]
    for name, bad, match in cases:
        sd = dict(release_mx)
        sd[name] = bad(sd[name])
        with pytest.raises(CheckpointError, match=match):
            W.from_hf(sd, MX)


@pytest.fixture(scope="module")
def saved_mx(tmp_path_factory):
    """A tiny-mxfp4 trainer (fp32, sharpened as the parity test's) saved by ``save_pretrained``."""
    from test_deepseek_v4 import sharpen

    from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4

    t = V4.build_trainer(PRESETS["tiny-mxfp4"], dtype=torch.float32, seed=3)
    sharpen(t, 4)
    d = tmp_path_factory.mktemp("mx")
    V4.save_pretrained(t, d)
    return t, d


def test_mxfp4_checkpoint_reloads_bit_for_bit(saved_mx):
    """Saved MXFP4 experts are the release's tensors (int8 codes, float8_e8m0fnu scales, one per expert) with the
    config's quantization_config; loaded back, every tensor, codes and scales included, and the trainer's and the
    server's log-probs of a 150- and a 33-token sequence equal the saved model's."""
    import json

    from safetensors import safe_open

    from alignzoo import SamplingParams
    from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4

    t, d = saved_mx
    q = json.loads((d / "config.json").read_text())["quantization_config"]
    assert (q["quant_method"], q["expert_dtype"], q["scale_fmt"]) == ("fp8", "fp4", "ue8m0")
    with safe_open(d / "model.safetensors", "pt") as f:
        assert (f.get_slice("layers.1.ffn.experts.8.w2.weight").get_dtype(), f.get_slice(
            "layers.1.ffn.experts.8.w2.scale").get_shape()) == ("I8", [64, 1])
        assert f.get_slice("layers.1.ffn.experts.8.w2.scale").get_dtype() == "F8_E8M0"
    back = V4.load(checkpoint=d, device="cpu", dtype=torch.float32)
    want, got = t.state_dict(), back.trainer.state_dict()
    assert set(got) == set(want) and any(v.dtype == torch.uint8 for v in got.values())
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    g = torch.Generator().manual_seed(6)
    seqs, plens = [torch.randint(0, t.cfg.vocab_size, (n,), generator=g).tolist() for n in (150, 33)], [100, 20]
    with torch.no_grad():
        ref = t.logprobs(seqs, plens)
        for a, b in zip(back.trainer.logprobs(seqs, plens), ref):
            assert torch.equal(a, b)
    for a, b in zip(back.server.score(seqs, plens, [SamplingParams()] * 2), ref):
        assert torch.equal(a, b)


def test_transformers_reads_our_mxfp4_checkpoint(saved_mx, monkeypatch):
    """transformers loads the saved directory, dequantizing the experts (their weights == our codes x scales,
    bitwise), and its fp32 logits equal ours within the parity test's 1e-5 (our C4 selections given to its indexer,
    as there); on a GPU it would build FP8 modules for the experts alone, their codes and scales shaped as saved."""
    from test_deepseek_v4_parity import _ours

    from alignzoo.common.moe.mxfp4 import dequantize_mxfp4

    t, d = saved_mx
    hf = modeling.DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    for i, layer in enumerate(t.layers):
        for s, hf_name in (("gate_up", "gate_up_proj"), ("down", "down_proj")):
            stack = getattr(layer.moe, s)
            assert torch.equal(getattr(hf.model.layers[i].mlp.experts, hf_name),
                               dequantize_mxfp4(stack.weight, stack.weight_scale)), (i, s)
    seq = torch.randint(0, t.cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(8))
    logits, sels, _ = _ours(t, seq, monkeypatch)
    for L, sel in sels.items():
        monkeypatch.setattr(hf.model.layers[L].self_attn.compressor.indexer, "forward",
                            lambda *a, _s=sel, **k: _s[None].long())
    with torch.no_grad():
        ref = hf(seq[None]).logits[0]
    err = ((logits.double() - ref.double()).norm() / ref.double().norm()).item()
    assert err < 1e-5, err  # 6.5e-7 measured; one expert 1% off gives 5.6e-5

    from transformers import AutoConfig
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer
    from transformers.utils.quantization_config import FineGrainedFP8Config

    c = AutoConfig.from_pretrained(d)
    with torch.device("meta"):
        meta = modeling.DeepseekV4ForCausalLM(c)
    quantizer = FineGrainedFP8HfQuantizer(FineGrainedFP8Config.from_dict(c.quantization_config), pre_quantized=True)
    quantizer._process_model_before_weight_loading(meta)
    fp8 = {n: {p: (tuple(v.shape), v.dtype) for p, v in m.named_parameters(recurse=False)}
           for n, m in meta.named_modules() if "FP8" in type(m).__name__}
    E, I, H, e8m0 = t.cfg.n_routed_experts, t.cfg.moe_intermediate_size, t.cfg.hidden_size, W.SAVED_SCALES
    assert fp8 == {f"model.layers.{i}.mlp.experts": {
        "gate_up_proj": ((E, 2 * I, H // 2), torch.int8), "gate_up_proj_scale_inv": ((E, 2 * I, H // 32), e8m0),
        "down_proj": ((E, H, I // 2), torch.int8), "down_proj_scale_inv": ((E, H, I // 32), e8m0)}
        for i in range(t.cfg.num_layers)}
