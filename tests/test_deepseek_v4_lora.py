"""deepseek_v4_mhc_mxfp4's LoRA on the CPU: adapters on the attention's q_a / q_b / kv / o_b and inside the routed
experts (MXFP4 codes too, separate only): sampled bits == the trainer's == a fresh prefill's before and after an
Adam step on the adapters; the sync ships the adapters alone; a PEFT directory written and read back gives the same
bits; a bad target is refused by name."""
from __future__ import annotations

import pytest
import torch
from model_cases import assert_lora_step_keeps_k3_zero, prompts_of, rich

from alignzoo.models import deepseek_v4_mhc_mxfp4 as V4
from alignzoo.models.deepseek_v4_mhc_mxfp4.weights import lora_from_hf, lora_to_hf
from test_deepseek_v4 import sharpen

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN = ["q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"]


def make_pair(config="tiny", seed=2, **kw):
    pair = V4.load(config=config, device="cpu", dtype=torch.bfloat16, seed=seed, **kw)
    sharpen(pair.trainer, seed + 1)
    pair.sync()
    return pair


CASES = [
    ("tiny", "separate", {"r": 4, "lora_alpha": 8, "target_modules": ATTN, "target_parameters": EXPERTS}),
    ("tiny", "merged", {"r": 3, "lora_alpha": 6, "target_modules": ["q_b_proj", "o_b_proj"],
                        "target_parameters": EXPERTS[1:]}),
    ("tiny-mxfp4", "separate", {"r": 4, "lora_alpha": 8, "target_modules": ["kv_proj", "q_a_proj"],
                                "target_parameters": EXPERTS}),
]


@pytest.mark.parametrize("config,mode,lora", CASES, ids=["attn-and-experts-separate", "merged", "mxfp4-separate"])
def test_lora_keeps_k3_zero_across_an_adam_step(config, mode, lora, tmp_path):
    """Random B so every adapter shows, then an Adam step on the adapters alone: trainer == prefill == sampled
    bitwise before and after; only adapters (merged: the W' they fold into) move on the server; the adapter saved
    as a PEFT directory and loaded into a fresh pair of the same base samples the same bits."""
    pair = make_pair(config, lora=lora, lora_mode=mode)
    prompts = prompts_of([97, 41], pair.config.vocab_size, seed=3)
    sps = rich(2, 5, seed=1)
    folded = (".q_b.", ".o_b.", ".moe.down.") if mode == "merged" else ()
    outs = assert_lora_step_keeps_k3_zero(pair, prompts, sps, folded)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in pair.trainer.adapter_parameters())
    if config == "tiny-mxfp4":
        assert pair.trainer.layers[1].moe.gate_up.weight.dtype == torch.uint8  # the codes stay packed and frozen
        with pytest.raises(NotImplementedError, match="adapter_only=True"):
            pair.save_pretrained(tmp_path / "merged")
    pair.save_pretrained(tmp_path, adapter_only=True)
    again = make_pair(config, lora=lora, lora_mode=mode)  # the same sharpened base
    V4.load_adapter(again, tmp_path)
    for a, b in zip(again.server.generate(prompts, sps), outs):
        assert torch.equal(a.logprobs, b.logprobs)


def test_multi_mode_adapters_on_the_attention():
    """Two named adapters on one base, each request its own: trainer == sampled."""
    lora = {"a": {"r": 2, "lora_alpha": 4, "target_modules": ["q_a_proj", "o_b_proj"]},
            "b": {"r": 3, "lora_alpha": 3, "target_modules": ["kv_proj"]}}
    pair = make_pair(lora_adapters=lora, seed=4)
    with torch.no_grad():
        for name in lora:
            for p in pair.trainer.adapter_parameters(name):
                p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    pair.sync()
    prompts = prompts_of([60, 33], pair.config.vocab_size, seed=5)
    sps = rich(2, 4, seed=2)
    outs = pair.server.generate(prompts, sps, adapters=["a", "b"])
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    with torch.no_grad():
        got = pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps, adapters=["a", "b"])
    for g, o in zip(got, outs):
        assert torch.equal(g, o.logprobs)


