"""The shared MoE block (models/moe_block.py) in each model's configuration: the trainer's module
and the server's twin give the same bits (torch.equal) on a batch and on any split of it, with
router replay and with LoRA inside the experts of every format; with each model's parameters the
block is transformers' MoE block (fp32, values and gradients)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from alignzoo.common.ladder import bitwise_equal, rel_err
from alignzoo.common.layers import Fp8Linear, Linear
from alignzoo.common.moe import quantize_experts_mxfp4
from alignzoo.common.moe.lora import ExpertsAdapter
from alignzoo.models.base import ServerBase, TrainerBase
from alignzoo.models.moe_block import (
    BF16,
    FP8,
    MXFP4,
    Frozen,
    GatedSharedExpert,
    HashRouter,
    MoEBlock,
    MoESpec,
    SharedExpert,
    SigmoidRouter,
    SoftmaxRouter,
    SqrtSoftplusRouter,
    moe_block_fwd,
    routed_extras,
    server_experts_lora,
)

BF, F32 = torch.bfloat16, torch.float32
VOCAB = 97
P = "layers.0.moe."

# name: (spec, activation dtype, the shared expert's projection class); odd sizes where the format allows
# (MXFP4 needs H and I multiples of 32)
CASES = {
    "qwen35_gdn": (MoESpec(72, 7, 40, SoftmaxRouter(3), BF16, GatedSharedExpert(56)), BF, Linear),
    "glm5_sparse_fp8": (MoESpec(72, 8, 40, SigmoidRouter(3, n_group=4, topk_group=2, routed_scaling_factor=2.5), FP8,
                                SharedExpert(40)), BF, Fp8Linear),
    "deepseek_v4": (MoESpec(96, 6, 64, SqrtSoftplusRouter(3, routed_scaling_factor=1.5), MXFP4, SharedExpert(64),
                            limit=0.25), BF, Linear),
    "deepseek_v4-hash": (MoESpec(96, 6, 64, HashRouter(3, VOCAB, routed_scaling_factor=1.5), MXFP4, SharedExpert(64),
                                 limit=0.25), BF, Linear),
    "routed-only-fp32": (MoESpec(60, 5, 24, SoftmaxRouter(2)), F32, Linear),
}


class _Host(TrainerBase):
    """A trainer holding one block at ``layers.0.moe``: its ``forward_weights`` is what a model's ships."""

    def __init__(self, block):
        super().__init__(SimpleNamespace())
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].moe = block


class _Server(ServerBase):
    lora_slices_of = staticmethod(lambda cfg: {})


def _table(E, k, vocab, g):
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(vocab)])


def make_block(name, device, seed=0):
    spec, dtype, linear = CASES[name]
    g = torch.Generator().manual_seed(seed)
    block = MoEBlock(spec, 0, linear=linear, device=device, dtype=dtype)
    E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
    with torch.no_grad():
        for n, p in block.named_parameters():
            if n == "tid2eid.weight":
                p.copy_(_table(E, spec.router.top_k, VOCAB, g))
            else:
                std = 0.5 if n == "gate.weight" else 0.2 if n == "correction_bias.weight" else 0.1
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if spec.experts is MXFP4:
            gu, gs, d, ds = quantize_experts_mxfp4(torch.randn(E, 2 * I, H, generator=g) * 0.1,
                                                   torch.randn(E, H, I, generator=g) * 0.1)
            for t, v in ((block.gate_up.weight, gu), (block.gate_up.weight_scale, gs), (block.down.weight, d),
                         (block.down.weight_scale, ds)):
                t.copy_(v)
    return block


def server_of(block, lora_scale=None):
    """The server over the block's forward weights, as a model lays them out (quantized experts' codes over
    the masters)."""
    spec = block.spec
    with torch.no_grad():  # as the pair's sync reads them
        w = _Host(block).forward_weights() | block.forward_weights(P)
    w["embed.weight"] = torch.zeros(1, spec.hidden_size, dtype=block.gate.weight.dtype, device=block.gate.weight.device)
    return _Server(SimpleNamespace(num_layers=1, vocab_size=VOCAB, max_position=1), w, lora_scale)


