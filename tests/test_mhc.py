"""DeepSeek-V4's hyper-connections (``alignzoo.common.mhc``): a token's weights, collapse, mix and head do not
depend on the batch; they match float64 and transformers' modules; gradients reach the streams and fn, base, scale.
"""
from __future__ import annotations

import pytest
import torch
from interpreted import TORCH_MATH, run_interpreted

from alignzoo.common.ladder import rel_err
from alignzoo.common.mhc import (hc_collapse_fwd, hc_collapse_ref, hc_head_ref, hc_mix, hc_mix_fwd, hc_mix_ref,
                                 hc_weights_fwd, hc_weights_ref, hyper_connection, hyper_head)
from alignzoo.common.mhc.cpu import rows_dot
from alignzoo.common.rmsnorm.cpu import row_tree_sum

HC, ITERS, EPS = 4, 20, 1e-6


def _params(D, seed=0, hc=HC, head=False):
    g = torch.Generator().manual_seed(seed)
    M = hc if head else (2 + hc) * hc
    fn = torch.randn(M, hc * D, generator=g) * 0.05
    base = torch.randn(M, generator=g) * 0.1
    scale = torch.rand(1 if head else 3, generator=g) + 0.5
    return fn, base, scale


def _streams(T, D, dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, HC, D, generator=g).to(dtype), torch.randn(T, D, generator=g).to(dtype)


def _all(x, out, w, w_head):
    """Every forward output of one batch: (post, comb, collapsed, mix, head)."""
    post, comb, collapsed = hyper_connection(x, *w, ITERS, EPS, EPS)
    return post, comb, collapsed, hc_mix(out, x, post, comb), hyper_head(x, *w_head, EPS, EPS)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("T,D", [(593, 60), (63, 1000)], ids=["T593_D60", "T63_D1000"])
def test_rows_do_not_depend_on_the_batch(T, D, dtype, device):
    """D = 60: K = 240, one 256-lane tree; D = 1000: K = 4000, sixteen chunks then the tree."""
    x, out = (t.to(device) for t in _streams(T, D, dtype))
    w = [t.to(device) for t in _params(D)]
    w_head = [t.to(device) for t in _params(D, seed=2, head=True)]
    whole = _all(x, out, w, w_head)
    for t in (0, 1, T // 2, T - 1):
        alone = _all(x[t:t + 1], out[t:t + 1], w, w_head)
        for a, b in zip(alone, whole):
            assert torch.equal(a, b[t:t + 1]), t
    perm = torch.randperm(T, generator=torch.Generator().manual_seed(3)).to(device)
    for a, b in zip(_all(x[perm], out[perm], w, w_head), whole):
        assert torch.equal(a, b[perm])
    # (B, S) leading dims are the same tokens
    for a, b in zip(_all(x.view(1, T, HC, D), out.view(1, T, D), w, w_head), whole):
        assert torch.equal(a.flatten(0, 1), b)


def test_the_fn_dot_adds_in_the_rmsnorm_row_order():
    """``rows_dot`` is ``row_tree_sum`` over the products, for one tree (K = 240) and chunks (K = 4000)."""
    for K in (240, 4000):
        g = torch.Generator().manual_seed(K)
        n, fn = torch.randn(7, K, generator=g), torch.randn(24, K, generator=g)
        want = row_tree_sum((n[:, None, :] * fn[None]).reshape(-1, K)).view(7, 24)
        assert torch.equal(rows_dot(n, fn), want)


@pytest.mark.parametrize("T,D", [(63, 100), (593, 60)], ids=["T63_D100", "T593_D60"])
def test_matches_float64(T, D):
    x, out = _streams(T, D)
    w, w_head = _params(D), _params(D, seed=2, head=True)
    post, comb, collapsed, mixed, head = _all(x, out, w, w_head)
    pre_r, post_r, comb_r = hc_weights_ref(x, *w, ITERS, EPS, EPS)
    pre, *_ = hc_weights_fwd(x, *w, ITERS, EPS, EPS)
    for got, want in ((pre, pre_r), (post, post_r), (comb, comb_r), (collapsed, hc_collapse_ref(x, pre_r)),
                      (mixed, hc_mix_ref(out, x, post_r, comb_r)), (head, hc_head_ref(x, *w_head, EPS, EPS))):
        assert rel_err(got, want) < 1e-6
    # Sinkhorn's last step is a column step: columns sum to 1 up to eps
    assert (comb.double().sum(-2) - 1).abs().max() < 1e-5


def _hf():
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    cfg = transformers.DeepseekV4Config(hidden_size=100, num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=32, vocab_size=64, intermediate_size=32,
                                        moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps) == (HC, ITERS, EPS, EPS)
    return m, cfg


def _fill(hc_module, D, seed):
    fn, base, scale = _params(D, seed, head=hc_module.__class__.__name__.endswith("Head"))
    with torch.no_grad():
        for p, v in zip(hc_module.parameters(), (fn, base, scale)):
            p.copy_(v)
    return hc_module


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_transformers_modules(dtype):
    """Same weights in ``DeepseekV4HyperConnection`` / ``HyperHead`` / the layer's mix expression.  Measured
    (torch 2.13, CPU): post, comb 1e-7 and the fp32 collapse, mix and head 1e-7 apart (transformers' sigmoid,
    softmax and matmul round their own way); in bf16 the mix has transformers' bits given the same post and comb,
    and the collapse and head differ by one bf16 ulp in ~1 of 6,300 elements (pre differs in its last fp32 bit)."""
    m, cfg = _hf()
    hc, head = _fill(m.DeepseekV4HyperConnection(cfg), 100, 0), _fill(m.DeepseekV4HyperHead(cfg), 100, 2)
    x, out = _streams(63, 100, dtype)
    x, out = x.view(3, 21, HC, 100), out.view(3, 21, 100)
    with torch.no_grad():
        post, comb, collapsed = hc(x)
        got = hyper_connection(x, hc.fn, hc.base, hc.scale, ITERS, EPS, EPS)
        want_mix = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), x)
        got_mix = hc_mix(out, x, post, comb)
        got_head = hyper_head(x, head.hc_fn, head.hc_base, head.hc_scale, EPS, EPS)
        want_head = head(x)
    assert rel_err(got[0], post) < 1e-6 and rel_err(got[1], comb) < 1e-6
    if dtype == torch.float32:
        for a, b in ((got[2], collapsed), (got_mix, want_mix), (got_head, want_head)):
            assert rel_err(a, b) < 1e-6
    else:
        assert torch.equal(got_mix, want_mix)
        for a, b in ((got[2], collapsed), (got_head, want_head)):
            assert rel_err(a, b) < 1e-5 and (a != b).sum() <= a.numel() // 1000


