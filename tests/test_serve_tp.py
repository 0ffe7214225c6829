"""``alignzoo serve qwen3 --config tiny --tp 2`` over real HTTP: two gloo ranks in lockstep behind rank 0's
server answer /generate with the output ids and FP32 log-probs of ``--tp 1`` (the same JSON values) and of
the one-device trainer, for a mixed batch of odd-length prompts under the four sampling transforms, for
requests that arrive while others decode, and after an abort.  Weight updates are refused with a 400;
a model without a TP plan and a degree that does not divide the heads are refused before any process
starts; a rank killed mid-request ends the request with the error and rank 0 exits 1."""
from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

import alignzoo  # noqa: E402
from alignzoo import cli  # noqa: E402
from alignzoo.client import ServerError, output_logprobs  # noqa: E402
from alignzoo.serve.tp_launch import tp_plan_of  # noqa: E402
from test_http import ours, start_server  # noqa: E402

LENS = (63, 5, 129, 1, 17)  # odd prompt lengths, one batch
SP = [{"temperature": 0.9, "top_k": 40, "top_p": 0.9, "min_p": 0.05, "max_new_tokens": 9, "sampling_seed": 1},
      {"temperature": 1.3, "top_p": 0.8, "max_new_tokens": 6, "sampling_seed": 2},
      {"temperature": 0.6, "top_k": 7, "min_p": 0.1, "max_new_tokens": 11, "sampling_seed": 3},
      {"temperature": 0.0, "max_new_tokens": 4, "sampling_seed": 4},
      {"temperature": 1.0, "min_p": 0.2, "max_new_tokens": 13, "sampling_seed": 5, "ignore_eos": True}]


def prompts(seed: int, lens=LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 151, (n,), generator=g).tolist() for n in lens]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """--tp 1 and --tp 2, started side by side."""
    logs = tmp_path_factory.mktemp("serve_tp")
    with ThreadPoolExecutor(2) as ex:
        started = list(ex.map(lambda tp: start_server("qwen3", "--config", "tiny", "--tp", str(tp),
                                                      log_path=logs / f"tp{tp}.log"), (1, 2)))
    yield {1: started[0][1], 2: started[1][1], "proc": started[1][0]}
    for proc, _ in started:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


@pytest.fixture(scope="module")
def pair():
    return alignzoo.load_pair("qwen3", config="tiny")


def answers(client, seed: int) -> list[dict]:
    return client.generate(prompts(seed), SP, return_logprob=True)


def same(a: dict, b: dict) -> bool:
    """output ids and log-probs, JSON value for JSON value"""
    return (a["output_ids"] == b["output_ids"] and a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]
            and a["meta_info"]["output_token_logprobs"] == b["meta_info"]["output_token_logprobs"])


def test_tp2_equals_tp1_and_the_trainer(servers, pair):
    one, two = answers(servers[1], 11), answers(servers[2], 11)
    assert len(two) == len(LENS)
    for a, b in zip(one, two):
        assert same(a, b)
    for p, d, b in zip(prompts(11), SP, two):
        lp = pair.trainer.logprobs([p + b["output_ids"]], [len(p)], ours(d))[0].detach()
        assert len(b["output_ids"]) > 0 and torch.equal(lp, output_logprobs(b))
    assert servers[2].get_server_info()["tp"] == 2


def test_requests_arriving_while_others_decode(servers):
    """Four clients at once: requests join the engine between steps; every rank admits them in step."""
    def run(client):
        with ThreadPoolExecutor(4) as ex:
            return list(ex.map(lambda s: answers(client, s), (21, 22, 23, 24)))

    for batch_one, batch_two in zip(run(servers[1]), run(servers[2])):
        assert all(same(a, b) for a, b in zip(batch_one, batch_two))


def test_abort_then_generate(servers):
    """An abort ends the request on every rank: the next answers are still --tp 1's."""
    two = servers[2]
    long = threading.Thread(target=lambda: two.generate([1, 2, 3], {"max_new_tokens": 3000, "ignore_eos": True},
                                                        rid="long"))
    long.start()
    while two.get_server_info()["num_running_reqs"] == 0:
        time.sleep(0.02)
    assert two.post("/abort_request", {"rid": "long"})["num_aborted"] == 1
    long.join(30)
    assert all(same(a, b) for a, b in zip(answers(servers[1], 31), answers(two, 31)))


