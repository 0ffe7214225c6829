"""RoPE: table bits, layouts against transformers, accuracy and gradients against
float64, batch invariance, and bad inputs."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.rope import (
    RopeSpec,
    Yarn,
    build_table,
    inv_freq_and_attention_factor,
    rope,
    rope_bwd,
    rope_fwd,
    rope_ref,
    rope_table,
)
from alignzoo.common.rope import table as rope_table_mod

# Norm-wise relative error bounds against float64.  bf16: one round-to-nearest
# at the output (unit roundoff 2**-8) dominates; fp32: the table rounding, two
# products and one add, each <= 2**-24, on a rotation (norm-preserving up to the
# YaRN factor): a few times 2**-24.
BOUND = {torch.bfloat16: 4e-3, torch.float32: 1e-6}
DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(torch.float32, id="fp32")]

MAXP = 5000  # tables in these tests; positions run past 593, 2048 and 3000

# name -> (spec, head_dim): one per pairing / slice / scaling the four models use.
SPECS = {
    "qwen3-D128": (RopeSpec(128, 1e6, MAXP), 128),
    "qwen3-D64-yarn": (RopeSpec(64, 1e6, MAXP, yarn=Yarn(4.0, 1024)), 64),
    "qwen35-D256-r64": (RopeSpec(64, 1e7, MAXP), 256),
    "glm5-D192-r64-last": (RopeSpec(64, 1e6, MAXP, pairing="interleaved_to_half", rotary_slice="last"), 192),
    "glm5-indexer-D128-r64": (RopeSpec(64, 1e6, MAXP, pairing="interleaved_to_half"), 128),
    "dsv4-D192-r64-yarn": (
        RopeSpec(64, 160000.0, MAXP, pairing="interleaved", rotary_slice="last", yarn=Yarn(16.0, 1024, attention_factor=1.0)),
        192,
    ),
    "interleaved-D64-mscale": (
        RopeSpec(64, 1e4, MAXP, pairing="interleaved", yarn=Yarn(40.0, 512, mscale=1.0, mscale_all_dim=0.707)),
        64,
    ),
}
SPEC_IDS = list(SPECS)


def _positions(T: int, device, seed: int = 0) -> torch.Tensor:
    """Packed sequences: a run 0..T/2, then random positions in [0, MAXP)."""
    g = torch.Generator().manual_seed(seed)
    head = torch.arange(T // 2)
    tail = torch.randint(0, MAXP, (T - T // 2,), generator=g)
    return torch.cat([head, tail]).to(device)


def _x(T, H, D, dtype, device, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, H, D, generator=g).to(device=device, dtype=dtype)


# ---------------------------------------------------------------- the table


def _hf_cases():
    from transformers import DeepseekV4Config, GlmMoeDsaConfig, Qwen3Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaRotaryEmbedding
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTextRotaryEmbedding

    yarn4 = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    dsv4 = DeepseekV4Config(
        num_hidden_layers=2,
        rope_parameters={"rope_type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
    )
    glm_yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 0.707, "rope_theta": 1e4}
    return {
        "qwen3": (Qwen3Config(head_dim=128, rope_theta=1e6, max_position_embeddings=40960), Qwen3RotaryEmbedding, None),
        "qwen3-yarn": (Qwen3Config(head_dim=128, rope_theta=1e6, max_position_embeddings=131072, rope_scaling=yarn4), Qwen3RotaryEmbedding, None),
        "qwen3-yarn-notruncate": (
            Qwen3Config(head_dim=64, rope_theta=1e4, max_position_embeddings=131072, rope_scaling={**yarn4, "truncate": False, "beta_fast": 16.0}),
            Qwen3RotaryEmbedding,
            None,
        ),
        "qwen3_5_moe": (Qwen3_5MoeTextConfig(num_hidden_layers=2), Qwen3_5MoeTextRotaryEmbedding, None),
        "glm_moe_dsa": (GlmMoeDsaConfig(num_hidden_layers=2), GlmMoeDsaRotaryEmbedding, None),
        "glm_moe_dsa-yarn-mscale": (
            GlmMoeDsaConfig(num_hidden_layers=2, max_position_embeddings=163840, rope_parameters=glm_yarn),
            GlmMoeDsaRotaryEmbedding,
            None,
        ),
        "deepseek_v4-main": (dsv4, DeepseekV4RotaryEmbedding, "main"),
        "deepseek_v4-compress-yarn": (dsv4, DeepseekV4RotaryEmbedding, "compress"),
    }


@pytest.fixture(scope="module")
def hf_cases():
    return _hf_cases()


HF_IDS = [
    "qwen3", "qwen3-yarn", "qwen3-yarn-notruncate", "qwen3_5_moe", "glm_moe_dsa",
    "glm_moe_dsa-yarn-mscale", "deepseek_v4-main", "deepseek_v4-compress-yarn",
]


def _hf_module(case):
    config, cls, key = case
    mod = cls(config)
    if key is None:
        return mod, mod.inv_freq, mod.attention_scaling, {}
    return mod, getattr(mod, f"{key}_inv_freq"), getattr(mod, f"{key}_attention_scaling"), {"layer_type": key}


@pytest.mark.parametrize("name", HF_IDS)
def test_inv_freq_and_factor_bitwise_equal_transformers(hf_cases, name):
    config, _, key = hf_cases[name]
    spec = RopeSpec.from_hf(config, rope_key=key, max_position=4096)
    _, hf_inv, hf_scale, _ = _hf_module(hf_cases[name])
    inv, scale = inv_freq_and_attention_factor(spec.rotary_dim, spec.base, spec.yarn)
    assert bitwise_equal(inv, hf_inv.float())
    assert scale == hf_scale
    if "yarn" in name:
        assert spec.yarn is not None


@pytest.mark.parametrize("name", HF_IDS)
def test_table_close_to_transformers_forward(hf_cases, name):
    """Transformers rounds the angle p*inv_freq to fp32 before cos/sin; we do not.
    Entry bound: scale * 2**-24 * p * inv_freq (its angle rounding) + 2**-21."""
    config, _, key = hf_cases[name]
    spec = RopeSpec.from_hf(config, rope_key=key, max_position=4096)
    mod, inv, scale, kw = _hf_module(hf_cases[name])
    pos = torch.arange(0, 4096, 7)
    hf_cos, hf_sin = mod(torch.zeros(1, dtype=torch.float32), pos[None], **kw)
    half = spec.rotary_dim // 2
    cos, sin = rope_table(spec)
    bound = scale * 2.0**-24 * pos[:, None].double() * inv.double()[None, :] + 2.0**-21
    assert ((cos[pos].double() - hf_cos[0, :, :half].double()).abs() <= bound).all()
    assert ((sin[pos].double() - hf_sin[0, :, :half].double()).abs() <= bound).all()


def test_from_hf_config_dicts_and_layouts(hf_cases):
    # a config.json dict goes through transformers' own normalisation
    assert RopeSpec.from_hf(hf_cases["qwen3-yarn"][0].to_dict(), max_position=4096) == RopeSpec.from_hf(hf_cases["qwen3-yarn"][0], max_position=4096)
    legacy = {
        "model_type": "deepseek_v4", "qk_rope_head_dim": 64, "head_dim": 512, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1},
        "num_hidden_layers": 2,
    }
    comp = RopeSpec.from_hf(legacy, rope_key="compress", max_position=4096)
    assert (comp.rotary_dim, comp.base, comp.pairing, comp.rotary_slice) == (64, 160000.0, "interleaved", "last")
    assert comp.yarn == Yarn(16.0, 65536, attention_factor=1.0)  # V4 does not scale cos/sin
    main = RopeSpec.from_hf(legacy, rope_key="main", max_position=4096)
    assert (main.base, main.yarn) == (10000.0, None)
    with pytest.raises(ValueError, match="rope_key"):
        RopeSpec.from_hf(legacy)
    q35 = RopeSpec.from_hf(hf_cases["qwen3_5_moe"][0], max_position=4096)
    assert (q35.rotary_dim, q35.pairing, q35.rotary_slice) == (64, "half", "first")
    glm = RopeSpec.from_hf(hf_cases["glm_moe_dsa"][0], max_position=4096)
    assert (glm.rotary_dim, glm.pairing, glm.rotary_slice) == (64, "interleaved_to_half", "last")
    assert RopeSpec.from_hf(hf_cases["qwen3"][0]).max_position == 40960


def _exact(fn, angle, scale):
    return rope_table_mod._exact_fp32(fn, angle, scale)


@pytest.mark.parametrize("spec", [
    pytest.param(RopeSpec(128, 1e6, 40960), id="default-40960"),
    pytest.param(RopeSpec(64, 160000.0, 1 << 17, yarn=Yarn(16.0, 65536, attention_factor=1.0)), id="yarn-131072"),
    pytest.param(RopeSpec(64, 1e4, 8192, yarn=Yarn(40.0, 512, mscale=1.0, mscale_all_dim=0.707)), id="yarn-mscale"),
])
def test_table_is_correctly_rounded(spec):
    """Every entry is RN_fp32(scale * cos(p * inv_freq)) of the exact real: checked
    with 160-bit mpmath on 400 random entries, and the first/last rows."""
    cos, sin = rope_table(spec)
    inv, scale = inv_freq_and_attention_factor(spec.rotary_dim, spec.base, spec.yarn)
    g = torch.Generator().manual_seed(0)
    P = torch.randint(0, spec.max_position, (400,), generator=g).tolist() + [0, 593, spec.max_position - 1]
    I = torch.randint(0, spec.rotary_dim // 2, (403,), generator=g).tolist()
    for p, i in zip(P, I):
        angle = p * inv[i].double().item()
        assert cos[p, i].item() == _exact("cos", angle, scale), (p, i)
        assert sin[p, i].item() == _exact("sin", angle, scale), (p, i)


def test_table_exact_path_agrees():
    """Send nearly every entry through the mpmath path: same table bits."""
    key = (16, 1e4, 64, Yarn(4.0, 32))
    wide = build_table(key, trust_rel=2.0**-16)
    normal = build_table(key)
    assert bitwise_equal(wide[0], normal[0]) and bitwise_equal(wide[1], normal[1])


def test_table_built_once_and_cached(device):
    spec = RopeSpec(32, 1e4, 3001)
    cos, sin = rope_table(spec)
    assert cos.dtype == torch.float32 and cos.shape == (3001, 16) and cos.device.type == "cpu"
    # pairing and slice do not change the table: same objects
    assert rope_table(spec.replace(pairing="interleaved", rotary_slice="last"))[0] is cos
    dcos, dsin = rope_table(spec, device)
    assert rope_table(spec, device)[0] is dcos
    assert bitwise_equal(dcos.cpu(), cos) and bitwise_equal(dsin.cpu(), sin)


def test_fp32_on_the_fly_table_differs_so_tests_would_catch_it():
    """The seeds' failure: a table computed in fp32 (transformers' way, and the
    GPU's way) is not our table; the difference shows well before position 2048."""
    spec = RopeSpec(128, 1e6, 4096)
    cos, sin = rope_table(spec)
    inv, _ = inv_freq_and_attention_factor(128, 1e6, None)
    ang32 = torch.arange(4096, dtype=torch.float32)[:, None] * inv[None, :]
    differ = (ang32.cos() != cos).any(1) | (ang32.sin() != sin).any(1)
    assert differ.any() and int(differ.nonzero()[0]) < 2048


