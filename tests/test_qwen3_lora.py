"""LoRA on the qwen3 pair, merged, separate and multi-adapter: K3 == 0 after every sync.

RL-like steps (sample with temperature / top-k / top-p / min-p on mixed prompt
lengths, one past 300 tokens; score with the trainer; backward; an optimizer
on the adapters; ``pair.sync()``) keep trainer log-probs == sampler log-probs
bitwise; the base stays frozen bit for bit; an untrained adapter is the base
model; merged checkpoints and PEFT adapters round-trip to the same bits.
Multi-adapter: base rows and three adapters in one engine batch, each row ==
the request alone == server prefill == token-by-token scoring == the trainer
under its adapter; a step on one adapter ships only it and changes no other
row; an unknown adapter fails its request alone.
"""
import json

import pytest
import torch
from model_cases import prompts_of
from safetensors import safe_open

import alignzoo
from alignzoo import SamplingParams
from alignzoo.common.lora import LoRAConfig
from alignzoo.common.metrics import mismatch
from alignzoo.models.qwen3 import load_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA = LoRAConfig(r=8, lora_alpha=16, target_modules=ALL)
MODES = [pytest.param("merged", id="merged"), pytest.param("separate", id="separate")]
SP = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, max_new_tokens=10, seed=11),
      SamplingParams(temperature=1.3, top_k=0, top_p=0.8, min_p=0.0, max_new_tokens=14, seed=12),
      SamplingParams(temperature=0.7, top_k=7, top_p=1.0, min_p=0.1, max_new_tokens=6, seed=13)]
STEPS = 3


def sharpen(pair):
    """Base weights away from the 0.02 init (norms off one, matrices x3), so
    top-p / min-p bite; then sync.  The base is frozen, not read-only."""
    with torch.no_grad():
        g = torch.Generator().manual_seed(1)
        for n, p in pair.trainer.named_parameters():
            if ".lora_" in n:
                continue
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=g)
            else:
                p.mul_(3.0)
    pair.sync()
    return pair


def make_pair(mode=None, lora=LORA, **kw):
    if mode is not None:
        kw |= dict(lora=lora, lora_mode=mode)
    return sharpen(alignzoo.load_pair("qwen3", config="tiny", device="cpu", seed=0, **kw))


def base_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.named_parameters() if ".lora_" not in n}


def adapter_of(trainer):
    return {n: p.detach().clone() for n, p in trainer.named_parameters() if ".lora_" in n}


def sample_and_score(pair, prompts, sps, grad=False):
    """-> (completions, trainer log-probs); asserts K3 == 0 (bitwise) on every token."""
    outs = pair.server.generate(prompts, sps)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    with torch.set_grad_enabled(grad):
        lps = pair.trainer.logprobs(seqs, [len(p) for p in prompts], sps)
    for o, lp in zip(outs, lps):
        assert o.error is None, o.error
        assert o.weight_version == pair.server.weight_version
        lp = lp.detach().cpu()
        assert torch.equal(lp, o.logprobs), mismatch(lp, o.logprobs)
    return outs, lps


@pytest.fixture(scope="module", params=MODES)
def trained(request):
    """A LoRA pair after STEPS RL-like steps, with what each step saw."""
    mode = request.param
    pair = make_pair(mode)
    t = pair.trainer
    base0 = base_of(t)
    opt = torch.optim.Adam([p for p in t.parameters() if p.requires_grad], lr=1e-2)
    prompts = prompts_of([310, 5, 47], pair.config.vocab_size)
    record = {"mode": mode, "pair": pair, "base0": base0, "prompts": prompts, "grads": [], "shipped": []}
    for step in range(STEPS):
        outs, lps = sample_and_score(pair, prompts, SP, grad=True)  # K3 == 0 at this version
        rewards = torch.tensor([float(sum(o.tokens) % 3) - 1.0 for o in outs])
        (-sum(r * lp[torch.isfinite(lp)].sum() for r, lp in zip(rewards, lps))).backward()
        record["grads"].append({n for n, p in t.named_parameters() if p.grad is not None})
        before = {n: w.clone() for n, w in pair.server.model.weights.items()}
        opt.step()
        opt.zero_grad(set_to_none=True)
        pair.sync()
        assert pair.weights_match()
        after = pair.server.model.weights
        record["shipped"].append({n for n in after if not torch.equal(after[n], before[n])})
    sample_and_score(pair, prompts, SP)  # and at the last version
    return record


