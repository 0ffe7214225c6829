"""Per-request sampling parameters and their per-row tensors."""
from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

_INT64 = (-(2**63), 2**63)


def _float32(x: float) -> float:
    """``x`` rounded to float32 as ``params_to_tensors`` stores it (round to nearest; too large: inf)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


_TEMPERATURE_MIN = _float32(1e-5)  # the trainer's check compares in float32
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 512  # each stop string; the engine decodes that string's token length + 1 per step to look for it


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling parameters, checked when built.

    temperature 0 is greedy; top_k 0 (or >= vocabulary) is off; top_p 1.0 is
    off; min_p 0.0 is off.  The transforms run in the fixed order
    temperature -> top-k -> top-p -> min-p (``alignzoo.common.sampling.op``).

    The float fields travel as float32 and the int fields as int64
    (``params_to_tensors``): a value is refused here when the tensor would
    not hold it, or would hold one the trainer's ``check_sampling_tensors``
    refuses (temperature 1e300 is inf in float32, top_p 1e-300 is 0), so
    whatever the server samples with, the trainer can replay.

    Stop rules (the engine's; they end a completion and change no bit of it):
    a completion stops at a token of ``stop_token_ids`` or of the model's EOS
    ids (the checkpoint's ``generation_config.json``, ``config.json`` and
    tokenizer; ``Engine(eos_token_ids=...)``), unless ``ignore_eos``, which
    turns off every token stop, ``stop_token_ids`` included, as SGLang's
    ``ignore_eos`` does; and at the first of ``stop`` (strings) that its
    decoded tail contains (needs the checkpoint's tokenizer).  Then at
    ``max_new_tokens``.  The trainer reads none of them.

    ``extras``: the model's on-request per-token extras this request wants on
    its ``Completion.extras`` beside the ones it always returns (glm5's
    "index_selected", each full indexer layer's selected positions, for index
    replay).  No step computes or copies one to the host unless a request in
    it asked; such a step runs eager (no decode graph).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_new_tokens: int = 64
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()

    def __post_init__(self):
        def is_int(x):
            return isinstance(x, int) and not isinstance(x, bool)

        def is_real(x):
            return isinstance(x, (int, float)) and not isinstance(x, bool)

        for name in ("temperature", "top_p", "min_p"):
            if not is_real(getattr(self, name)):
                raise TypeError(f"{name} must be a float, got {type(getattr(self, name)).__name__}")
        for name in ("top_k", "max_new_tokens", "seed"):
            if not is_int(getattr(self, name)):
                raise TypeError(f"{name} must be an int, got {type(getattr(self, name)).__name__}")
        for name in ("temperature", "top_p", "min_p"):
            try:
                float(getattr(self, name))
            except OverflowError:
                raise ValueError(f"{name} does not fit a float: an int of {getattr(self, name).bit_length()} bits") from None
        t, p, m = (float(self.temperature), float(self.top_p), float(self.min_p))
        t32, p32, m32 = _float32(t), _float32(p), _float32(m)
        # Each rule holds for the value given and for its float32 (the rules of check_sampling_tensors).
        if not all(v == 0.0 or (v >= bound and math.isfinite(v)) for v, bound in ((t, 1e-5), (t32, _TEMPERATURE_MIN))):
            raise ValueError(f"temperature must be 0 (greedy) or a finite value >= 1e-5 (in float32 too, "
                             f"which holds {t32}), got {self.temperature}")
        if not (0.0 < p <= 1.0 and 0.0 < p32 <= 1.0):
            raise ValueError(f"top_p must be in (0, 1] (1.0 means off; in float32 too, which holds {p32}), "
                             f"got {self.top_p}")
        if not (0.0 <= m <= 1.0 and 0.0 <= m32 <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 means off), got {self.min_p}")
        if not 0 <= self.top_k < _INT64[1]:
            raise ValueError(f"top_k must be >= 0 (0 or >= vocabulary size means off) and fit in int64, "
                             f"got {self.top_k}")
        if not 1 <= self.max_new_tokens < _INT64[1]:
            raise ValueError(f"max_new_tokens must be >= 1 and fit in int64, got {self.max_new_tokens}")
        if not _INT64[0] <= self.seed < _INT64[1]:
            raise ValueError(f"seed must fit in int64, got {self.seed}")
        if isinstance(self.stop_token_ids, (str, bytes)):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {type(self.stop_token_ids).__name__}")
        try:
            ids = tuple(self.stop_token_ids)
        except TypeError:
            raise TypeError(f"stop_token_ids must be a sequence of ints, "
                            f"got {type(self.stop_token_ids).__name__}") from None
        if any(not is_int(i) or not 0 <= i < _INT64[1] for i in ids):
            raise ValueError(f"stop_token_ids must be non-negative ints that fit in int64, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", ids)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")
        object.__setattr__(self, "stop", _stop_strings(self.stop))
        if isinstance(self.extras, str) or not all(isinstance(x, str) for x in self.extras):
            raise TypeError(f"extras must be a sequence of extra names (str), got {self.extras!r}")
        object.__setattr__(self, "extras", tuple(self.extras))


def _stop_strings(stop) -> tuple[str, ...]:
    """``stop`` as a tuple of strings (one string is one stop), each non-empty and at most MAX_STOP_CHARS."""
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, bytes) or not isinstance(stop, Sequence):
        raise TypeError(f"stop must be a string or a sequence of strings, got {type(stop).__name__}")
    stop = tuple(stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS}")
    for i, s in enumerate(stop):
        if not isinstance(s, str):
            raise TypeError(f"stop[{i}] must be a string, got {type(s).__name__}")
        if not s:
            raise ValueError(f"stop[{i}] is empty: an empty stop string would match before any text")
        if len(s) > MAX_STOP_CHARS:
            raise ValueError(f"stop[{i}] is {len(s)} characters; a stop string has at most {MAX_STOP_CHARS}")
    return stop


def params_to_tensors(
    params: Sequence[SamplingParams], steps: Sequence[int], device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """One row per request: the keyword tensors of ``sample`` / ``sample_fwd``
    (temperature, top_k, top_p, min_p, seed, step)."""
    if len(params) != len(steps):
        raise ValueError(f"{len(params)} params but {len(steps)} steps: one step per request")

    def col(name, dtype):
        return torch.tensor([getattr(p, name) for p in params], dtype=dtype, device=device)

    return {
        "temperature": col("temperature", torch.float32),
        "top_k": col("top_k", torch.int64),
        "top_p": col("top_p", torch.float32),
        "min_p": col("min_p", torch.float32),
        "seed": col("seed", torch.int64),
        "step": torch.tensor(list(steps), dtype=torch.int64, device=device),
    }
