"""alignzoo serve over real HTTP on 127.0.0.1: the server is ``python -m alignzoo.cli serve qwen3 --config
tiny`` in its own process, started here and stopped (SIGTERM, exit 0) at the end; this process holds the
same seeded pair in-process and checks /generate against it bit for bit (tokens and FP32 log-probs
through JSON), before and after every kind of weight update, and that every refused update leaves the
served bytes as they were (the device-side checksum of the weights)."""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import alignzoo  # noqa: E402
from alignzoo import SamplingParams  # noqa: E402
from alignzoo.client import Client, ServerError, output_logprobs  # noqa: E402
from alignzoo.common.metrics import mismatch  # noqa: E402
from alignzoo.sync import Publisher, weights_checksum  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*args: str, log_path: Path, api_key: str | None = None,
                 env: dict | None = None) -> tuple[subprocess.Popen, Client]:
    """``alignzoo serve *args`` on a free port, and a Client (with ``api_key``) once it answers."""
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ALIGNZOO_") or not k.endswith("API_KEY")},
           "OMP_NUM_THREADS": "1", **(env or {})}
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "alignzoo.cli", "serve", *args, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    client = Client(f"http://127.0.0.1:{port}", timeout=120, api_key=api_key or "")
    try:
        client.wait_ready(120, proc)
    except Exception:
        proc.kill()
        raise AssertionError(f"the server did not start:\n{log_path.read_text()}")
    return proc, client


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    log_path = tmp_path_factory.mktemp("serve") / "server.log"
    # a preset allows no disk updates by default: the tests' checkpoints are written under pytest's base temp
    proc, client = start_server("qwen3", "--config", "tiny", "--weights-dir", str(tmp_path_factory.getbasetemp()),
                                log_path=log_path)
    yield proc, client, log_path
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def server(served) -> Client:
    return served[1]


@pytest.fixture(scope="module")
def pair():
    """The served model in this process: same preset, same seed, same bytes (checked first)."""
    return alignzoo.load_pair("qwen3", config="tiny")


def sp_dict(seed=7, max_new=12, **kw) -> dict:
    return {"temperature": 0.8, "top_k": 20, "top_p": 0.95, "min_p": 0.01, "max_new_tokens": max_new,
            "sampling_seed": seed, **kw}


def ours(d: dict) -> SamplingParams:
    top_k = d.get("top_k", -1)
    stop = d.get("stop") or ()
    return SamplingParams(temperature=d.get("temperature", 1.0), top_k=0 if top_k == -1 else top_k,
                          top_p=d.get("top_p", 1.0), min_p=d.get("min_p", 0.0), max_new_tokens=d["max_new_tokens"],
                          seed=d["sampling_seed"], stop_token_ids=tuple(d.get("stop_token_ids", ())),
                          ignore_eos=d.get("ignore_eos", False), stop=(stop,) if isinstance(stop, str) else tuple(stop))


def assert_same_as_in_process(pair, prompt, d, result, *, trainer=True):
    """Tokens and FP32 log-probs of a /generate result == the in-process engine's, and == the trainer's."""
    want = pair.server.generate([prompt], ours(d))[0]
    assert result["output_ids"] == want.tokens
    lps = output_logprobs(result)
    assert torch.equal(lps, want.logprobs)
    if trainer:
        lp = pair.trainer.logprobs([prompt + want.tokens], [len(prompt)], ours(d))[0].detach()
        m = mismatch(lp, lps)
        assert m.differing == 0 and m.k3_max == 0.0 and torch.equal(lp, lps)
    meta = result["meta_info"]
    assert meta["completion_tokens"] == len(want.tokens) and meta["prompt_tokens"] == len(prompt)
    assert meta["finish_reason"]["type"] == want.finish_reason


def trainer_checksum(pair) -> str:
    return weights_checksum(pair.trainer.forward_weights())


