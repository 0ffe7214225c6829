"""``alignzoo serve`` on a checkpoint that ships a tokenizer, a chat template and a generation_config.json
(``text_toys.py``), behind an API key and an admin key, over real HTTP on 127.0.0.1: text in and out of
/generate, EOS and stop strings as SGLang has them, the OpenAI-compatible API (chat, completions,
streaming), and who may call what.  Every log-prob that comes back is checked against the trainer's with
``torch.equal`` on FP32, and against this process's engine on the same checkpoint."""
from __future__ import annotations

import http.client
import json
import logging
import os

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from test_http import assert_same_as_in_process, ours, start_server, step_weights, trainer_checksum  # noqa: E402
from text_toys import END, EOS, find_eos_seed, trainer_logprobs, write_checkpoint  # noqa: E402

import alignzoo  # noqa: E402
from alignzoo import SamplingParams  # noqa: E402
from alignzoo.client import Client, ServerError, choice_logprobs, join_stream, output_logprobs  # noqa: E402
from alignzoo.serve import ADMIN_ROUTES  # noqa: E402

KEY, ADMIN = "test-key-0123", "admin-key-4567"
DEFAULTS = {"temperature": 0.9, "top_k": 40, "top_p": 0.95}  # text_toys' generation_config.json


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    write_checkpoint(root / "ckpt")
    (root / "allowed").mkdir()
    (root / "outside").mkdir()
    return root


@pytest.fixture(scope="module")
def served(root):
    # the API key from the environment, the admin key from the command line
    proc, client = start_server("qwen3", "--checkpoint", str(root / "ckpt"), "--admin-api-key", ADMIN,
                                "--weights-dir", str(root / "allowed"), log_path=root / "server.log", api_key=KEY,
                                env={"ALIGNZOO_API_KEY": KEY})
    yield proc, client
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def server(served) -> Client:
    return served[1]


@pytest.fixture(scope="module")
def admin(server) -> Client:
    return Client(server.url, timeout=120, api_key=KEY, admin_api_key=ADMIN)


@pytest.fixture(scope="module")
def pair(root):
    return alignzoo.load_pair("qwen3", checkpoint=root / "ckpt", num_pages=256)


@pytest.fixture(scope="module")
def tok(pair):
    return pair.tokenizer


def rejected(fn, status, *words):
    with pytest.raises(ServerError) as e:
        fn()
    assert e.value.status == status and all(w in e.value.message for w in words), e.value.message


def chat_ids(tok, messages, tools=None):
    return list(tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                        return_dict=False))


# ------------------------------------------------------------------ /generate with text
def test_text_in_text_out(server, pair, tok):
    d = {"max_new_tokens": 10, "sampling_seed": 5, "temperature": 0.8, "top_k": 30, "ignore_eos": True}
    out = server.generate_text("hello world the cat", d, return_logprob=True)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)
    assert_same_as_in_process(pair, tok.encode("hello world the cat"), d, out)
    assert server.get_model_info()["eos_token_ids"] == [EOS, END]


def test_a_text_stream_is_cumulative_and_ends_as_the_plain_answer(server, tok):
    d = {"max_new_tokens": 12, "sampling_seed": 9, "ignore_eos": True}
    chunks = list(server.stream("/generate", {"text": "the dog", "sampling_params": d, "stream": True,
                                              "return_logprob": True}))
    plain = server.generate_text("the dog", d, return_logprob=True)
    assert len(chunks) > 2
    for a, b in zip(chunks, chunks[1:]):
        assert b["text"].startswith(a["text"]) and b["output_ids"][:len(a["output_ids"])] == a["output_ids"]
    assert chunks[-2]["text"] == tok.decode(chunks[-2]["output_ids"], skip_special_tokens=True)
    assert chunks[-1]["text"] == plain["text"] and chunks[-1]["output_ids"] == plain["output_ids"]
    assert torch.equal(output_logprobs(chunks[-1]), output_logprobs(plain))


def test_a_batch_of_texts_is_the_same_prompts_as_ids(server, tok):
    texts = ["hello world", "the cat sat on the mat", "reverse 1 2 3"]
    ds = [{"max_new_tokens": 6 + i, "sampling_seed": 20 + i, "n": 2} for i in range(3)]
    by_text = server.generate_text(texts, ds, return_logprob=True)
    by_ids = server.generate([tok.encode(t) for t in texts], ds, return_logprob=True)
    assert len(by_text) == len(by_ids) == 6
    for a, b in zip(by_text, by_ids):
        assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
        assert torch.equal(output_logprobs(a), output_logprobs(b))
        assert a["meta_info"]["finish_reason"] == b["meta_info"]["finish_reason"]


