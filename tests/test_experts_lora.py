"""LoRA on the routed experts of an MoE model (qwen35_gdn): PEFT's target_parameters, in the merged
and separate modes, trainer == server bit for bit, gradients to the adapters, PEFT files both ways."""
import pytest
import torch

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.moe.lora import ExpertsAdapter, _MergedExperts, merge_experts

LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "in_proj_qkv"],
        "target_parameters": ["experts.gate_up_proj", "mlp.experts.down_proj"]}
# prompts across 64-row GDN chunks, and a short one
PROMPTS = [[(7 * i + 3) % 151 for i in range(150)], [5, 9, 2], [(3 * i) % 151 for i in range(70)]]
SP = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=24, seed=5, stop_token_ids=())


def trained_pair(mode, lora=LORA, seed=1):
    pair = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", lora=lora, lora_mode=mode)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in pair.trainer.lora_adapters().values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    pair.sync()
    return pair


def served_and_scored(pair):
    outs = pair.server.generate(PROMPTS, SP)
    lps = pair.trainer.logprobs([p + o.tokens for p, o in zip(PROMPTS, outs)], [len(p) for p in PROMPTS], SP)
    return outs, lps


@pytest.fixture(scope="module")
def served():
    """mode -> (trained_pair(mode), served_and_scored of it), built once a mode (3-4 s each): the tests
    below only read the pair (a backward fills gradients, the weights stay)."""
    built = {}

    def get(mode):
        if mode not in built:
            pair = trained_pair(mode)
            built[mode] = (pair, *served_and_scored(pair))
        return built[mode]
    return get


@pytest.mark.parametrize("mode", ["separate", "merged"])
def test_experts_lora_trainer_equals_server(served, mode):
    pair, outs, lps = served(mode)
    names = [n for n in pair.trainer.lora_adapters() if ".moe." in n]
    assert names[:2] == ["layers.0.moe.gate_up", "layers.0.moe.down"] and len(names) == 8
    assert all(torch.equal(lp, o.logprobs) for lp, o in zip(lps, outs))
    # the experts' adapters matter: without them the same tokens score differently
    plain = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", lora={**LORA, "target_parameters": []},
                               lora_mode=mode)
    own = {n: ab for n, ab in pair.trainer.lora_adapters().items() if ".moe." not in n}
    plain.trainer.set_lora_adapters(own)
    plain.sync()
    other = plain.trainer.logprobs([p + o.tokens for p, o in zip(PROMPTS, outs)], [len(p) for p in PROMPTS], SP)
    assert not all(torch.equal(a, b) for a, b in zip(lps, other))
    (sum(lp.sum() for lp in lps)).backward()
    for n, (a, b) in pair.trainer.lora_adapters().items():
        if ".moe." in n:
            assert a.grad is not None and a.grad.abs().sum() > 0 and b.grad.abs().sum() > 0, n


def test_untrained_experts_adapter_is_the_base():
    """B = 0: the separate-mode experts add exactly nothing (the base's bits)."""
    lora = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", lora={**LORA, "target_modules": []},
                              lora_mode="separate")
    base = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu")
    a, b = lora.server.generate(PROMPTS, SP), base.server.generate(PROMPTS, SP)
    assert all(x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))


def test_merged_experts_gradient_is_the_formula():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(5, 12, 8, generator=g)
    a = torch.randn(5, 3, 8, generator=g, requires_grad=True)
    b = torch.randn(5, 12, 3, generator=g, requires_grad=True)
    dw = torch.randn(5, 12, 8, generator=g)
    (_MergedExperts.apply(merge_experts(w, a, b, 1.5), a, b, 1.5) * dw).sum().backward()
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    ((w + 1.5 * b2 @ a2) * dw).sum().backward()
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad, b2.grad)


@pytest.mark.parametrize("mode", ["separate", "merged"])
def test_experts_adapter_round_trips_through_peft_files(tmp_path, served, mode):
    pair, outs, _ = served(mode)
    pair.save_pretrained(tmp_path / "ad", adapter_only=True)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        a_gu = f.get_tensor("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight")
    assert "base_model.model.model.layers.0.mlp.experts.lora_B.weight" in keys  # down: the outer wrapper
    assert a_gu.shape == (7 * 4, 72)  # (E·r, hidden): gate_up's A, as PEFT lays it out
    again = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", lora_adapter=tmp_path / "ad", lora_mode=mode)
    assert again.trainer.lora.target_parameters == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    for n, (a, b) in pair.trainer.lora_adapters().items():
        a2, b2 = again.trainer.lora_adapters()[n]
        assert torch.equal(a, a2) and torch.equal(b, b2), n
    outs2 = again.server.generate(PROMPTS, SP)
    assert all(x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs) for x, y in zip(outs, outs2))


def test_merged_checkpoint_folds_the_experts_adapter(tmp_path, served):
    pair, outs, lps = served("merged")
    pair.save_pretrained(tmp_path / "ckpt")
    plain = alignzoo.load_pair("qwen35_gdn", checkpoint=tmp_path / "ckpt", device="cpu")
    again = plain.trainer.logprobs([p + o.tokens for p, o in zip(PROMPTS, outs)], [len(p) for p in PROMPTS], SP)
    assert all(torch.equal(a, b) for a, b in zip(lps, again))


def test_peft_loads_our_experts_adapter(tmp_path):
    """PEFT's own LoRA on the parameters of transformers' Qwen3_5MoeExperts reads the file we write
    and merges the same W' (to bf16 rounding)."""
    peft = pytest.importorskip("peft")
    pair = trained_pair("separate", lora={**LORA, "target_modules": []})
    pair.save_pretrained(tmp_path / "ckpt")  # W + s·B·A folded: the W' PEFT must merge to
    pair.save_pretrained(tmp_path / "ad", adapter_only=True)
    base = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu")
    base.save_pretrained(tmp_path / "base")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "base", torch_dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(hf, tmp_path / "ad").merge_and_unload()
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", torch_dtype=torch.float32)
    for name in ("gate_up_proj", "down_proj"):
        got = getattr(merged.model.layers[1].mlp.experts, name)
        exp = getattr(want.model.layers[1].mlp.experts, name)
        torch.testing.assert_close(got, exp, rtol=0.02, atol=2e-3)


def test_bad_experts_lora_configs_fail_before_anything_changes():
    with pytest.raises(ValueError, match="unknown LoRA target parameter 'experts.up_proj'"):
        alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu",
                           lora={**LORA, "target_parameters": ["experts.up_proj"]})
    pair = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu")
    with pytest.raises(NotImplementedError, match="merged and separate"):
        pair.trainer.add_lora({"a": LORA}, mode="multi")
    assert pair.trainer.lora_mode is None and all(p.requires_grad for p in pair.trainer.parameters())
    assert not any(isinstance(m, ExpertsAdapter) for m in pair.trainer.modules())
    with pytest.raises(ValueError, match="unknown LoRA target parameter"):
        alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora={**LORA, "target_modules": ["q_proj"]})
