"""Request and response shapes of ``alignzoo serve``: SGLang's names and JSON layouts.

Requests are checked here, before anything reaches the engine: a bad one is an ``ApiError`` (a
4xx and one line naming the field).  SGLang fields whose neutral value is the only one the aligned
sampler can honour (penalties, grammars, logit bias) are accepted at that value and refused
otherwise, so an existing driver's defaults pass and a setting we would silently ignore does not.

Stops are SGLang's: a request stops at the model's EOS ids (the checkpoint's) and its
``stop_token_ids`` unless ``ignore_eos`` (which turns off every token stop, as SGLang's does), and
at its ``stop`` strings (with the checkpoint's tokenizer).  With a tokenizer, ``text`` prompts are
taken and every answer carries ``text`` (``serve/text.py``).

``output_token_logprobs`` are ``[logprob, token_id, null]`` triples.  Each log-prob is the one the
sampler drew from: log-softmax of the logits after temperature, top-k, top-p and min-p (renormalised
over the tokens the filters keep), in FP32, bitwise what ``trainer.logprobs`` gives for the same
tokens and sampling parameters.  SGLang's default returns the log-prob under the raw softmax
(temperature and filters not applied); the two agree only at temperature 1 with the filters off.
A JSON float is the Python float of the FP32 value, which parses back to the same FP32 bits.
"""
from __future__ import annotations

import base64
import dataclasses
import json
import math
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from ..common.engine.sequence import check_token_ids
from ..common.sampling import SamplingParams
from . import jsonio
from .text import TextDelta, output_text

ROUTED_EXPERTS = "routed_experts"  # the extras key an MoE model's forward fills: (T, layers, top_k) expert ids
INDEX_SELECTED = "index_selected"  # glm5's on-request extra: (T, full indexer layers, index_topk) positions
_INT64 = 2**63


class ApiError(Exception):
    """A request the server refuses: HTTP ``status`` and a one-line ``message``."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def parse_json(body: bytes) -> Any:
    if not body:
        return {}
    try:
        return jsonio.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"malformed JSON body: {e}") from None


def validated(model: type[BaseModel], obj: Any, where: str = ""):
    """``model`` built from ``obj``; an ApiError(400) naming the first bad field otherwise."""
    if not isinstance(obj, dict):
        raise ApiError(400, f"{where or 'the body'} must be a JSON object, got {type(obj).__name__}")
    try:
        return model.model_validate(obj)
    except ValidationError as e:
        errs = e.errors()
        first = errs[0]
        loc = ".".join(str(p) for p in (where, *first["loc"]) if p != "")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        got = "" if first["type"] == "missing" else f", got {_short(first.get('input'))}"
        raise ApiError(400, f"{loc}: {first['msg'].lower().rstrip('.')}{got}{more}") from None


def _short(x: Any) -> str:
    s = json.dumps(x) if isinstance(x, (dict, list, str, int, float, bool, type(None))) else repr(x)
    return s if len(s) <= 60 else s[:57] + "..."


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class SamplingIn(_Strict):
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: off (SGLang); ours is 0
    min_p: float = 0.0
    max_new_tokens: int | None = 128  # None: up to the model's max_position (and what the KV cache holds)
    stop_token_ids: list[int] | None = None
    sampling_seed: int | None = None  # None: a random seed, returned in meta_info
    n: int = 1
    ignore_eos: bool = False  # SGLang's: no token stop at all (the model's EOS ids and stop_token_ids alike)
    stop: str | list[str] | None = None  # needs the checkpoint's tokenizer
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    # Accepted at their neutral values only (NEUTRAL): the sampler has none of these transforms.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None


NEUTRAL = {
    "frequency_penalty": (0.0,), "presence_penalty": (0.0,), "repetition_penalty": (1.0,),
    "min_new_tokens": (0,), "regex": (None,), "json_schema": (None,), "ebnf": (None,), "structural_tag": (None,),
    "logit_bias": (None, {}), "custom_params": (None, {}),
}


class GenerateIn(_Strict):
    input_ids: Any = None  # checked by hand: one list of ids or a batch of lists
    text: Any = None
    input_embeds: Any = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    rid: str | list[str] | None = None
    lora_path: str | list[str | None] | None = None
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_index_selected: bool = False  # index replay (a DSA model's on-request extra); ours, not SGLang's
    index_selected_start_len: int = 0
    return_hidden_states: bool = False
    custom_logit_processor: str | list[str | None] | None = None
    log_metrics: bool = True
    priority: int | None = None


# What a weight update may ask besides its data; SGLang's fields with no meaning here are accepted and ignored.
class _UpdateCommon(_Strict):
    abort_all_requests: bool = False
    weight_version: int | str | None = None
    flush_cache: bool = True  # no prefix cache: nothing to flush
    torch_empty_cache: bool = False
    rid: str | None = None


class UpdateFromDiskIn(_UpdateCommon):
    model_path: str
    load_format: Literal["auto", "safetensors"] | None = None
    is_async: Literal[False] = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0


class UpdateFromTensorIn(_UpdateCommon):
    serialized_named_tensors: list[str]
    load_format: Literal["alignzoo.sync/1"] | None = None
    disable_draft_model: bool | None = None


class InitGroupIn(_Strict):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"
    timeout_s: float = 600.0  # the process group's timeout (each send/recv)


class UpdateFromDistributedIn(_UpdateCommon):
    group_name: str = "weight_update_group"
    load_format: Literal["alignzoo.sync/1"] | None = None
    # SGLang's raw per-tensor broadcast: refused with a message (payloads carry their own names and checks).
    names: list[str] | None = None
    dtypes: list[str] | None = None
    shapes: list[list[int]] | None = None


class DestroyGroupIn(_Strict):
    group_name: str = "weight_update_group"


class PauseIn(_Strict):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class AbortIn(_Strict):
    rid: str = ""
    abort_all: bool = False
    abort_message: str | None = None


def parse_weight_version(v) -> int | None:
    """An update's ``weight_version``: SGLang sends a string; this server numbers versions with ints."""
    if v is None:
        return None
    if isinstance(v, str) and v.strip().lstrip("v").isdigit():
        return int(v.strip().lstrip("v"))
    if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
        return v
    raise ApiError(400, f"weight_version must be a non-negative int (or a string of one, 'v3' too), got {_short(v)}")