def test_rl_steps_keep_k3_zero_and_base_frozen(trained):
    """K3 == 0 is asserted in the fixture at every version; here: the base is
    unchanged bitwise, only adapters got gradients, and the adapters moved."""
    t = trained["pair"].trainer
    params = dict(t.named_parameters())
    for n, p in base_of(t).items():
        assert torch.equal(p, trained["base0"][n]) and not params[n].requires_grad, n
    adapters = set(adapter_of(t))
    assert len(adapters) == 2 * 7 * t.cfg.num_layers
    for step, got in enumerate(trained["grads"]):
        assert got == adapters, f"step {step}: gradients on {sorted(got ^ adapters)[:4]}"
    if trained["mode"] == "merged":
        targeted = {f"layers.{i}.{m}.weight" for i in range(t.cfg.num_layers) for m in ("qkv", "o", "gate_up", "down")}
        assert all(s == targeted for s in trained["shipped"]), trained["shipped"]
    else:  # B starts at 0, so step 0 moves only B (dA = s·Bᵀ·dW' = 0); later steps move A too
        assert trained["shipped"][0] == {n for n in adapters if ".lora_B." in n}
        assert all(s == adapters for s in trained["shipped"][1:])


def test_merged_sync_ships_only_targeted_tensors():
    lora = LoRAConfig(r=4, lora_alpha=8, target_modules=["v_proj", "down_proj"])
    pair = make_pair("merged", lora=lora)
    t = pair.trainer
    assert sorted(n for n, p in t.named_parameters() if p.requires_grad) == sorted(
        f"layers.{i}.{m}.lora_{ab}.{p}" for i in range(2) for m, p in (("qkv", "v_proj"), ("down", "down_proj"))
        for ab in "AB")
    seqs = prompts_of([40, 23], pair.config.vocab_size, seed=4)
    opt = torch.optim.SGD([p for p in t.parameters() if p.requires_grad], lr=1.0)
    for _ in range(2):
        before = {n: w.clone() for n, w in pair.server.model.weights.items()}
        (-sum(lp.sum() for lp in t.logprobs(seqs, [10, 10]))).backward()
        opt.step()
        opt.zero_grad()
        pair.sync()
        w = pair.server.model.weights
        changed = {n for n in w if not torch.equal(w[n], before[n])}
        assert changed == {f"layers.{i}.{m}.weight" for i in range(2) for m in ("qkv", "down")}
        assert (pair.last_sync.tensors_changed, pair.last_sync.tensors_total) == (4, len(w))
        # only v's rows of qkv moved: q and k rows keep the base's bits
        q_k = t.cfg.num_heads * t.cfg.head_dim + t.cfg.num_kv_heads * t.cfg.head_dim
        for i in range(2):
            assert torch.equal(w[f"layers.{i}.qkv.weight"][:q_k], t.layers[i].qkv.weight[:q_k])
        assert pair.weights_match()
    qkv = t.layers[0].qkv
    assert qkv.forward_weights("")["weight"] is qkv.merged_weight()  # the bytes read are the bytes shipped


def test_merged_weight_is_built_once_per_step():
    pair = make_pair("merged")
    qkv = pair.trainer.layers[0].qkv
    w0 = qkv.merged_weight()
    seqs = prompts_of([30], pair.config.vocab_size, seed=5)
    for _ in range(2):
        pair.trainer.logprobs(seqs, [3])[0].sum().backward()
        assert qkv.merged_weight() is w0  # forwards and backwards do not rebuild it
    torch.optim.SGD([qkv.lora_B["q_proj"]], lr=1.0).step()
    assert qkv.merged_weight() is not w0


