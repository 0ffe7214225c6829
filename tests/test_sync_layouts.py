"""Weight sync of MoE tensors: expert stacks (bf16 (E, N, K), fp32 4-D), MXFP4 expert codes (uint8
(E, N, K/2)) with their E8M0 scales (uint8 (E, N, K/32)), integer tables (int32 hash routing) and
the E8M0 / E2M1 dtypes.

A change to one expert ships that expert's blocks only (counted from the payload's stats), the
server ends with the trainer's bytes (torch.equal), codes and scales round trip through publish,
a directory transport and apply, tampered payloads are refused with the server untouched, and every
new kind gets a checksum that sees each byte and a NaN/Inf count only where its dtype has them.
"""
from __future__ import annotations

import os

import pytest
import torch
from interpreted import run_interpreted

from alignzoo.sync import (CorruptPayload, DirectoryTransport, EndStateMismatch, Layout, NonFiniteWeights, Publisher,
                           Receiver, layout_of, tensor_checksum)
from alignzoo.sync.checksum import checksums_and_nonfinite
from alignzoo.sync.layout import as_int
from alignzoo.weights.formats import MXFP4

R = 32  # rows per block


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(as_int(a[n]), as_int(b[n])) for n in a)


def synced(trainer: dict, rows: int = R, check_finite: bool = False):
    server = {n: torch.zeros_like(t) for n, t in trainer.items()}
    pub = Publisher(lambda: trainer, rows_per_block=rows, check_finite=check_finite)
    rx = Receiver(server, check_finite=check_finite)
    first = pub.publish()
    rx.apply(first)
    assert same_bytes(server, trainer)
    return server, pub, rx, first


def test_one_changed_expert_ships_only_its_blocks():
    g = torch.Generator().manual_seed(0)
    trainer = {"experts.gate_up.weight": torch.randn(6, 70, 48, generator=g).bfloat16(),  # 32 + 32 + 6 rows an expert
               "experts.x.weight": torch.randn(2, 3, 10, 5, generator=g),  # six 10x5 matrices, one block each
               "router.weight": torch.randn(6, 48, generator=g).bfloat16()}
    assert layout_of("experts.gate_up.weight", trainer["experts.gate_up.weight"], trainer, R) == \
        Layout((6, 70, 48), (R, 48))
    assert layout_of("router.weight", trainer["router.weight"], trainer, R) == Layout((1, 6, 48), (R, 48))
    server, pub, rx, first = synced(trainer)
    assert first.stats.blocks_total == 6 * 3 + 6 + 1

    trainer["experts.gate_up.weight"][4, 65] += 1  # expert 4's 6-row edge block: 4 * 3 + 2
    p = pub.publish()
    assert p.changed_blocks() == {"experts.gate_up.weight": [14]}
    assert (p.stats.blocks_changed, p.stats.tensors_changed, p.stats.bytes_shipped) == (1, 1, 8 + 6 * 48 * 2)
    assert torch.equal(p.tensors["experts.gate_up.weight"].data, trainer["experts.gate_up.weight"][4, 64:].reshape(-1))
    rx.apply(p)
    assert same_bytes(server, trainer)

    trainer["experts.gate_up.weight"][1] *= 2  # all of expert 1: blocks 3, 4, 5
    trainer["experts.x.weight"][1, 2, 9, 4] += 1  # matrix (1, 2): block 5
    p = pub.publish()
    assert p.changed_blocks() == {"experts.gate_up.weight": [3, 4, 5], "experts.x.weight": [5]}
    assert p.stats.blocks_changed == 4
    assert p.stats.bytes_shipped == 4 * 8 + 70 * 48 * 2 + 10 * 5 * 4
    rx.apply(p)
    assert same_bytes(server, trainer)


def mxfp4_weights(master: torch.Tensor, table: torch.Tensor) -> dict[str, torch.Tensor]:
    codes, scales = MXFP4.quantize(master)
    return {"experts.w.weight": codes, "experts.w.weight_scale_inv": scales, "tid2eid": table}


