"""A small client for ``alignzoo serve`` (or any server with SGLang's RL API, for the calls both have).

    from alignzoo.client import Client, output_logprobs, choice_logprobs
    c = Client("http://127.0.0.1:30000", api_key=...)     # default: $ALIGNZOO_API_KEY
    out = c.generate([1, 2, 3], {"temperature": 0.8, "max_new_tokens": 16, "sampling_seed": 7}, return_logprob=True)
    out["output_ids"], output_logprobs(out)               # tokens, (n,) fp32 tensor, bitwise the server's
    c.generate_text("Hello", {"max_new_tokens": 16})["text"]
    ans = c.chat([{"role": "user", "content": "Hi"}], max_tokens=16, logprobs=True, return_token_ids=True)
    ans["choices"][0]["message"]["content"], choice_logprobs(ans["choices"][0])
    pub = c.publisher(trainer.forward_weights)            # versions continue the server's
    c.init_weights_update_group("127.0.0.1", 29500, backend="gloo")
    c.update_weights_from_distributed(pub.publish())     # checked by the server before it is applied

Standard library HTTP only (one connection per call, so a Client is safe to share between threads).
"""
from __future__ import annotations

import http.client
import os
import threading
import time
import urllib.parse
from collections.abc import Iterator

import torch

from ..sync import Payload, Publisher
from ..sync.payload import FORMAT
from . import ADMIN_ROUTES, jsonio


class ServerError(RuntimeError):
    """A non-2xx answer: ``status`` and the server's ``message``."""

    def __init__(self, status: int, message: str, path: str = ""):
        super().__init__(f"{path}: HTTP {status}: {message}" if path else f"HTTP {status}: {message}")
        self.status, self.message, self.path = status, message, path


def output_logprobs(result: dict) -> torch.Tensor:
    """(completion_tokens,) fp32: a result's ``output_token_logprobs`` (JSON floats of FP32 values: exact)."""
    return torch.tensor([t[0] for t in result["meta_info"].get("output_token_logprobs", [])], dtype=torch.float32)


def choice_logprobs(choice: dict) -> torch.Tensor:
    """(tokens,) fp32: the chosen tokens' log-probs of an OpenAI choice (chat or completion, whole or the
    chunks of a stream joined by ``join_stream``), bitwise the server's."""
    lp = choice.get("logprobs") or {}
    values = [e["logprob"] for e in lp["content"]] if "content" in lp else lp.get("token_logprobs", [])
    return torch.tensor(values, dtype=torch.float32)