def step_weights(pair, scale=1e-2, seed=0):
    """A deterministic change of every trainer weight (stands in for an optimizer step)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(pair.trainer.named_parameters()):
            p.add_(torch.randn(p.shape, generator=g).to(p.device, p.dtype) * scale)
    pair.sync()


# ------------------------------------------------------------------ generate
def test_served_weights_are_the_in_process_pair(server, pair):
    assert server.weights_checksum() == trainer_checksum(pair)
    assert server.get_weight_version() == 1
    info = server.get_model_info()
    assert info["vocab_size"] == 151 and info["model_type"] == "qwen3" and info["routed_experts"] is False
    assert server.get_server_info()["weight_version"] == 1
    assert server.health() and server.health_generate()


def test_generate_one_prompt_bit_for_bit(server, pair):
    prompt, d = [1, 2, 3, 4, 5], sp_dict()
    out = server.generate(prompt, d, return_logprob=True)
    assert_same_as_in_process(pair, prompt, d, out)
    meta = out["meta_info"]
    assert meta["weight_version"] == 1 and meta["sampling_seed"] == 7 and meta["id"]
    triples = meta["output_token_logprobs"]
    assert all(len(t) == 3 and t[2] is None and t[1] == tok for t, tok in zip(triples, out["output_ids"]))
    # each JSON float is exactly an FP32 value, so float -> fp32 -> float is the identity
    assert all(struct.unpack("f", struct.pack("f", t[0]))[0] == t[0] for t in triples)


def test_generate_batch_and_n_bit_for_bit(server, pair):
    prompts = [[3], list(range(40, 140)), [7, 8, 9, 10, 11, 12, 13]]
    ds = [sp_dict(seed=11, max_new=9), sp_dict(seed=12, max_new=5, temperature=1.0, top_k=-1),
          sp_dict(seed=13, max_new=14, stop_token_ids=[5, 6, 7])]
    for d in ds:
        d["n"] = 3
    outs = server.generate(prompts, ds, return_logprob=True, rid="batch")
    assert isinstance(outs, list) and len(outs) == 9
    for i, (p, d) in enumerate(zip(prompts, ds)):
        for j in range(3):
            out = outs[i * 3 + j]  # prompt-major; sample j is drawn with seed sampling_seed + j
            assert out["meta_info"]["id"] == f"batch_{i}_{j}" and out["meta_info"]["sampling_seed"] == d["sampling_seed"] + j
            assert_same_as_in_process(pair, p, {**d, "sampling_seed": d["sampling_seed"] + j}, out)
    assert len({tuple(o["output_ids"]) for o in outs[:3]}) > 1  # n samples differ


def test_stream_is_cumulative_and_ends_bit_for_bit(server, pair):
    prompt, d = [9, 8, 7], sp_dict(seed=21, max_new=10)
    chunks = list(server.generate_stream(prompt, d, return_logprob=True))
    assert len(chunks) >= 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    assert_same_as_in_process(pair, prompt, d, chunks[-1])
    batch = list(server.generate_stream([[1, 2], [3, 4, 5]], [sp_dict(seed=1, max_new=4), sp_dict(seed=2, max_new=6)],
                                        return_logprob=True))
    last = {c["index"]: c for c in batch if c["meta_info"]["finish_reason"] is not None}
    assert sorted(last) == [0, 1]
    assert_same_as_in_process(pair, [1, 2], sp_dict(seed=1, max_new=4), last[0], trainer=False)
    assert_same_as_in_process(pair, [3, 4, 5], sp_dict(seed=2, max_new=6), last[1], trainer=False)


def test_64_concurrent_clients_get_their_bits_alone(server, pair):
    g = torch.Generator().manual_seed(5)
    reqs = [(torch.randint(0, 151, (int(torch.randint(1, 120, (1,), generator=g)),), generator=g).tolist(),
             sp_dict(seed=100 + i, max_new=int(torch.randint(1, 17, (1,), generator=g)))) for i in range(64)]
    with ThreadPoolExecutor(64) as ex:
        outs = list(ex.map(lambda r: server.generate(r[0], r[1], return_logprob=True), reqs))
    for (prompt, d), out in zip(reqs, outs):  # each against its in-process run alone
        assert_same_as_in_process(pair, prompt, d, out, trainer=False)


BAD = [
    (b'{"input_ids": [1, 2', "malformed JSON"),
    (b"[1, 2, 3]", "must be a JSON object"),
    (b'{"input_ids": [1], "temperature": 1}', "temperature: extra inputs are not permitted"),
    (b'{"input_ids": [1], "sampling_params": {"max_tokens": 3}}', "sampling_params.max_tokens: extra inputs"),
    (b'{"input_ids": [1, 151]}', "outside the vocabulary [0, 151)"),
    (b'{"input_ids": [1, -1]}', "outside the vocabulary"),
    (b'{"input_ids": [1, true]}', "is a bool"),
    (b'{"input_ids": []}', "input_ids is empty"),
    (b'{"input_ids": [[1], []]}', "prompt 1: input_ids: the prompt is empty"),
    (b'{"text": "hello"}', "no tokenizer"),
    (b'{"input_ids": [1], "sampling_params": {"temperature": -1}}', "temperature must be 0 (greedy)"),
    (b'{"input_ids": [1], "sampling_params": {"top_p": 0}}', "top_p must be in (0, 1]"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": 0}}', "top_k must be -1 (off) or >= 1"),
    (b'{"input_ids": [1], "sampling_params": {"top_k": 1.5}}', "sampling_params.top_k: input should be a valid integer"),
    (b'{"input_ids": [1], "sampling_params": {"n": 0}}', "n must be >= 1"),
    (b'{"input_ids": [1], "sampling_params": {"max_new_tokens": 0}}', "max_new_tokens must be >= 1"),
    (b'{"input_ids": [1], "sampling_params": {"repetition_penalty": 1.2}}', "repetition_penalty = 1.2 is not supported"),
    (b'{"input_ids": [1], "sampling_params": {"stop": ["x"]}}', "sampling_params.stop: stop strings need the checkpoint's tokenizer"),
    (json.dumps({"input_ids": [1] * 4000, "sampling_params": {"max_new_tokens": 200}}).encode(),
     "exceeds the model's max_position 4096"),
    (b'{"input_ids": [1], "return_routed_experts": true}', "emits no routed experts"),
    (b'{"input_ids": [1], "logprob_start_len": 0}', "only output-token log-probs"),
    (b'{"input_ids": [[1], [2]], "sampling_params": [{}]}', "1 values for 2 prompts"),
    (b'{"input_ids": [1], "lora_path": "math"}', "unknown adapter"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_request_is_a_400_naming_it(server, body, message):
    with pytest.raises(ServerError) as e:
        server.post("/generate", body)
    assert e.value.status == 400 and message in e.value.message, e.value.message


def test_server_keeps_serving_after_bad_requests(server, pair):
    for body, _ in BAD[:5]:
        with pytest.raises(ServerError):
            server.post("/generate", body)
    for path in ("/update_weights_from_disk", "/pause_generation", "/abort_request", "/init_weights_update_group"):
        with pytest.raises(ServerError) as e:
            server.post(path, b'{"nonsense": 1}')
        assert e.value.status == 400
    assert_same_as_in_process(pair, [4, 5], sp_dict(seed=3), server.generate([4, 5], sp_dict(seed=3), return_logprob=True))


# ------------------------------------------------------------------ control
class Background:
    def __init__(self, fn):
        self.result, self.error = None, None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.result = fn()
        except BaseException as e:  # noqa: BLE001
            self.error = e

    def get(self, timeout=60):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "still running"
        if self.error is not None:
            raise self.error
        return self.result


def wait_for(cond, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def first_chunk_then(server, prompt, d, rid):
    """Start a streamed request; return (Background of its chunks, once one chunk has arrived)."""
    got = []

    def run():
        for c in server.generate_stream(prompt, d, return_logprob=True, rid=rid):
            got.append(c)
        return got

    bg = Background(run)
    bg.chunks = got
    wait_for(lambda: got or bg.error)
    return bg


def test_pause_in_place_holds_and_continue_finishes_bit_for_bit(server, pair):
    d = sp_dict(seed=31, max_new=150)
    bg = first_chunk_then(server, [1, 2, 3], d, "held")
    assert server.pause_generation("in_place")["success"]
    with pytest.raises(ServerError) as e:
        server.flush_cache()
    assert e.value.status == 400 and "running or waiting" in e.value.message
    queued = Background(lambda: server.generate([5, 6], sp_dict(seed=32, max_new=3), return_logprob=True))
    time.sleep(0.3)
    assert bg.thread.is_alive() and queued.thread.is_alive()
    info = server.get_server_info()
    assert info["paused"] == "in_place" and info["num_in_flight"] == 1 and info["num_queued"] == 1
    server.continue_generation()
    assert_same_as_in_process(pair, [1, 2, 3], d, bg.get()[-1], trainer=False)
    assert_same_as_in_process(pair, [5, 6], sp_dict(seed=32, max_new=3), queued.get(), trainer=False)
    assert server.flush_cache()["success"]


def test_retract_recomputes_the_same_bits(server, pair):
    d = sp_dict(seed=33, max_new=150)
    bg = first_chunk_then(server, list(range(30)), d, "retracted")
    server.pause_generation("retract")
    assert server.get_server_info()["num_running_reqs"] == 0
    server.continue_generation()
    assert_same_as_in_process(pair, list(range(30)), d, bg.get()[-1], trainer=False)


def test_abort_request_by_rid_and_pause_abort(server, pair):
    d = sp_dict(seed=41, max_new=3000, temperature=1.0, top_k=-1)
    bg = first_chunk_then(server, [2], d, "doomed")
    assert server.abort_request("doomed")["num_aborted"] == 1
    last = bg.get()[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    want = pair.server.generate([[2]], ours(d | {"max_new_tokens": len(last["output_ids"])}))[0]
    assert last["output_ids"] == want.tokens and torch.equal(output_logprobs(last), want.logprobs)
    bg = first_chunk_then(server, [3], d, "paused-away")
    assert "1 request(s) aborted" in server.pause_generation("abort")["message"]
    assert bg.get()[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    server.continue_generation()
    assert server.abort_request("nobody")["num_aborted"] == 0
    with pytest.raises(ServerError) as e:
        server.abort_request("")
    assert e.value.status == 400


# ------------------------------------------------------------------ weight updates
def assert_serves_trainer(server, pair, version):
    assert server.get_weight_version() == version
    assert server.weights_checksum() == trainer_checksum(pair)
    prompt, d = [6, 5, 4, 3], sp_dict(seed=50 + version, max_new=16)
    out = server.generate(prompt, d, return_logprob=True)
    assert out["meta_info"]["weight_version"] == version
    assert_same_as_in_process(pair, prompt, d, out)


def test_update_from_disk(server, pair, tmp_path):
    step_weights(pair, seed=1)
    pair.save_pretrained(tmp_path / "v2")
    v = server.get_weight_version()
    answer = server.update_weights_from_disk(tmp_path / "v2")
    assert answer["success"] and answer["weight_version"] == v + 1
    assert_serves_trainer(server, pair, v + 1)


def test_update_from_tensor_full_then_delta(server, pair):
    pub = server.publisher(pair.trainer.forward_weights)
    step_weights(pair, seed=2)
    v = server.get_weight_version()
    assert server.update_weights_from_tensor(pub.publish())["weight_version"] == v + 1
    assert_serves_trainer(server, pair, v + 1)
    with torch.no_grad():
        _, p = sorted(pair.trainer.named_parameters())[0]
        p[:2] += 0.125  # two rows: one row block of one tensor
    pair.sync()
    payload = pub.publish()
    assert not payload.full and payload.stats.blocks_changed < payload.stats.blocks_total
    assert server.update_weights_from_tensor(payload)["weight_version"] == v + 2
    assert_serves_trainer(server, pair, v + 2)


def test_in_flight_requests_finish_on_their_version_or_abort(server, pair):
    pub = server.publisher(pair.trainer.forward_weights)
    v = server.get_weight_version()
    d = sp_dict(seed=61, max_new=300, temperature=1.0, top_k=-1)
    want = pair.server.generate([[1, 1]], ours(d))[0]  # under the weights it starts with
    step_weights(pair, seed=3)
    payload = pub.publish()
    bg = first_chunk_then(server, [1, 1], d, "old-version")
    sent_at = len(bg.chunks)
    upd = Background(lambda: server.update_weights_from_tensor(payload))
    chunks = bg.get()
    assert upd.get()["weight_version"] == v + 1
    assert len(chunks) > sent_at + 10  # it was in flight when the update came
    last = chunks[-1]
    assert last["meta_info"]["weight_version"] == v and last["output_ids"] == want.tokens
    assert torch.equal(output_logprobs(last), want.logprobs)
    bg = first_chunk_then(server, [1, 2], d, "aborted-for-update")
    step_weights(pair, seed=4)
    assert server.update_weights_from_tensor(pub.publish(), abort_all_requests=True)["weight_version"] == v + 2
    assert bg.get()[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_serves_trainer(server, pair, v + 2)


def refused(server, fn, status, *words):
    before = (server.get_weight_version(), server.weights_checksum())
    with pytest.raises(ServerError) as e:
        fn()
    assert e.value.status == status and all(w in e.value.message for w in words), e.value.message
    assert (server.get_weight_version(), server.weights_checksum()) == before


def test_refused_updates_leave_the_weights_unchanged(server, pair, tmp_path):
    pub = server.publisher(pair.trainer.forward_weights)
    step_weights(pair, seed=5)
    good = pub.publish()
    post = lambda body: lambda: server.post("/update_weights_from_tensor", body)  # noqa: E731
    refused(server, post({"serialized_named_tensors": ["%%% not base64"]}), 400, "not valid base64")
    refused(server, post({"serialized_named_tensors": [base64.b64encode(b"\0" * 64).decode()]}), 400, "safetensors")
    refused(server, post({"serialized_named_tensors": []}), 400, "must hold one payload")
    refused(server, post({"serialized_named_tensors": ["x"], "shapes": [1]}), 400, "shapes: extra inputs")
    tampered = pub.publish(full=True)  # v+2 as a full payload, its data changed after the checksums
    name = next(n for n, d in tampered.tensors.items() if d.data.numel())
    tampered.tensors[name].data.view(torch.uint8)[0] ^= 1
    refused(server, lambda: server.update_weights_from_tensor(tampered), 400, "checksum mismatch", name)
    weights = {n: w.clone() for n, w in pair.trainer.forward_weights().items()}
    name = sorted(weights)[0]
    weights[name] = weights[name].reshape(-1)
    misshaped = Publisher(lambda: weights)
    misshaped.version = server.get_weight_version()
    refused(server, lambda: server.update_weights_from_tensor(misshaped.publish()), 400, "tensor", name)
    weights = {n: w.clone() for n, w in pair.trainer.forward_weights().items()}
    weights[name].view(-1)[3] = float("nan")
    nan = Publisher(lambda: weights)  # unchecked here, so the server is the one to refuse it
    nan.version = server.get_weight_version()
    refused(server, lambda: server.update_weights_from_tensor(nan.publish()), 400, "NaN/Inf", name)
    v = server.get_weight_version()
    assert server.update_weights_from_tensor(good)["weight_version"] == v + 1  # the good one still applies
    refused(server, lambda: server.update_weights_from_tensor(good), 409, "not newer")  # stale: sent twice
    # disk: stale version, a NaN tensor, another config, a mis-shaped tensor, no checkpoint
    pair.save_pretrained(tmp_path / "same")
    refused(server, lambda: server.update_weights_from_disk(tmp_path / "same", weight_version=v), 409, "stale")
    from safetensors.torch import load_file, save_file

    f = next((tmp_path / "same").glob("*.safetensors"))
    tensors = load_file(f)
    key = sorted(tensors)[0]
    bad = dict(tensors, **{key: tensors[key].clone().view(-1).index_fill(0, torch.tensor([0]), float("inf"))
                           .view(tensors[key].shape)})
    (tmp_path / "nan").mkdir()
    (tmp_path / "nan" / "config.json").write_text((tmp_path / "same" / "config.json").read_text())
    save_file(bad, tmp_path / "nan" / f.name)
    refused(server, lambda: server.update_weights_from_disk(tmp_path / "nan"), 400, "NaN/Inf", key)
    (tmp_path / "shape").mkdir()
    (tmp_path / "shape" / "config.json").write_text((tmp_path / "same" / "config.json").read_text())
    save_file(dict(tensors, **{key: tensors[key][:-1].clone()}), tmp_path / "shape" / f.name)
    refused(server, lambda: server.update_weights_from_disk(tmp_path / "shape"), 400, key)
    cfg = json.loads((tmp_path / "same" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    refused(server, lambda: server.update_weights_from_disk(tmp_path / "other"), 400, "config differs", "num_layers")
    refused(server, lambda: server.update_weights_from_disk(tmp_path / "absent"), 400, "not a directory")
    assert_serves_trainer(server, pair, v + 1)


def test_update_from_distributed_over_gloo(server, pair):
    import torch.distributed as dist

    server.init_weights_update_group("127.0.0.1", free_port(), backend="gloo", timeout_s=60)
    try:
        assert dist.get_world_size() == 2 and dist.get_rank() == 0
        pub = server.publisher(pair.trainer.forward_weights)
        v = server.get_weight_version()
        step_weights(pair, seed=6)
        assert server.update_weights_from_distributed(pub.publish())["weight_version"] == v + 1
        assert_serves_trainer(server, pair, v + 1)
        weights = {n: w.clone() for n, w in pair.trainer.forward_weights().items()}
        name = sorted(weights)[-1]
        weights[name].view(-1)[0] = float("nan")
        nan = Publisher(lambda: weights)
        nan.version = v + 1
        refused(server, lambda: server.update_weights_from_distributed(nan.publish()), 400, "NaN/Inf", name)
        step_weights(pair, seed=7)  # the group still carries the next one, a delta
        assert server.update_weights_from_distributed(pub.publish())["weight_version"] == v + 2
        assert_serves_trainer(server, pair, v + 2)
    finally:
        server.destroy_weights_update_group()
    assert not dist.is_initialized()
    with pytest.raises(ServerError) as e:
        server.post("/update_weights_from_distributed", {})
    assert e.value.status == 400 and "no weight update group" in e.value.message


def test_routed_experts_of_an_moe_model(tmp_path):
    """SGLang's encoding: base64 of int32 (positions, layers, top_k), positions [start, prompt + completion - 1)."""
    proc, client = start_server("qwen35_gdn", "--config", "tiny", log_path=tmp_path / "moe.log")
    try:
        assert client.get_model_info()["routed_experts"] is True
        prompt, d = [1, 2, 3, 4], sp_dict(seed=9, max_new=5)
        out = client.generate(prompt, d, return_logprob=True, return_routed_experts=True, routed_experts_start_len=2)
        want = alignzoo.load_pair("qwen35_gdn", config="tiny").server.generate([prompt], ours(d))[0]
        assert out["output_ids"] == want.tokens and torch.equal(output_logprobs(out), want.logprobs)
        ids = want.extras["routed_experts"]  # (positions fed, layers, top_k)
        got = torch.frombuffer(bytearray(base64.b64decode(out["meta_info"]["routed_experts"])), dtype=torch.int32)
        assert torch.equal(got.reshape(-1, *ids.shape[1:]), ids[2:])
        assert got.numel() == (len(prompt) + len(want.tokens) - 1 - 2) * ids.shape[1] * ids.shape[2]
        with pytest.raises(ServerError) as e:
            client.generate(prompt, d, return_routed_experts=True, routed_experts_start_len=5)
        assert e.value.status == 400 and "routed_experts_start_len must be in [0, 4]" in e.value.message
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_index_selections_of_a_dsa_model(tmp_path):
    """glm5's on-request extra over HTTP: return_index_selected gives each full indexer layer's selection, base64
    of int32 (positions from the start, full layers, index_topk), the pair's own; a model without an indexer,
    or a start past the prompt, is a 400 naming it."""
    proc, client = start_server("glm5_sparse_fp8", "--config", "tiny", log_path=tmp_path / "glm5.log")
    try:
        assert client.get_model_info()["index_selected"] is True
        prompt, d = list(range(1, 80)), sp_dict(seed=4, max_new=5)
        out = client.generate(prompt, d, return_logprob=True, return_index_selected=True, index_selected_start_len=3)
        pair = alignzoo.load_pair("glm5_sparse_fp8", config="tiny")
        want = pair.server.generate([prompt], [dataclasses.replace(ours(d), extras=("index_selected",))])[0]
        assert out["output_ids"] == want.tokens and torch.equal(output_logprobs(out), want.logprobs)
        sel = want.extras["index_selected"]  # (positions fed, full layers, top_k)
        got = torch.frombuffer(bytearray(base64.b64decode(out["meta_info"]["index_selected"])), dtype=torch.int32)
        assert torch.equal(got.reshape(-1, *sel.shape[1:]), sel[3:])
        plain = client.generate(prompt, d, return_logprob=True)
        assert "index_selected" not in plain["meta_info"] and plain["output_ids"] == want.tokens
        with pytest.raises(ServerError) as e:
            client.generate(prompt, d, return_index_selected=True, index_selected_start_len=80)
        assert e.value.status == 400 and "index_selected_start_len must be in [0, 79]" in e.value.message
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_index_selections_are_refused_without_an_indexer(server):
    with pytest.raises(ServerError) as e:
        server.generate([1, 2, 3], sp_dict(seed=1, max_new=2), return_index_selected=True)
    assert e.value.status == 400 and "no indexer selections to return" in e.value.message