# ------------------------------------------------- layouts against transformers


def _hf_apply(name, x, pos, cos, sin, conjugate):
    """transformers' own apply functions fed our fp32 table rows.  x: (T, H, D)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as q35

    c, s = cos[pos][None], sin[pos][None]  # (1, T, R/2)
    if conjugate:
        s = -s
    full_c, full_s = torch.cat([c, c], -1), torch.cat([s, s], -1)  # transformers' cat(freqs, freqs) form
    xb = x.transpose(0, 1)[None]  # (1, H, T, D)
    R = 2 * c.shape[-1]
    if name.startswith("qwen"):  # partial-aware half-split (qwen3_5_moe; equals qwen3's when R == D)
        y, _ = q35.apply_rotary_pos_emb(xb, xb, full_c, full_s)
    elif name.startswith("glm5-indexer"):
        rot, _ = glm.apply_rotary_pos_emb_interleave(xb[..., :R], xb[..., :R], full_c, full_s)
        y = torch.cat([rot, xb[..., R:]], -1)
    elif name.startswith("glm5"):  # MLA query: [nope | rope]
        rot, _ = glm.apply_rotary_pos_emb_interleave(xb[..., -R:], xb[..., -R:], full_c, full_s)
        y = torch.cat([xb[..., :-R], rot], -1)
    else:  # DeepSeek-V4: trailing rope slice, interleaved in and out
        y = dsv4.apply_rotary_pos_emb(xb.float(), c, s)
    return y[0].transpose(0, 1).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conjugate", [False, True], ids=["theta", "conj"])
@pytest.mark.parametrize("name", [n for n in SPEC_IDS if not n.startswith("interleaved")])
def test_bits_equal_transformers_apply_with_our_table(device, name, conjugate, dtype):
    """Fed the same fp32 table, transformers' rotation formulas (fp32 math, one
    cast) give our bits exactly: pairing, output layout and slice all match."""
    spec, D = SPECS[name]
    T, H = 700, 3
    x, pos = _x(T, H, D, dtype, device), _positions(T, device)
    cos, sin = rope_table(spec, device)
    assert bitwise_equal(rope(x, pos, spec, conjugate=conjugate), _hf_apply(name, x, pos, cos, sin, conjugate))


# ----------------------------------------------------- accuracy and gradients


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SPEC_IDS)
@pytest.mark.parametrize("T,H", [(1000, 3), (63, 5), (593, 1)], ids=["T1000-H3", "T63-H5", "T593-H1"])
def test_accuracy_vs_float64(device, name, T, H, dtype):
    spec, D = SPECS[name]
    x, pos = _x(T, H, D, dtype, device), _positions(T, device)
    y = rope(x, pos, spec)
    assert y.dtype == dtype and y.shape == x.shape
    assert rel_err(y, rope_ref(x, pos, spec)) <= BOUND[dtype]
    off, R = spec.rotary_offset(D), spec.rotary_dim
    # pass-through channels are bit-exact copies
    assert bitwise_equal(y[..., :off], x[..., :off]) and bitwise_equal(y[..., off + R :], x[..., off + R :])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("conjugate", [False, True], ids=["theta", "conj"])
@pytest.mark.parametrize("name", SPEC_IDS)
def test_grad_vs_float64_autograd(device, name, conjugate, dtype):
    spec, D = SPECS[name]
    T, H = 601, 3
    x, pos = _x(T, H, D, dtype, device), _positions(T, device)
    dy = _x(T, H, D, dtype, device, seed=2)
    xg = x.clone().requires_grad_()
    rope(xg, pos, spec, conjugate=conjugate).backward(dy)
    x64 = x.double().requires_grad_()
    rope_ref(x64, pos, spec, conjugate=conjugate).backward(dy.double())
    assert xg.grad.dtype == dtype
    assert rel_err(xg.grad, x64.grad) <= BOUND[dtype]
    off, R = spec.rotary_offset(D), spec.rotary_dim
    assert bitwise_equal(xg.grad[..., :off], dy[..., :off]) and bitwise_equal(xg.grad[..., off + R :], dy[..., off + R :])


# ----------------------------------------------------------- batch invariance


def _block_configs(device):
    return [{}, {"block_rows": 1}, {"block_rows": 64}] if device.type == "cuda" else [{}, {"block_rows": 3}, {"block_rows": 37}]


@pytest.mark.parametrize("name", ["qwen3-D128", "glm5-D192-r64-last", "dsv4-D192-r64-yarn"])
def test_packed_sequences_equal_alone(device, name):
    """Three sequences (593, 1000 and 63 tokens, one starting at position 2900)
    packed in one call give each sequence's bits alone, for every block size."""
    spec, D = SPECS[name]
    lens, starts = [593, 1000, 63], [0, 2900, 17]
    xs = [_x(n, 3, D, torch.bfloat16, device, seed=i) for i, n in enumerate(lens)]
    ps = [torch.arange(s, s + n, device=device) for s, n in zip(starts, lens)]
    alone = [rope_fwd(x, p, spec) for x, p in zip(xs, ps)]
    grads = [rope_bwd(x, p, spec) for x, p in zip(xs, ps)]
    for cfg in _block_configs(device):
        packed = rope_fwd(torch.cat(xs), torch.cat(ps), spec, **cfg)
        assert bitwise_equal(packed, torch.cat(alone))
        assert bitwise_equal(rope_bwd(torch.cat(xs), torch.cat(ps), spec, **cfg), torch.cat(grads))


