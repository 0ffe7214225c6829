"""``alignzoo bisect`` and parity receipts: a planted one-bit difference is
found at its op, layer, sequence, position and element; the vendor server's
divergence is found at the op that causes it; capture points are off unless
a recorder attaches; receipts round-trip, verify, and refuse an edit."""
from __future__ import annotations

import json

import pytest
import torch

import alignzoo
from alignzoo.cli import main
from alignzoo.models import capture
from alignzoo.models.bisect import bisect
from alignzoo.models.qwen3 import Qwen3Server, serve


@pytest.fixture(scope="module")
def pair():
    return alignzoo.load_pair("qwen3", config="tiny", device="cpu", cuda_graphs=False, freeze_gc=False)


def _plant(monkeypatch, *, layer: int, position: int, element: int, decode_only: bool = False):
    """The server's SwiGLU output of ``layer`` gets its lowest bit flipped at
    ``element`` of the row at ``position`` (decode steps only, if asked)."""
    state = {"calls": 0, "positions": None, "decode": False}
    real_forward, real_swiglu = Qwen3Server.forward, serve.swiglu_fwd

    def forward(self, batch, caches):
        state.update(calls=0, positions=batch.positions, decode=batch.max_seqlen_q == 1)
        return real_forward(self, batch, caches)

    def swiglu(gate, up):
        y = real_swiglu(gate, up)
        if state["calls"] == layer and (state["decode"] or not decode_only):
            rows = (state["positions"] == position).nonzero()[:, 0]
            flat = y.view(torch.int16)
            flat[rows, element] ^= 1
        state["calls"] += 1
        return y

    monkeypatch.setattr(Qwen3Server, "forward", forward)
    monkeypatch.setattr(serve, "swiglu_fwd", swiglu)


def test_a_planted_bit_is_found_exactly(pair, monkeypatch):
    """Position 250 exists only in sequence 0 (300 tokens; the others 129, 216)."""
    _plant(monkeypatch, layer=1, position=250, element=3)
    prefill, decode = bisect(pair, against="server", length=300, batch=3)
    d = prefill.diffs[0]
    assert (d.name, d.key, d.element, d.rows) == ("layer.1.mlp.swiglu", (0, 250), 3, 1)
    assert prefill.order.index("layer.1.mlp.swiglu") > 0 and all(
        x.name != n for x in prefill.diffs for n in prefill.order[:prefill.order.index(d.name)])
    assert decode.equal  # the decode path scores 160 tokens: position 250 is never fed there
    assert not prefill.equal and "layer.1.mlp.swiglu, sequence 0, position 250, element 3" in prefill.lines()[1]


def test_a_decode_only_difference_is_found_in_decode(pair, monkeypatch):
    _plant(monkeypatch, layer=0, position=100, element=7, decode_only=True)
    prefill, decode = bisect(pair, against="server", length=300, batch=3)
    assert prefill.equal
    d = decode.diffs[0]
    assert (d.name, d.key, d.element) == ("layer.0.mlp.swiglu", (0, 100), 7) and d.rows == 3  # all three reach 100
    assert decode.diffs[1].name == "layer.0.mlp.down"


def test_a_cache_write_that_parts_is_found(pair, monkeypatch):
    """Decode's V row of layer 1 at position 90 lands one bit off in the cache:
    the cache rows are capture points, so bisect names them."""
    real, calls = serve.qk_norm_rope_kv_fwd, {"n": 0}

    def write(qkv, q_w, k_w, eps, positions, rope, k_cache, v_cache, slots, hq, hkv):
        q = real(qkv, q_w, k_w, eps, positions, rope, k_cache, v_cache, slots, hq, hkv)
        layer, calls["n"] = calls["n"] % 2, calls["n"] + 1
        rows = (positions == 90).nonzero()[:, 0]
        if layer == 1 and len(rows) and qkv.shape[0] <= 3:  # a decode step of the three sequences
            bad = v_cache.flatten(0, 1)[slots[rows]]
            bad.view(torch.int16)[:, 0, 5] ^= 1
            v_cache.flatten(0, 1)[slots[rows]] = bad
        return q

    monkeypatch.setattr(serve, "qk_norm_rope_kv_fwd", write)
    prefill, decode = bisect(pair, against="server", length=300, batch=3)
    assert prefill.equal
    d = decode.diffs[0]
    assert (d.name, d.key, d.element) == ("layer.1.attn.v", (0, 90), 5) and d.rows == 3


def test_the_vendor_server_parts_at_its_first_own_op(pair):
    for rep in bisect(pair, against="vendor", length=300, batch=3):
        first = rep.diffs[0]
        assert first.name.startswith("layer.0.")
        before = rep.order[:rep.order.index(first.name)]
        assert before and not {d.name for d in rep.diffs} & set(before)  # every op before it has the same bytes
        assert rep.tokens_differing > 0


