"""Paged KV cache: page bookkeeping, and one writer whose bytes do not depend
on whether a token arrived in a prefill, a chunk or a decode step."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common.kv_cache import PAGE_SIZE, BlockManager, OutOfPages, allocate_kv_cache, write_kv
from alignzoo.common.ladder import bitwise_equal


def test_append_takes_pages_at_block_boundaries():
    bm = BlockManager(10)
    assert bm.append("a", 63) == list(range(63))  # page 0, offsets 0..62
    assert bm.block_table("a") == [0]
    assert bm.append("a", 1) == [63]
    assert bm.block_table("a") == [0]
    assert bm.append("a", 1) == [PAGE_SIZE]  # position 64: a new page
    assert bm.block_table("a") == [0, 1] and bm.length("a") == 65 and bm.num_free == 8
    assert bm.append("b", 130)[-1] == 4 * PAGE_SIZE + 1  # pages 2, 3, 4
    assert bm.pages_needed("b", 62) == 0 and bm.pages_needed("b", 63) == 1


def test_free_and_reuse():
    bm = BlockManager(4)
    bm.append(0, 128)
    bm.append(1, 100)
    assert not bm.can_append(2, 1)
    with pytest.raises(OutOfPages, match="needs 1 more pages of the 'kv' cache, 0 are free"):
        bm.append(2, 1)
    bm.free(0)
    assert bm.num_free == 2 and 0 not in bm
    assert bm.append(2, 65) == [p * PAGE_SIZE + i for p, i in [(0, j) for j in range(64)] + [(1, 0)]]
    with pytest.raises(KeyError, match="not in the cache"):
        bm.length(0)


def test_append_one_is_append_of_one():
    """The decode fast path: ``append_one`` gives ``append(seq, 1)``'s slot and
    state across page boundaries (shuffled pages), and None with nothing
    changed when a page is needed and none is free, or the sequence is new."""
    a, b = BlockManager(3, shuffle_seed=5), BlockManager(3, shuffle_seed=5)
    a.append("x", 60)
    b.append("x", 60)
    for _ in range(132):  # to the last free slot: 192 positions fill the 3 pages
        assert a.append_one("x") == b.append("x", 1)[0]
        assert a.block_table("x") == b.block_table("x") and a.length("x") == b.length("x")
    assert a.num_free == 0 and a.length("x") == 192
    assert a.append_one("x") is None and a.length("x") == 192 and a.block_table("x") == b.block_table("x")
    assert a.append_one("new") is None and "new" not in a


def test_shuffled_free_order_and_tables():
    a, b = BlockManager(16, shuffle_seed=0), BlockManager(16, shuffle_seed=1)
    a.append("x", 300)
    b.append("x", 300)
    assert a.block_table("x") != b.block_table("x")
    assert len(set(a.block_table("x"))) == 5 and len(set(b.block_table("x"))) == 5
    a.append("y", 10)
    t = a.block_tables(["y", "x"])
    assert t.dtype == torch.int32 and t.shape == (2, 5)
    assert t[0, 1:].tolist() == [-1] * 4 and t[1].tolist() == a.block_table("x")
    assert a.seq_lens(["x", "y"]).tolist() == [300, 10]
    with pytest.raises(ValueError, match="outside sequence"):
        a.slots("y", 5, 11)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_writer_bytes_same_for_prefill_chunks_and_decode(device, dtype):
    """The same tokens written as one prompt, as chunks, or one by one land as
    the same bytes (same page placement); unwritten slots stay untouched."""
    g = torch.Generator().manual_seed(0)
    n = 200
    k = torch.randn(n, 2, 24, generator=g).to(dtype).to(device)
    v = torch.randn(n, 2, 24, generator=g).to(dtype).to(device)
    caches = []
    for split in ([n], [63, 1, 64, 2, 70], [1] * n):
        bm = BlockManager(6, shuffle_seed=3)
        kc, vc = allocate_kv_cache(6, 2, 24, dtype=dtype, device=device)
        kc.fill_(float("nan"))
        vc.fill_(float("nan"))
        done = 0
        for c in split:
            slots = torch.tensor(bm.append("s", c), dtype=torch.int32, device=device)
            write_kv(k[done : done + c], v[done : done + c], kc, vc, slots)
            done += c
        caches.append((kc, vc))
        table = bm.block_table("s")
        got_k = kc[table].reshape(-1, 2, 24)[:n]
        assert bitwise_equal(got_k, k) and bitwise_equal(vc[table].reshape(-1, 2, 24)[:n], v)
    for kc, vc in caches[1:]:
        assert bitwise_equal(kc, caches[0][0]) and bitwise_equal(vc, caches[0][1])


def test_writer_skips_negative_slots(device):
    kc, vc = allocate_kv_cache(2, 1, 16, device=device)
    k = torch.ones(3, 1, 16, dtype=torch.bfloat16, device=device)
    write_kv(k, 2 * k, kc, vc, torch.tensor([-1, 70, -1], device=device))
    assert kc.flatten(0, 1)[70].eq(1).all() and vc.flatten(0, 1)[70].eq(2).all()
    assert kc.count_nonzero() == 16 and vc.count_nonzero() == 16


def _args():
    kc, vc = allocate_kv_cache(2, 2, 16)
    k = torch.randn(3, 2, 16).bfloat16()
    return dict(k=k, v=k.clone(), k_cache=kc, v_cache=vc, slot_mapping=torch.tensor([0, 1, 2]))


BAD = {
    "slot-past-cache": (dict(slot_mapping=torch.tensor([0, 1, 128])), ValueError, "past the cache"),
    "duplicate-slot": (dict(slot_mapping=torch.tensor([0, 5, 5])), ValueError, "same slot twice"),
    "slot-below-minus-1": (dict(slot_mapping=torch.tensor([0, -2, 1])), ValueError, "-1 to skip"),
    "slot-count": (dict(slot_mapping=torch.tensor([0, 1])), ValueError, "2 entries for 3 tokens"),
    "slot-float": (dict(slot_mapping=torch.tensor([0.0, 1.0, 2.0])), TypeError, "slot_mapping has dtype"),
    "dtype-cast": (dict(k=torch.randn(3, 2, 16), v=torch.randn(3, 2, 16)), TypeError, "never casts"),
    "head-shape": (dict(k=torch.randn(3, 1, 16).bfloat16(), v=torch.randn(3, 1, 16).bfloat16()), ValueError, "Hkv, D"),
    "page-size": (dict(k_cache=torch.zeros(2, 16, 2, 16).bfloat16(), v_cache=torch.zeros(2, 16, 2, 16).bfloat16()), ValueError, "PAGE_SIZE"),
    "non-contiguous": (dict(k=torch.randn(2, 3, 16).bfloat16().transpose(0, 1)), ValueError, "k must be contiguous"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_writer_bad_input(case):
    change, exc, match = BAD[case]
    with pytest.raises(exc, match=match):
        write_kv(**{**_args(), **change})


def test_manager_bad_input():
    with pytest.raises(ValueError, match="page_size must be 64"):
        BlockManager(4, page_size=16)
    with pytest.raises(ValueError, match="num_pages"):
        BlockManager(0)
    bm = BlockManager(4)
    bm.add("a")
    with pytest.raises(ValueError, match="already in the cache"):
        bm.add("a")
    with pytest.raises(ValueError, match="cannot append -1"):
        bm.append("a", -1)


def test_a_row_of_parts_lands_as_its_parts_side_by_side():
    """``write_row``: an MLA row [latent (36) | rope key (16)] written from its two parts, a -1 slot skipped, the
    bytes those of the parts (no cast, no arithmetic); bad rows are refused naming the problem."""
    from alignzoo.common.kv_cache import write_row

    g = torch.Generator().manual_seed(0)
    latent, rope = torch.randn(5, 36, generator=g).bfloat16(), torch.randn(5, 16, generator=g).bfloat16()
    cache = torch.zeros(3, PAGE_SIZE, 1, 52, dtype=torch.bfloat16)
    slots = torch.tensor([7, 64, -1, 130, 0])
    write_row((latent, rope), cache, slots)
    flat = cache.view(-1, 52)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(flat[s, :36], latent[i]) and torch.equal(flat[s, 36:], rope[i])
    assert int((flat != 0).any(1).sum()) == 4
    with pytest.raises(ValueError, match="add up to 50 values a row"):
        write_row((latent, rope[:, :14].contiguous()), cache, slots)
    with pytest.raises(TypeError, match="never casts"):
        write_row((latent.float(), rope.float()), cache, slots)
    with pytest.raises(ValueError, match="same slot twice"):
        write_row((latent, rope), cache, torch.tensor([7, 7, -1, 1, 2]))