def test_pause_retract_continue(servers):
    """A retract frees every rank's pages mid-generation; continued, the completion is --tp 1's unpaused one."""
    two, body = servers[2], ([5, 6, 7, 8, 9], {**SP[0], "max_new_tokens": 150, "ignore_eos": True})
    out = {}
    req = threading.Thread(target=lambda: out.update(two.generate(*body, return_logprob=True)))
    req.start()
    while two.get_server_info()["num_running_reqs"] == 0:
        time.sleep(0.02)
    assert "retract" in two.pause_generation("retract")["message"]
    info = two.get_server_info()
    assert two.continue_generation()["success"]
    req.join(60)
    assert info["num_in_flight"] == 1 and info["num_running_reqs"] == 0
    assert same(servers[1].generate(*body, return_logprob=True), out)


def test_weight_updates_refused(servers):
    for path, body in (("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]}),
                       ("/update_weights_from_disk", {"model_path": "/tmp"}),
                       ("/init_weights_update_group", {})):
        with pytest.raises(ServerError, match=r"not served under --tp 2: each rank holds only its shards") as e:
            servers[2].post(path, body)
        assert e.value.status == 400
    with pytest.raises(ServerError, match="not served under --tp 2"):
        servers[2].get("/get_weights_checksum")


def no_plan() -> str:
    """A registered model whose parallelize.py has no tp_plan (the first, as plans are added)."""
    for m in alignzoo.list_models():
        try:
            tp_plan_of(m)
        except ValueError:
            return m
    pytest.skip("every registered model declares a tp_plan")


@pytest.mark.parametrize("args, why", [
    (lambda: [no_plan(), "--tp", "2"], r"(\w+) declares no tensor-parallel plan .* models with a tp_plan: .*qwen3"),
    (["qwen3", "--config", "tiny", "--tp", "3"], "--tp 3 on qwen3: TP = 3 does not fit 4 q heads"),
    (["qwen3", "--config", "tiny", "--tp", "8"], "--tp 8 on qwen3: TP = 8 does not divide 4 q heads"),
], ids=["no-plan", "tp3-heads", "tp8-heads"])
def test_refused_before_any_process_starts(args, why, monkeypatch, capsys):
    def no_process(*a, **k):
        raise AssertionError("a process was started")

    monkeypatch.setattr(torch.multiprocessing, "get_context", no_process)
    monkeypatch.setattr("torch.distributed.init_process_group", no_process)
    args = args() if callable(args) else args
    assert cli.main(["serve", *args, "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert re.search(why, err) and args[0] in err, err


def test_a_killed_rank_fails_the_request_and_rank_0_exits_1(servers):
    """Last: it ends the --tp 2 server."""
    two, proc = servers[2], servers["proc"]
    rank1 = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
    out = {}
    req = threading.Thread(target=lambda: out.update(two.generate(
        [1, 2, 3], {"max_new_tokens": 3000, "ignore_eos": True}, return_logprob=True)))
    req.start()
    while two.get_server_info()["num_running_reqs"] == 0:
        time.sleep(0.02)
    os.kill(rank1, signal.SIGKILL)
    req.join(30)
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "the tensor-parallel engine stopped (a rank died" in reason["message"]
    assert proc.wait(30) == 1


def test_a_hung_rank_times_out(tmp_path):
    """A rank that stops answering (SIGSTOP) fails the request once --tp-timeout (3 s) passes; rank 0 exits 1."""
    proc, client = start_server("qwen3", "--config", "tiny", "--tp", "2", "--tp-timeout", "3",
                                log_path=tmp_path / "hung.log")
    rank1 = int(open(f"/proc/{proc.pid}/task/{proc.pid}/children").read().split()[0])
    try:
        os.kill(rank1, signal.SIGSTOP)
        t0 = time.monotonic()
        reason = client.generate([1, 2, 3], {"max_new_tokens": 5})["meta_info"]["finish_reason"]
        assert reason["type"] == "abort" and "the tensor-parallel engine stopped" in reason["message"]
        assert "Timed out" in reason["message"] and 2.5 < time.monotonic() - t0 < 20
        assert proc.wait(30) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            os.kill(rank1, signal.SIGKILL)
        except ProcessLookupError:
            pass