@pytest.mark.parametrize("mode", MODES)
def test_untrained_adapter_is_the_base_model(mode):
    plain, lora = make_pair(), make_pair(mode)
    prompts = prompts_of([64, 9], plain.config.vocab_size, seed=6)
    a, b = plain.server.generate(prompts, SP[:2]), lora.server.generate(prompts, SP[:2])
    for x, y in zip(a, b):
        assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)
    seqs = [p + o.tokens for p, o in zip(prompts, a)]
    for x, y in zip(plain.trainer.logprobs(seqs, [64, 9], SP[:2]), lora.trainer.logprobs(seqs, [64, 9], SP[:2])):
        assert torch.equal(x, y)
    if mode == "merged":  # B = 0: W' is W, bit for bit
        for n, w in plain.server.model.weights.items():
            assert torch.equal(w, lora.server.model.weights[n]), n


def test_merged_save_reloads_as_a_plain_pair(trained, tmp_path):
    """Merged mode: the checkpoint holds the served W', so a plain pair gives
    the same bits.  Separate mode rounds its branch apart from W: close only."""
    pair = trained["pair"]
    pair.save_pretrained(tmp_path)
    plain = alignzoo.load_pair("qwen3", checkpoint=tmp_path, device="cpu")
    assert plain.trainer.lora is None and not any(".lora_" in n for n in plain.server.model.weights)
    if trained["mode"] == "separate":
        seqs = trained["prompts"][1:]
        for x, y in zip(pair.trainer.logprobs(seqs, [1, 1]), plain.trainer.logprobs(seqs, [1, 1])):
            assert (x - y).abs().max() <= 5e-2, (x - y).abs().max()  # 1.6e-2 measured with B ~ N(0, 0.05)
        return
    for n, w in pair.server.model.weights.items():
        assert torch.equal(plain.server.model.weights[n], w), n
    prompts = [trained["prompts"][1], trained["prompts"][2]]
    for x, y in zip(pair.server.generate(prompts, SP[:2]), plain.server.generate(prompts, SP[:2])):
        assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)


def test_peft_adapter_round_trip(trained, tmp_path):
    pair, mode = trained["pair"], trained["mode"]
    pair.save_pretrained(tmp_path, adapter_only=True)
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (8, 16, list(ALL))
    with safe_open(str(tmp_path / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        a = f.get_tensor("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight")
    assert len(keys) == 2 * 7 * 2 and "base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight" in keys
    assert torch.equal(a, pair.trainer.layers[1].qkv.lora_A["k_proj"])

    # a fresh pair from the same base plus the adapter file, and one loaded into in place
    base = {n: p.detach().clone() for n, p in pair.trainer.named_parameters() if ".lora_" not in n}
    again = alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora_adapter=tmp_path, lora_mode=mode)
    other = make_pair(mode)  # untrained adapters
    with torch.no_grad():
        for t in (again.trainer, other.trainer):
            for n, p in t.named_parameters():
                if n in base:
                    p.copy_(base[n])
    again.sync()
    load_adapter(other, tmp_path)
    prompts = [trained["prompts"][1], trained["prompts"][2]]
    ref = pair.server.generate(prompts, SP[:2])
    for q in (again, other):
        assert q.trainer.lora == pair.trainer.lora
        for n, p in adapter_of(pair.trainer).items():
            assert torch.equal(dict(q.trainer.named_parameters())[n], p), n
        assert q.weights_match()
        for x, y in zip(ref, q.server.generate(prompts, SP[:2])):
            assert x.tokens == y.tokens and torch.equal(x.logprobs, y.logprobs)


@pytest.mark.parametrize("mode", MODES)
def test_peft_library_reads_and_writes_our_adapters(tmp_path, mode):
    """Where peft is installed (the H200 image has it; CI does not): an
    adapter trained by peft on a transformers Qwen3 gives, loaded here, the
    log-probs of peft's model (fp32, |Δ| <= 1e-5), and ours loads into peft."""
    pytest.importorskip("peft")
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151, hidden_size=72, intermediate_size=100, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=24, rope_theta=10000.0)
    hf = Qwen3ForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "base")
    pm = get_peft_model(hf, LoraConfig(r=4, lora_alpha=12, target_modules=list(ALL))).eval()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.5)
    pm.save_pretrained(tmp_path / "theirs")
    seqs = prompts_of([90, 17], cfg.vocab_size, seed=8)
    with torch.no_grad():
        ref = [torch.log_softmax(pm(torch.tensor(s)[None]).logits[0, :-1].float(), -1)
               .gather(1, torch.tensor(s[1:])[:, None])[:, 0] for s in seqs]
    ours = alignzoo.load_pair("qwen3", checkpoint=tmp_path / "base", device="cpu", dtype=torch.float32,
                              lora_adapter=tmp_path / "theirs", lora_mode=mode)
    assert ours.trainer.lora.scale == 3.0
    with torch.no_grad():
        for got, r in zip(ours.trainer.logprobs(seqs, [1, 1]), ref):
            assert (got - r).abs().max() <= 1e-5
    ours.save_pretrained(tmp_path / "ours", adapter_only=True)
    back = dict(PeftModel.from_pretrained(Qwen3ForCausalLM.from_pretrained(tmp_path / "base"),
                                          tmp_path / "ours").named_parameters())
    for n, p in pm.named_parameters():
        if "lora_" in n:
            assert torch.equal(back[n], p), n