def _layer_pair(dtype):
    """transformers' decoder layer with its attention and MoE replaced by fixed element-wise blocks, and the same
    layer written with our functions."""
    m, cfg = _hf()
    layer = m.DeepseekV4DecoderLayer(cfg, 0)
    _fill(layer.attn_hc, 100, 0), _fill(layer.ffn_hc, 100, 4)

    class Attn(torch.nn.Module):
        def forward(self, h, **kwargs):
            return torch.tanh(h) * 0.5, None

    class Mlp(torch.nn.Module):
        def forward(self, h, input_ids=None):
            return h * torch.sigmoid(h)

    layer.self_attn, layer.mlp = Attn(), Mlp()

    def ours(x):
        for hcm, norm, block in ((layer.attn_hc, layer.input_layernorm, lambda h: layer.self_attn(h)[0]),
                                 (layer.ffn_hc, layer.post_attention_layernorm, layer.mlp)):
            post, comb, collapsed = hyper_connection(x, hcm.fn, hcm.base, hcm.scale, ITERS, EPS, EPS)
            x = hc_mix(block(norm(collapsed)), x, post, comb)
        return x

    return layer, ours


def test_a_decoder_layer_matches_transformers_forward_and_backward():
    """Two hyper-connections and two mixes around stand-in blocks, fp32: the streams and every gradient
    (streams, fn, base, scale of both) within 1e-6 of transformers' autograd, which also differentiates
    through pre, post and comb."""
    layer, ours = _layer_pair(torch.float32)
    x, _ = _streams(63, 100)
    x = x.view(3, 21, HC, 100)
    wy = torch.randn(3, 21, HC, 100)
    params = [p for hcm in (layer.attn_hc, layer.ffn_hc) for p in hcm.parameters()]
    results = []
    for f in (layer, ours):
        xx = x.clone().requires_grad_()
        y = f(xx)
        grads = torch.autograd.grad((y * wy).sum(), [xx] + params)
        results.append((y, grads))
    (y_hf, g_hf), (y_us, g_us) = results
    assert rel_err(y_us, y_hf) < 1e-6
    for name, a, b in zip(["streams"] + [f"{n}" for n in ("attn.fn", "attn.base", "attn.scale", "ffn.fn",
                                                             "ffn.base", "ffn.scale")], g_us, g_hf):
        assert rel_err(a, b) < 1e-5, name