# ------------------------------------------------------------------ generate
@dataclass
class ModelLimits:
    """What request checks need to know of the served model."""
    name: str
    vocab_size: int
    max_position: int
    fits_alone: Callable[[int], str | None]  # the KV cache's verdict on a sequence of that many positions
    adapter_names: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()  # the per-token extras the model's forward emits
    tokenizer: Any = None  # the checkpoint's (the HTTP side's copy), None: token ids only
    on_request: tuple[str, ...] = ()  # the extras it emits only for a request that asks (SamplingParams.extras)


@dataclass(frozen=True)
class TextOut:
    """How a sample's text is decoded (SGLang's sampling_params of that name)."""
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class Item:
    """One sample to generate: a prompt and one of its n samples."""
    rid: str
    index: int  # position in the response list
    prompt: list[int]
    sampling: SamplingParams
    adapter: str | None
    return_logprob: bool
    routed_start: int | None  # None: no routed experts asked
    text: TextOut | None = None  # None: no text in the answer (no tokenizer)
    index_start: int | None = None  # None: no index selections asked
    engine_id: int = -1
    seq: Any = None  # the engine's Sequence, for streaming progress
    sent: int = 0  # tokens streamed so far


@dataclass
class GenerateSpec:
    items: list[Item]
    single: bool  # one prompt and n == 1: the response is one object, else a list
    stream: bool


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, list):
        if len(value) != n:
            raise ApiError(400, f"{name}: {len(value)} values for {n} prompts: give one, or one per prompt")
        return value
    return [value] * n


def _prompts(ids) -> tuple[list, bool]:
    if ids is None:
        raise ApiError(400, "input_ids is required: a list of token ids, or a batch of lists")
    if not isinstance(ids, list):
        raise ApiError(400, f"input_ids must be a list of token ids or a batch of lists, got {_short(ids)}")
    if not ids:
        raise ApiError(400, "input_ids is empty: give at least one token id")
    if all(isinstance(x, list) for x in ids):
        return ids, False
    if any(isinstance(x, list) for x in ids):
        raise ApiError(400, "input_ids mixes lists and ids: give one list of ids or a batch of lists")
    return [ids], True


def _wrap64(x: int) -> int:
    return (x + _INT64) % (2 * _INT64) - _INT64