def test_bad_config(tmp_path):
    cases = [
        (dict(lora=LoRAConfig(r=8, lora_alpha=16, target_modules=["q_proj", "qkv_proj"])), ValueError,
         "unknown LoRA target module 'qkv_proj'.*q_proj, k_proj"),
        (dict(lora=LoRAConfig(r=0, lora_alpha=16, target_modules=["q_proj"])), ValueError, "r must be an integer >= 1"),
        (dict(lora={"r": 4, "alpha": 8}), ValueError, r"unknown LoRA config fields \['alpha'\]"),
        (dict(lora=LoRAConfig(r=4, lora_alpha=8)), ValueError, "target_modules is empty"),
        (dict(lora=LORA, lora_mode="fused"), ValueError, "lora_mode must be one of"),
        (dict(lora=LORA, fp8=True), NotImplementedError, "fp8"),
        (dict(lora=LORA, lora_mode="separate", server_kernels="vendor"), NotImplementedError, "vendor"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            alignzoo.load_pair("qwen3", config="tiny", device="cpu", **kw)
    small = alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora={"r": 4, "lora_alpha": 8,
                                                                         "target_modules": "q_proj"})
    small.save_pretrained(tmp_path, adapter_only=True)
    with pytest.raises(ValueError, match="r=4.*the model's LoRA has r=8"):
        load_adapter(alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora=LORA), tmp_path)
    with pytest.raises(ValueError, match="the model's LoRA has r=8"):
        alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora=LORA, lora_adapter=tmp_path)
    with pytest.raises(ValueError, match="adapter_only=True needs a LoRA model"):
        alignzoo.load_pair("qwen3", config="tiny", device="cpu").save_pretrained(tmp_path / "x", adapter_only=True)
    with pytest.raises(RuntimeError, match="already has LoRA"):
        small.trainer.add_lora(LORA)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", MODES)