def test_bf16_decoder_layer_stays_near_transformers():
    """In bf16 the streams follow transformers' rounding points: measured rel err ~1e-3 after one layer (a bf16
    ulp where a pre or comb weight differs in its last fp32 bit and the rounding flips)."""
    layer, ours = _layer_pair(torch.bfloat16)
    x, _ = _streams(63, 100, torch.bfloat16)
    x = x.view(3, 21, HC, 100)
    with torch.no_grad():
        assert rel_err(ours(x), layer(x)) < 4e-3


def _loss_terms(T, D, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g) for s in ((T, HC, D), (T, D), (T, D), (T, HC), (T, HC, HC))]


def test_gradients_match_float64_autograd():
    """fp32 backward of a hyper-connection, a mix and the head against float64 autograd through the reference:
    streams, block output, fn, base, scale (both sets), with post and comb also used directly."""
    T, D = 63, 60
    x, out = _streams(T, D)
    w, w_head = _params(D), _params(D, seed=2, head=True)
    wy, wc, wh, wpost, wcomb = _loss_terms(T, D)

    def loss(x, out, fn, base, scale, hfn, hbase, hscale, ref):
        if ref:
            pre, post, comb = hc_weights_ref(x, fn, base, scale, ITERS, EPS, EPS)
            collapsed = hc_collapse_ref(x, pre)
            y, head = hc_mix_ref(out, x, post, comb), hc_head_ref(x, hfn, hbase, hscale, EPS, EPS)
        else:
            post, comb, collapsed = hyper_connection(x, fn, base, scale, ITERS, EPS, EPS)
            y, head = hc_mix(out, x, post, comb), hyper_head(x, hfn, hbase, hscale, EPS, EPS)
        terms = ((y, wy), (collapsed, wc), (head, wh), (post, wpost), (comb, wcomb))
        return sum((a * b).sum() for a, b in terms)

    inputs = [x, out, *w, *w_head]
    ours = [t.clone().requires_grad_() for t in inputs]
    ref = [t.double().requires_grad_() for t in inputs]
    loss(*ours, ref=False).backward()
    loss(*ref, ref=True).backward()
    names = ("streams", "block_out", "fn", "base", "scale", "head.fn", "head.base", "head.scale")
    for name, a, b in zip(names, ours, ref):
        assert rel_err(a.grad, b.grad) < 1e-5, name


def test_backward_is_deterministic_run_to_run(device):
    T, D = 593, 60
    x, _ = _streams(T, D, torch.bfloat16)
    x, wy = x.to(device), _loss_terms(T, D)[0].to(device)
    w = [t.to(device) for t in _params(D)]
    grads = []
    for _ in range(2):
        xx, *ww = (t.clone().requires_grad_() for t in (x, *w))
        post, comb, collapsed = hyper_connection(xx, *ww, ITERS, EPS, EPS)
        y = hc_mix(collapsed, xx, post, comb)
        grads.append(torch.autograd.grad((y.float() * wy).sum(), [xx, *ww]))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


_INTERPRETED_KERNELS = TORCH_MATH + """
import torch
from alignzoo.common.mhc.cpu import hc_collapse_cpu, hc_mix_cpu, hc_weights_cpu
from alignzoo.common.mhc.kernel import hc_collapse_triton, hc_mix_triton, hc_weights_triton
g = torch.Generator().manual_seed(0)
for T, D, dtype in ((5, 60, torch.bfloat16), (3, 100, torch.float32), (2, 1000, torch.bfloat16)):
    x = torch.randn(T, 4, D, generator=g).to(dtype)
    out = torch.randn(T, D, generator=g).to(dtype)
    for M in (24, 4):
        fn = torch.randn(M, 4 * D, generator=g) * 0.05
        base = torch.randn(M, generator=g) * 0.1
        scale = torch.rand(3 if M > 4 else 1, generator=g) + 0.5
        want = hc_weights_cpu(x, fn, base, scale, 20, 1e-6, 1e-6)
        got = hc_weights_triton(x, fn, base, scale, 20, 1e-6, 1e-6)
        for name, a, b in zip(("pre", "post", "comb", "rstd", "mix"), got, want):
            assert (a is None) == (b is None), name
            assert a is None or torch.equal(a, b), (T, D, M, name, (a - b).abs().max())
        pre = want[0]
        assert torch.equal(hc_collapse_triton(x, pre), hc_collapse_cpu(x, pre)), (T, D, M, "collapse")
    post, comb = torch.rand(T, 4, generator=g) * 2, torch.rand(T, 4, 4, generator=g)
    assert torch.equal(hc_mix_triton(out, x, post, comb), hc_mix_cpu(out, x, post, comb)), (T, D, "mix")
x, out = torch.randn(2, 4, 1100, generator=g), torch.randn(2, 1100, generator=g)  # two 1,024-column programs
assert torch.equal(hc_collapse_triton(x, pre[:2]), hc_collapse_cpu(x, pre[:2]))
assert torch.equal(hc_mix_triton(out, x, post, comb), hc_mix_cpu(out, x, post, comb))
print("ok")
"""


