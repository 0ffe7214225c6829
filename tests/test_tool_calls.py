"""Tool calls in /v1/chat/completions (``serve/tools.py``): the parser on strings (Hermes / Qwen3 blocks and
GLM's key/value blocks), the stream's hold-back on every split of the text, and the answers the server
builds (``openai.build`` → ``openai.response`` / ``openai.Stream``) from completions whose tokens spell a
tool call, through a byte-level tokenizer that round-trips any text.  The tiny model cannot be made to
write a call, so the HTTP side (``test_http_text.py``) checks answers to requests with tools are well
formed and that a conversation with calls and tool messages renders."""
from __future__ import annotations

import json
import random

import pytest
import torch

pytest.importorskip("fastapi")

from alignzoo.client import join_stream  # noqa: E402
from alignzoo.common.engine.sequence import Completion  # noqa: E402
from alignzoo.serve import api, openai  # noqa: E402
from alignzoo.serve.api import ApiError  # noqa: E402
from alignzoo.serve.tools import GLM, HERMES, StreamCalls, Tools, parse, template_calls  # noqa: E402

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}]
HERMES_TOOLS = Tools.of(TOOLS, "a Qwen3 template")


def block(name, args, close=True) -> str:
    """A call as Qwen3's template writes one."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args)}}}\n' + ("</tool_call>" if close else "")


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


# ------------------------------------------------------------------ the parser
def test_one_call_after_text():
    content, calls = parse("Let me look.\n" + block("get_weather", {"city": "Paris"}), HERMES_TOOLS)
    assert content == "Let me look.\n" and calls_of(calls) == [("get_weather", {"city": "Paris"})]
    (c,) = calls
    assert set(c) == {"id", "type", "function"} and c["type"] == "function" and c["id"].startswith("call_")
    assert isinstance(c["function"]["arguments"], str)


def test_two_calls_and_nothing_else_is_no_content():
    text = "\n" + block("get_weather", {"city": "Paris", "days": 2}) + "\n" + block("get_time", {}) + "\n"
    content, calls = parse(text, HERMES_TOOLS)
    assert content is None
    assert calls_of(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("bad", [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # JSON cut short
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',                   # no name
    '<tool_call>\n{"name": 7, "arguments": {}}\n</tool_call>',                        # a name not a string
    '<tool_call>\n{"name": "get_weather", "arguments": [1, 2]}\n</tool_call>',       # arguments not an object
    '<tool_call>\n["get_weather"]\n</tool_call>',                                    # not an object
    "<tool_call>" + "[" * 100_000 + "</tool_call>",                                  # deeper than json's stack
    block("send_email", {"to": "x"}),                                                # a tool the request lacks
], ids=["bad-json", "no-name", "name-not-string", "args-not-object", "not-object", "too-deep", "unknown-tool"])
def test_a_block_that_is_not_a_call_of_an_offered_tool_stays_content(bad):
    text = "Sure.\n" + bad
    assert parse(text, HERMES_TOOLS) == (text, [])
    content, calls = parse(text + "\n" + block("get_time", {}), HERMES_TOOLS)  # next to a good call: kept in place
    assert content == text + "\n" and calls_of(calls) == [("get_time", {})]


def test_an_unclosed_last_block_and_arguments_as_json_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n'
    assert calls_of(parse(text, HERMES_TOOLS)[1]) == [("get_weather", {"city": "Paris"})]
    cut = block("get_time", {}) + "\n" + block("get_weather", {"city": "Pa"})[:-16]  # the second cut mid-JSON
    content, calls = parse(cut, HERMES_TOOLS)
    assert calls_of(calls) == [("get_time", {})] and content == cut[cut.index("\n<tool_call>", 5):]


@pytest.mark.parametrize("text", [
    '<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>123</arg_value>\n<arg_key>days</arg_key>\n'
    '<arg_value>3</arg_value>\n</tool_call>',                                                  # GLM-4.5's layout
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>123</arg_value><arg_key>days</arg_key>"
    "<arg_value>3</arg_value></tool_call>",                                                    # GLM-4.7's and 5's
], ids=["glm45", "glm47"])
def test_glm_blocks_take_their_types_from_the_schema(text):
    tools = Tools.of(TOOLS, "{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key>{% endfor %}")
    assert tools.format == GLM and HERMES_TOOLS.format == HERMES
    content, calls = parse("Checking.\n" + text, tools)
    assert content == "Checking.\n" and calls_of(calls) == [("get_weather", {"city": "123", "days": 3})]
    junk = "<tool_call>get_weather\nthe city is Paris</tool_call>"  # text outside the key/value pairs
    assert parse(junk, tools) == (junk, [])
    assert calls_of(parse("<tool_call>get_time</tool_call>", tools)[1]) == [("get_time", {})]


def test_bad_tools_and_tool_calls_are_a_400_naming_the_field():
    with pytest.raises(ApiError, match=r"tools\[1\] must be"):
        Tools.of([TOOLS[0], {"type": "function", "name": "flat"}], "")
    with pytest.raises(ApiError, match=r"messages\[2\].tool_calls\[0\].function.arguments must be a JSON object"):
        template_calls([{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}],
                       "messages[2]")
    with pytest.raises(ApiError, match=r"messages\[2\].tool_calls\[0\] must be"):
        template_calls([{"id": "c", "name": "f"}], "messages[2]")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, {"b": null}]}'}}
    assert template_calls([call], "m")[0]["function"]["arguments"] == {"a": [1, {"b": None}]}
    assert template_calls([{**call, "function": {"name": "f", "arguments": ""}}], "m")[0]["function"]["arguments"] == {}


# ------------------------------------------------------------------ the stream's hold-back
STREAMED = [
    "Let me look.\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {}),
    "\n\n" + block("get_time", {}),
    "No call here, only <tool a mention of <tool_call and text.",
    "Sure.\n" + block("send_email", {"to": "x"}) + "\nthen " + block("get_time", {}),
    "Trailing half a marker <tool_c",
    "   ",
]


@pytest.mark.parametrize("text", STREAMED, ids=["two-calls", "white-space-then-call", "mentions", "unknown-then-call",
                                                "half-marker", "white-space-only"])
def test_streamed_content_is_the_start_of_the_parsed_content_at_every_split(text):
    content, calls = parse(text, HERMES_TOOLS)
    rng = random.Random(0)
    for _ in range(50):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(1, 12))))
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        s, sent = StreamCalls(HERMES_TOOLS), ""
        for p in pieces[:-1]:
            sent += s.running(p)
            first = text.find("<tool_call>")
            assert "<tool_call>" not in sent and (first == -1 or len(sent) <= first)
            assert (content or "").startswith(sent)
        rest, got = s.final(pieces[-1])
        assert sent + rest == (content or "") and calls_of(got) == calls_of(calls)


# ------------------------------------------------------------------ the answers, from tokens that spell a call
QWEN_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{%- for tc in m.tool_calls or [] %}\n<tool_call>\n{\"name\": \"{{ tc.function.name }}\", \"arguments\": "
    "{{ tc.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def byte_tok():
    """Bytes as tokens (byte-level BPE with no merges), so any text round-trips; ``<tool_call>`` and
    ``</tool_call>`` added as plain tokens and ``<|im_end|>`` as the special EOS, as Qwen3's tokenizer has them."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))},
                              merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN_TEMPLATE
    return tok


MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


def spec_of(tok, stream=False, **body):
    limits = api.ModelLimits("toy", len(tok), 4096, lambda n: None, tokenizer=tok)
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 200, "seed": 1, "stream": stream, "logprobs": True,
            **body}
    return openai.build(body, limits, {}, "toy", chat=True)


def completion(tok, spec, text: str, reason: str = "stop"):
    """The engine's Completion of ``text``: ended by EOS (then the EOS id is its last token) or by length."""
    tokens = tok.encode(text) + ([tok.eos_token_id] if reason == "stop" else [])
    return Completion(spec.items[0].prompt, tokens, -torch.arange(len(tokens), dtype=torch.float32) / 64, reason,
                      matched=tok.eos_token_id if reason == "stop" else None)


def answer(tok, text, reason="stop", **body):
    spec = spec_of(tok, **body)
    return openai.response(spec, tok, [(spec.items[0], completion(tok, spec, text, reason), 3)])["choices"][0]


def stream(tok, text, reason="stop", **body) -> list[dict]:
    """The chunks ``openai.Stream`` writes for that completion, its tokens arriving three at a time."""
    spec = spec_of(tok, stream=True, **body)
    s, item, c = openai.Stream(spec, tok), spec.items[0], completion(tok, spec, text, reason)
    lps = c.logprobs.tolist()
    chunks = [s.running(item, c.tokens[:k], lps[:k], 3) for k in range(3, len(c.tokens), 3)]
    return chunks + [s.final(item, c, 3)] + s.closing()