def test_cuda_graph_decode_with_lora(mode):
    """0.6B shapes on the GPU: trainer == prefill == eager decode == CUDA-graph decode, after a step."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kw = dict(config="qwen3-0.6b", device="cuda", max_batch_size=8, kv_cache_bytes=4 << 30, lora=LORA, lora_mode=mode)
    pair = alignzoo.load_pair("qwen3", **kw)
    eager = alignzoo.load_pair("qwen3", cuda_graphs=False, **kw)
    prompts = prompts_of([1500, 333, 17], pair.config.vocab_size, seed=4)
    sps = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.01, max_new_tokens=n, seed=n)
           for n in (40, 30, 20)]
    for p in (pair, eager):
        opt = torch.optim.SGD([q for q in p.trainer.parameters() if q.requires_grad], lr=1e-2)
        outs, lps = sample_and_score(p, prompts, sps, grad=True)
        sum(lp[torch.isfinite(lp)].sum() for lp in lps).backward()
        opt.step()
        p.sync()
    outs, _ = sample_and_score(pair, prompts, sps)
    lp_s = pair.server.score([q + o.tokens for q, o in zip(prompts, outs)], [len(q) for q in prompts], sps)
    for o, e, s in zip(outs, eager.server.generate(prompts, sps), lp_s):
        assert o.tokens == e.tokens and torch.equal(o.logprobs, e.logprobs) and torch.equal(s, o.logprobs)


# --------------------------------------------------------------------------- multi-adapter

ADAPTERS = {  # ranks, scales and targets differ; together they cover all seven projections, some twice
    "a": LoRAConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "up_proj"]),
    "b": LoRAConfig(r=4, lora_alpha=4, target_modules=["q_proj", "k_proj", "down_proj"]),
    "c": LoRAConfig(r=3, lora_alpha=9, target_modules=["v_proj", "gate_proj", "up_proj"]),
}
MIXED = ["b", None, "a", "c", "a", None]  # one engine batch: base rows and three adapters
MIXED_LENS = [610, 5, 47, 129, 1, 64]  # 610: past the 593 where CPU and CUDA rope tables part


def make_multi(**kw):
    """A multi-adapter pair whose adapters look trained (B != 0, each its own)."""
    pair = alignzoo.load_pair("qwen3", config="tiny", device="cpu", seed=0, lora_adapters=ADAPTERS, **kw)
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for n, p in pair.trainer.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return sharpen(pair)


def mixed_sps(n, new_tokens=(5, 7, 4)):
    return [SamplingParams(temperature=(0.9, 1.2, 0.7)[i % 3], top_k=(0, 40, 7)[i % 3], top_p=(0.9, 1.0, 0.8)[i % 3],
                           min_p=(0.05, 0.0, 0.1)[i % 3], max_new_tokens=new_tokens[i % 3], seed=20 + i)
            for i in range(n)]


def assert_multi_k3_zero(pair, prompts, sps, adapters):
    """One engine batch of mixed adapters: decode == server prefill == the
    trainer under each row's adapter (one packed batch), bitwise."""
    outs = pair.server.generate(prompts, sps, adapters=adapters)
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    with torch.no_grad():
        lp_t = pair.trainer.logprobs(seqs, lens, sps, adapters=adapters)
    lp_s = pair.server.score(seqs, lens, sps, adapters=adapters)
    for i, (o, t, s) in enumerate(zip(outs, lp_t, lp_s)):
        assert o.error is None and o.adapter == adapters[i], (o.error, o.adapter)
        assert o.weight_version == pair.server.weight_version
        t = t.cpu()
        assert torch.equal(t, o.logprobs), (i, adapters[i], mismatch(t, o.logprobs))
        assert torch.equal(s, o.logprobs), (i, adapters[i], mismatch(s, o.logprobs))
    return outs


@pytest.fixture(scope="module")
def multi():
    pair = make_multi()
    prompts = prompts_of(MIXED_LENS, pair.config.vocab_size, seed=9)
    return pair, prompts, mixed_sps(len(prompts))


def test_multi_adapter_batch_is_each_request_alone_and_the_trainer(multi):
    pair, prompts, sps = multi
    outs = assert_multi_k3_zero(pair, prompts, sps, MIXED)
    for i in (1, 2, 3, 5):  # alone in the engine (a batch of one: no other adapter beside it)
        alone = pair.server.generate([prompts[i]], sps[i], adapters=MIXED[i])[0]
        assert alone.tokens == outs[i].tokens and torch.equal(alone.logprobs, outs[i].logprobs), i
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    with torch.no_grad():  # the trainer with one adapter for the whole batch; then another adapter
        lp = pair.trainer.logprobs([seqs[2], seqs[4]], [lens[2], lens[4]], [sps[2], sps[4]], adapters="a")
        other = pair.trainer.logprobs([seqs[2]], [lens[2]], [sps[2]], adapters="b")[0]
    assert torch.equal(lp[0], outs[2].logprobs) and torch.equal(lp[1], outs[4].logprobs)
    assert not torch.equal(other, outs[2].logprobs)  # the adapters matter
    # decode-shaped scoring, token by token (the short rows)
    short = [1, 4]
    lp1 = pair.server.score([seqs[i] for i in short], [lens[i] for i in short], [sps[i] for i in short],
                            adapters=[MIXED[i] for i in short], chunk_tokens=1)
    for i, lp in zip(short, lp1):
        assert torch.equal(lp, outs[i].logprobs), i