def test_kernels_have_the_cpu_bits_interpreted():
    """The CUDA kernels under Triton's interpreter (torch's exp and bf16 rounding patched in) give ``cpu.py``'s
    bits: the weights (pre, post, comb, rstd, raw mixes) at K = 240 (one tree), 400 (two chunks) and 4000 (sixteen),
    the hyper-connection's 24 rows and the head's 4; the collapse and the mix, bf16 and fp32 streams, and
    D = 1100 over two 1,024-column programs."""
    run_interpreted(_INTERPRETED_KERNELS, expect="ok")


@pytest.mark.gpu
@pytest.mark.parametrize("T,D", [(593, 60), (64, 4096)], ids=["T593_D60", "T64_D4096_flash"])
def test_kernels_on_cuda_keep_the_cpu_bits_but_exp(T, D):
    """Compiled on CUDA: rstd and the mixes keep the CPU bits (no exp before them); pre, post and comb use
    libdevice's exp (torch's CUDA exp), within 1e-6 of the CPU path's.  D = 4096 is DeepSeek-V4 Flash (K = 16384)."""
    x, _ = _streams(T, D, torch.bfloat16)
    w = _params(D)
    want = hc_weights_fwd(x, *w, ITERS, EPS, EPS)
    got = hc_weights_fwd(x.cuda(), *(t.cuda() for t in w), ITERS, EPS, EPS)
    assert torch.equal(got[3].cpu(), want[3]) and torch.equal(got[4].cpu(), want[4])
    for a, b in zip(got[:3], want[:3]):
        assert rel_err(a.cpu(), b) < 1e-6
    # the collapse and the mix have no exp: the CPU bits from the same weights
    pre, post, comb = want[:3]
    out = torch.randn(T, D).bfloat16()
    assert torch.equal(hc_collapse_fwd(x.cuda(), pre.cuda()).cpu(), hc_collapse_fwd(x, pre))
    assert torch.equal(hc_mix_fwd(out.cuda(), x.cuda(), post.cuda(), comb.cuda()).cpu(), hc_mix_fwd(out, x, post, comb))


def test_bad_input_is_named():
    x, out = _streams(4, 10)
    fn, base, scale = _params(10)
    with pytest.raises(ValueError, match="fn must have shape"):
        hyper_connection(x, fn[:, :-1].contiguous(), base, scale)
    with pytest.raises(ValueError, match="base must have shape"):
        hyper_connection(x, fn, base[:-1], scale)
    with pytest.raises(ValueError, match="scale must have shape"):
        hyper_connection(x, fn, base, scale[:1])
    with pytest.raises(ValueError, match=r"x must have shape \(\*, hc, D\)"):
        hyper_connection(x[0], fn, base, scale)
    with pytest.raises(TypeError, match="fn has dtype bfloat16"):
        hyper_connection(x, fn.bfloat16(), base, scale)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        hyper_connection(x, fn, base, scale, sinkhorn_iters=0)
    with pytest.raises(ValueError, match="hc_eps"):
        hyper_connection(x, fn, base, scale, hc_eps=float("nan"))
    post, comb, _ = hyper_connection(x, fn, base, scale)
    with pytest.raises(ValueError, match="block_out must have shape"):
        hc_mix(out[:, :-1].contiguous(), x, post, comb)
    with pytest.raises(ValueError, match="comb must have shape"):
        hc_mix(out, x, post, comb[:, :3].contiguous())
    with pytest.raises(TypeError, match="post has dtype bfloat16"):
        hc_mix(out, x, post.bfloat16(), comb)
    with pytest.raises(ValueError, match="fn must have shape"):
        hyper_head(x, fn, base[:4], scale[:1])


def test_ladder(device):
    """``alignzoo check mhc``'s rows (run twice, batch/order/padding, float64) pass."""
    from alignzoo.common.mhc.checks import ladder

    rows = ladder(device)
    assert rows and all(r.passed for r in rows), [(r.check, r.detail) for r in rows if not r.passed]
