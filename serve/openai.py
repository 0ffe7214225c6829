"""The OpenAI-compatible API of ``alignzoo serve``: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, in OpenAI's JSON shapes with SGLang's extensions.

A request becomes the same ``Item``s as a /generate request (``api.py``), so the engine, the stop
rules and the log-probs are the same: every ``logprob`` returned is the sampler's, FP32, bitwise what
``trainer.logprobs`` gives for the same tokens and sampling parameters.  Fields map as SGLang maps
them: ``max_tokens`` (chat: ``max_completion_tokens`` too) -> max_new_tokens, ``temperature``,
``top_p``, and the extensions ``top_k``, ``min_p``, ``ignore_eos``, ``stop_token_ids``,
``no_stop_trim``, ``skip_special_tokens``, ``spaces_between_special_tokens``; ``seed`` -> the
sampling seed (choice j draws with seed + j).  A sampling field the request leaves out takes the
checkpoint's generation_config.json default, as SGLang's and vLLM's OpenAI servers do.

Refused with a 400 naming the field, at any but their neutral value: what the trainer could not replay
(penalties, ``logit_bias``, ``min_tokens``, grammars and ``response_format``, a forced ``tool_choice``)
and what this server does not compute: alternatives' log-probs (``top_logprobs`` > 0, completions'
``logprobs`` > 0: the chosen token's log-prob is served, with ``logprobs: true`` / ``logprobs: 0``),
``echo``, ``suffix``.  ``tools`` are rendered by the chat template, and the calls the model writes
(``tools.py``: Hermes / Qwen3 blocks, or GLM's) come back as the message's ``tool_calls`` with
``finish_reason`` tool_calls (length stays length); a block that does not parse, or names a tool the
request did not offer, stays in the content.  A stream sends content until a block may begin and the
calls with the last chunk.  ``tool_choice: none`` leaves the text as it is.  An assistant message's
``tool_calls`` may carry their arguments as JSON text (OpenAI's) or an object: the template gets an
object.  Each answer's ``metadata`` holds the weight version and the sampling parameters every
choice was drawn with (the trainer replays them); ``return_token_ids: true`` (vLLM's) adds the prompt's
and each choice's token ids.
"""
from __future__ import annotations

import secrets
import time
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from . import api
from .api import ApiError, Item, ModelLimits, TextOut, _short
from .text import TextDelta, output_text
from .tools import StreamCalls, Tools, parse, template_calls

ROLES = ("system", "user", "assistant", "tool", "developer")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Common(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    # SGLang's extensions
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    lora_path: str | None = None
    rid: str | None = None
    return_token_ids: bool = False  # vLLM's: prompt and completion token ids in the answer
    # Accepted at their neutral values only (NEUTRAL)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | None = None
    return_hidden_states: bool = False


class CompletionIn(_Common):
    prompt: Any = None  # a string, a list of strings, a list of ids or a list of lists of ids
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None  # 0: the chosen token's log-prob
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatIn(_Common):
    messages: Any = None  # checked by hand (``_messages``), for messages that name the bad entry
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    separate_reasoning: bool = True  # no reasoning parser here: the text is the message's content
    stream_reasoning: bool = True
    reasoning_effort: str | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    prediction: Any = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


WHY = ("the aligned sampler applies temperature, top_k, top_p and min_p only (its log-probs are what the trainer "
       "replays)")
NEUTRAL = {
    "presence_penalty": ((0.0, None), WHY), "frequency_penalty": ((0.0, None), WHY),
    "repetition_penalty": ((1.0, None), WHY), "logit_bias": ((None, {}), WHY), "min_tokens": ((0, None), WHY),
    "regex": ((None,), WHY), "ebnf": ((None,), WHY), "json_schema": ((None,), WHY),
    "return_hidden_states": ((False,), "hidden states are not served"),
    # completions
    "echo": ((False,), "the prompt's log-probs are not served"),
    "suffix": ((None,), "insertion is not served"),
    # chat
    "response_format": ((None, {"type": "text"}), WHY),
    "tool_choice": ((None, "none", "auto"), "a forced tool call needs constrained decoding, which " + WHY),
    "functions": ((None,), "use tools"), "function_call": ((None, "none", "auto"), WHY),
    "reasoning_effort": ((None,), "pass template options in chat_template_kwargs"),
    "modalities": ((None, ["text"]), "text only"), "audio": ((None,), "text only"),
    "prediction": ((None,), "predicted outputs are not served"),
}


@dataclass
class OpenAISpec:
    chat: bool
    items: list[Item]
    prompts: list[list[int]]
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    return_token_ids: bool
    model: str
    params: dict  # the sampling parameters every choice was drawn with (choice j: seed + j)
    stop: tuple[str, ...] = ()
    tools: Tools | None = None  # the request's tools, when calls are parsed out of the text
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))