def _sampling(sp: SamplingIn, prompt_len: int, limits: ModelLimits, seed: int, where: str,
              prefix: str = "sampling_params.") -> SamplingParams:
    """The engine's SamplingParams of one sample; ``prefix`` names the fields' place in the body."""
    for name, allowed in NEUTRAL.items():
        v = getattr(sp, name)
        if v not in allowed:
            raise ApiError(400, f"{where}{prefix}{name} = {_short(v)} is not supported: the aligned sampler "
                                f"applies temperature, top_k, top_p and min_p only (its log-probs are what the "
                                f"trainer replays); leave {name} at {_short(allowed[0])}")
    if sp.top_k == 0 or sp.top_k < -1:
        raise ApiError(400, f"{where}{prefix}top_k must be -1 (off) or >= 1, got {sp.top_k}")
    stop = check_stop(sp.stop, limits, f"{where}{prefix}stop")
    max_new = sp.max_new_tokens if sp.max_new_tokens is not None else room(prompt_len, limits)
    try:
        return SamplingParams(temperature=sp.temperature, top_k=0 if sp.top_k == -1 else sp.top_k, top_p=sp.top_p,
                              min_p=sp.min_p, max_new_tokens=max_new, seed=seed,
                              stop_token_ids=tuple(sp.stop_token_ids or ()), ignore_eos=sp.ignore_eos, stop=stop)
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"{where}{prefix.rstrip('.') or 'sampling'}: {e}") from None


def check_stop(stop, limits: ModelLimits, field: str) -> tuple[str, ...]:
    """Stop strings as the engine takes them; a 400 naming ``field`` for an empty or over-long one, or for
    any without a tokenizer."""
    if stop is None:
        return ()
    strings = (stop,) if isinstance(stop, str) else tuple(stop)
    if not strings:
        return ()
    if limits.tokenizer is None:
        raise ApiError(400, f"{field}: stop strings need the checkpoint's tokenizer and this server has none; "
                            f"stop on token ids with stop_token_ids")
    try:
        return SamplingParams(stop=strings).stop
    except (TypeError, ValueError) as e:
        raise ApiError(400, f"{field}: {e}") from None


def encode_text(text, limits: ModelLimits, field: str) -> list[int]:
    """A text prompt as the checkpoint's tokenizer encodes it (special tokens added as it adds them)."""
    if limits.tokenizer is None:
        raise ApiError(400, f"{field}: this server has no tokenizer (the checkpoint ships none); send input_ids")
    if not isinstance(text, str):
        raise ApiError(400, f"{field} must be a string, got {_short(text)}")
    if not text:
        raise ApiError(400, f"{field} is empty: give some text")
    return list(limits.tokenizer.encode(text))


def room(prompt_len: int, limits: ModelLimits) -> int:
    """The most tokens a prompt of ``prompt_len`` may be completed by: up to the model's positions, and
    no more than the KV cache holds for one sequence (at least 1: too little is refused by check_length)."""
    lo, hi = 1, limits.max_position - prompt_len
    if hi <= 1 or limits.fits_alone(prompt_len + hi - 1) is None:
        return max(hi, 1)
    while lo < hi:  # the last sampled token is never fed back: prompt + n tokens cache prompt + n - 1 positions
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if limits.fits_alone(prompt_len + mid - 1) is None else (lo, mid - 1)
    return lo


def check_prompt(prompt_len: int, limits: ModelLimits, field: str, where: str = "") -> None:
    if prompt_len >= limits.max_position:
        raise ApiError(400, f"{where}{field}: the prompt is {prompt_len} tokens; the model's context is "
                            f"{limits.max_position} positions, so no token is left to generate")


def check_length(prompt_len: int, max_new: int, limits: ModelLimits, field: str, where: str = "") -> None:
    """The prompt and its completion fit the model's positions and, alone, the KV cache."""
    check_prompt(prompt_len, limits, field, where)
    total = prompt_len + max_new
    if total > limits.max_position:
        raise ApiError(400, f"{where}{field}: the prompt ({prompt_len} tokens) + max_new_tokens ({max_new}) = {total} "
                            f"exceeds the model's max_position {limits.max_position}")
    short = limits.fits_alone(total - 1)  # the last sampled token is never fed back
    if short is not None:
        raise ApiError(400, f"{where}the request needs {short}: it could never run, even alone")