@pytest.mark.parametrize("name", ["qwen3-D128", "qwen35-D256-r64", "glm5-D192-r64-last", "dsv4-D192-r64-yarn"])
def test_rung1_rung2(device, name):
    spec, D = SPECS[name]
    T = 200
    x, pos = _x(T, 3, D, torch.bfloat16, device), _positions(T, device)
    fwd = lambda x, p, **kw: rope_fwd(x, p, spec, **kw)  # noqa: E731
    assert rung1_repeat("rope", fwd, x, pos).passed
    r = rung2_rows("rope", fwd, [x, pos], configs=_block_configs(device), batch_sizes=(1, 2, 7, 100))
    assert r.passed, r.detail
    r = rung2_rows("rope", lambda d, p, **kw: rope_bwd(d, p, spec, **kw), [x, pos], configs=_block_configs(device))
    assert r.passed, r.detail


def test_rung2_catches_a_batch_dependent_variant(device):
    """A 'decode fast path' that computes cos/sin on the fly in fp32 for small
    batches (as a GPU-side table would) is caught by rung 2."""
    spec, D = SPECS["qwen3-D128"]
    inv, _ = inv_freq_and_attention_factor(spec.rotary_dim, spec.base, spec.yarn)

    def variant(x, p):
        if x.shape[0] > 4:
            return rope_fwd(x, p, spec)
        ang = p.float()[:, None] * inv.to(x.device)[None, :]
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        a, b = x[..., :64].float(), x[..., 64:].float()
        return torch.cat([a * c - b * s, b * c + a * s], -1).to(x.dtype)

    T = 100
    x, pos = _x(T, 2, D, torch.float32, device), _positions(T, device)
    assert rung2_rows("rope", lambda x, p: rope_fwd(x, p, spec), [x, pos], batch_sizes=(1, 2, 3)).passed
    r = rung2_rows("rope-variant", variant, [x, pos], batch_sizes=(1, 2, 3))
    assert not r.passed and r.differing > 0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", SPEC_IDS)