def inputs(name, T, device, seed=1):
    spec, dtype, _ = CASES[name]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, spec.hidden_size, generator=g).to(device, dtype)
    return x, torch.randint(0, VOCAB, (T,), generator=g).to(device)


def taps(obj) -> dict:
    seen = {}
    obj.tap = lambda op, t, layer=None, rows="tokens": seen.__setitem__(op, t)
    return seen


def serve(server, spec, x, tokens, lora=None):
    return moe_block_fwd(server, spec, x, 0, SimpleNamespace(tokens=tokens, adapter_ids=None), lora)


@pytest.mark.parametrize("T", [1, 63, 200])
@pytest.mark.parametrize("name", CASES)
def test_trainer_equals_server(device, name, T):
    block = make_block(name, device)
    spec = block.spec
    server = server_of(block)
    x, tokens = inputs(name, T, device)
    seen_t, seen_s = taps(block), taps(server)
    y = block(x, tokens=tokens)
    y_s, ids, w = serve(server, spec, x, tokens)
    assert bitwise_equal(y.detach(), y_s), name
    for op in ("moe.router.ids", "moe.router.weights", "moe.routed", "moe.out"):
        assert bitwise_equal(seen_t[op].detach(), seen_s[op]), op
    # a token's bits do not depend on the rest of the batch: any split, served apart, gives the same rows
    a = T // 3
    parts = [serve(server, spec, x[lo:hi], tokens[lo:hi]) for lo, hi in ((0, a), (a, T)) if hi > lo]
    assert bitwise_equal(torch.cat([p[0] for p in parts]), y_s)
    extras = routed_extras([ids, ids], [w, w])
    assert extras["routed_experts"].shape == (T, 2, spec.router.top_k) and extras["routed_experts"].dtype == torch.int32
    assert extras["routed_weights"].dtype == F32 and torch.equal(extras["routed_weights"][:, 1], w.float())
    # every trainable part gets a gradient; the router's tables none
    (y.float() * torch.linspace(-1, 1, spec.hidden_size, device=device)).sum().backward()
    for n, p in block.named_parameters():
        if isinstance(block.get_submodule(n.rsplit(".", 1)[0]), Frozen):
            assert p.grad is None, n
        else:
            assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, n


@pytest.mark.parametrize("mode", ["frozen", "straight-through"])
@pytest.mark.parametrize("name", CASES)
def test_replay_routes_as_the_server(device, name, mode):
    """The trainer moved on (its router disagrees with the sampler's); replaying the server's routing gives
    the server's bits on every row that has one (not a sequence's last token)."""
    block = make_block(name, device)
    spec = block.spec
    x, tokens = inputs(name, 90, device)
    y_s, ids, w = serve(server_of(block), spec, x, tokens)
    with torch.no_grad():
        block.gate.weight.add_(torch.randn(block.gate.weight.shape, generator=torch.Generator().manual_seed(5))
                               .to(block.gate.weight) * 0.5)
    have = torch.ones(90, dtype=torch.bool, device=device)
    have[[30, 89]] = False
    extras = routed_extras([ids], [w])
    replay = (extras["routed_experts"][:, 0], extras["routed_weights"][:, 0], have, mode)
    y = block(x, replay=replay, tokens=tokens)
    assert bitwise_equal(y.detach()[have], y_s[have])
    if not isinstance(spec.router, HashRouter):
        assert not torch.equal(block(x, tokens=tokens).detach(), y_s)  # without replay the stale router differs
    y.float().sum().backward()
    assert (block.gate.weight.grad is not None) == (mode == "straight-through")