def join_stream(chunks) -> list[dict]:
    """The choices of a streamed OpenAI answer, joined as the non-streamed answer has them: text (or
    message content), log-probs, token ids, finish_reason and matched_stop; ``tool_calls`` where a
    chat choice has any (each call's deltas joined by their ``index``, arguments concatenated)."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.get("choices", []):
            o = out.setdefault(c["index"], {"index": c["index"], "text": "", "logprobs": None, "token_ids": [],
                                            "finish_reason": None, "matched_stop": None})
            o["text"] += (c["delta"].get("content") or "") if "delta" in c else c.get("text", "")
            for tc in c.get("delta", {}).get("tool_calls") or []:
                calls = o.setdefault("tool_calls", [])
                while len(calls) <= tc["index"]:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call, fn = calls[tc["index"]], tc.get("function") or {}
                call["id"] = tc.get("id") or call["id"]
                call["function"]["name"] += fn.get("name") or ""
                call["function"]["arguments"] += fn.get("arguments") or ""
            lp = c.get("logprobs")
            if lp is not None:
                if o["logprobs"] is None:
                    o["logprobs"] = {k: [] for k in lp if k != "top_logprobs"}
                for k, v in lp.items():
                    if k != "top_logprobs":
                        o["logprobs"][k] += v
            o["token_ids"] += c.get("token_ids", [])
            if c.get("finish_reason") is not None:
                o["finish_reason"], o["matched_stop"] = c["finish_reason"], c.get("matched_stop")
    return [out[i] for i in sorted(out)]


def _key(key: str | None, env: str) -> str | None:
    return key if key is not None else os.environ.get(env) or None


class Client:
    def __init__(self, url: str = "http://127.0.0.1:30000", *, timeout: float = 600.0, api_key: str | None = None,
                 admin_api_key: str | None = None):
        """``api_key`` (default $ALIGNZOO_API_KEY) goes with every call as ``Authorization: Bearer``;
        ``admin_api_key`` (default $ALIGNZOO_ADMIN_API_KEY) instead with weight updates and control."""
        u = urllib.parse.urlsplit(url)
        if u.scheme != "http" or not u.hostname:
            raise ValueError(f"url must be http://HOST:PORT, got {url!r}")
        self.url, self.host, self.port, self.timeout = url, u.hostname, u.port or 80, timeout
        self.api_key = _key(api_key, "ALIGNZOO_API_KEY")
        self.admin_api_key = _key(admin_api_key, "ALIGNZOO_ADMIN_API_KEY")
        self._group: dict | None = None

    # ---------------------------------------------------------- transport
    def _open(self, method: str, path: str, body=None, timeout: float | None = None) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout or self.timeout)
        data = None if body is None else (body if isinstance(body, bytes) else jsonio.dumps(body))
        headers = {"Content-Type": "application/json"} if data is not None else {}
        key = self.admin_api_key if self.admin_api_key and path in ADMIN_ROUTES else self.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=headers)
        return conn.getresponse()

    def request(self, method: str, path: str, body=None, *, timeout: float | None = None):
        """The decoded JSON answer (None for an empty one); ServerError for a non-2xx status."""
        resp = self._open(method, path, body, timeout)
        raw = resp.read()
        resp.close()
        try:
            out = jsonio.loads(raw) if raw else None
        except ValueError:
            out = raw.decode(errors="replace")
        if not 200 <= resp.status < 300:
            msg = out
            if isinstance(out, dict):
                msg = out.get("message") or (out.get("error") or {}).get("message") or out
            raise ServerError(resp.status, str(msg), path)
        return out

    def post(self, path: str, body=None, **kw):
        return self.request("POST", path, {} if body is None else body, **kw)

    def get(self, path: str, **kw):
        return self.request("GET", path, **kw)

    # ---------------------------------------------------------- health and info
    def health(self) -> bool:
        try:
            self.get("/health", timeout=5)
            return True
        except (OSError, ServerError):
            return False

    def wait_ready(self, timeout: float = 120.0, proc=None) -> None:
        """Poll /health until it answers; ``proc`` (a Popen): fail at once if it exits."""
        deadline = time.monotonic() + timeout
        while not self._up():
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.url} not ready within {timeout} s")
            time.sleep(0.1)

    def _up(self) -> bool:
        try:
            self.get("/health", timeout=5)
            return True
        except ServerError as e:
            if e.status == 401:  # it is up, and refuses this client: waiting will not change that
                raise
            return False
        except OSError:
            return False

    def health_generate(self) -> bool:
        try:
            self.get("/health_generate")
            return True
        except ServerError:
            return False

    def get_model_info(self) -> dict:
        return self.get("/get_model_info")

    def get_server_info(self) -> dict:
        return self.get("/get_server_info")

    def get_weight_version(self) -> int:
        return self.get("/get_weight_version")["weight_version"]

    def weights_checksum(self) -> str:
        """``alignzoo.sync.weights_checksum`` of the served weights (compare with the trainer's)."""
        return self.get("/get_weights_checksum")["checksum"]

    # ---------------------------------------------------------- generate
    def generate(self, input_ids, sampling_params: dict | list | None = None, *, return_logprob: bool = False,
                 **fields):
        """POST /generate: one result dict for one prompt with n == 1, else a list (prompt-major)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                **fields}
        return self.post("/generate", body)

    def generate_stream(self, input_ids, sampling_params: dict | list | None = None, *, return_logprob: bool = False,
                        **fields) -> Iterator[dict]:
        """The server-sent chunks of a streamed /generate (each cumulative: output ids and log-probs so far;
        the last of each sample has its finish_reason)."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob,
                "stream": True, **fields}
        return self.stream("/generate", body)

    def generate_text(self, text, sampling_params: dict | list | None = None, *, return_logprob: bool = False,
                      **fields):
        """POST /generate with ``text`` (a string or a batch): the answers carry ``text`` too."""
        body = {"text": text, "sampling_params": sampling_params or {}, "return_logprob": return_logprob, **fields}
        return self.post("/generate", body)

    def stream(self, path: str, body: dict) -> Iterator[dict]:
        """POST ``body`` to ``path`` and yield its server-sent JSON events until ``[DONE]``."""
        resp = self._open("POST", path, body)
        if resp.status != 200:
            raw = resp.read()
            resp.close()
            try:
                msg = (jsonio.loads(raw).get("error") or {}).get("message") or raw.decode(errors="replace")
            except (ValueError, AttributeError):
                msg = raw.decode(errors="replace")
            raise ServerError(resp.status, msg, path)
        try:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield jsonio.loads(data)
        finally:
            resp.close()

    # ---------------------------------------------------------- the OpenAI-compatible API
    def models(self) -> dict:
        return self.get("/v1/models")

    def completions(self, prompt, **fields) -> dict:
        """POST /v1/completions (``stream`` not here: ``completions_stream``)."""
        return self.post("/v1/completions", {"prompt": prompt, **fields})

    def completions_stream(self, prompt, **fields) -> Iterator[dict]:
        return self.stream("/v1/completions", {"prompt": prompt, **fields, "stream": True})

    def chat(self, messages: list[dict], **fields) -> dict:
        """POST /v1/chat/completions: ``fields`` as OpenAI's (max_tokens, temperature, top_p, n, seed,
        logprobs, stop) and SGLang's (top_k, min_p, ignore_eos, stop_token_ids); ``return_token_ids``
        adds the prompt's and each choice's token ids."""
        return self.post("/v1/chat/completions", {"messages": messages, **fields})

    def chat_stream(self, messages: list[dict], **fields) -> Iterator[dict]:
        return self.stream("/v1/chat/completions", {"messages": messages, **fields, "stream": True})

    # ---------------------------------------------------------- weight updates
    def publisher(self, get_weights, **kw) -> Publisher:
        """A ``Publisher`` of ``get_weights()`` whose first payload (full) is the server's next version."""
        pub = Publisher(get_weights, **{"check_finite": True, **kw})
        pub.version = self.get_weight_version()
        return pub

    def update_weights_from_disk(self, model_path: str, *, weight_version: int | None = None,
                                 abort_all_requests: bool = False) -> dict:
        return self.post("/update_weights_from_disk", {"model_path": str(model_path), "weight_version": weight_version,
                                                       "abort_all_requests": abort_all_requests})

    def update_weights_from_tensor(self, payload: Payload, *, abort_all_requests: bool = False) -> dict:
        from .wire import encode_payload_b64

        return self.post("/update_weights_from_tensor", {"serialized_named_tensors": [encode_payload_b64(payload)],
                                                         "load_format": FORMAT,
                                                         "abort_all_requests": abort_all_requests})

    def init_weights_update_group(self, master_address: str, master_port: int, *, backend: str = "gloo",
                                  group_name: str = "weight_update_group", timeout_s: float = 600.0) -> dict:
        """Open a two-rank torch.distributed group with the server: this process is rank 0 (it takes the
        default process group), the server rank 1."""
        import datetime

        import torch.distributed as dist

        body = {"master_address": master_address, "master_port": master_port, "rank_offset": 1, "world_size": 2,
                "group_name": group_name, "backend": backend, "timeout_s": timeout_s}
        answer = _Background(lambda: self.post("/init_weights_update_group", body))
        answer.wait(0.3)  # a refusal comes back at once; a rendezvous waits for our side
        if answer.done:
            answer.result()
        dist.init_process_group(backend, init_method=f"tcp://{master_address}:{master_port}", world_size=2, rank=0,
                                timeout=datetime.timedelta(seconds=timeout_s))
        out = answer.result()
        self._group = {"group_name": group_name, "backend": backend}
        return out

    def update_weights_from_distributed(self, payload: Payload, *, abort_all_requests: bool = False) -> dict:
        """Send ``payload`` to the server over the group while it answers the HTTP call."""
        from ..sync import DistTransport

        if self._group is None:
            raise RuntimeError("no weight update group: call init_weights_update_group first")
        body = {"group_name": self._group["group_name"], "load_format": FORMAT,
                "weight_version": payload.version, "abort_all_requests": abort_all_requests}
        answer = _Background(lambda: self.post("/update_weights_from_distributed", body))
        DistTransport(1).send(payload)
        return answer.result()

    def destroy_weights_update_group(self) -> dict:
        import torch.distributed as dist

        if self._group is None:
            raise RuntimeError("no weight update group is open")
        try:
            return self.post("/destroy_weights_update_group", {"group_name": self._group["group_name"]})
        finally:
            dist.destroy_process_group()
            self._group = None

    # ---------------------------------------------------------- control
    def pause_generation(self, mode: str = "abort") -> dict:
        return self.post("/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self.post("/continue_generation")

    def abort_request(self, rid: str = "", *, abort_all: bool = False) -> dict:
        return self.post("/abort_request", {"rid": rid, "abort_all": abort_all})

    def flush_cache(self) -> dict:
        return self.post("/flush_cache")


class _Background:
    """A call on its own thread; ``result()`` joins it and re-raises what it raised."""

    def __init__(self, fn):
        self._out = self._err = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn):
        try:
            self._out = fn()
        except BaseException as e:
            self._err = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float) -> None:
        self._thread.join(timeout)

    def result(self):
        self._thread.join()
        if self._err is not None:
            raise self._err
        return self._out
