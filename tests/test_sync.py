"""Weight sync: after every publish/apply the server holds the trainer's bytes.

A fake training loop over odd-shaped tensors (bf16 300x200 and 129x64, a 1-D
norm, a frozen matrix, an FP8 e4m3 weight 300x260 with its fp32 scale_inv
3x3) checks that the payload holds exactly the changed blocks, that torn,
corrupted, skewed and mismatched payloads are refused with the server
untouched byte for byte, the directory and torch.distributed (gloo)
transports, and one real step on the qwen3 tiny pair.
"""
from __future__ import annotations

import datetime
import socket
import threading

import pytest
import torch
from interpreted import run_interpreted

from alignzoo.sync import (CorruptPayload, DirectoryTransport, DistTransport, EndStateMismatch, InProcessTransport,
                           LayoutMismatch, Publisher, Receiver, VersionSkew, apply_between_steps, tensor_checksum,
                           weights_checksum, weights_digest)
from alignzoo.sync.layout import as_int

F8 = torch.float8_e4m3fn
ROWS = 64


def make_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(300, 200, generator=g).to(torch.bfloat16),  # row blocks 0..4, last one 44 rows
        "b.weight": torch.randn(129, 64, generator=g).to(torch.bfloat16),  # row blocks 0..2, last one 1 row
        "norm.weight": torch.rand(200, generator=g).to(torch.bfloat16),  # one block
        "frozen.weight": torch.randn(70, 33, generator=g).to(torch.bfloat16),
        # every byte pattern, NaN codes included: comparison is on bytes
        "fp8.weight": torch.randint(0, 256, (300, 260), generator=g, dtype=torch.uint8).view(F8),  # 3x3 blocks
        "fp8.weight_scale_inv": torch.rand(3, 3, generator=g) + 0.5,  # (ceil(300/128), ceil(260/128))
    }


def same_bytes(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(as_int(a[n]), as_int(b[n])) for n in a)


def snapshot(w: dict) -> dict:
    return {n: t.clone() for n, t in w.items()}


def server_like(w: dict) -> dict:
    """A server copy that starts different from the trainer (the first, full, payload fixes that)."""
    return {n: torch.zeros_like(t) for n, t in w.items()}


# one fake optimizer step per entry: (edits, expected changed block indices)
def step_edits(w: dict, step: int) -> dict[str, list[int]]:
    fp8 = as_int(w["fp8.weight"])  # (300, 260) bytes
    if step == 0:
        w["a.weight"][5] += 1  # block 0
        w["a.weight"][130, 7] = -w["a.weight"][130, 7]  # block 2
        w["b.weight"][128, 0] += 1  # block 2, the 1-row edge block
        w["norm.weight"][17] *= 2
        fp8[200, 257] ^= 1  # block (1, 2) -> 5: the 128x4 edge block
        w["fp8.weight_scale_inv"][1, 2] *= 2  # its scale: entry 5
        return {"a.weight": [0, 2], "b.weight": [2], "fp8.weight": [5], "fp8.weight_scale_inv": [5],
                "norm.weight": [0]}
    if step == 1:
        fp8[256:300, 0:128] ^= 3  # re-quantize block (2, 0) -> 6, 44 rows
        fp8[0, 0] ^= 0x80  # and a sign flip in block 0
        w["fp8.weight_scale_inv"][2, 0] *= 0.5
        w["a.weight"][299] -= 1  # block 4, the 44-row edge block
        return {"a.weight": [4], "fp8.weight": [0, 6], "fp8.weight_scale_inv": [6]}
    if step == 2:
        return {}  # nothing changed: an empty delta still bumps the version
    w["b.weight"].mul_(2)  # every block of b
    w["a.weight"][64:128] += 1
    return {"a.weight": [1], "b.weight": [0, 1, 2]}