def _neutral(req: BaseModel) -> None:
    for name, (allowed, why) in NEUTRAL.items():
        if name in type(req).model_fields:
            v = getattr(req, name)
            if v not in allowed:
                raise ApiError(400, f"{name} = {_short(v)} is not supported: {why}; leave it at "
                                    f"{_short(allowed[0])}")


def _adapter(req: _Common, limits: ModelLimits) -> str | None:
    """SGLang's: ``lora_path``, or a ``model`` of the form ``base:adapter`` or naming an adapter."""
    name = req.lora_path
    if name is None and req.model:
        tail = req.model.rsplit(":", 1)[-1]
        name = tail if tail in limits.adapter_names else None
    if name is not None and name not in limits.adapter_names:
        have = ", ".join(map(repr, limits.adapter_names)) or "none"
        raise ApiError(400, f"lora_path {name!r}: unknown adapter; the model serves {have}")
    return name


def _completion_prompts(prompt, limits: ModelLimits) -> list[list[int]]:
    """OpenAI's ``prompt``: a string, a list of token ids, or a list of prompts (each a string or a list of ids)."""
    if prompt is None:
        raise ApiError(400, "prompt is required: a string, a list of token ids, or a list of strings or id lists")
    if isinstance(prompt, str):
        return [api.encode_text(prompt, limits, "prompt")]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, f"prompt must be a string, a list of token ids, or a list of strings or id lists, "
                            f"got {_short(prompt)}")
    one = not any(isinstance(p, (str, list)) for p in prompt)
    out = []
    for i, p in enumerate([prompt] if one else prompt):
        where = "prompt" if one else f"prompt[{i}]"
        if isinstance(p, str):
            out.append(api.encode_text(p, limits, where))
            continue
        try:
            out.append(api.check_token_ids(p, limits.vocab_size, "prompt"))
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"{where}: {e}") from None
    return out


