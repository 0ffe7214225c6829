"""Tool calls in ``/v1/chat/completions``: parsed out of a completion's text, and an assistant message's
calls put back as chat templates take them.

The text holds a call in the format the checkpoint's chat template writes one (so the model was
trained to write it).  Hermes, Qwen2.5's and Qwen3's: a JSON object per block,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

GLM-4.5 to GLM-5's (a template that holds ``<arg_key>``): the name, then each argument as a key and a
value, a value JSON unless the tool's schema types it a string,

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

A block is a call when it parses (Hermes: a JSON object with a string ``name`` and object
``arguments``) and names one of the request's tools; the last block may lack its closing tag (a model
that ends its turn after the JSON).  Any other block (JSON that does not parse, no name, a tool the
request did not offer) stays in the content where it stood: a model's slip comes back as its text,
never as a call of a tool that does not exist.  The content is the text outside the calls, less the
white space between and after them (None when nothing else is left).  The markers must survive
decoding: Qwen3's are not special tokens; a tokenizer that marks them special needs
``skip_special_tokens: false``.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .api import ApiError, _short

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES, GLM = "hermes", "glm"
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@dataclass(frozen=True)
class Tools:
    """What a request offers: each tool's parameters schema by name, and the format its template writes."""
    params: dict[str, dict]
    format: str = HERMES

    @classmethod
    def of(cls, tools: list, chat_template) -> Tools:
        params = {}
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise ApiError(400, f"tools[{i}] must be {{type: function, function: {{name, parameters}}}}, got "
                                    f"{_short(t)}")
            params[fn["name"]] = fn.get("parameters") if isinstance(fn.get("parameters"), dict) else {}
        return cls(params, GLM if "<arg_key>" in str(chat_template or "") else HERMES)


def _blocks(text: str):
    """(start, end, body) of each block; the last runs to the end of the text if unclosed."""
    at = 0
    while (start := text.find(OPEN, at)) != -1:
        close = text.find(CLOSE, start)
        body_end, at = (len(text), len(text)) if close == -1 else (close, close + len(CLOSE))
        yield start, at, text[start + len(OPEN):body_end]


def _json(s: str):
    try:
        return json.loads(s)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        return None


def _hermes(body: str, params: dict) -> tuple[str, dict] | None:
    call = _json(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", {})
    args = _json(args) if isinstance(args, str) else args  # a model that writes them as JSON text
    return (call["name"], args) if isinstance(args, dict) else None


def _glm(body: str, params: dict) -> tuple[str, dict] | None:
    name, _, _ = body.partition("<arg_key>")
    if _GLM_ARG.sub("", body[len(name):]).strip():
        return None
    name = name.strip()
    props = params.get(name, {}).get("properties") or {}
    args = {}
    for key, raw in _GLM_ARG.findall(body):
        typed = props.get(key.strip()) if isinstance(props, dict) else None
        as_json = None if isinstance(typed, dict) and typed.get("type") == "string" else _json(raw)
        args[key.strip()] = raw if as_json is None else as_json
    return name, args


def parse(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content, tool_calls) of a completion's text: the calls in OpenAI's shape, ``{id: call_<hex>, type:
    function, function: {name, arguments: JSON text}}``; none found: (text, [])."""
    read = _glm if tools.format == GLM else _hermes
    calls, kept, at = [], [], 0
    for start, end, body in _blocks(text):
        call = read(body, tools.params)
        if call is None or call[0] not in tools.params:
            continue
        kept.append(text[at:start])
        at = end
        calls.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call[0], "arguments": json.dumps(call[1], ensure_ascii=False)}})
    if not calls:
        return text, []
    kept.append(text[at:])
    content = kept[0] + "".join(s for s in kept[1:] if s.strip())
    return (content if content.strip() else None), calls


def _may_open_at(text: str, start: int) -> int:
    """Where a block may begin: the first ``<tool_call>`` from ``start``, else a tail that may grow into one,
    else the end."""
    at = text.find(OPEN, start)
    if at != -1:
        return at
    return len(text) - next((k for k in range(len(OPEN) - 1, 0, -1) if text.endswith(OPEN[:k])), 0)


class StreamCalls:
    """One streamed choice's content with its tool calls held back: content goes out until a block may
    begin (a ``<tool_call>`` or the start of one at the end of the text; white space alone waits too, as it
    may end up no content at all), and ``final`` parses the whole text as ``parse`` does.  What it sends
    is always the start of ``parse``'s content, so the deltas join to the plain answer's content."""

    def __init__(self, tools: Tools):
        self.tools, self.text, self.sent = tools, "", 0

    def running(self, delta: str) -> str:
        self.text += delta
        free = _may_open_at(self.text, self.sent)  # none begins before what was sent: a chunk costs its own text
        if not self.sent and not self.text[:free].strip():
            free = 0
        out = self.text[self.sent:free]
        self.sent = max(self.sent, free)
        return out

    def final(self, delta: str) -> tuple[str, list[dict]]:
        """(the content not sent yet, the calls)."""
        self.text += delta
        content, calls = parse(self.text, self.tools)
        return (content or "")[self.sent:], calls


def template_calls(calls, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` as chat templates take them: each function's ``arguments`` a
    dict (OpenAI sends JSON text; GLM's template iterates them as a dict, Qwen3's writes either)."""
    if not isinstance(calls, list):
        raise ApiError(400, f"{where}.tool_calls must be a list, got {_short(calls)}")
    out = []
    for j, tc in enumerate(calls):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(400, f"{where}.tool_calls[{j}] must be {{id, type: function, function: {{name, "
                                f"arguments}}}}, got {_short(tc)}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _json(args) if args.strip() else {}
        if not isinstance(args, dict):
            raise ApiError(400, f"{where}.tool_calls[{j}].function.arguments must be a JSON object or its JSON "
                                f"text, got {_short(fn.get('arguments'))}")
        out.append({**tc, "function": {**fn, "arguments": args}})
    return out