def requantize(trainer: dict, master: torch.Tensor) -> None:
    """In place, as a serving cache re-quantizes its master after a step."""
    codes, scales = MXFP4.quantize(master)
    trainer["experts.w.weight"].copy_(codes)
    trainer["experts.w.weight_scale_inv"].copy_(scales)


def test_mxfp4_codes_and_scales_round_trip_and_ship_one_expert(tmp_path):
    g = torch.Generator().manual_seed(1)
    master = torch.randn(5, 40, 64, generator=g)  # 16 + 16 + 8 rows an expert at R = 16
    table = torch.randint(0, 5, (50, 2), dtype=torch.int32, generator=g)
    trainer = mxfp4_weights(master, table)
    codes, scales = trainer["experts.w.weight"], trainer["experts.w.weight_scale_inv"]
    assert (codes.shape, codes.dtype, scales.shape, scales.dtype) == ((5, 40, 32), torch.uint8, (5, 40, 2), torch.uint8)
    assert layout_of("experts.w.weight", codes, trainer, 16) == Layout((5, 40, 32), (16, 32))
    assert layout_of("experts.w.weight_scale_inv", scales, trainer, 16) == Layout((5, 40, 2), (16, 2))

    server = {n: torch.zeros_like(t) for n, t in trainer.items()}
    pub = Publisher(lambda: trainer, rows_per_block=16, check_finite=True)
    rx = Receiver(server, check_finite=True)
    link = DirectoryTransport(tmp_path)
    link.send(pub.publish())
    rx.apply(link.recv(timeout=5))
    assert same_bytes(server, trainer)

    old_codes, old_scales = codes.clone(), scales.clone()
    master[3, 20:22] = 8 * torch.randn(2, 64, generator=g)  # expert 3, rows 20-21: block 3 * 3 + 1 of each
    requantize(trainer, master)
    assert not torch.equal(codes[3, 20:22], old_codes[3, 20:22])
    assert not torch.equal(scales[3, 20:22], old_scales[3, 20:22])
    trainer["tid2eid"][49, 1] = 4 if int(table[49, 1]) != 4 else 3  # its 2-row edge block: 3
    p = pub.publish()
    assert p.changed_blocks() == {"experts.w.weight": [10], "experts.w.weight_scale_inv": [10], "tid2eid": [3]}
    assert p.stats.blocks_changed == 3
    assert p.stats.bytes_shipped == 3 * 8 + 16 * 32 + 16 * 2 + 2 * 2 * 4
    link.send(p)
    got = link.recv(timeout=5)
    assert got.tensors["experts.w.weight"].data.dtype == torch.uint8

    # tampered: a code byte flipped in transit is refused by its checksum, the server untouched
    data = got.tensors["experts.w.weight"].data
    data[7] ^= 0x10
    before = {n: t.clone() for n, t in server.items()}
    with pytest.raises(CorruptPayload, match=r"'experts.w.weight': checksum mismatch"):
        rx.apply(got)
    assert same_bytes(server, before) and rx.version == 1
    # re-checksummed by the tamperer: the end state gives it away
    d = got.tensors["experts.w.weight"]
    d.checksum = d.compute_checksum()
    got.manifest_hash = got.compute_manifest_hash()
    with pytest.raises(EndStateMismatch, match="its blocks are damaged"):
        rx.apply(got)
    assert same_bytes(server, before) and rx.version == 1

    data[7] ^= 0x10
    d.checksum = d.compute_checksum()
    got.manifest_hash = got.compute_manifest_hash()
    rx.apply(got)
    assert same_bytes(server, trainer) and rx.version == 2
    assert torch.equal(MXFP4.dequantize(server["experts.w.weight"], server["experts.w.weight_scale_inv"]),
                       MXFP4.dequantize(codes, scales))