TWO = "I'll check both.\n" + block("get_weather", {"city": "Paris"}) + "\n" + block("get_time", {})


def test_calls_come_back_as_tool_calls_with_finish_reason_tool_calls(byte_tok):
    ch = answer(byte_tok, TWO)
    assert ch["finish_reason"] == "tool_calls" and ch["matched_stop"] == byte_tok.eos_token_id
    assert ch["message"]["role"] == "assistant" and ch["message"]["content"] == "I'll check both.\n"
    assert calls_of(ch["message"]["tool_calls"]) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len(ch["logprobs"]["content"]) == len(byte_tok.encode(TWO)) + 1  # every token's log-prob, EOS included


def test_finish_reason_rules(byte_tok):
    cut = answer(byte_tok, block("get_time", {}), reason="length")  # a whole call, then max_tokens: length
    assert cut["finish_reason"] == "length" and calls_of(cut["message"]["tool_calls"]) == [("get_time", {})]
    plain = answer(byte_tok, "It is sunny.")
    assert plain["finish_reason"] == "stop" and plain["message"] == {"role": "assistant", "content": "It is sunny."}
    bad = answer(byte_tok, "Hm.\n" + block("send_email", {}))
    assert bad["finish_reason"] == "stop" and bad["message"]["content"] == "Hm.\n" + block("send_email", {})
    for body in ({"tools": None}, {"tool_choice": "none"}):  # no tools offered, or calls turned off: text as it is
        ch = answer(byte_tok, TWO, **body)
        assert ch["finish_reason"] == "stop" and ch["message"] == {"role": "assistant", "content": TWO}


def test_a_stream_holds_the_calls_back_and_sends_them_with_the_last_chunk(byte_tok):
    chunks = stream(byte_tok, TWO, stream_options={"include_usage": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0]["role"] == "assistant" and all("tool_calls" not in d for d in deltas[:-1])
    assert "".join(d["content"] for d in deltas[:-1]) + deltas[-1]["content"] == "I'll check both.\n"
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    assert chunks[-1]["usage"]["completion_tokens"] == len(byte_tok.encode(TWO)) + 1
    calls = last["delta"]["tool_calls"]
    assert [c["index"] for c in calls] == [0, 1] and all(set(c) == {"index", "id", "type", "function"} for c in calls)
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    (joined,) = join_stream(chunks)
    plain = answer(byte_tok, TWO)
    assert joined["text"] == plain["message"]["content"] and joined["finish_reason"] == plain["finish_reason"]
    assert calls_of(joined["tool_calls"]) == calls_of(plain["message"]["tool_calls"])
    assert joined["logprobs"]["content"] == plain["logprobs"]["content"]
    cut = stream(byte_tok, block("get_time", {}), reason="length")[-1]["choices"][0]
    assert cut["finish_reason"] == "length" and calls_of(cut["delta"]["tool_calls"]) == [("get_time", {})]
    none = stream(byte_tok, "No call: <tool_c")
    assert join_stream(none)[0]["text"] == "No call: <tool_c" and "tool_calls" not in join_stream(none)[0]


def test_a_conversation_sends_the_calls_back_as_the_model_wrote_them(byte_tok):
    """The answer's calls (arguments as JSON text, as OpenAI's clients send them) and the tools' results go
    back in the next request; the template renders the calls exactly as the model wrote them."""
    ch = answer(byte_tok, block("get_weather", {"city": "Paris"}))
    (call,) = ch["message"]["tool_calls"]
    history = MESSAGES + [{"role": "assistant", "content": ch["message"]["content"], "tool_calls": [call]},
                          {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"}]
    prompt = byte_tok.decode(spec_of(byte_tok, messages=history).prompts[0])
    assert "<|im_start|>assistant\n" + block("get_weather", {"city": "Paris"}) + "<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>tool\nsunny, 21 C<|im_end|>\n<|im_start|>assistant\n")
    ch2 = answer(byte_tok, "It is sunny in Paris.", messages=history)
    assert ch2["message"] == {"role": "assistant", "content": "It is sunny in Paris."}