LORA_CASES = [("qwen35_gdn", "separate"), ("qwen35_gdn", "merged"), ("routed-only-fp32", "merged"),
              ("glm5_sparse_fp8", "separate"), ("deepseek_v4", "separate"), ("deepseek_v4-hash", "separate")]


@pytest.mark.parametrize("name,mode", LORA_CASES, ids=[f"{n}-{m}" for n, m in LORA_CASES])
def test_experts_lora_trainer_equals_server(device, name, mode):
    """LoRA inside the experts of every format (added to the base's own dots, the base kept in its format):
    trainer == server, and the adapters get gradients.  Merged mode folds W' into bf16 stacks only."""
    block = make_block(name, device)
    spec, dtype = block.spec, CASES[name][1]
    E, I, H = spec.num_experts, spec.intermediate_size, spec.hidden_size
    if spec.experts is BF16:
        base = block.gate_up.weight, block.down.weight
    else:  # the adapter's shapes and dtype: the activations' (E, 2I, H), (E, H, I)
        base = torch.zeros(E, 2 * I, H, dtype=dtype, device=device), torch.zeros(E, H, I, dtype=dtype, device=device)
    for p in block.parameters():
        p.requires_grad_(False)
    block.experts_lora = ExpertsAdapter(*base, ExpertsAdapter.KEYS, 3, 2.0, mode, {"gate_up": 1, "down": 2})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for b in block.experts_lora.lora_B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    x, tokens = inputs(name, 63, device)
    server = server_of(block, lora_scale=2.0)
    lora = server_experts_lora(server, spec, 0)
    assert (lora is None) == (mode == "merged")
    y = block(x, tokens=tokens)
    y_s = serve(server, spec, x, tokens, lora)[0]
    assert bitwise_equal(y.detach(), y_s)
    y.float().sum().backward()
    for p in (*block.experts_lora.lora_A.values(), *block.experts_lora.lora_B.values()):
        assert p.grad is not None and p.grad.abs().sum() > 0
    with torch.no_grad():
        block.experts_lora.lora_B["down"].zero_()
        assert not torch.equal(block(x, tokens=tokens), y_s)  # the adapter matters


def test_merged_lora_on_quantized_experts_is_refused():
    block = make_block("glm5_sparse_fp8", "cpu")
    assert block.spec.experts is FP8
    base = torch.zeros(8, 80, 72, dtype=BF), torch.zeros(8, 72, 40, dtype=BF)
    block.experts_lora = ExpertsAdapter(*base, ("down",), 2, 1.0, "merged", {"down": 0})
    with pytest.raises(NotImplementedError, match="separate"):
        block(inputs("glm5_sparse_fp8", 5, "cpu")[0])


# ---------------------------------------------------------------- parity with transformers' MoE blocks


def _hf_blocks(name):
    """(transformers' MoE block with random fp32 weights, our MoESpec for the same config)."""
    g = torch.Generator().manual_seed(11)
    if name == "qwen35_gdn":
        from transformers import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

        c = Qwen3_5MoeTextConfig(hidden_size=72, num_experts=7, num_experts_per_tok=3, moe_intermediate_size=40,
                                 shared_expert_intermediate_size=56)
        hf = Qwen3_5MoeSparseMoeBlock(c)
        spec = MoESpec(72, 7, 40, SoftmaxRouter(3), BF16, GatedSharedExpert(56))
    elif name == "glm5_sparse_fp8":
        from transformers import GlmMoeDsaConfig
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMoE

        c = GlmMoeDsaConfig(hidden_size=72, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=40,
                            n_group=4, topk_group=2, n_shared_experts=2)
        hf = GlmMoeDsaMoE(c)
        spec = MoESpec(72, 8, 40, SigmoidRouter(3, 4, 2, c.routed_scaling_factor), BF16, SharedExpert(80))
    else:
        from transformers import DeepseekV4Config
        from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4SparseMoeBlock

        c = DeepseekV4Config(hidden_size=96, n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=64,
                             vocab_size=VOCAB, num_hidden_layers=4, swiglu_limit=0.25)
        hash_layer = name.endswith("hash")
        hf = DeepseekV4SparseMoeBlock(c, 0 if hash_layer else c.num_hidden_layers - 1)
        assert hf.is_hash == hash_layer
        router = (HashRouter(3, VOCAB, c.routed_scaling_factor) if hash_layer
                  else SqrtSoftplusRouter(3, c.routed_scaling_factor))
        spec = MoESpec(96, 6, 64, router, BF16, SharedExpert(64), limit=c.swiglu_limit)
    hf = hf.float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.5 if n == "gate.weight" else 0.1))
        for n, b in hf.named_buffers():  # e_score_correction_bias, tid2eid
            b.copy_(_table(spec.num_experts, 3, VOCAB, g) if n.endswith("tid2eid")
                    else torch.randn(b.shape, generator=g) * 0.2)
    return hf, spec