def build_generate(body: Any, limits: ModelLimits) -> GenerateSpec:
    """A /generate body -> its items (prompt-major: prompt i's sample j at i * n + j), checked."""
    req = validated(GenerateIn, body)
    if req.input_embeds is not None:
        raise ApiError(400, "input_embeds is not served; send input_ids")
    for name, off in (("return_text_in_logprobs", False), ("return_hidden_states", False),
                      ("custom_logit_processor", None), ("token_ids_logprob", None)):
        if getattr(req, name) not in (off, None):
            raise ApiError(400, f"{name} is not served by the aligned server; leave it at {json.dumps(off)}")
    if req.text is not None:
        if req.input_ids is not None:
            raise ApiError(400, "give text or input_ids, not both")
        texts, single = (req.text, False) if isinstance(req.text, list) else ([req.text], True)
        if not texts:
            raise ApiError(400, "text is empty: give a string or a batch of strings")
        prompts = [encode_text(t, limits, "text" if single else f"text[{i}]") for i, t in enumerate(texts)]
        field = "text"
    else:
        prompts, single = _prompts(req.input_ids)
        field = "input_ids"
    n_prompts = len(prompts)
    sps = _per_prompt(req.sampling_params or {}, n_prompts, "sampling_params")
    logprob = _per_prompt(req.return_logprob, n_prompts, "return_logprob")
    for name, off in (("logprob_start_len", -1), ("top_logprobs_num", 0)):
        for v in _per_prompt(getattr(req, name), n_prompts, name):
            if v not in (None, off):
                raise ApiError(400, f"{name} = {v}: only output-token log-probs are served; leave it at {off}")
    adapters = _per_prompt(req.lora_path, n_prompts, "lora_path")
    if isinstance(req.rid, list):
        rids = _per_prompt(req.rid, n_prompts, "rid")
    else:
        base = req.rid if req.rid is not None else uuid.uuid4().hex
        rids = [base] if single else [f"{base}_{i}" for i in range(n_prompts)]
    routed = None
    if req.return_routed_experts:
        if ROUTED_EXPERTS not in limits.extras:
            raise ApiError(400, f"return_routed_experts: model {limits.name} emits no routed experts (it is not a "
                                f"mixture of experts); leave it false")
        routed = req.routed_experts_start_len
    selected = None
    if req.return_index_selected:
        if INDEX_SELECTED not in limits.on_request:
            raise ApiError(400, f"return_index_selected: model {limits.name} has no indexer selections to return (it "
                                f"is not a DSA sparse-attention model); leave it false")
        selected = req.index_selected_start_len
    items, index = [], 0
    for i, (ids, spd, lp, adapter, rid) in enumerate(zip(prompts, sps, logprob, adapters, rids)):
        where = "" if single else f"prompt {i}: "
        try:
            prompt = check_token_ids(ids, limits.vocab_size, "prompt")
        except (TypeError, ValueError) as e:
            raise ApiError(400, f"{where}{field}: {e}") from None
        sp_in = validated(SamplingIn, spd, "sampling_params" if single else f"sampling_params[{i}]")
        if sp_in.n < 1:
            raise ApiError(400, f"{where}sampling_params.n must be >= 1, got {sp_in.n}")
        if adapter is not None and adapter not in limits.adapter_names:
            have = ", ".join(map(repr, limits.adapter_names)) or "none"
            raise ApiError(400, f"{where}lora_path {adapter!r}: unknown adapter; the model serves {have}")
        for name, start in (("routed_experts_start_len", routed), ("index_selected_start_len", selected)):
            if start is not None and not 0 <= start <= len(prompt):
                raise ApiError(400, f"{where}{name} must be in [0, {len(prompt)}] (the prompt's tokens), got {start}")
        seed = sp_in.sampling_seed if sp_in.sampling_seed is not None else secrets.randbits(63)
        if not -_INT64 <= seed < _INT64:
            raise ApiError(400, f"{where}sampling_params.sampling_seed must fit in int64, got {seed}")
        check_prompt(len(prompt), limits, field, where)
        text = None if limits.tokenizer is None else TextOut(sp_in.skip_special_tokens,
                                                              sp_in.spaces_between_special_tokens, sp_in.no_stop_trim)
        for j in range(sp_in.n):
            sp = _sampling(sp_in, len(prompt), limits, _wrap64(seed + j), where)
            if selected is not None:
                sp = dataclasses.replace(sp, extras=(INDEX_SELECTED,))
            check_length(len(prompt), sp.max_new_tokens, limits, field, where)
            item_rid = rid if sp_in.n == 1 else f"{rid}_{j}"
            items.append(Item(item_rid, index, prompt, sp, adapter, bool(lp), routed, text, index_start=selected))
            index += 1
    rid_list = [it.rid for it in items]
    if len(set(rid_list)) != len(rid_list):
        raise ApiError(400, "rid: the request's ids are not unique")
    return GenerateSpec(items, single and len(items) == 1, req.stream)


