"""Cache pools' bookkeeping: rows at a rate, windows that give pages back,
per-sequence state slots, and the manager that grows all of a sequence's
pools or none."""
from __future__ import annotations

import pytest
import torch

from alignzoo.common._host import cdiv

from alignzoo.common.kv_cache import (
    PAGE_SIZE,
    BlockManager,
    CacheManager,
    OutOfPages,
    PagedPool,
    PoolLimits,
    RatePool,
    StatePool,
    StateSlots,
    WindowManager,
    WindowPool,
)
from alignzoo.common.kv_cache.pools import blocks_for_bytes, pool_bytes, pool_units


@pytest.mark.parametrize("rate", [1, 4, 128])
def test_rate_rows_appear_at_boundaries_under_any_split(rate):
    """Position p completes row (p + 1) / rate - 1 exactly when rate divides
    p + 1; one append, chunks split at every offset, and append_one give the
    same slots and tables."""
    n = 3 * PAGE_SIZE * rate // 2 + 5 if rate < 128 else 2 * 128 * 3 + 7
    whole = BlockManager(64, rate=rate, shuffle_seed=1)
    ref = whole.append("s", n)
    rows = [i for i, s in enumerate(ref) if s >= 0]
    assert rows == [p for p in range(n) if (p + 1) % rate == 0]
    assert len(set(s for s in ref if s >= 0)) == len(rows)
    assert whole.block_table("s") == whole.block_table("s")[: -(-(n // rate) // PAGE_SIZE)]
    for split in range(1, min(n, 200), 7):
        bm = BlockManager(64, rate=rate, shuffle_seed=1)
        got = bm.append("s", split)
        while bm.length("s") < n:
            got += [bm.append_one("s")] if (bm.length("s") + split) % 3 == 0 else bm.append("s", min(split, n - bm.length("s")))
        assert got == ref and bm.block_table("s") == whole.block_table("s"), split


def test_rate_pages_needed_counts_rows():
    bm = BlockManager(2, rate=4)
    assert bm.pages_needed("s", 4 * PAGE_SIZE) == 1 and bm.pages_needed("s", 4 * PAGE_SIZE + 4) == 2
    bm.append("s", 4 * PAGE_SIZE + 3)  # 64 rows: one page; 3 positions of the 65th row
    assert bm.num_free == 1 and bm.pages_needed("s", 1) == 1
    assert bm.append_one("s") == bm.block_table("s")[1] * PAGE_SIZE and bm.num_free == 0
    assert bm.pages_for(4 * PAGE_SIZE * 2) == 2


def test_rate_pool_gives_every_short_sequence_its_page():
    """Eight 70-position sequences fill 16 blocks; each still holds a C4 page of 17 rows: 8 pages, not the 4 that
    blocks / rate alone would give."""
    lim = PoolLimits(max_batch_size=8, max_batch_tokens=256)
    c4 = RatePool({"kv": (8,)}, torch.float32, layers=1, rate=4)
    ledger = c4.ledger(c4.units(16, lim), name="c4")
    for s in range(8):
        ledger.append(s, 70)
    assert c4.units(16, lim) == 16 and cdiv(16, 4) < 8


def test_window_gives_pages_back_under_a_long_decode():
    window = 100
    bm = WindowManager(6, window, shuffle_seed=3)
    bm.append("s", 150)  # the chunk's first query (position 0) reads from position 0: nothing freed
    assert bm.num_free == 3 and -1 not in bm.block_table("s")
    live = []
    for _ in range(2000):
        start = bm.length("s")
        slot = bm.append_one("s")
        assert slot is not None
        table = bm.block_table("s")
        first_key = max(0, start - window + 1)
        # every page the new query reads is still held; every page wholly before it is back
        assert all(table[b] >= 0 for b in range(first_key // PAGE_SIZE, len(table)))
        assert all(table[b] == -1 for b in range(first_key // PAGE_SIZE))
        live.append(sum(t >= 0 for t in table))
    assert max(live) <= bm.pages_for(10**6) + 1
    bm.free("s")
    assert bm.num_free == 6


def test_window_keeps_what_a_chunk_reads():
    """A chunk of 200 positions from 300: its first query reads from 201."""
    bm = WindowManager(20, 100)
    bm.append("s", 300)
    bm.append("s", 200)
    table = bm.block_table("s")
    assert table[:3] == [-1, -1, -1] and all(t >= 0 for t in table[3:])  # blocks 0-2 end at 192 <= 201


def test_state_slots_follow_the_sequence():
    st = StateSlots(2)
    assert st.append("a", 100) == [] and st.append("a", 1) == [] and st.slot("a") == 0
    st.append("b", 5)
    assert not st.can_append("c", 1) and st.can_append("a", 1)
    with pytest.raises(OutOfPages, match="needs a state slot"):
        st.append("c", 1)
    st.free("a")
    st.append("c", 3)
    assert st.slot("c") == 0 and st.num_free == 0


def test_manager_grows_every_pool_or_none():
    m = CacheManager({"kv": BlockManager(10), "c4": BlockManager(1, rate=4, name="c4"), "state": StateSlots(2)})
    assert m.append("a", 100)["c4"][3] >= 0 and m.state_slot("a") in (0, 1)
    # kv has room for b's 256 positions; c4's one page (64 rows) is a's
    assert not m.can_append("b", 4 * PAGE_SIZE)
    with pytest.raises(OutOfPages, match="'c4' cache"):
        m.append("b", 4 * PAGE_SIZE)
    assert "b" not in m and m.ledgers["kv"].num_free == 8 and m.state.num_free == 1  # nothing half-applied
    assert "c4" in m.shortfall("b", 4 * PAGE_SIZE)


def test_manager_append_one_undoes_when_a_later_pool_is_full():
    kv, c = BlockManager(2), BlockManager(1, rate=2, name="c2")
    m = CacheManager({"kv": kv, "c2": c})
    m.append("a", 127)  # kv: 2 pages (128 slots), c2: 63 rows, full at 128 positions
    assert m.append_one("a") == {"kv": kv.block_table("a")[1] * PAGE_SIZE + 63, "c2": c.block_table("a")[0] * PAGE_SIZE + 63}
    free_kv = kv.num_free
    assert m.append_one("a") is None  # kv needs a third page: none; nothing changed
    assert kv.length("a") == 128 and c.length("a") == 128 and kv.num_free == free_kv


def test_manager_append_one_undo_returns_the_page():
    kv, c = BlockManager(4, shuffle_seed=2), BlockManager(1, name="other")
    m = CacheManager({"kv": kv, "other": c})
    m.append("a", 64)  # both full at 64 positions
    before = (kv.block_table("a"), kv.num_free, list(kv._free))
    assert m.append_one("a") is None  # kv takes a page, other has none: kv gives it back
    assert (kv.block_table("a"), kv.num_free, list(kv._free)) == before and kv.length("a") == 64


def test_pool_specs_size_and_allocate():
    kv = PagedPool({"k": (2, 24), "v": (2, 24)}, torch.bfloat16, layers=3)
    c4 = RatePool({"kv": (40,)}, torch.float32, layers=2, rate=4)
    win = WindowPool({"k": (2, 24)}, torch.bfloat16, layers=1, window=128)
    st = StatePool({"h": ((4, 8, 8), torch.float32), "conv": ((3, 10), torch.bfloat16)}, layers=2)
    assert kv.page_bytes() == PAGE_SIZE * 3 * 2 * 2 * 2 * 24
    assert st.slot_bytes() == 2 * (4 * 64 * 4 + 30 * 2)
    assert kv.graph_width(4096) == 64 and c4.graph_width(4096) == 16 and RatePool(kv.rows, kv.dtype, 1, rate=128).graph_width(4096) == 1
    lim = PoolLimits(max_batch_size=4, max_batch_tokens=256)
    pools = {"kv": kv, "c4": c4, "win": win, "state": st}
    units = pool_units(pools, 100, lim)
    assert units == {"kv": 100, "c4": 25 + 8, "win": min(100, 4 * 4 + 4), "state": 8}
    budget = pool_bytes(pools, units)
    assert blocks_for_bytes(pools, budget, lim, most=1000) == 100
    assert blocks_for_bytes(pools, budget - 1, lim, most=1000) == 99
    layers = st.allocate(5, "cpu")
    assert len(layers) == 2 and layers[0]["h"].shape == (5, 4, 8, 8) and layers[1]["conv"].dtype == torch.bfloat16
    assert kv.allocate(3, "cpu")[2]["v"].shape == (3, PAGE_SIZE, 2, 24)
    with pytest.raises(ValueError, match="rate"):
        RatePool({"kv": (4,)}, torch.float32, 1, rate=0)
    with pytest.raises(ValueError, match="window"):
        WindowPool({"kv": (4,)}, torch.float32, 1, window=0)
    with pytest.raises(ValueError, match="rows"):
        PagedPool({"k": (0,)}, torch.float32, 1)


def test_pool_specs_share_one_sizing_interface():
    """Every spec has ``units`` (pages; a state pool's slots, whatever the
    blocks) and ``unit_bytes`` (a page's or a slot's), which ``pool_units``
    and ``pool_bytes`` use; integer fields refuse bools and values below 1."""
    kv = PagedPool({"k": (2, 24)}, torch.bfloat16, layers=3)
    c4 = RatePool({"kv": (40,)}, torch.float32, layers=2, rate=4)
    win = WindowPool({"k": (2, 24)}, torch.bfloat16, layers=1, window=128)
    st = StatePool({"h": ((4, 8, 8), torch.float32)}, layers=2)
    lim = PoolLimits(max_batch_size=4, max_batch_tokens=256)
    assert [p.units(100, lim) for p in (kv, c4, win, st)] == [100, 33, 20, 8]
    assert [p.units(1, lim) for p in (kv, c4, win, st)] == [1, 1, 1, 8]
    assert (kv.unit_bytes(), st.unit_bytes()) == (kv.page_bytes(), st.slot_bytes())
    for make, match in ((lambda: PagedPool({"k": (4,)}, torch.float32, 0), "a pool's layers must be an int >= 1, got 0"),
                        (lambda: StatePool({"h": ((4,), torch.float32)}, True), "a pool's layers must be an int >= 1, got True"),
                        (lambda: RatePool({"k": (4,)}, torch.float32, 1, rate=True), "a rate pool's rate must be an int >= 1"),
                        (lambda: WindowPool({"k": (4,)}, torch.float32, 1, window=2.0), "a window pool's window must be an int")):
        with pytest.raises(ValueError, match=match):
            make()
    for make, match in ((lambda: BlockManager(4, rate=0), r"rate must be an int >= 1 \(positions per row\), got 0"),
                        (lambda: WindowManager(4, True), "window must be an int >= 1, got True"),
                        (lambda: StateSlots(0), "num_slots must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=match):
            make()


def test_ring_window_table_follows_the_window_not_the_context():
    """A ring window pool's decode table is cdiv(window - 1, 64) + 2 columns at any max_position, and a prefill
    step's follows its longest chunk; ``ring_table`` puts block b of a sequence in column b % width, only the
    last ``width`` blocks (so an older held block never overwrites a live one), given-back blocks as page 0."""
    from alignzoo.common.engine.model_runner import ring_table

    ring = WindowPool({"k": (2, 24)}, torch.bfloat16, layers=1, window=128, ring=True)
    flat = WindowPool({"k": (2, 24)}, torch.bfloat16, layers=1, window=128)
    assert [ring.graph_width(m) for m in (64, 4096, 1 << 20)] == [1, 3, 3]
    assert flat.graph_width(1 << 20) == (1 << 20) // PAGE_SIZE
    assert [ring.ring_width(c) for c in (1, 2, 64, 1000)] == [3, 3, 4, 19]
    tables = [[-1, -1, 7, 3, 9], [5], [-1, 4, 8, 2, 6, 1, 0]]
    got = ring_table(tables, 4, 3)
    assert got.tolist() == [[3, 9, 7], [5, 0, 0], [0, 6, 1], [0, 0, 0]]  # blocks 4, 5, 6 of the third in 1, 2, 0
    assert ring_table(tables, 3, 8).tolist()[2] == [0, 4, 8, 2, 6, 1, 0, 0]  # wide enough: the linear table