def test_eos_stops_without_stop_token_ids_and_ignore_eos_runs_on(server, pair, tok):
    prompt = tok.encode("hello world the cat")
    seed, long, at = find_eos_seed(pair, prompt)
    d = {"max_new_tokens": 24, "sampling_seed": seed}  # SamplingParams' defaults, as find_eos_seed samples
    out = server.generate(prompt, d, return_logprob=True)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": long.tokens[at]}
    assert out["output_ids"] == long.tokens[:at + 1]
    assert out["text"] == tok.decode(long.tokens[:at], skip_special_tokens=True)
    assert_same_as_in_process(pair, prompt, d, out)  # and the trainer's bits
    on = server.generate(prompt, {**d, "ignore_eos": True}, return_logprob=True)
    assert on["output_ids"] == long.tokens and on["meta_info"]["finish_reason"] == {"type": "length", "length": 24}
    assert torch.equal(output_logprobs(on), long.logprobs)
    assert_same_as_in_process(pair, prompt, {**d, "ignore_eos": True}, on)


def test_stop_strings_trim_the_text_not_the_tokens(server, pair, tok):
    prompt, d = tok.encode("reverse 1 2 3"), {"max_new_tokens": 20, "sampling_seed": 3, "ignore_eos": True}
    full = server.generate(prompt, d, return_logprob=True)
    words = tok.convert_ids_to_tokens(full["output_ids"])
    k = next(i for i in range(3, 15) if words[i] not in words[:i] and words[i + 1] not in words[:i + 1]
             and full["output_ids"][i] not in tok.all_special_ids
             and full["output_ids"][i + 1] not in tok.all_special_ids)
    stop = f"{words[k]} {words[k + 1]}"
    out = server.generate(prompt, {**d, "stop": [stop]}, return_logprob=True)
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == full["output_ids"][:k + 2]  # every sampled token, log-prob and all
    text = tok.decode(out["output_ids"], skip_special_tokens=True)
    assert out["text"] == text[:text.find(stop)] and stop not in out["text"]
    assert_same_as_in_process(pair, prompt, {**d, "stop": [stop]}, out)
    kept = server.generate(prompt, {**d, "stop": stop, "no_stop_trim": True})
    assert kept["text"] == text and kept["text"].endswith(stop)