# ------------------------------------------------------------------ the command
@pytest.mark.parametrize("args, message", [
    (["--port", "0"], "argument --port: a port is in [1, 65535], got 0"),
    (["--port", "http"], "argument --port: expected a port number"),
    (["--host", "no such host!"], "argument --host"),
    (["--host", ""], "argument --host"),
])
def test_cli_refuses_a_bad_port_or_host(capsys, args, message):
    from alignzoo.cli import main

    assert main(["serve", "qwen3", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err


def test_cli_refuses_a_port_in_use(capsys):
    from alignzoo.cli import main

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert main(["serve", "qwen3", "--port", str(s.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot listen on 127.0.0.1" in err, err


def test_bench_http_smoke(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench_http

    report = bench_http.main(["--batch", "4", "--prompt-len", "8", "--new", "4", "--repeats", "1"])
    assert report["tokens"] == 16 and all(report["bitwise_equal"].values())
    assert set(report["ratio"]) == {"batched", "concurrent"} and "tok/s" in capsys.readouterr().out


def test_http_rl_example_is_exact(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "examples"))
    import http_rl

    assert http_rl.main(["--steps", "3", "--prompts", "2", "--group-size", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of" in out and "served weights == the trainer's; server exit status 0" in out
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [2, 3, 4] and all(r["differing_tokens"] == 0 for r in rows)


def test_sigterm_shuts_down_cleanly(served):
    proc, client, log_path = served
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    text = log_path.read_text()
    assert "at http://127.0.0.1:" in text and "alignzoo serve: stopped" in text and "Traceback" not in text
    assert not client.health()


@pytest.mark.gpu
def test_update_from_distributed_over_nccl_on_two_gpus(tmp_path):
    """The NCCL path of /update_weights_from_distributed: the server on cuda:1, the
    trainer's pair on cuda:0 (NCCL refuses two ranks on one GPU), a full payload
    then a delta, each served with the trainer's bits."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices (NCCL refuses two ranks on one GPU)")
    torch.cuda.set_device(0)
    proc, client = start_server("qwen3", "--config", "tiny", "--device", "cuda:1", log_path=tmp_path / "server.log")
    try:
        pair = alignzoo.load_pair("qwen3", config="tiny", device="cuda:0")
        assert client.weights_checksum() == trainer_checksum(pair)
        client.init_weights_update_group("127.0.0.1", free_port(), backend="nccl", timeout_s=120)
        try:
            pub = client.publisher(pair.trainer.forward_weights)
            v = client.get_weight_version()
            for i, seed in enumerate((8, 9), 1):  # the first payload is full, the second a delta
                step_weights(pair, seed=seed)
                assert client.update_weights_from_distributed(pub.publish())["weight_version"] == v + i
                assert_serves_trainer(client, pair, v + i)
        finally:
            client.destroy_weights_update_group()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
