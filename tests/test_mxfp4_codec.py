"""The one MXFP4 codec (``alignzoo.common.moe.mxfp4``): checkpoint load and save, sync, the experts' kernels
and the trainer all read and write E2M1 codes (two a byte, the low nibble first) with an E8M0 scale per 32
along K through it.

Its decode is transformers 5.25's dequantization of DeepSeek-V4's experts (``Fp8Dequantize._dequantize_one``,
the ``expert_dtype="fp4"`` path) bit for bit, every code byte under every scale byte; its encoder gives back
the codes and scales it decodes (a sync of unchanged blocks ships nothing) and its own output unchanged.
"""
from __future__ import annotations

import math

import pytest
import torch

from alignzoo.common.ladder import rel_err
from alignzoo.common.moe.mxfp4 import GROUP, dequantize_mxfp4, e2m1_decode, e8m0_to_float, quantize_mxfp4
from alignzoo.sync import Publisher, Receiver
from alignzoo.weights.formats import MXFP4, DequantizedSource, QuantRule

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


def same_or_both_nan(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


def every_byte_under_every_scale() -> tuple[torch.Tensor, torch.Tensor]:
    """(256, 256) code bytes, row r rotated by 7r so each 32-group sees other pairs, and (256, 16) scale
    bytes: row r's first group has byte r (0 and 255 included), the others random."""
    r = torch.arange(256)[:, None]
    codes = ((torch.arange(256)[None, :] + 7 * r) % 256).to(torch.uint8)
    scales = torch.randint(0, 256, (256, 16), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    scales[:, 0] = torch.arange(256, dtype=torch.uint8)
    return codes, scales


def canonical(shape, seed, low=0, high=251) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes (every nibble, -0 included) with a +-4 or +-6 in every group, and scales in [low, high)."""
    *lead, N, K = shape
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (*lead, N, K // 2), generator=g).to(torch.uint8)
    first = codes.view(*lead, N, K // GROUP, GROUP // 2)[..., 0]
    first.copy_((first & 0xF0) | torch.tensor([6, 7, 14, 15], dtype=torch.uint8)[torch.randint(0, 4, first.shape,
                                                                                               generator=g)])
    return codes, torch.randint(low, high, (*lead, N, K // GROUP), generator=g).to(torch.uint8)


# ---------------------------------------------------------------- decode == transformers
def test_decode_is_transformers_dequantization_bit_for_bit():
    """DeepSeek-V4 stores int8 codes and float8_e8m0fnu scales; transformers unpacks the nibbles through
    its E2M1 table (low first), casts the scales to fp32 (byte 0 is 2^-127, 255 NaN) and multiplies in
    fp32, then casts.  Ours gives those bits for every code byte under every scale byte, in fp32 and bf16
    (255: NaN wherever transformers has NaN).  transformers' uint8-scale path (MXFP8) agrees on 0..254;
    it reads 255 as 2^128 (inf), which is not an E8M0 value."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    hf = fp8.Fp8Dequantize(None)._dequantize_one
    codes, scales = every_byte_under_every_scale()
    c8, s8 = codes.view(torch.int8), scales.view(torch.float8_e8m0fnu)
    for dt in (torch.float32, torch.bfloat16):
        want = hf(c8, s8, output_dtype=dt)
        got = dequantize_mxfp4(c8, s8, dt)
        assert same_or_both_nan(got, want), dt
        assert bool(got.isnan().view(256, 16, 32).any(-1).eq(scales == 255).all())  # NaN only under byte 255
        assert torch.equal(bits(got[:255, :32]), bits(hf(c8[:255], scales[:255], output_dtype=dt)[:, :32]))
    assert torch.equal(bits(dequantize_mxfp4(c8, s8, torch.bfloat16)), bits(hf(c8, s8)))  # transformers' default
    # checkpoint load: DeepSeek's names (codes "X.weight", scales "X.scale") through the format's rule
    rule = QuantRule(MXFP4, suffix="weight", scale_suffix="scale")
    src = DequantizedSource({"layers.0.ffn.experts.3.w1.weight": c8, "layers.0.ffn.experts.3.w1.scale": s8}, (rule,))
    assert same_or_both_nan(src.get("layers.0.ffn.experts.3.w1.weight"), hf(c8, s8, output_dtype=torch.float32))
    stack = torch.stack([codes[:64], codes[64:128]]).view(torch.int8), torch.stack([s8[:64], s8[64:128]])
    assert same_or_both_nan(dequantize_mxfp4(*stack), torch.stack([hf(stack[0][i], stack[1][i], torch.float32)
                                                                   for i in range(2)]))


def test_every_stored_dtype_decodes_alike():
    """Codes as uint8, int8 or float4_e2m1fn_x2, scales as uint8 or float8_e8m0fnu: the same bits."""
    codes, scales = every_byte_under_every_scale()
    want = dequantize_mxfp4(codes, scales)
    assert want.shape == (256, 512) and want.dtype == torch.float32
    for c in (codes.view(torch.int8), *((codes.view(torch.float4_e2m1fn_x2),) if hasattr(torch, "float4_e2m1fn_x2")
                                        else ())):
        assert same_or_both_nan(dequantize_mxfp4(c, scales.view(torch.float8_e8m0fnu)), want)
    assert same_or_both_nan(dequantize_mxfp4(codes, scales, torch.bfloat16).float(), want)  # bf16 holds each value
    lut = torch.tensor(E2M1 + tuple(-v for v in E2M1))
    assert same_or_both_nan(e2m1_decode(codes), torch.stack([lut[codes.long() & 15], lut[codes.long() >> 4]],
                                                            -1).flatten(-2))
    e = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    assert same_or_both_nan(e8m0_to_float(e), torch.tensor([2.0 ** -127, 2.0 ** -126, 0.5, 1.0, 2.0, 2.0 ** 127,
                                                            float("nan")]))


# ---------------------------------------------------------------- the encoder
def test_encode_gives_back_what_it_decodes():
    """Canonical blocks (a +-4 or +-6 in each group, so no exponent is a better fit; scales from 2^-127 to
    2^123; every nibble, -0 included) come back byte for byte, stored as int8 / e8m0 or as uint8.  Any
    other block comes back as the same values (a group topping at 3 takes the exponent below, codes
    doubled), and the encoder's own output is canonical: encode(decode(encode(w))) == encode(w)."""
    codes, scales = canonical((3, 5, 96), seed=1)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 1  # the subnormal scales
    for c, s in ((codes, scales), (codes.view(torch.int8), scales.view(torch.float8_e8m0fnu))):
        for dt in (torch.float32, torch.bfloat16):
            qc, qs = quantize_mxfp4(dequantize_mxfp4(c, s, dt))
            assert qc.dtype == qs.dtype == torch.uint8
            assert torch.equal(qc, codes) and torch.equal(qs, scales), dt

    anyc = torch.randint(0, 256, (4, 7, 48), generator=torch.Generator().manual_seed(2)).to(torch.uint8)
    anys = torch.randint(0, 251, (4, 7, 3), generator=torch.Generator().manual_seed(3)).to(torch.uint8)
    anyc[:2, :, :16] &= 0x55  # nibbles 0..5: groups topping at 3 or less
    anyc[0, :, 16:32] &= 0x11  # nibbles 0 and 1: at 0.5 or 0
    w = dequantize_mxfp4(anyc, anys)
    qc, qs = quantize_mxfp4(w)
    assert torch.equal(bits(dequantize_mxfp4(qc, qs)), bits(w))
    assert not torch.equal(qs, anys)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(9, 7, 160, generator=g) * torch.exp(4 * torch.randn(9, 7, 1, generator=g))
    for dt in (torch.float32, torch.bfloat16):
        c, s = quantize_mxfp4(x.to(dt))
        c2, s2 = quantize_mxfp4(dequantize_mxfp4(c, s, dt))
        assert torch.equal(c2, c) and torch.equal(s2, s), dt


def test_a_sync_of_unchanged_weights_ships_nothing():
    """The server holds a checkpoint's canonical codes; the trainer's masters are their decode.  Requantized
    after a step that left expert 0 alone, the publisher ships expert 1's blocks only, and none at all when
    no weight changed."""
    codes, scales = canonical((2, 16, 64), seed=7)
    master = dequantize_mxfp4(codes, scales)
    trainer = dict(zip(("w.weight", "w.scale"), quantize_mxfp4(master)))
    server = {"w.weight": codes.clone(), "w.scale": scales.clone()}
    pub = Publisher(lambda: trainer, rows_per_block=16)
    Receiver(server).apply(pub.publish())
    assert torch.equal(trainer["w.weight"], codes) and torch.equal(trainer["w.scale"], scales)
    assert pub.publish().changed_blocks() == {}
    master[1] += 0.01 * master[1].abs().amax()
    trainer.update(zip(("w.weight", "w.scale"), quantize_mxfp4(master)))
    assert set(pub.publish().changed_blocks()["w.weight"]) == {1}


def _encode_ref(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in float64, a group at a time: the exponent of amax rounded to E2M1's two significant bits,
    less 2 (at least -127); then the nearest code, ties to the even one, |q| above 6 saturating, the sign
    bit kept; an all-zero group gets scale 1."""
    vals = torch.tensor(E2M1, dtype=torch.float64)
    even = torch.arange(8) % 2 == 0
    codes, exps = [], []
    for row in w.double().reshape(-1, GROUP):
        amax = float(row.abs().max())
        m, k = math.frexp(amax)  # amax = m 2^k, m in [0.5, 1); 1.75 2^(k-1) and up round to 2^k
        e = 0 if amax == 0 else max(-127, k - 3 + (m >= 0.875))
        q = row / 2.0 ** e
        d = (q.abs().clamp(max=6.0)[:, None] - vals).abs()
        tie = d == d.min(-1, keepdim=True).values
        i = torch.where((tie & even).any(-1), (tie & even).int().argmax(-1), tie.int().argmax(-1))
        codes.append(i + 8 * torch.signbit(q).long())
        exps.append(e + 127)
    c = torch.stack(codes).reshape(w.shape).to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4), torch.tensor(exps, dtype=torch.uint8).reshape(*w.shape[:-1], -1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_encode_is_the_float64_rule_and_its_error_is_bounded(dtype):
    """Codes and scales equal a float64 element-by-element encoder's, ties included; every element's error
    is at most its scale (half the widest code step, 4 -> 6; the clipped (6, 7) scales too); the relative
    error on Gaussian weights is below both OCP's floor(log2 amax) - 2 (which clips (7, 8) to 6: two
    scales) and the smallest scale that fits 6 (which doubles the step of a group topping in (6, 7))."""
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(3, 61, 64, generator=g) * torch.exp(3 * torch.randn(3, 61, 1, generator=g))).to(dtype)
    w[0, 0, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0] * 4) * 2.0 ** -3  # every tie, 7 -> 6
    w[0, 1, :32] = 0.0
    w[0, 1, 32:] = torch.linspace(-1, 1, 32) * 2.0 ** -128  # subnormal weights: the 2^-127 scale
    c, s = quantize_mxfp4(w)
    rc, rs = _encode_ref(w)
    assert torch.equal(s, rs) and torch.equal(c, rc)
    assert int(s[0, 1, 0]) == 127 and int(s[0, 1, 1]) == 0
    err = (dequantize_mxfp4(c, s).double() - w.double()).abs()
    assert bool((err <= e8m0_to_float(s).double().repeat_interleave(GROUP, -1)).all())

    x = torch.randn(4000, GROUP, generator=g, dtype=torch.float64)
    amax = x.abs().amax(-1, keepdim=True)
    k = torch.floor(torch.log2(amax))
    vals = torch.tensor(E2M1, dtype=torch.float64)

    def err(e):  # round to nearest at scale 2^e, saturating at 6
        q = x / 2.0 ** e
        near = vals[(q.abs()[..., None].clamp(max=6.0) - vals).abs().argmin(-1)]
        return rel_err(near * q.sign() * 2.0 ** e, x)

    ours = rel_err(dequantize_mxfp4(*quantize_mxfp4(x.float())).double(), x)
    assert ours < 0.98 * err(k - 2) and ours < 0.98 * err(torch.ceil(torch.log2(amax / 6)))
    assert ours < 0.12


def test_negative_zero():
    """-0.0, and a negative weight that rounds to 0, encode to code 8 (the sign bit over 0), which decodes
    to -0.0 (transformers' table does too); +0.0 to code 0.  So a block holding code 8 comes back as it is."""
    w = torch.tensor([[-0.0, 0.0, -1e-3, 1e-3, -6.0, 6.0] + [0.0] * 26])
    c, s = quantize_mxfp4(w)
    assert c[0, :3].tolist() == [0x08, 0x08, 0x7F] and int(s) == 127
    d = dequantize_mxfp4(c, s)
    assert torch.signbit(d[0, :6]).tolist() == [True, False, True, False, True, False]
    assert d[0, :6].tolist() == [0.0, 0.0, 0.0, 0.0, -6.0, 6.0]


# ---------------------------------------------------------------- refused input
def test_bad_input_is_refused_with_the_tensor_name():
    codes, scales = canonical((2, 4, 64), seed=6)
    with pytest.raises(ValueError, match=r"w1\.weight: MXFP4 needs K % 32 == 0 .* K=48"):
        quantize_mxfp4(torch.zeros(4, 48), name="w1.weight")
    with pytest.raises(ValueError, match=r"w1\.weight: MXFP4 needs K % 32 == 0 .* K=48"):
        dequantize_mxfp4(codes[..., :24], scales, name="w1.weight")
    with pytest.raises(ValueError, match=r"w1\.scale: expected \(2, 4, 2\) for MXFP4 codes w1\.weight \(2, 4, 32\)"
                                         r".*found \(2, 4, 1\)"):
        dequantize_mxfp4(codes, scales[..., :1], name="w1.weight", scale_name="w1.scale")
    with pytest.raises(ValueError, match=r"w1\.weight scales: expected \(2, 4, 2\) .* found \(4, 2\)"):
        dequantize_mxfp4(codes, scales[0], name="w1.weight")
    with pytest.raises(ValueError, match=r"w1\.scale: MXFP4 scales are uint8 or float8_e8m0fnu \(E8M0\), got float32"):
        dequantize_mxfp4(codes, scales.float(), name="w1.weight", scale_name="w1.scale")
    with pytest.raises(ValueError, match=r"w1\.weight: MXFP4 codes are uint8, int8 or float4_e2m1fn_x2 .* bfloat16"):
        dequantize_mxfp4(codes.bfloat16(), scales, name="w1.weight")
    with pytest.raises(ValueError, match=r"w3\.weight: holds 2 NaN/Inf value\(s\), which MXFP4 cannot encode"):
        quantize_mxfp4(torch.tensor([float("nan"), float("inf")] + [0.0] * 30), name="w3.weight")
    with pytest.raises(ValueError, match=r"w3\.weight: MXFP4 encodes a float tensor, got int32"):
        quantize_mxfp4(torch.zeros(2, 32, dtype=torch.int32), name="w3.weight")