def test_capture_points_are_off_unless_attached(pair):
    seqs, lens = [list(range(5, 105)), list(range(7, 47))], [30, 10]
    before = pair.trainer.logprobs(seqs, lens)
    bisect(pair, against="server", length=120, batch=2)
    assert all("tap" not in m.__dict__ for m in pair.trainer.modules())
    assert "tap" not in pair.server.model.__dict__ and "forward" not in pair.server.model.__dict__
    assert Qwen3Server.tap is capture.no_tap or Qwen3Server.tap.__func__ is capture.no_tap
    after = pair.trainer.logprobs(seqs, lens)
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_bisect_cli_exits_nonzero_on_a_difference(capsys):
    assert main(["bisect", "qwen3", "--length", "120", "--batch", "2"]) == 0
    assert "every byte equal" in capsys.readouterr().out
    assert main(["bisect", "qwen3", "--against", "vendor", "--length", "120", "--batch", "2"]) == 1
    out = capsys.readouterr().out
    assert "first difference: layer.0." in out and "log-probs:" in out


def test_receipts_round_trip_verify_and_refuse_edits(tmp_path, capsys, monkeypatch):
    path = tmp_path / "r.json"
    # 80 tokens: the check runs three times here (written, verified, re-run against a server one ULP off)
    assert main(["check", "qwen3", "--length", "80", "--batch", "2", "--receipt", str(path)]) == 0
    r = json.loads(path.read_text())
    assert r["schema"] == "alignzoo.receipt/1" and r["model"] == "qwen3" and r["passed"]
    assert r["run"] == {"length": 80, "batch": 2, "seed": 0, "dtype": "bf16", "fp8": False, "device": "cpu"}
    assert len(r["rungs"]) == 9 and all(x["differing"] == 0 and x["tokens"] > 0 for x in r["rungs"])
    assert r["environment"]["torch"] == torch.__version__ and r["checkpoint"] is None
    capsys.readouterr()
    assert main(["receipt", "verify", str(path)]) == 0
    assert "verified" in capsys.readouterr().out
    # an edit: the file no longer matches its digest
    r["rungs"][2]["differing"] = 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(r))
    assert main(["receipt", "verify", str(edited)]) == 2
    assert "was edited after it was written" in capsys.readouterr().err
    # an honest receipt whose re-run parts: a server one ULP off now
    from alignzoo.models import base

    real = base.matmul_fwd
    monkeypatch.setattr(base, "matmul_fwd", lambda x, w: torch.nextafter(real(x, w), x.new_tensor(float("inf"))))
    assert main(["receipt", "verify", str(path)]) == 1
    out = capsys.readouterr().out
    assert "NOT verified" in out and "rung 3 'trainer == server prefill': passed True -> False" in out


def test_a_checkpoint_receipt_names_its_bytes(tmp_path, pair):
    ck = tmp_path / "ck"
    pair.save_pretrained(ck)
    path = tmp_path / "r.json"
    assert main(["check", "qwen3", "--checkpoint", str(ck), "--length", "80", "--batch", "1", "--receipt", str(path)]) == 0
    r = json.loads(path.read_text())
    assert len(r["checkpoint"]["sha256"]) == 64
    (ck / "config.json").write_text((ck / "config.json").read_text().replace('"rms_norm_eps"', '"rms_norm_eps" ', 1))
    ok, lines = __import__("alignzoo.models.receipt", fromlist=["verify"]).verify(path)
    assert not ok and "changed since the receipt was written" in lines[0]


def test_qwen35_gdn_bisect_equal_server_and_vendor_parts_in_layer_0():
    """The second model's capture points: the aligned server (prefill and
    decode, GDN slots and K/V rows included) has every byte; the vendor server
    parts first in layer 0 with every op before it equal."""
    q35 = alignzoo.load_pair("qwen35_gdn", config="tiny", device="cpu", cuda_graphs=False, freeze_gc=False)
    reps = bisect(q35, against="server", length=150, batch=2)
    assert all(r.equal for r in reps) and reps[0].ops > 40 and reps[2].rows >= 4  # states at 64 and 128
    for rep in bisect(q35, against="vendor", length=150, batch=2)[:2]:  # prefill, decode (then its own states)
        first = rep.diffs[0]
        assert first.name.startswith("layer.0.")
        assert not {d.name for d in rep.diffs} & set(rep.order[:rep.order.index(first.name)])


def test_glm5_vendor_bisect_parts_in_layer_0():
    """glm5_sparse_fp8: the aligned server has every byte (its latent rows and indexer keys compared as
    the cache holds them, and the selection); the vendor server (torch's linear, norms, RoPE, indexer
    top-k and attention) parts in layer 0 with every op before it equal."""
    glm5 = alignzoo.load_pair("glm5_sparse_fp8", config="tiny", device="cpu", cuda_graphs=False, freeze_gc=False)
    reps = bisect(glm5, against="server", length=200, batch=2)
    assert all(r.equal for r in reps) and reps[0].ops > 40
    assert {"layer.0.attn.kv_row", "layer.0.indexer.k", "layer.2.indexer.selected"} <= set(reps[0].order)
    for rep in bisect(glm5, against="vendor", length=200, batch=2):
        first = rep.diffs[0]
        assert first.name.startswith("layer.0.") and "layer.0.indexer.selected" in rep.order
        assert not {d.name for d in rep.diffs} & set(rep.order[:rep.order.index(first.name)])
        assert rep.tokens_differing > 0 and not rep.one_sided