def _content(content, where: str) -> str | None:
    """A message's content as the template takes it: a string (text parts joined by newlines)."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of text parts, got {_short(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ApiError(400, f"{where}.content[{j}]: only text parts ({{\"type\": \"text\", \"text\": ...}}) are "
                                f"served, got {_short(kind)}")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(messages) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ApiError(400, f"{where} must be an object with role and content, got {_short(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise ApiError(400, f"{where}.role: unknown role {_short(role)}; one of {', '.join(ROLES)}")
        msg = dict(m)
        if role == "developer":  # OpenAI's newer name for the system message; chat templates know "system"
            msg["role"] = "system"
        msg["content"] = _content(m.get("content"), where)
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = template_calls(m["tool_calls"], where)
        if msg["content"] is None and not (role == "assistant" and m.get("tool_calls")):
            raise ApiError(400, f"{where}.content is required (only an assistant message with tool_calls may omit it)")
        out.append(msg)
    return out


def render_chat(tokenizer, req: ChatIn) -> list[int]:
    """The prompt's token ids as ``tokenizer.apply_chat_template(messages, tools=..., add_generation_prompt=True,
    tokenize=True)`` renders them (``continue_final_message``: the last assistant message continued instead)."""
    messages = _messages(req.messages)
    if getattr(tokenizer, "chat_template", None) is None:
        raise ApiError(400, "messages: the checkpoint's tokenizer has no chat template; use /v1/completions")
    kwargs = dict(req.chat_template_kwargs or {})
    fixed = {"tools", "add_generation_prompt", "continue_final_message", "tokenize", "return_dict", "messages",
             "conversation", "chat_template"}
    clash = sorted(fixed & set(kwargs))
    if clash:
        raise ApiError(400, f"chat_template_kwargs: {', '.join(clash)} are set by the request's own fields")
    if req.continue_final_message and messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message: the last message must be the assistant's")
    try:
        ids = tokenizer.apply_chat_template(messages, tools=req.tools,
                                            add_generation_prompt=not req.continue_final_message,
                                            continue_final_message=req.continue_final_message, tokenize=True,
                                            return_dict=False, **kwargs)
    except Exception as e:  # jinja2's TemplateError, raise_exception(), a template's TypeError: the request's fault
        why = " ".join(str(e).split())
        raise ApiError(400, f"messages: the chat template failed: {type(e).__name__}: {why}") from None
    if hasattr(ids, "keys"):  # a BatchEncoding from an older transformers
        ids = ids["input_ids"]
    ids = list(ids)
    if not ids:
        raise ApiError(400, "messages: the chat template rendered no tokens")
    return ids


def build(req_body: Any, limits: ModelLimits, defaults: dict, model_name: str, chat: bool) -> OpenAISpec:
    req = api.validated(ChatIn if chat else CompletionIn, req_body)
    _neutral(req)
    tok = limits.tokenizer
    if tok is None:
        route = "/v1/chat/completions" if chat else "/v1/completions"
        raise ApiError(400, f"{route} needs the checkpoint's tokenizer and this server has none (the checkpoint ships "
                            f"none); use /generate with input_ids")
    if chat:
        offered = Tools.of(req.tools, tok.chat_template) if req.tools else None  # checked before the template sees them
        prompts, field_name = [render_chat(tok, req)], "messages"
        if req.max_tokens is not None and req.max_completion_tokens is not None \
                and req.max_tokens != req.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs not in (None, 0):
            raise ApiError(400, f"top_logprobs = {req.top_logprobs} is not supported: only the chosen token's "
                                f"log-prob is served (the sampler's, bitwise the trainer's); leave it at 0")
        logprobs = req.logprobs
        tools = offered if req.tool_choice != "none" else None
    else:
        prompts, field_name = _completion_prompts(req.prompt, limits), "prompt"
        max_tokens = req.max_tokens
        if req.logprobs not in (None, 0):
            raise ApiError(400, f"logprobs = {req.logprobs} is not supported: only the chosen token's log-prob is "
                                f"served (logprobs: 0; the sampler's, bitwise the trainer's)")
        if req.best_of not in (None, req.n):
            raise ApiError(400, f"best_of = {req.best_of} is not supported: every sample is returned (use n)")
        logprobs = req.logprobs is not None
        tools = None
    if req.n < 1:
        raise ApiError(400, f"n must be >= 1, got {req.n}")
    if max_tokens is not None and max_tokens < 1:
        name = "max_completion_tokens" if chat and req.max_completion_tokens is not None else "max_tokens"
        raise ApiError(400, f"{name} must be >= 1, got {max_tokens}")
    opts = req.stream_options or {}
    unknown = set(opts) - {"include_usage", "continuous_usage_stats"}
    if unknown or not all(isinstance(v, bool) for v in opts.values()):
        raise ApiError(400, f"stream_options: takes include_usage and continuous_usage_stats (booleans), got "
                            f"{_short(opts)}")
    adapter = _adapter(req, limits)
    seed = req.seed if req.seed is not None else secrets.randbits(63)
    if not -api._INT64 <= seed < api._INT64:
        raise ApiError(400, f"seed must fit in int64, got {seed}")
    top_k = req.top_k if req.top_k is not None else (defaults.get("top_k") or -1)
    sp_in = api.validated(api.SamplingIn, {
        "temperature": float(req.temperature if req.temperature is not None else defaults.get("temperature", 1.0)),
        "top_p": float(req.top_p if req.top_p is not None else defaults.get("top_p", 1.0)),
        "top_k": top_k, "min_p": float(req.min_p if req.min_p is not None else defaults.get("min_p", 0.0)),
        "max_new_tokens": max_tokens, "stop_token_ids": req.stop_token_ids, "ignore_eos": req.ignore_eos,
        "stop": req.stop, "n": req.n,
    })
    text = TextOut(req.skip_special_tokens, req.spaces_between_special_tokens, req.no_stop_trim)
    base = req.rid or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    items, index = [], 0
    for i, prompt in enumerate(prompts):
        where = "" if len(prompts) == 1 else f"prompt {i}: "
        api.check_prompt(len(prompt), limits, field_name, where)
        for j in range(req.n):
            sp = api._sampling(sp_in, len(prompt), limits, api._wrap64(seed + j), where, prefix="")
            api.check_length(len(prompt), sp.max_new_tokens, limits, field_name, where)
            items.append(Item(f"{base}_{index}", index, prompt, sp, adapter, logprobs, None, text))
            index += 1
    params = {"temperature": sp_in.temperature, "top_k": sp_in.top_k, "top_p": sp_in.top_p, "min_p": sp_in.min_p,
              "seed": api._wrap64(seed)}
    return OpenAISpec(chat, items, prompts, req.n, req.stream, bool(opts.get("include_usage")), logprobs,
                      req.return_token_ids, req.model or model_name, params, items[0].sampling.stop, tools, id=base)


# ------------------------------------------------------------------ answers
def finish(c, calls: list | None = None) -> str:
    """stop, length or abort; tool_calls for a choice that stopped by itself after writing calls."""
    reason = {"stop": "stop", "length": "length"}.get(c.finish_reason, "abort")
    return "tool_calls" if calls and reason == "stop" else reason


_STRINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {token id: its text}


def token_strings(tokenizer, tokens: list[int]) -> list[str]:
    """Each token's own text (``decode([id])``), cached per token id: building a batch-64 answer of 64
    tokens each took 25 ms through transformers' batch_decode, 6 ms with the cache (CPU, the tests'
    word-level tokenizer)."""
    cache = _STRINGS.setdefault(tokenizer, {})
    missing = [t for t in dict.fromkeys(tokens) if t not in cache]
    if missing:
        cache.update(zip(missing, tokenizer.batch_decode([[t] for t in missing])))
    return [cache[t] for t in tokens]


def logprobs_of(spec: OpenAISpec, tokenizer, tokens: list[int], lps: list[float], offset: int = 0):
    """OpenAI's ``logprobs`` of the given tokens: chat ``{content: [...]}``, completions ``{tokens, ...}``
    (``offset``: where the first token's text starts in the choice's text, for ``text_offset``)."""
    strings = token_strings(tokenizer, tokens)
    if spec.chat:
        return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                            for s, lp in zip(strings, lps)]}
    offsets = []
    for s in strings:
        offsets.append(offset)
        offset += len(s)
    return {"tokens": strings, "token_logprobs": list(lps), "top_logprobs": None, "text_offset": offsets}


def _metadata(spec: OpenAISpec, version: int) -> dict:
    return {"weight_version": version, "sampling_params": spec.params}


def usage(spec: OpenAISpec, completion_tokens: int) -> dict:
    prompt_tokens = sum(len(p) for p in spec.prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def check_finite(item: Item, lps: list[float]) -> None:
    import math

    if not all(map(math.isfinite, lps)):
        raise ValueError(f"request {item.rid}: a log-prob is not finite")


def choice(spec: OpenAISpec, tokenizer, item: Item, c) -> dict:
    t = item.text
    text = output_text(tokenizer, c.tokens, c.matched, skip_special_tokens=t.skip_special_tokens,
                       spaces_between_special_tokens=t.spaces_between_special_tokens, no_stop_trim=t.no_stop_trim)
    lps = c.logprobs.tolist()
    out: dict = {"index": item.index}
    content, calls = parse(text, spec.tools) if spec.tools is not None else (text, [])
    if spec.chat:
        out["message"] = {"role": "assistant", "content": content}
        if calls:
            out["message"]["tool_calls"] = calls
    else:
        out["text"] = text
    if spec.logprobs:
        check_finite(item, lps)
    out["logprobs"] = logprobs_of(spec, tokenizer, c.tokens, lps) if spec.logprobs else None
    out["finish_reason"] = finish(c, calls)
    out["matched_stop"] = c.matched
    if c.finish_reason not in ("stop", "length"):
        out["error"] = c.error or "aborted"
    if spec.return_token_ids:
        out["token_ids"] = list(c.tokens)
        if not spec.chat:
            out["prompt_token_ids"] = item.prompt
    return out


def response(spec: OpenAISpec, tokenizer, done: list[tuple[Item, Any, int]]) -> dict:
    """The non-streamed answer: ``done`` = (item, Completion, weight version) of every choice, in index order."""
    out = {"id": spec.id, "object": "chat.completion" if spec.chat else "text_completion", "created": spec.created,
           "model": spec.model, "choices": [choice(spec, tokenizer, it, c) for it, c, _ in done],
           "usage": usage(spec, sum(len(c.tokens) for _, c, _ in done)),
           "metadata": _metadata(spec, min(v for _, _, v in done))}
    if spec.return_token_ids and spec.chat:
        out["prompt_token_ids"] = spec.prompts[0]
    return out


class Stream:
    """The server-sent chunks of a streamed answer: each choice's new text (``TextDelta``: their
    concatenation is the non-streamed text) and its new tokens' log-probs; with tools, the text of a
    tool call held back and the calls sent with the last chunk (``StreamCalls``)."""

    def __init__(self, spec: OpenAISpec, tokenizer):
        self.spec, self.tokenizer = spec, tokenizer
        self.deltas = {it.rid: TextDelta(tokenizer, spec.stop, skip_special_tokens=it.text.skip_special_tokens,
                                         spaces_between_special_tokens=it.text.spaces_between_special_tokens,
                                         no_stop_trim=it.text.no_stop_trim) for it in spec.items}
        self.sent = {it.rid: 0 for it in spec.items}  # tokens sent
        self.calls = {it.rid: StreamCalls(spec.tools) for it in spec.items} if spec.tools is not None else {}
        self.completion_tokens = 0

    def _chunk(self, choice_: dict) -> dict:
        return {"id": self.spec.id, "object": "chat.completion.chunk" if self.spec.chat else "text_completion",
                "created": self.spec.created, "model": self.spec.model, "choices": [choice_]}

    def _choice(self, item: Item, tokens: list[int], lps: list[float], text: str) -> dict:
        a = self.sent[item.rid]
        new, new_lps = tokens[a:], lps[a:]
        self.sent[item.rid] = len(tokens)
        out: dict = {"index": item.index}
        if self.spec.chat:
            out["delta"] = {"role": "assistant", "content": text} if a == 0 else {"content": text}
        else:
            out["text"] = text
        if self.spec.logprobs:
            check_finite(item, new_lps)
            offset = len(self.deltas[item.rid].sent) - len(text)
            out["logprobs"] = logprobs_of(self.spec, self.tokenizer, new, new_lps, offset)
        else:
            out["logprobs"] = None
        if self.spec.return_token_ids:
            out["token_ids"] = new
        return out

    def running(self, item: Item, tokens: list[int], lps: list[float], version: int) -> dict:
        """``version`` goes unused: a chunk names the weight version once, in the last one's metadata."""
        text = self.deltas[item.rid].running(tokens)
        held = self.calls.get(item.rid)
        c = self._choice(item, tokens, lps, text if held is None else held.running(text))
        c["finish_reason"] = None
        return self._chunk(c)

    def final(self, item: Item, c, version: int) -> dict:
        text, calls = self.deltas[item.rid].final(c.tokens, c.matched), []
        held = self.calls.get(item.rid)
        if held is not None:
            text, calls = held.final(text)
        ch = self._choice(item, c.tokens, c.logprobs.tolist(), text)
        if calls:
            ch["delta"]["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        ch["finish_reason"], ch["matched_stop"] = finish(c, calls), c.matched
        if c.finish_reason not in ("stop", "length"):
            ch["error"] = c.error or "aborted"
        self.completion_tokens += len(c.tokens)
        out = self._chunk(ch)
        out["metadata"] = _metadata(self.spec, version)
        return out

    def closing(self) -> list[dict]:
        """The usage chunk, if asked for (``stream_options.include_usage``)."""
        if not self.spec.include_usage:
            return []
        return [{**self._chunk({}), "choices": [], "usage": usage(self.spec, self.completion_tokens)}]


def models(name: str, limits: ModelLimits, created: int, root: str | None) -> dict:
    data = [{"id": name, "object": "model", "created": created, "owned_by": "alignzoo", "root": root or name,
             "parent": None, "max_model_len": limits.max_position}]
    data += [{"id": a, "object": "model", "created": created, "owned_by": "alignzoo", "root": root or name,
              "parent": name, "max_model_len": limits.max_position} for a in limits.adapter_names]
    return {"object": "list", "data": data}