# ------------------------------------------------------------------ the OpenAI-compatible API
MESSAGES = [{"role": "system", "content": "you are good"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": "cat"}]},
            {"role": "assistant", "content": "the cat sat on the mat"},
            {"role": "user", "content": "reverse 1 2 3 please"}]


def as_template_takes(messages):
    return [{**m, "content": m["content"] if isinstance(m["content"], str) else
             "\n".join(p["text"] for p in m["content"])} for m in messages]


def test_chat_prompt_is_the_template_and_logprobs_are_the_trainers(server, pair, tok):
    ans = server.chat(MESSAGES, max_tokens=12, n=2, seed=11, logprobs=True, return_token_ids=True)
    prompt = chat_ids(tok, as_template_takes(MESSAGES))
    assert ans["prompt_token_ids"] == prompt and ans["usage"]["prompt_tokens"] == len(prompt)
    assert ans["metadata"]["sampling_params"] == {**DEFAULTS, "min_p": 0.0, "seed": 11}  # generation_config.json's
    assert ans["object"] == "chat.completion" and len(ans["choices"]) == 2
    for j, ch in enumerate(ans["choices"]):
        sp = SamplingParams(**DEFAULTS, max_new_tokens=12, seed=11 + j)
        tokens, lps = ch["token_ids"], choice_logprobs(ch)
        assert lps.dtype == torch.float32 and len(lps) == len(tokens) > 0
        assert torch.equal(trainer_logprobs(pair, prompt, tokens, sp), lps)  # the contract, through the chat door
        want = pair.server.generate([prompt], sp)[0]
        assert want.tokens == tokens and torch.equal(want.logprobs, lps)
        body = tokens[:-1] if ch["finish_reason"] == "stop" else tokens
        assert ch["message"] == {"role": "assistant", "content": tok.decode(body, skip_special_tokens=True)}
        assert [e["token"] for e in ch["logprobs"]["content"]] == [tok.decode([t]) for t in tokens]


def test_completions_take_text_and_ids(server, pair, tok):
    ans = server.completions(["hello world", [9, 10, 11]], max_tokens=5, n=2, seed=4, logprobs=0, temperature=1.0,
                             top_k=-1, top_p=1.0, min_p=0.05, return_token_ids=True)
    assert [c["index"] for c in ans["choices"]] == [0, 1, 2, 3]
    for i, ch in enumerate(ans["choices"]):
        prompt = [tok.encode("hello world"), [9, 10, 11]][i // 2]
        assert ch["prompt_token_ids"] == prompt
        sp = SamplingParams(min_p=0.05, max_new_tokens=5, seed=4 + i % 2)
        assert torch.equal(trainer_logprobs(pair, prompt, ch["token_ids"], sp), choice_logprobs(ch))
        assert ch["logprobs"]["tokens"] == [tok.decode([t]) for t in ch["token_ids"]]
    assert ans["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in ans["choices"])


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_streaming_returns_what_the_plain_answer_does(server, tok, chat):
    plain_kw = {"max_tokens": 16, "n": 2, "seed": 8, "ignore_eos": True, "logprobs": True if chat else 0,
                "return_token_ids": True}
    call = (lambda **kw: server.chat(MESSAGES, **kw)) if chat else (lambda **kw: server.completions("the dog", **kw))
    first = call(**plain_kw)["choices"][0]
    words = tok.convert_ids_to_tokens(first["token_ids"])
    stop = f"{words[6]} {words[7]}"  # a stop string spanning two tokens: its first word is held back in the stream
    kw = {**plain_kw, "stop": [stop]}
    plain = call(**kw)
    stream = server.chat_stream(MESSAGES, **kw, stream_options={"include_usage": True}) if chat else \
        server.completions_stream("the dog", **kw, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
    assert len(chunks) > 4
    for got, want in zip(join_stream(chunks), plain["choices"]):
        assert got["text"] == (want["message"]["content"] if chat else want["text"])
        assert got["token_ids"] == want["token_ids"] and torch.equal(choice_logprobs(got), choice_logprobs(want))
        assert (got["finish_reason"], got["matched_stop"]) == (want["finish_reason"], want["matched_stop"])
    assert plain["choices"][0]["matched_stop"] == stop


TOOLS = [{"type": "function", "function": {"name": "reverse", "description": "reverse the digits",
                                           "parameters": {"type": "object",
                                                          "properties": {"digits": {"type": "string"}}}}}]


def test_a_chat_with_tools_answers_well_formed_plain_and_streamed(server, pair, tok):
    """The tiny model cannot write a call (``tests/test_tool_calls.py`` checks the answers to calls): with
    tools, the prompt is the template's with them, each choice is a well-formed message, its log-probs the
    trainer's, and the stream joins to the plain answer."""
    kw = {"max_tokens": 12, "n": 3, "seed": 5, "logprobs": True, "return_token_ids": True, "tools": TOOLS,
          "tool_choice": "auto"}
    ans = server.chat(MESSAGES, **kw)
    prompt = chat_ids(tok, as_template_takes(MESSAGES), TOOLS)
    assert ans["prompt_token_ids"] == prompt and prompt != chat_ids(tok, as_template_takes(MESSAGES))
    for j, ch in enumerate(ans["choices"]):
        msg, tokens = ch["message"], ch["token_ids"]
        assert msg["role"] == "assistant" and set(msg) <= {"role", "content", "tool_calls"}
        for call in msg.get("tool_calls", []):
            assert call["id"].startswith("call_") and call["type"] == "function"
            assert call["function"]["name"] == "reverse" and isinstance(json.loads(call["function"]["arguments"]), dict)
        if "tool_calls" not in msg:
            body = tokens[:-1] if ch["finish_reason"] == "stop" else tokens
            assert ch["finish_reason"] in ("stop", "length")
            assert msg["content"] == tok.decode(body, skip_special_tokens=True)
        sp = SamplingParams(**DEFAULTS, max_new_tokens=12, seed=5 + j)
        assert torch.equal(trainer_logprobs(pair, prompt, tokens, sp), choice_logprobs(ch))
    for got, want in zip(join_stream(server.chat_stream(MESSAGES, **kw)), ans["choices"]):
        assert got["text"] == (want["message"]["content"] or "") and got["token_ids"] == want["token_ids"]
        assert got["finish_reason"] == want["finish_reason"] and "tool_calls" not in got
        assert torch.equal(choice_logprobs(got), choice_logprobs(want))


def test_a_conversation_with_tool_calls_and_results_renders(server, tok):
    """An assistant's calls come back with their arguments as JSON text (OpenAI's clients send them so);
    the template, which iterates them as a dict (GLM's does), gets a dict."""
    call = {"id": "call_1", "type": "function", "function": {"name": "reverse", "arguments": '{"digits": "1 2 3"}'}}
    history = [{"role": "user", "content": "reverse 1 2 3 please"},
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": "3 2 1"}]
    ans = server.chat(history, tools=TOOLS, max_tokens=4, seed=2, return_token_ids=True)
    as_dict = {**call, "function": {"name": "reverse", "arguments": {"digits": "1 2 3"}}}
    want = chat_ids(tok, [history[0], {**history[1], "tool_calls": [as_dict]}, history[2]], TOOLS)
    assert ans["prompt_token_ids"] == want
    shown = tok.decode(want)  # "<tool_call>" is no word of the toy vocabulary: <unk>s around the call
    assert " reverse digits 1 2 3 " in shown and shown.endswith("<|tool|> 3 2 1 <|end|> <|assistant|>")
    assert ans["choices"][0]["finish_reason"] in ("stop", "length")


def test_v1_models(server):
    models = server.models()
    assert models["object"] == "list" and models["data"][0]["id"].endswith("ckpt")
    assert models["data"][0]["max_model_len"] == 4096


LONG = " ".join(["hello"] * 4200)  # 4200 tokens: past the 4096 positions
BAD = [
    ("/generate", {"text": LONG}, "text: the prompt is 4200 tokens; the model's context is 4096 positions"),
    ("/generate", {"text": "hi", "input_ids": [1]}, "give text or input_ids, not both"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": [""]}}, "sampling_params.stop: stop[0] is empty"),
    ("/generate", {"text": "hi", "sampling_params": {"stop": "x" * 600}}, "sampling_params.stop: stop[0] is 600"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages: the prompt is 42"),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "hi"}]}, "messages[0].role: unknown role"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "content": "hi"}]},
     "messages: the chat template failed: TemplateError: the conversation must start"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]: only text parts"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop": ""}, "stop: stop[0] is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3},
     "top_logprobs = 3 is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "presence_penalty": 0.5},
     "presence_penalty = 0.5 is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logit_bias": {"5": 2.0}},
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1},
     "frobnicate: extra inputs are not permitted"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"name": "flat"}]},
     "tools[0] must be {type: function, function: {name, parameters}}"),
    ("/v1/chat/completions", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                              "function": {"name": "reverse", "arguments": "{1 2"}}]}]},
     "messages[1].tool_calls[0].function.arguments must be a JSON object or its JSON text"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 2}, "logprobs = 2 is not supported"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo"),
    ("/v1/completions", {"prompt": [1, 151]}, "prompt: token id 151 at index 1 is outside the vocabulary"),
]