def _ours(hf, spec):
    block = MoEBlock(spec, 0, dtype=F32)
    sh = getattr(hf, "shared_experts", None) or hf.shared_expert
    copies = {"gate.weight": hf.gate.weight, "gate_up.weight": hf.experts.gate_up_proj,
              "down.weight": hf.experts.down_proj,
              "shared_gate_up.weight": torch.cat([sh.gate_proj.weight, sh.up_proj.weight]),
              "shared_down.weight": sh.down_proj.weight}
    for ours, theirs in (("correction_bias.weight", "e_score_correction_bias"), ("tid2eid.weight", "tid2eid")):
        if hasattr(hf.gate, theirs):
            copies[ours] = getattr(hf.gate, theirs)
    if hasattr(hf, "shared_expert_gate"):
        copies["shared_gate.weight"] = hf.shared_expert_gate.weight
    params = dict(block.named_parameters())
    assert set(params) == set(copies)
    with torch.no_grad():
        for n, t in copies.items():
            params[n].copy_(t)
    return block


# ||ours - transformers|| / ||transformers|| in fp32 (the same arithmetic, other summation orders): measured
# <= 3e-7 for the outputs, <= 4.3e-7 for the gradients
PARITY = 2e-6


@pytest.mark.parametrize("name", ["qwen35_gdn", "glm5_sparse_fp8", "deepseek_v4", "deepseek_v4-hash"])
def test_parity_with_transformers(name):
    hf, spec = _hf_blocks(name)
    block = _ours(hf, spec)
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(1, 63, spec.hidden_size, generator=g)).requires_grad_()
    tokens = torch.randint(0, VOCAB, (1, 63), generator=g)
    want = hf(x, tokens) if name.startswith("deepseek") else hf(x)
    x2 = x.detach()[0].requires_grad_()
    got = block(x2, tokens=tokens[0])
    assert rel_err(got, want[0]) <= PARITY, rel_err(got, want[0])
    dy = torch.randn(63, spec.hidden_size, generator=g)
    (want[0] * dy).sum().backward()
    (got * dy).sum().backward()
    assert rel_err(x2.grad, x.grad[0]) <= PARITY
    sh = getattr(hf, "shared_experts", None) or hf.shared_expert
    theirs = {"gate.weight": hf.gate.weight.grad, "gate_up.weight": hf.experts.gate_up_proj.grad,
              "down.weight": hf.experts.down_proj.grad,
              "shared_gate_up.weight": torch.cat([sh.gate_proj.weight.grad, sh.up_proj.weight.grad]),
              "shared_down.weight": sh.down_proj.weight.grad}
    if hasattr(hf, "shared_expert_gate"):
        theirs["shared_gate.weight"] = hf.shared_expert_gate.weight.grad
    assert {n for n, p in block.named_parameters() if p.requires_grad} == set(theirs)
    for n, t in theirs.items():
        assert rel_err(block.get_parameter(n).grad, t) <= PARITY, n