def test_cuda_bits_equal_cpu(name, dtype):
    """Same table, same rounding points, FMA contraction off: the Triton kernel
    gives the CPU path's bits (forward and backward)."""
    spec, D = SPECS[name]
    T = 2049
    x, pos = _x(T, 5, D, dtype, "cpu"), _positions(T, "cpu")
    for conj in (False, True):
        assert bitwise_equal(rope_fwd(x.cuda(), pos.cuda(), spec, conjugate=conj).cpu(), rope_fwd(x, pos, spec, conjugate=conj))
        assert bitwise_equal(rope_bwd(x.cuda(), pos.cuda(), spec, conjugate=conj).cpu(), rope_bwd(x, pos, spec, conjugate=conj))


def test_empty_and_single_token(device):
    spec, D = SPECS["qwen3-D128"]
    x = torch.empty(0, 4, D, dtype=torch.bfloat16, device=device)
    assert rope(x, torch.empty(0, dtype=torch.int64, device=device), spec).shape == (0, 4, D)
    x1 = _x(1, 1, D, torch.bfloat16, device)
    p1 = torch.tensor([MAXP - 1], device=device)
    assert rel_err(rope(x1, p1, spec), rope_ref(x1, p1, spec)) <= BOUND[torch.bfloat16]
    p32 = torch.tensor([3001], dtype=torch.int32, device=device)
    assert bitwise_equal(rope(x1, p32, spec), rope(x1, p32.long(), spec))


