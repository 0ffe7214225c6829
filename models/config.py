"""What every model config shares: reading a transformers ``config.json`` and
checking the fields a config dataclass holds, so that a bad file fails with
its own name and the field it got wrong, the same way for every model."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any

from ..weights import CheckpointError, read_hf_config


def read_config_json(config: dict[str, Any] | str | os.PathLike, model: str,
                     where: str | None = None) -> tuple[dict[str, Any], str]:
    """(the parsed config, the name errors give it) from the dict, a
    checkpoint directory or the file itself."""
    if isinstance(config, dict):
        return config, where or f"the {model} config"
    path = os.fspath(config)
    if os.path.isdir(path):
        return read_hf_config(path), os.path.join(path, "config.json")
    with open(path) as f:
        try:
            parsed = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise CheckpointError(f"{path} holds a JSON {type(parsed).__name__}, expected an object")
    return parsed, path


def require_keys(config: dict[str, Any], keys: tuple[str, ...], where: str, what: str) -> None:
    missing = [k for k in keys if k not in config]
    if missing:
        raise CheckpointError(f"{where} lacks {', '.join(missing)}: {what} needs {', '.join(keys)}")


@contextmanager
def errors_name(where: str):
    """Within: a field's error (ours first, transformers' after) is
    prefixed by the file it came from; an unsupported option stays
    NotImplementedError."""
    try:
        yield
    except (NotImplementedError, CheckpointError):
        raise
    except Exception as e:
        raise CheckpointError(f"{where}: {e}") from e


def check_fields(cfg, ints: Iterable[str], reals: Iterable[str] = ("rms_norm_eps", "rope_theta")) -> None:
    """Positive ints, finite reals > 0 and a bool ``tie_word_embeddings`` (a
    string "false" in a config.json would read as true)."""
    name = type(cfg).__name__
    for f in ints:
        v = getattr(cfg, f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}.{f} must be a positive int, got {v!r}")
    for f in reals:
        v = getattr(cfg, f)
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
            raise ValueError(f"{name}.{f} must be a finite number > 0, got {v!r}")
    if not isinstance(cfg.tie_word_embeddings, bool):
        raise ValueError(f"{name}.tie_word_embeddings must be a bool (true or false in config.json), "
                         f"got {cfg.tie_word_embeddings!r}")