# ---------------------------------------------------------------- checksums of the new kinds
def kinds() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    raw = torch.randint(0, 255, (3, 5, 7), dtype=torch.uint8, generator=g)  # 105 bytes: a partial last word
    flat = raw.view(-1)
    flat[[0, 37, 90]] = 0xFF  # E8M0 NaN, each followed by an even byte: a lane read off by a bit finds none
    flat[[1, 38, 91]] = 0x00
    return {"codes_u8": raw, "codes_i8": raw.view(torch.int8), "codes_fp4": raw.view(torch.float4_e2m1fn_x2),
            "scales_u8": raw[:, :, :2].contiguous(), "scales_e8m0": raw.view(torch.float8_e8m0fnu),
            "table_i32": torch.randint(-2**31, 2**31 - 1, (9, 3), dtype=torch.int32, generator=g),
            "table_i64": torch.randint(-2**62, 2**62, (5,), dtype=torch.int64, generator=g),
            "mask_bool": torch.rand(13, generator=g) > 0.5, "stack_bf16": torch.randn(2, 3, 5, generator=g).bfloat16()}


@pytest.mark.parametrize("name", list(kinds()))
def test_checksum_sees_every_byte_of_the_new_kinds(name):
    t = kinds()[name]
    cs = tensor_checksum(t)
    n = t.numel() * t.element_size()
    for i in sorted({0, 1, n // 2, n - 1}):
        u = t.clone()
        b = u.view(-1).view(torch.uint8)
        b[i] ^= 0x01  # a bool stays 0 or 1
        assert tensor_checksum(u) != cs, i
    # NaN/Inf only where the dtype has them: e8m0's 0xFF is NaN, uint8 0xFF and every E2M1 code are values
    (_, bad), = checksums_and_nonfinite([t])
    assert bad == (3 if name == "scales_e8m0" else 0)


def test_finite_checks_publish_integer_codes_and_refuse_e8m0_nan():
    w = kinds()
    server, *_ = synced({k: v for k, v in w.items() if k != "scales_e8m0"}, check_finite=True)
    assert server["codes_u8"][0, 0, 0] == 0xFF
    with pytest.raises(NonFiniteWeights, match=r"'scales_e8m0' \(3\)"):
        Publisher(lambda: {"scales_e8m0": w["scales_e8m0"]}, check_finite=True).publish()


def test_every_new_kind_crosses_the_directory_transport(tmp_path):
    trainer = kinds()
    server = {n: torch.zeros_like(t) for n, t in trainer.items()}
    pub, rx, link = Publisher(lambda: trainer, rows_per_block=2), Receiver(server), DirectoryTransport(tmp_path)
    link.send(pub.publish())
    trainer["codes_fp4"].view(torch.uint8)[2, 4, 6] ^= 0x11  # the (2, 4) row of the 3-D stack: block 2 * 3 + 2
    trainer["scales_e8m0"].view(torch.uint8)[0, 1, 1] ^= 0x02  # the kinds view one buffer: each sees both edits
    link.send(pub.publish())
    rx.apply(link.recv(timeout=5))
    p = link.recv(timeout=5)
    assert p.changed_blocks()["codes_fp4"] == [0, 8] and p.tensors["codes_fp4"].data.dtype == torch.float4_e2m1fn_x2
    rx.apply(p)
    assert same_bytes(server, trainer)


def test_checksum_kernel_interpreted_on_the_new_kinds():
    """The CUDA kernel's source under Triton's interpreter gives the torch passes' sums and NaN
    counts on the words of each new kind (the kernel sees 32-bit words, the rule sees the dtype)."""
    code = ("import torch\nfrom alignzoo.sync import checksum as C\n"
            "from test_sync_layouts import kinds\n"
            "for name, t in kinds().items():\n"
            "    b = C.tensor_bytes(t)\n"
            "    b = torch.cat([b, b.new_zeros(-b.numel() % 4)])\n"
            "    w = b.view(torch.int32)\n"
            "    rule = C.nonfinite_rule(t.dtype)\n"
            "    s, bad = C._word_sums_triton(w, rule)\n"
            "    assert int(s) == int(C._word_sum_torch(w)), name\n"
            "    if rule is not None:\n"
            "        assert int(bad) == int(C._nonfinite_torch(w, rule)), name\n"
            "print('ok')\n")
    run_interpreted(f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n" + code, expect="ok")