def test_multi_adapter_training_step_then_sync(multi):
    """A step on adapter "a" (its rows mixed with others in the batch): only
    a's tensors change and ship, K3 == 0 again, and rows of the other
    adapters and of the base model give the same bits as before the step."""
    _, prompts, sps = multi
    prompts = [p[:48] for p in prompts]  # long prompts: the test above
    pair = make_multi()
    t = pair.trainer
    before = {n: p.detach().clone() for n, p in t.named_parameters()}
    outs = pair.server.generate(prompts, sps, adapters=MIXED)
    seqs, lens = [p + o.tokens for p, o in zip(prompts, outs)], [len(p) for p in prompts]
    lps = t.logprobs(seqs, lens, sps, adapters=MIXED)
    for o, lp in zip(outs, lps):
        assert torch.equal(lp.detach(), o.logprobs)
    rewards = torch.tensor([float(sum(o.tokens) % 3) - 1.0 for o in outs])
    (-sum(r * lp[torch.isfinite(lp)].sum() for r, lp in zip(rewards, lps))).backward()
    grads = {n for n, p in t.named_parameters() if p.grad is not None}
    assert grads == {n for n in before if ".lora_" in n}  # every adapter in the batch, never the base
    opt = torch.optim.Adam(t.adapter_parameters("a"), lr=1e-2)
    opt.step()
    served = {n: w.clone() for n, w in pair.server.model.weights.items()}
    pair.sync()
    assert pair.weights_match()
    mine = {n for n in served if ".adapters.0." in n}
    assert {n for n, w in pair.server.model.weights.items() if not torch.equal(w, served[n])} == mine
    for n, p in t.named_parameters():
        assert torch.equal(p, before[n]) == (".adapters.0." not in n), n
    again = assert_multi_k3_zero(pair, prompts, sps, MIXED)
    for a, o, o2 in zip(MIXED, outs, again):
        same = o.tokens == o2.tokens and torch.equal(o.logprobs, o2.logprobs)
        assert same == (a != "a"), a


def test_multi_adapter_bad_requests_and_config(multi, tmp_path):
    pair, prompts, sps = multi
    outs = pair.server.generate(prompts[1:4], sps[1:4], adapters=[None, "nope", "c"])
    assert outs[1].finish_reason == "error" and "unknown adapter 'nope': the model serves adapters 'a', 'b', 'c'" \
        in outs[1].error
    for i in (0, 2):
        assert outs[i].error is None and len(outs[i].tokens) == sps[1 + i].max_new_tokens
    with pytest.raises(ValueError, match="sequence 1: unknown adapter 'nope': the model has adapters 'a', 'b', 'c'"):
        pair.trainer.logprobs([prompts[1], prompts[1]], [1, 1], adapters=["a", "nope"])
    with pytest.raises(ValueError, match="2 sequences but 3 adapters"):
        pair.trainer.logprobs([prompts[1], prompts[1]], [1, 1], adapters=["a", "b", None])
    with pytest.raises(ValueError, match="name one of the adapters 'a', 'b', 'c'"):
        pair.save_pretrained(tmp_path, adapter_only=True)
    plain = make_pair()
    with pytest.raises(ValueError, match="no named LoRA adapters"):
        plain.trainer.logprobs([prompts[1]], [1], adapters="a")
    assert "the model serves adapters none" in plain.server.generate([prompts[1]], sps[1], adapters="a")[0].error
    cases = [
        (dict(lora_adapters=ADAPTERS, lora=LORA), ValueError, "neither lora= nor lora_adapter="),
        (dict(lora_mode="multi"), ValueError, "multi-adapter LoRA takes lora_adapters="),
        (dict(lora_adapters=ADAPTERS, lora_mode="separate"), ValueError, "multi-adapter LoRA takes lora_adapters="),
        (dict(lora_adapters={}), ValueError, "needs a non-empty"),
        (dict(lora_adapters=["a"]), TypeError, "lora_adapters must be a dict"),
        (dict(lora_adapters={"a": {"r": 4, "lora_alpha": 8, "target_modules": "qkv"}}), ValueError,
         "adapter 'a': unknown LoRA target module 'qkv'"),
        (dict(lora_adapters=ADAPTERS, server_kernels="vendor"), NotImplementedError, "vendor"),
    ]
    for kw, err, match in cases:
        with pytest.raises(err, match=match):
            alignzoo.load_pair("qwen3", config="tiny", device="cpu", **kw)