def finish_reason(c, item: Item) -> dict | None:
    if c is None:
        return None
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.matched if c.matched is not None else c.tokens[-1]}
    if c.finish_reason == "length":
        return {"type": "length", "length": item.sampling.max_new_tokens}
    return {"type": "abort", "message": c.error or "aborted"}


def item_text(item: Item, tokens: list[int], c, tokenizer) -> str:
    """A sample's ``text``: a finished one's as SGLang trims it, a running one's decoded so far."""
    t = item.text
    return output_text(tokenizer, tokens, None if c is None else c.matched,
                       skip_special_tokens=t.skip_special_tokens,
                       spaces_between_special_tokens=t.spaces_between_special_tokens,
                       no_stop_trim=t.no_stop_trim or c is None)


def item_response(item: Item, tokens: list[int], logprobs: list[float], version: int, c=None, *,
                  latency: float | None = None, index: int | None = None, tokenizer=None,
                  text: str | None = None) -> dict:
    """One sample's ``{text?, output_ids, meta_info}``; ``c`` the finished Completion (None: a stream chunk,
    whose ``text`` so far the caller may pass)."""
    meta = {"id": item.rid, "finish_reason": finish_reason(c, item), "prompt_tokens": len(item.prompt),
            "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": version,
            "sampling_seed": item.sampling.seed}
    if latency is not None:
        meta["e2e_latency"] = latency
    if item.return_logprob:
        if not all(map(math.isfinite, logprobs)):  # JSON cannot carry it (orjson would write null)
            raise ValueError(f"request {item.rid}: a log-prob is not finite")
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(logprobs, tokens)]
    if item.routed_start is not None and c is not None:
        meta[ROUTED_EXPERTS] = encode_routed_experts(c.extras.get(ROUTED_EXPERTS), item.routed_start)
    if item.index_start is not None and c is not None:  # the same int32 encoding, (positions, full layers, top_k)
        meta[INDEX_SELECTED] = encode_routed_experts(c.extras.get(INDEX_SELECTED), item.index_start)
    out = {"output_ids": tokens, "meta_info": meta}
    if item.text is not None and tokenizer is not None:
        out = {"text": item_text(item, tokens, c, tokenizer) if text is None else text, **out}
    if index is not None:
        out["index"] = index
    return out


class Stream:
    """The server-sent chunks of a streamed /generate: SGLang's, each cumulative (every token and log-prob so
    far, and the text so far, decoded incrementally: ``TextDelta``), the last one ``item_response``'s answer."""

    def __init__(self, spec: GenerateSpec, tokenizer, started: float):
        self.tokenizer, self.started, self.multi = tokenizer, started, not spec.single
        self.texts = {it.rid: TextDelta(tokenizer, skip_special_tokens=it.text.skip_special_tokens,
                                        spaces_between_special_tokens=it.text.spaces_between_special_tokens)
                      for it in spec.items if it.text is not None and tokenizer is not None}

    def running(self, item: Item, tokens: list[int], lps: list[float], version: int) -> dict:
        delta = self.texts.get(item.rid)
        if delta is not None:
            delta.running(tokens)
        return item_response(item, tokens, lps, version, index=item.index if self.multi else None,
                             tokenizer=self.tokenizer, text=None if delta is None else delta.sent)

    def final(self, item: Item, c, version: int) -> dict:
        return item_response(item, c.tokens, c.logprobs.tolist(), version, c,
                             latency=time.perf_counter() - self.started, index=item.index if self.multi else None,
                             tokenizer=self.tokenizer)

    def closing(self) -> list[dict]:
        return []


def encode_routed_experts(ids: torch.Tensor | None, start: int) -> str:
    """SGLang's encoding: base64 of the int32 expert ids, (positions from ``start``, layers, top_k) in C order
    (decode: ``np.frombuffer(b64decode(s), np.int32).reshape(-1, layers, top_k)``); positions cover
    ``[start, prompt + completion - 1)``."""
    if ids is None:
        return ""
    return base64.b64encode(ids[start:].to(torch.int32).contiguous().numpy().tobytes()).decode("ascii")