def block_data(w: torch.Tensor, name: str, indices: list[int]) -> torch.Tensor:
    """The expected payload data (as integers), built with Python slicing."""
    if w.dtype == F8:
        nbc = -(-w.shape[1] // 128)
        mask = torch.zeros(w.shape, dtype=torch.bool)
        for i in indices:
            r, c = divmod(i, nbc)
            mask[r * 128:(r + 1) * 128, c * 128:(c + 1) * 128] = True
        return as_int(w)[mask]
    if name.endswith("_scale_inv"):
        return as_int(w).reshape(-1)[indices]
    if w.dim() == 1:
        return as_int(w)
    return torch.cat([as_int(w)[i * ROWS:(i + 1) * ROWS].reshape(-1) for i in indices])


def test_training_loop_ships_exactly_the_changed_blocks():
    trainer = make_weights()
    server = server_like(trainer)
    ptrs = {n: t.data_ptr() for n, t in server.items()}
    pub, rx = Publisher(lambda: trainer, rows_per_block=ROWS), Receiver(server)

    p = pub.publish()
    assert (p.version, p.base_version, p.full) == (1, 0, True)
    s = p.stats
    assert s.blocks_changed == s.blocks_total == 5 + 3 + 1 + 2 + 9 + 9
    full_bytes = sum(t.numel() * t.element_size() for t in trainer.values())
    assert s.bytes_full == full_bytes and s.bytes_shipped == full_bytes + 8 * s.blocks_total
    rx.apply(p)
    assert rx.version == 1 and same_bytes(server, trainer)

    for step in range(4):
        expected = step_edits(trainer, step)
        p = pub.publish()
        assert (p.version, p.base_version, p.full) == (step + 2, step + 1, False)
        assert p.changed_blocks() == expected
        for name, idx in expected.items():
            assert torch.equal(as_int(p.tensors[name].data), block_data(trainer[name], name, idx)), name
        s = p.stats
        assert s.blocks_changed == sum(map(len, expected.values())) and s.tensors_changed == len(expected)
        assert s.bytes_full == full_bytes
        assert s.bytes_shipped == sum(d.nbytes for d in p.tensors.values()) < full_bytes
        assert s.seconds >= 0 and "blocks" in str(s)
        rx.apply(p)
        assert rx.version == p.version
        assert weights_digest(server) == weights_digest(trainer)
        assert weights_checksum(server) == weights_checksum(trainer) == p.end_checksum
        for n in trainer:
            assert torch.equal(as_int(server[n]), as_int(trainer[n])), n
    assert {n: t.data_ptr() for n, t in server.items()} == ptrs  # written in place, never rebound


@pytest.mark.parametrize("rows", [1, 7, 64, 1000], ids=lambda r: f"R{r}")
def test_rows_per_block(rows):
    trainer = make_weights(1)
    server = server_like(trainer)
    pub, rx = Publisher(lambda: trainer, rows_per_block=rows), Receiver(server)
    rx.apply(pub.publish())
    trainer["a.weight"][[3, 150, 299]] += 1
    p = pub.publish()
    assert p.changed_blocks()["a.weight"] == sorted({3 // rows, 150 // rows, 299 // rows})
    rx.apply(p)
    assert same_bytes(server, trainer)


def test_negative_zero_and_nan_payloads_count_as_changes():
    trainer = {"w": torch.zeros(130, 8, dtype=torch.bfloat16), "v": torch.full((5,), float("nan"))}
    server = server_like(trainer)
    pub, rx = Publisher(lambda: trainer), Receiver(server)
    rx.apply(pub.publish())
    trainer["w"][100, 3] = -0.0  # == 0.0 as a float
    as_int(trainer["v"])[2] ^= 1  # another NaN
    p = pub.publish()
    assert p.changed_blocks() == {"v": [0], "w": [1]}
    rx.apply(p)
    assert as_int(server["w"])[100, 3] == as_int(trainer["w"])[100, 3] != 0
    assert same_bytes(server, trainer)


def test_checksums_see_every_byte():
    t = torch.randn(1001, dtype=torch.float32)
    cs = tensor_checksum(t)
    for i in (0, 1, 2, 3, 4000, 4003):
        u = t.clone()
        u.view(torch.uint8)[i] ^= 0x10
        assert tensor_checksum(u) != cs
    odd = torch.arange(7, dtype=torch.uint8)  # not a multiple of 4 bytes
    assert tensor_checksum(odd) != tensor_checksum(torch.cat([odd, odd.new_zeros(1)]))
    assert weights_digest({"x": t}) != weights_digest({"x": t.view(7, 143)})  # the shape counts too
    assert weights_checksum({"x": t}) != weights_checksum({"y": t})


def test_checksums_are_pinned_and_batched_alike():
    """The checksum is part of the sync protocol (a payload's end state), so
    its values are pinned; ``tensor_checksums`` (one host read per device)
    gives each tensor's ``tensor_checksum``."""
    from alignzoo.sync.checksum import tensor_checksums

    g = torch.Generator().manual_seed(5)
    ts = [torch.randn(37, 5, generator=g), torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
          torch.randn(8, 9, generator=g).bfloat16()[:, 1:], torch.zeros(0), torch.tensor(True),
          torch.randn(3, generator=g).double()]
    sums = tensor_checksums(ts)
    assert [f"{v:016x}" for v in sums] == ["b4c402f341f120af", "a8111ed60d022578", "0b940f63eccff129",
                                           "0000000000000000", "8d9c35f3f1f31e0e", "90ac4c4dc06ca4db"]
    assert sums == [tensor_checksum(t) for t in ts]
    assert weights_checksum({f"w{i}": t for i, t in enumerate(ts)}) == \
        "7936bdf4d0deeadcf254e0ed8b17bd9de07d64685ff0ca113e568d0beef7086f"


def test_checksum_chunks_give_the_unchunked_sums_and_counts(monkeypatch):
    """The CPU path's chunk loop (chunks of an even number of words: float64's
    rule counts the odd words of the tensor) gives what one chunk gives."""
    from alignzoo.sync import checksum as C

    g = torch.Generator().manual_seed(6)
    ts = [torch.randn(1001, generator=g).double(), torch.randn(999, generator=g).bfloat16(),
          torch.randn(37, 5, generator=g)]
    for t in ts:
        t.view(torch.uint8)[::97] = 0xFF  # NaNs; in a float64's low word 0xFF must not count
    one = C.checksums_and_nonfinite(ts)
    assert all(bad for _, bad in one)
    monkeypatch.setattr(C, "_CHUNK_WORDS", 6)
    assert C.checksums_and_nonfinite(ts) == one


@pytest.mark.gpu
def test_checksum_cuda_kernel_equals_cpu():
    """The CUDA kernel and the CPU torch passes give the same checksum, at odd
    sizes and offsets (a block boundary, a partial word, a view into a buffer)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator().manual_seed(3)
    buf = torch.randint(0, 256, (3 * 4096 * 4 + 13,), dtype=torch.uint8, generator=g)
    for n in (1, 4, 7, 4096 * 4, 4096 * 4 + 4, 3 * 4096 * 4 + 9):
        for off in (0, 4, 1):
            t = buf[off:off + n]
            assert tensor_checksum(t.cuda()) == tensor_checksum(t), (n, off)
    w = torch.randn(1000, 4099, generator=g).bfloat16()
    assert tensor_checksum(w.cuda()) == tensor_checksum(w)
    assert tensor_checksum(w.cuda()[:, 1:]) == tensor_checksum(w[:, 1:])


def test_checksum_kernel_interpreted_equals_torch_passes():
    """The CUDA checksum kernel's source, run by Triton's interpreter on the
    CPU, sums to the torch passes' value (a partial last block included): CI
    checks the kernel's arithmetic, the gpu test its compiled form."""
    code = ("import torch\nfrom alignzoo.sync import checksum as C\n"
            "g = torch.Generator().manual_seed(0)\n"
            "for n in (1, 4095, 4096, 9001):\n"
            "    w = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=g)\n"
            "    assert int(C._word_sums_triton(w, None)[0]) == int(C._word_sum_torch(w)), n\n")
    run_interpreted(code)


def test_views_and_expert_stacks():
    """Server tensors that are views at odd offsets of one flat buffer, a
    transposed (non-contiguous) trainer tensor, and a float8 expert stack
    (E, N, K) whose 128x128 blocks never straddle two experts."""
    g = torch.Generator().manual_seed(8)
    trainer = {"x": torch.randn(129, generator=g).to(torch.bfloat16),
               "t": torch.randn(33, 70, generator=g).to(torch.bfloat16).t(),  # (70, 33), strides (1, 70)
               "e.weight": torch.randint(0, 256, (2, 130, 129), generator=g, dtype=torch.uint8).view(F8),
               "e.weight_scale_inv": torch.rand(2, 2, 2, generator=g)}
    flat = torch.zeros(1 + 129 + 70 * 33, dtype=torch.bfloat16)
    server = {"x": flat[1:130], "t": flat[130:].view(70, 33),
              "e.weight": torch.zeros(2, 130, 129, dtype=F8), "e.weight_scale_inv": torch.zeros(2, 2, 2)}
    pub, rx = Publisher(lambda: trainer), Receiver(server)
    rx.apply(pub.publish())
    assert same_bytes(server, trainer)
    trainer["t"][69, 0] += 1
    as_int(trainer["e.weight"])[1, 127, 128] ^= 1  # expert 1, block (0, 1) -> 1*4 + 0*2 + 1
    trainer["e.weight_scale_inv"][1, 1, 0] += 1  # -> 1*4 + 1*2 + 0
    p = pub.publish()
    assert p.changed_blocks() == {"e.weight": [5], "e.weight_scale_inv": [6], "t": [1]}
    assert p.tensors["e.weight"].data.numel() == 128 * 1  # the 128x1 edge block
    rx.apply(p)
    assert same_bytes(server, trainer) and flat[0] == 0


# ---------------------------------------------------------------- refusals
@pytest.fixture
def synced():
    """trainer, server, publisher and receiver at v1."""
    trainer = make_weights(2)
    server = server_like(trainer)
    pub, rx = Publisher(lambda: trainer, rows_per_block=ROWS), Receiver(server)
    rx.apply(pub.publish())
    step_edits(trainer, 0)
    return trainer, server, pub, rx


def refused(rx: Receiver, payload, exc, match: str) -> None:
    before, version = snapshot(rx.weights), rx.version
    with pytest.raises(exc, match=match):
        rx.apply(payload)
    assert same_bytes(rx.weights, before), "a refused payload changed the server's weights"
    assert rx.version == version


def test_torn_payload(synced):
    _, _, pub, rx = synced
    p = pub.publish()
    d = p.tensors["a.weight"]
    d.data = d.data[:-7]
    refused(rx, p, CorruptPayload, r"'a\.weight': torn payload: 25593 data elements for 2 blocks of 25600")


def test_corrupted_payload(synced):
    trainer, server, pub, rx = synced
    p = pub.publish()
    good = p.tensors["fp8.weight"].data.clone()
    p.tensors["fp8.weight"].data.view(torch.uint8)[100] ^= 0x04  # one bit
    refused(rx, p, CorruptPayload, r"'fp8\.weight': checksum mismatch")
    p.tensors["fp8.weight"].data = good
    p.tensors["b.weight"].indices = torch.tensor([1])  # a 64-row block for the data of the 1-row block 2
    refused(rx, p, CorruptPayload, r"'b\.weight': torn payload")
    p.tensors["b.weight"].indices = torch.tensor([3])
    refused(rx, p, CorruptPayload, r"'b\.weight': block index out of range \[3, 3\]: the tensor has 3 blocks")
    p.tensors["b.weight"].indices = torch.tensor([2])
    good, p.end_checksum = p.end_checksum, "0" * 64
    refused(rx, p, CorruptPayload, r"manifest hash mismatch")
    p.end_checksum = good
    rx.apply(p)  # restored, it applies
    assert same_bytes(server, trainer)


def test_version_skew(synced):
    _, _, pub, rx = synced
    pub.publish()  # v2, lost
    p3 = pub.publish()
    refused(rx, p3, VersionSkew, r"payload v3 is a delta against v2, but the server holds v1")
    resync = pub.publish(full=True)  # v4, every block: applies on v1
    assert resync.full and resync.base_version == 3
    rx.apply(resync)
    assert rx.version == 4
    refused(rx, p3, VersionSkew, r"v3 is a delta against v2, but the server holds v4")


def test_shape_dtype_and_names(synced):
    trainer, server, pub, rx = synced
    p = pub.publish()
    bad = dict(server, **{"a.weight": torch.zeros(300, 201, dtype=torch.bfloat16)})
    refused(Receiver(bad, version=1), p, LayoutMismatch, r"'a\.weight': the payload has \(300, 200\) torch.bfloat16, "
                                                         r"the server \(300, 201\)")
    bad = dict(server, **{"norm.weight": torch.zeros(200, dtype=torch.float32)})
    refused(Receiver(bad, version=1), p, LayoutMismatch, r"'norm\.weight'.*torch.float32")
    bad = {n: t for n, t in server.items() if n != "b.weight"}
    refused(Receiver(bad, version=1), p, LayoutMismatch, r"unknown to the server \['b\.weight'\]")
    bad = dict(server, extra=torch.zeros(3))
    refused(Receiver(bad, version=1), p, LayoutMismatch, r"missing from the payload \['extra'\]")
    rx.apply(p)
    assert same_bytes(server, trainer)


def test_end_state_mismatch_needs_a_full_resync(synced):
    trainer, server, pub, rx = synced
    server["frozen.weight"][0, 0] += 1  # out of band: the server is no longer v1
    with pytest.raises(EndStateMismatch, match="were not v1 before"):
        rx.apply(pub.publish())
    assert rx.version is None
    step_edits(trainer, 1)
    refused(rx, pub.publish(), VersionSkew, "holds no valid version")
    rx.apply(pub.publish(full=True))
    assert rx.version == 4 and same_bytes(server, trainer)


@pytest.mark.parametrize("full", [False, True], ids=["delta", "full"])
def test_damaged_blocks_with_consistent_checksums_write_nothing(synced, full):
    """A payload whose block data and checksums agree but whose end state is
    not the trainer's (a partly changed and a whole tensor, each alone) is
    refused by the end-state check with the server untouched byte for byte."""
    from alignzoo.sync.checksum import tensor_checksum as cs

    _, server, pub, rx = synced
    p = pub.publish(full=full)
    for name in ("a.weight", "norm.weight"):  # 2 of a's 5 blocks, or all; norm's only block
        d = p.tensors[name]
        good = d.data.clone()
        d.data.view(torch.uint8)[3] ^= 0x01
        d.checksum = f"{cs(d.indices):016x}{cs(d.data):016x}"
        p.manifest_hash = p.compute_manifest_hash()
        refused(rx, p, EndStateMismatch, "its blocks are damaged; nothing was written")
        d.data = good
        d.checksum = d.compute_checksum()
        p.manifest_hash = p.compute_manifest_hash()
    rx.apply(p)
    assert rx.version == 2 and weights_checksum(server) == p.end_checksum


def test_publisher_refuses_a_changed_model():
    w = make_weights()
    pub = Publisher(lambda: w)
    pub.publish()
    w["a.weight"] = torch.zeros(300, 201, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"'a\.weight' changed since v1: \(300, 200\)"):
        pub.publish()
    del w["a.weight"]
    with pytest.raises(ValueError, match=r"gone \['a\.weight'\]"):
        pub.publish()


# ---------------------------------------------------------------- transports
def test_in_process_transport_thread():
    trainer = make_weights(3)
    server = server_like(trainer)
    pub, rx, tr = Publisher(lambda: trainer), Receiver(server), InProcessTransport()
    digests = []

    def train():
        for step in range(4):
            if step:
                step_edits(trainer, step - 1)
            tr.send(pub.publish())
            digests.append(weights_digest(trainer))

    th = threading.Thread(target=train)
    th.start()
    th.join(30)
    for v in range(1, 5):
        rx.apply(tr.recv(timeout=10))
        assert rx.version == v and weights_digest(server) == digests[v - 1]
    with pytest.raises(TimeoutError):
        tr.recv(timeout=0.01)


def test_directory_transport(tmp_path):
    trainer = make_weights(4)
    server = server_like(trainer)
    pub, rx = Publisher(lambda: trainer), Receiver(server)
    writer, reader = DirectoryTransport(tmp_path), DirectoryTransport(tmp_path)
    for step in range(3):
        if step:
            step_edits(trainer, step - 1)
        p = pub.publish()
        writer.send(p)
        q = reader.recv(timeout=5)
        assert (q.version, q.base_version, q.full, q.changed_blocks()) == (p.version, p.base_version, p.full,
                                                                           p.changed_blocks())
        assert str(q.stats) == str(p.stats)
        rx.apply(q)
        assert weights_digest(server) == weights_digest(trainer)
    with pytest.raises(FileExistsError):
        writer.send(p)

    # a writer caught mid-write: only temporaries, and tensors whose manifest is not there yet
    (tmp_path / ".v00000004.safetensors.tmp-1-abcd").write_bytes(b"partial")
    (tmp_path / ".v00000004.json.tmp-1-abcd").write_text('{"manif')
    (tmp_path / "v00000004.safetensors").write_bytes(b"\x08\x00")
    assert reader.versions() == [1, 2, 3]
    assert reader.poll() is None
    with pytest.raises(TimeoutError, match="v4 did not appear"):
        reader.recv(timeout=0.05)

    step_edits(trainer, 2)
    pub.publish()  # v4 is lost
    writer.send(pub.publish())
    with pytest.raises(VersionSkew, match="expects v4 next but the next complete version is v5"):
        reader.poll()


def test_directory_transport_concurrent_reader(tmp_path):
    """A reader polling while the writer writes sees complete versions only."""
    trainer = make_weights(5)
    server = server_like(trainer)
    pub, rx = Publisher(lambda: trainer), Receiver(server)
    writer, reader = DirectoryTransport(tmp_path), DirectoryTransport(tmp_path)
    digests = {}

    def train():
        for step in range(4):
            if step:
                step_edits(trainer, step - 1)
            p = pub.publish()
            digests[p.version] = weights_digest(trainer)
            writer.send(p)

    th = threading.Thread(target=train)
    th.start()
    for v in range(1, 5):
        rx.apply(reader.recv(timeout=30, poll_interval=0.0005))
        assert weights_digest(server) == digests[v]
    th.join(30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist_worker(rank: int, port: int, results, backend: str = "gloo") -> None:
    import os

    import torch.distributed as dist

    if backend == "nccl":
        os.environ["NCCL_NVLS_ENABLE"] = "0"  # no NVLink multicast on shared hosts
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        trainer = make_weights(6)
        if backend == "nccl":  # the weights live on each rank's GPU and travel GPU to GPU
            trainer = {n: t.cuda() for n, t in trainer.items()}
        tr = DistTransport(peer=1 - rank)
        if rank == 0:
            pub = Publisher(lambda: trainer, rows_per_block=ROWS)
            for step in range(3):
                if step:
                    step_edits(trainer, step - 1)
                p = pub.publish()
                tr.send(p)
                results.put(("trainer", p.version, p.changed_blocks(), weights_digest(trainer)))
        else:
            server = server_like(trainer)
            rx = Receiver(server)
            for _ in range(3):
                p = tr.recv()
                rx.apply(p)
                results.put(("server", rx.version, p.changed_blocks(), weights_digest(server)))
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["gloo", pytest.param("nccl", marks=pytest.mark.gpu)])
def test_dist_transport(backend):
    import torch.multiprocessing as mp

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = mp.start_processes(_dist_worker, args=(_free_port(), results, backend), nprocs=2, join=False,
                               start_method="spawn")
    try:
        for _ in range(120):  # 60 s at most: a hung peer fails the test, never CI
            if procs.join(timeout=0.5):
                break
        else:
            pytest.fail(f"the {backend} workers did not finish within 60 s")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.kill()
    got = {}
    while not results.empty():
        side, *rest = results.get()
        got.setdefault(side, []).append(rest)
    assert [r[0] for r in got["server"]] == [1, 2, 3]
    assert got["server"] == got["trainer"]  # same versions, blocks and bytes
    assert got["server"][1][1] == {"a.weight": [0, 2], "b.weight": [2], "fp8.weight": [5],
                                   "fp8.weight_scale_inv": [5], "norm.weight": [0]}


# ---------------------------------------------------------------- the qwen3 pair
def test_qwen3_step_publish_apply_bitwise():
    import alignzoo
    from alignzoo import SamplingParams

    pair = alignzoo.load_pair("qwen3", config="tiny", device="cpu", seed=0)
    params = dict(pair.trainer.named_parameters())
    pub = Publisher(lambda: {n: p.detach() for n, p in pair.trainer.named_parameters()})
    rx = Receiver(pair.server.model.weights)
    assert apply_between_steps(pair.server, rx, pub.publish()) == 1

    sps = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, max_new_tokens=12, seed=3),
           SamplingParams(temperature=1.2, min_p=0.05, max_new_tokens=9, seed=4)]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in (40, 17)]
    outs = pair.server.generate(prompts, sps)
    seqs = [p + o.tokens for p, o in zip(prompts, outs)]
    lens = [len(p) for p in prompts]
    matrices = [p for p in params.values() if p.dim() >= 2]
    opt = torch.optim.SGD(matrices, lr=0.5)  # norms frozen: they must not ship
    lps = pair.trainer.logprobs(seqs, lens, sps)
    (-sum(lp[torch.isfinite(lp)].sum() for lp in lps)).backward()
    opt.step()

    p = pub.publish()
    assert p.changed_blocks() and not any(params[n].dim() == 1 for n in p.changed_blocks())
    assert p.stats.bytes_shipped < p.stats.bytes_full
    ptrs = {n: t.data_ptr() for n, t in pair.server.model.weights.items()}
    assert apply_between_steps(pair.server, rx, p) == 2
    assert {n: t.data_ptr() for n, t in pair.server.model.weights.items()} == ptrs
    assert weights_digest(pair.server.model.weights) == weights_digest(params)

    outs = pair.server.generate(prompts, sps)
    assert all(o.weight_version == 2 and o.error is None for o in outs)
    with torch.no_grad():
        lps = pair.trainer.logprobs([p + o.tokens for p, o in zip(prompts, outs)], lens, sps)
    for o, t in zip(outs, lps):
        assert torch.equal(t.cpu(), o.logprobs)

    stale = pub.publish()  # v3 ...
    with pytest.raises(VersionSkew):
        apply_between_steps(pair.server, rx, pub.publish())  # ... lost: v4 is refused
    assert pair.server.weight_version == 2 and rx.version == 2
    assert apply_between_steps(pair.server, rx, stale) == 3
