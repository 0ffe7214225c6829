"""Qwen3 against transformers: the same checkpoint, the same log-probs.

fp32: max |Δ logprob| <= 1e-5 (measured 9.5e-7 at these sizes).
bf16: max |Δ| <= 3e-2 against transformers in bf16 (measured 7e-3; both sides
round activations to bf16 at different points), and our bf16 error against the
fp32 model is at most 2x transformers' own bf16 error plus 1e-3.  Saving and
transformers loading what we save: tests/test_models.py, which every model runs.
"""
import pytest
import torch

from alignzoo.models.qwen3 import Qwen3Config, build_trainer

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=211, hidden_size=72, intermediate_size=100, num_hidden_layers=3, num_attention_heads=3,
             num_key_value_heads=1, head_dim=24, max_position_embeddings=2048, rope_theta=10000.0)


def hf_model(tie: bool, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.Qwen3Config(**SIZES, tie_word_embeddings=tie)
    m = transformers.Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)  # not all ones: a swapped norm weight must show
    return m.to(dtype)


def hf_logprobs(m, seqs):
    with torch.no_grad():
        return [torch.log_softmax(m(s[None]).logits[0, :-1].float(), -1).gather(1, s[1:, None])[:, 0] for s in seqs]


def sequences(vocab, lens=(300, 77, 2), seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_fp32_matches_transformers(tmp_path, tie):
    m = hf_model(tie)
    m.save_pretrained(tmp_path)
    cfg = Qwen3Config.from_hf(tmp_path)
    assert cfg.tie_word_embeddings == tie and cfg.num_layers == 3 and cfg.head_dim == 24
    ours = build_trainer(cfg, tmp_path, dtype=torch.float32)
    seqs = sequences(cfg.vocab_size)
    with torch.no_grad():
        got = ours.logprobs(seqs, [1] * len(seqs))
    for g, r in zip(got, hf_logprobs(m, seqs)):
        assert (g - r).abs().max() <= 1e-5


def test_bf16_close_to_transformers(tmp_path):
    m32 = hf_model(False)
    m32.save_pretrained(tmp_path)
    m16 = hf_model(False).to(torch.bfloat16)
    cfg = Qwen3Config.from_hf(tmp_path)
    ours = build_trainer(cfg, tmp_path, dtype=torch.bfloat16)
    seqs = sequences(cfg.vocab_size)
    with torch.no_grad():
        got = ours.logprobs(seqs, [1] * len(seqs))
    for g, r16, r32 in zip(got, hf_logprobs(m16, seqs), hf_logprobs(m32, seqs)):
        assert (g - r16).abs().max() <= 3e-2
        assert (g - r32).abs().max() <= 2 * (r16 - r32).abs().max() + 1e-3


def test_other_architecture_refused(tmp_path):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="llama.*not qwen3"):
        Qwen3Config.from_hf(tmp_path)