def test_adapters_are_transformers_modules_and_compute_what_transformers_does(tmp_path, monkeypatch):
    """fp32, separate adapters on every target: each PEFT module the adapter directory names is one of
    transformers' DeepseekV4ForCausalLM, and our logits equal transformers' on the merged checkpoint
    (W' = W + s·B·A, ``save_pretrained``) within 1e-5 on a 130-token sequence (9e-7 measured); without the
    adapters they differ."""
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from safetensors import safe_open
    from test_deepseek_v4_parity import _ours

    t = V4.DeepseekV4Trainer(V4.PRESETS["tiny"], dtype=torch.float32)
    V4.init_weights(t, 3)
    sharpen(t, 4)
    t.add_lora({"r": 3, "lora_alpha": 6, "target_modules": "all-linear", "target_parameters": EXPERTS}, "separate")
    with torch.no_grad():
        for p in t.adapter_parameters():
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(p.numel()))
    V4.save_pretrained(t, tmp_path / "peft", adapter_only=True)
    V4.save_pretrained(t, tmp_path / "merged")
    hf = modeling.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32,
                                                        attn_implementation="eager").eval()
    modules = dict(hf.named_modules())
    with safe_open(tmp_path / "peft" / "adapter_model.safetensors", "pt") as f:
        saved = {k.removeprefix("base_model.model."): f.get_tensor(k) for k in f.keys()}
    named = {k.split(".lora_")[0].removesuffix(".base_layer") for k in saved}
    assert len(named) == 5 * t.cfg.num_layers and named <= set(modules), sorted(named - set(modules))
    for m in named - {n for n in named if n.endswith("experts")}:  # each pair fits its projection's shape
        lin = modules[m]
        assert saved[m + ".lora_A.weight"].shape[1] == lin.in_features, m
        assert saved[m + ".lora_B.weight"].shape[0] == lin.out_features, m
    seq = torch.randint(0, t.cfg.vocab_size, (130,), generator=torch.Generator().manual_seed(5))
    logits, sels, _ = _ours(t, seq, monkeypatch)
    for L, sel in sels.items():  # transformers' indexer returns our selection (ties: test_deepseek_v4_parity)
        monkeypatch.setattr(hf.model.layers[L].self_attn.compressor.indexer, "forward",
                            lambda *a, _s=sel, **k: _s[None].long())
    with torch.no_grad():
        ref = hf(seq[None]).logits[0].double()
    monkeypatch.undo()
    err = ((logits.double() - ref).norm() / ref.norm()).item()
    assert err < 1e-5, err
    with torch.no_grad():
        for _, b in t.lora_adapters().values():
            b.zero_()
    base = _ours(t, seq, monkeypatch)[0].double()
    assert ((base - ref).norm() / ref.norm()).item() > 1e-3


def test_peft_names_round_trip():
    assert lora_to_hf("layers.3.kv_proj") == "model.layers.3.self_attn.kv_proj"
    assert lora_to_hf("layers.0.moe.gate_up") == "model.layers.0.mlp.experts:gate_up_proj"
    for n in ("layers.2.q_a_proj", "layers.2.q_b_proj", "layers.2.o_b_proj", "layers.1.moe.down"):
        assert lora_from_hf(lora_to_hf(n)) == n
    assert lora_from_hf("model.layers.0.self_attn.compressor.kv_proj") is None  # the compressor takes none


def test_bad_targets_are_named():
    with pytest.raises(ValueError, match="unknown LoRA target module 'o_a_proj'"):
        V4.DeepseekV4Trainer.check_lora({"r": 2, "lora_alpha": 4, "target_modules": ["o_a_proj"]})
    with pytest.raises(ValueError, match="unknown LoRA target parameter 'mlp.experts.up_proj'"):
        V4.DeepseekV4Trainer.check_lora({"r": 2, "lora_alpha": 4, "target_parameters": ["mlp.experts.up_proj"]})
    with pytest.raises(NotImplementedError, match="MXFP4 experts.*separate"):
        V4.load(config="tiny-mxfp4", device="cpu", lora={"r": 2, "lora_alpha": 4, "target_parameters": EXPERTS},
                lora_mode="merged")