# ------------------------------------------------------------------ bad input


def test_bad_inputs(device):
    spec, D = SPECS["qwen3-D128"]
    x, pos = _x(8, 2, D, torch.bfloat16, device), torch.arange(8, device=device)
    with pytest.raises(ValueError, match="past the RoPE table"):
        rope(x, torch.full((8,), MAXP, device=device), spec)
    with pytest.raises(ValueError, match="past the RoPE table"):
        rope_fwd(x, torch.full((8,), MAXP + 10, device=device), spec)
    with pytest.raises(ValueError, match="negative position"):
        rope(x, pos - 1, spec)
    with pytest.raises(TypeError, match="x has dtype int32"):
        rope(x.to(torch.int32), pos, spec)
    with pytest.raises(TypeError, match="positions has dtype float32"):
        rope(x, pos.float(), spec)
    with pytest.raises(ValueError, match="x must be contiguous"):
        rope(x.transpose(0, 1), pos[:2], spec)
    with pytest.raises(ValueError, match="x must have 3 dimensions"):
        rope(x[0], pos, spec)
    with pytest.raises(ValueError, match="positions must have 1 dimensions"):
        rope(x, pos[None], spec)
    with pytest.raises(ValueError, match="positions: length"):
        rope(x, pos[:7], spec)
    with pytest.raises(ValueError, match="smaller than spec.rotary_dim"):
        rope(x[..., :64].contiguous(), pos, spec)
    with pytest.raises(TypeError, match="spec must be a RopeSpec"):
        rope(x, pos, {"rotary_dim": 128})
    if device.type == "cuda":
        with pytest.raises(ValueError, match="different devices"):
            rope(x, pos.cpu(), spec)


