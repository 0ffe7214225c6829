"""Unified FP8 for qwen3: the codes are requantized once per optimizer step
(a fused optimizer's too, through ``pair.sync()``), and FP8 Hugging Face
checkpoints load.  The training loop whose syncs ship only the changed
tensors, in bf16 and FP8, is tests/test_models.py's, which every model runs.
"""
import json

import pytest
import torch
from model_cases import prompts_of

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.fp8 import dequantize_weight_fp8, quantize_weight_fp8

SP = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, max_new_tokens=20, seed=3)


def assert_k3_zero(pair, prompts, sp=SP):
    outs = pair.server.generate(prompts, sp)
    with torch.no_grad():
        lps = pair.trainer.logprobs([p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts], sp)
    for o, lp in zip(outs, lps):
        assert torch.equal(lp.cpu(), o.logprobs)
    return outs


def test_fp8_codes_requantized_once_per_step():
    pair = alignzoo.load_pair("qwen3", config="tiny", fp8=True)
    layer = pair.trainer.layers[0].qkv
    n0 = layer.cache.quantizations
    prompts = prompts_of([30, 7], pair.config.vocab_size)
    for _ in range(3):  # forwards without a step reuse the codes
        pair.trainer.logprobs(prompts, [1, 1])
    assert layer.cache.quantizations == n0
    with torch.no_grad():
        layer.weight.mul_(1.5)  # an in-place update, as an optimizer step
    pair.trainer.logprobs(prompts, [1, 1])
    pair.trainer.logprobs(prompts, [1, 1])
    assert layer.cache.quantizations == n0 + 1


@pytest.mark.parametrize("kind", ["fp8", "lora-merged"])
def test_fused_optimizer_step_reaches_trainer_and_server(kind):
    """torch.optim's fused kernels write the parameters without bumping their
    version counter, so a version-keyed cache alone would keep the old FP8
    codes / merged W' (measured on torch 2.13).  ``pair.sync()`` is the
    once-per-step point: after it the trainer's forward weights are the
    requantized / re-merged ones, the server holds them, and K3 == 0."""
    kw = dict(fp8=True) if kind == "fp8" else dict(lora={"r": 4, "lora_alpha": 8, "target_modules": "all-linear"},
                                                   lora_mode="merged")
    pair = alignzoo.load_pair("qwen3", config="tiny", **kw)
    params = [p for p in pair.trainer.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2, fused=True)
    prompts = prompts_of([40, 9], pair.config.vocab_size, seed=5)
    seqs = [p + [1, 2, 3] for p in prompts]
    lp = pair.trainer.logprobs(seqs, [len(p) for p in prompts])
    sum(x.sum() for x in lp).backward()
    before = {n: t.clone() for n, t in pair.trainer.forward_weights().items()}
    opt.step()
    pair.sync()
    after = pair.trainer.forward_weights()
    if kind == "fp8":
        layer = pair.trainer.layers[0].qkv
        codes, scale_inv = quantize_weight_fp8(layer.weight.detach())
        assert torch.equal(after["layers.0.qkv.weight"].view(torch.uint8), codes.view(torch.uint8))
        assert torch.equal(after["layers.0.qkv.weight_scale_inv"], scale_inv)
    else:
        layer = pair.trainer.layers[0].qkv
        assert torch.equal(after["layers.0.qkv.weight"], layer.merge())
    assert not torch.equal(after["layers.0.qkv.weight"].view(torch.uint8),
                           before["layers.0.qkv.weight"].view(torch.uint8))
    assert pair.last_sync.blocks_changed > 0 and pair.weights_match()
    assert_k3_zero(pair, prompts)


def _fp8_checkpoint(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3Config(vocab_size=160, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                   max_position_embeddings=512)
    transformers.Qwen3ForCausalLM(cfg).save_pretrained(tmp_path / "bf16")
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "bf16" / "model.safetensors")
    out = {}
    for name, t in sd.items():
        if name.endswith("_proj.weight"):
            codes, scale_inv = quantize_weight_fp8(t.float())
            out[name], out[name[: -len("weight")] + "weight_scale_inv"] = codes, scale_inv
        else:
            out[name] = t
    (tmp_path / "fp8").mkdir()
    save_file(out, tmp_path / "fp8" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                     "activation_scheme": "dynamic"}
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    return tmp_path / "fp8", out


@pytest.mark.parametrize("fp8", [True, False], ids=["unified-fp8", "dequantized-bf16"])
def test_fp8_hf_checkpoint_loads(tmp_path, fp8):
    path, stored = _fp8_checkpoint(tmp_path)
    pair = alignzoo.load_pair("qwen3", checkpoint=path, fp8=fp8)
    o = pair.trainer.layers[1].o.weight
    deq = dequantize_weight_fp8(stored["model.layers.1.self_attn.o_proj.weight"],
                                stored["model.layers.1.self_attn.o_proj.weight_scale_inv"], torch.float32)
    assert torch.equal(o.detach(), deq if fp8 else deq.to(o.dtype))
    if fp8:  # a 128-aligned layer requantizes to the stored codes
        assert torch.equal(pair.server.model.weights["layers.1.o.weight"].view(torch.uint8),
                           stored["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8))
    assert_k3_zero(pair, prompts_of([60, 5], pair.config.vocab_size))