def test_multi_adapter_save_and_load(multi, tmp_path):
    """One adapter of a multi pair out as a PEFT directory and back in (as a
    named adapter of another multi pair, and into a live one), bit for bit."""
    pair = multi[0]
    pair.save_pretrained(tmp_path, adapter_only=True, adapter="c")
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["target_modules"]) == (3, 9, ["v_proj", "gate_proj", "up_proj"])
    want = pair.trainer.lora_adapters("c")
    other = alignzoo.load_pair("qwen3", config="tiny", device="cpu", lora_adapters={"b": ADAPTERS["b"], "x": tmp_path})
    assert other.server.adapter_names == ("b", "x") and other.weights_match()
    live = make_multi()
    load_adapter(live, tmp_path, adapter="c")
    for got in (other.trainer.lora_adapters("x"), live.trainer.lora_adapters("c")):
        assert set(got) == set(want) and all(torch.equal(got[n][k], want[n][k]) for n in want for k in (0, 1))
    with pytest.raises(ValueError, match="r=3.*the model's LoRA has r=8"):
        load_adapter(live, tmp_path, adapter="a")
    # merged with one adapter: the weights merged mode would serve for it
    pair.save_pretrained(tmp_path / "merged", adapter="c")
    plain = alignzoo.load_pair("qwen3", checkpoint=tmp_path / "merged", device="cpu")
    qkv = pair.trainer.layers[1].qkv
    assert torch.equal(plain.trainer.layers[1].qkv.weight, qkv.merge(2))
    assert torch.equal(plain.trainer.layers[1].down.weight, pair.trainer.layers[1].down.weight)  # c leaves down


@pytest.mark.gpu
def test_cuda_graph_decode_with_multi_adapters():
    """0.6B shapes on the GPU, three adapters and the base in one batch:
    trainer == prefill == eager decode == CUDA-graph decode == alone, before
    and after a step on one adapter."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    ads = {"a": LORA, "b": ADAPTERS["b"], "c": ADAPTERS["c"]}
    kw = dict(config="qwen3-0.6b", device="cuda", max_batch_size=8, kv_cache_bytes=4 << 30, lora_adapters=ads)
    pair = alignzoo.load_pair("qwen3", **kw)
    eager = alignzoo.load_pair("qwen3", cuda_graphs=False, **kw)
    assert pair.server.runner.graphs is not None
    prompts = prompts_of([1500, 333, 17, 64, 5], pair.config.vocab_size, seed=4)
    pick = ["a", None, "b", "c", "a"]
    sps = [SamplingParams(temperature=0.8, top_k=100, top_p=0.9, min_p=0.01, max_new_tokens=n, seed=n)
           for n in (40, 30, 20, 25, 33)]
    for p in (pair, eager):
        with torch.no_grad():
            g = torch.Generator(device="cuda").manual_seed(3)
            for n, q in p.trainer.named_parameters():
                if ".lora_B." in n:
                    q.normal_(0.0, 0.05, generator=g)
        p.sync()
    for step in range(2):
        outs = assert_multi_k3_zero(pair, prompts, sps, pick)
        for o, e in zip(outs, eager.server.generate(prompts, sps, adapters=pick)):
            assert o.tokens == e.tokens and torch.equal(o.logprobs, e.logprobs)
        alone = pair.server.generate([prompts[2]], sps[2], adapters=pick[2])[0]  # bucket 1
        assert alone.tokens == outs[2].tokens and torch.equal(alone.logprobs, outs[2].logprobs)
        for p in (pair, eager):
            opt = torch.optim.SGD(p.trainer.adapter_parameters("a"), lr=1e-2)
            seqs = [q + o.tokens for q, o in zip(prompts, outs)]
            lps = p.trainer.logprobs(seqs, [len(q) for q in prompts], sps, adapters=pick)
            sum(lp[torch.isfinite(lp)].sum() for lp in lps).backward()
            opt.step()
            p.sync()