@pytest.mark.parametrize("kwargs,match", [
    ({"rotary_dim": 63}, "rotary_dim must be a positive even"),
    ({"base": 1.0}, "base"),
    ({"max_position": 0}, "max_position"),
    ({"max_position": (1 << 24) + 1}, "max_position"),
    ({"pairing": "neox"}, "pairing must be one of"),
    ({"rotary_slice": "middle"}, "rotary_slice must be one of"),
], ids=["odd-dim", "base", "maxpos-0", "maxpos-huge", "pairing", "slice"])
def test_bad_spec(kwargs, match):
    base = dict(rotary_dim=64, base=1e4, max_position=128)
    with pytest.raises(ValueError, match=match):
        RopeSpec(**{**base, **kwargs})


def test_unsupported_rope_type():
    from transformers import Qwen3Config

    cfg = Qwen3Config(rope_scaling={"rope_type": "linear", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="linear"):
        RopeSpec.from_hf(cfg)


def test_rope_parameters_hf_reads_back_as_written():
    """rope_parameters_hf is RopeSpec.from_hf's inverse: plain, YaRN with GLM's mscales, YaRN without truncation."""
    from alignzoo.common.rope import rope_parameters_hf
    from alignzoo.models.qwen3 import Qwen3Config

    cfg = Qwen3Config.preset("tiny")
    for yarn in (None, Yarn(factor=40.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.707),
                 Yarn(factor=4.0, original_max_position_embeddings=32768, truncate=False)):
        d = {**cfg.to_hf(), "rope_parameters": rope_parameters_hf(1e6, yarn)}
        spec = RopeSpec.from_hf(d)
        assert (spec.base, spec.yarn) == (1e6, yarn)