@pytest.mark.parametrize("path, body, message", BAD, ids=[f"{p.split('/')[-1]}-{m.split(':')[0][:24]}"
                                                         for p, _, m in BAD])
def test_bad_input_is_a_400_naming_the_field(server, path, body, message):
    rejected(lambda: server.post(path, body), 400, message)


def test_the_server_keeps_serving_after_bad_input(server, pair, tok):
    for path, body, _ in BAD[:8]:
        with pytest.raises(ServerError):
            server.post(path, body)
    ans = server.chat([{"role": "user", "content": "hello"}], max_tokens=4, seed=1, logprobs=True,
                      return_token_ids=True)
    prompt = chat_ids(tok, [{"role": "user", "content": "hello"}])
    sp = SamplingParams(**DEFAULTS, max_new_tokens=4, seed=1)
    assert torch.equal(trainer_logprobs(pair, prompt, ans["choices"][0]["token_ids"], sp),
                       choice_logprobs(ans["choices"][0]))


# ------------------------------------------------------------------ who may call it
GETS = ["/health", "/health_generate", "/get_model_info", "/get_server_info", "/get_weight_version",
        "/get_weights_checksum", "/v1/models", "/flush_cache", "/no/such/route"]
POSTS = {"/generate": {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
         "/v1/completions": {"prompt": "hello", "max_tokens": 2},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
         "/update_weights_from_disk": {"model_path": "ALLOWED"},
         "/update_weights_from_tensor": {"serialized_named_tensors": ["x"]},
         "/init_weights_update_group": {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                                        "world_size": 2, "backend": "gloo"},
         "/update_weights_from_distributed": {}, "/destroy_weights_update_group": {},
         "/pause_generation": {"mode": "abort"}, "/continue_generation": {}, "/abort_request": {"abort_all": True},
         "/flush_cache": {}}


def raw(server, method, path, body=None, key=None):
    conn = http.client.HTTPConnection(server.host, server.port, timeout=30)
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = key
    conn.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data


def test_no_key_or_a_wrong_one_is_a_401_on_every_route_and_changes_nothing(server, admin, pair, root):
    pair.save_pretrained(root / "allowed" / "same")  # a good update, were the key right
    before = (admin.get_weight_version(), admin.weights_checksum())
    calls = [("GET", p, None) for p in GETS] + [("POST", p, b) for p, b in POSTS.items()]
    for method, path, body in calls:
        if body and body.get("model_path") == "ALLOWED":
            body = {"model_path": str(root / "allowed" / "same")}
        for key in (None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer"):
            status, data = raw(server, method, path, body, key)
            assert status == 401, (method, path, key, status, data)
            assert json.loads(data)["error"]["message"].startswith(("missing API key", "wrong API key"))
        if path in ADMIN_ROUTES:
            status, data = raw(server, method, path, body, f"Bearer {KEY}")  # the API key is not the admin key
            assert status == 401 and b"needs the admin API key" in data, (path, data)
    assert (admin.get_weight_version(), admin.weights_checksum()) == before
    info = admin.get_server_info()
    assert info["paused"] is None and info["weight_update_group"] is None
    assert raw(server, "GET", "/get_weight_version", key=f"Bearer {KEY}")[0] == 200
    assert raw(server, "GET", "/get_weight_version", key=f"bearer {ADMIN}")[0] == 200  # the admin key opens all


def test_serve_refuses_an_open_bind_beyond_loopback(capsys, caplog):
    from alignzoo.cli import main
    from alignzoo.serve.server import access, is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("localhost") and not is_loopback("0.0.0.0")
    env = {k: os.environ.pop(k) for k in ("ALIGNZOO_API_KEY", "ALIGNZOO_ADMIN_API_KEY") if k in os.environ}
    try:
        assert main(["serve", "qwen3", "--host", "0.0.0.0"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "no API key is set" in err and "--allow-unauthenticated" in err, err
        assert main(["serve", "qwen3", "--api-key", "has space"]) == 2
        assert "--api-key" in capsys.readouterr().err
        with caplog.at_level(logging.WARNING, logger="alignzoo.serve"):
            keys = access("0.0.0.0", None, None, allow_unauthenticated=True)
        assert keys.api_key is None and any("WARNING" in r.getMessage() for r in caplog.records)
        assert access("0.0.0.0", "k", None, False).api_key == "k"
    finally:
        os.environ.update(env)


def test_disk_updates_read_only_under_the_allowed_directories(server, admin, pair, root):
    v = admin.get_weight_version()
    step_weights(pair, seed=11)
    pair.save_pretrained(root / "outside" / "v2")
    rejected(lambda: admin.update_weights_from_disk(root / "outside" / "v2"), 403, "outside the allowed")
    (root / "allowed" / "link").symlink_to(root / "outside" / "v2")
    rejected(lambda: admin.update_weights_from_disk(root / "allowed" / "link"), 403, "outside the allowed")
    (root / "allowed" / "files").mkdir()
    for f in (root / "outside" / "v2").iterdir():
        (root / "allowed" / "files" / f.name).symlink_to(f)
    rejected(lambda: admin.update_weights_from_disk(root / "allowed" / "files"), 403, "links outside")
    assert admin.get_weight_version() == v
    pair.save_pretrained(root / "allowed" / "v2")
    assert admin.update_weights_from_disk(root / "allowed" / "v2")["weight_version"] == v + 1
    assert admin.weights_checksum() == trainer_checksum(pair)
    prompt, d = pair.tokenizer.encode("hello cat"), {"max_new_tokens": 8, "sampling_seed": 2, "ignore_eos": True}
    assert_same_as_in_process(pair, prompt, d, server.generate(prompt, d, return_logprob=True))
    assert ours(d).ignore_eos


def test_http_chat_rl_example_is_exact(tmp_path, capsys):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
    import http_chat_rl

    assert http_chat_rl.main(["--steps", "2", "--episodes", "2", "--group-size", "3", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0 of" in out and "served weights == the trainer's; server exit status 0" in out
    rows = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["weight_version"] for r in rows] == [2, 3] and all(r["differing_tokens"] == 0 for r in rows)
    assert all(r["tokens"] > 0 for r in rows)
