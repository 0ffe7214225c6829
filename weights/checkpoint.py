"""Hugging Face checkpoint directories: ``config.json`` plus safetensors, one file or index + shards.

Pickled checkpoints (``pytorch_model.bin``) are refused: unpickling one runs whatever code it holds.
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_INDEX_NAME = "model.safetensors.index.json"
PICKLED_NAMES = ("pytorch_model.bin", "pytorch_model.bin.index.json")
DEFAULT_MAX_SHARD_BYTES = 5 * 2**30
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# safetensors header dtypes; quantized formats check codes and scales from these before any read.
_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
                       "F4": "float4_e2m1fn_x2", "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8",
                       "U8": "uint8", "U16": "uint16", "U32": "uint32", "U64": "uint64", "BOOL": "bool"}


class CheckpointError(ValueError):
    """A checkpoint that exists but cannot be used as it is."""


def _checkpoint_dir(path: str | os.PathLike) -> Path:
    d = Path(path)
    if not d.exists():
        raise FileNotFoundError(f"checkpoint directory {d} does not exist")
    if not d.is_dir():
        raise NotADirectoryError(f"checkpoint path {d} is not a directory")
    return d


def read_hf_config(path: str | os.PathLike) -> dict:
    """The parsed ``config.json`` of checkpoint directory ``path``."""
    f = _checkpoint_dir(path) / CONFIG_NAME
    if not f.is_file():
        raise FileNotFoundError(f"{f} is missing: a Hugging Face checkpoint keeps its config.json beside the weights")
    try:
        config = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise CheckpointError(f"{f} holds a JSON {type(config).__name__}, expected an object")
    return config


def check_model_type(config: Mapping, model_type: str, architectures: Iterable[str]) -> None:
    """Raise unless ``config`` (a parsed config.json) describes ``model_type`` with one of ``architectures``."""
    architectures = tuple(architectures)
    got_type = config.get("model_type")
    got_arch = list(config.get("architectures") or [])
    if got_type != model_type or (got_arch and not set(got_arch) & set(architectures)):
        listed = ", ".join(got_arch) or "no architectures listed"
        raise CheckpointError(
            f"checkpoint is {got_type} ({listed}), not {model_type} (expected model_type {model_type!r} "
            f"and one of {', '.join(architectures)})"
        )


class HFCheckpoint:
    """Lazy reader of the tensors of one checkpoint directory.

    Reads ``model.safetensors`` or, failing that, ``model.safetensors.index.json`` and the shards
    its ``weight_map`` names. A shard is opened with ``safe_open`` (memory-mapped) the first time
    one of its tensors is asked for; ``shape`` reads only the header. Use as a context manager, or
    call ``close``.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = _checkpoint_dir(path)
        self._handles: dict[str, object] = {}
        single, index = self.path / SAFE_WEIGHTS_NAME, self.path / SAFE_INDEX_NAME
        if single.is_file():
            self._shard_of = dict.fromkeys(self._open(SAFE_WEIGHTS_NAME).keys(), SAFE_WEIGHTS_NAME)
        elif index.is_file():
            self._shard_of = self._read_index(index)
        else:
            pickled = [n for n in PICKLED_NAMES if (self.path / n).is_file()]
            if pickled:
                raise CheckpointError(
                    f"{self.path} holds only {pickled[0]}: pickled checkpoints are refused, since unpickling "
                    f"runs arbitrary code. Convert it once, where you trust its origin: "
                    f"`python -c \"from transformers import AutoModelForCausalLM as M; "
                    f"M.from_pretrained('{self.path}').save_pretrained('OUT_DIR')\"` writes safetensors."
                )
            raise FileNotFoundError(f"{self.path} has neither {SAFE_WEIGHTS_NAME} nor {SAFE_INDEX_NAME}")

    def _read_index(self, index: Path) -> dict[str, str]:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a safetensors index with a weight_map: {e!r}") from e
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
        outside = sorted({s for s in weight_map.values() if Path(s).name != s})
        if outside:
            raise CheckpointError(f"{index} names shards outside the checkpoint directory: {', '.join(outside)}")
        absent = sorted({s for s in weight_map.values() if not (self.path / s).is_file()})
        if absent:
            raise FileNotFoundError(
                f"{index} names {len(absent)} shard(s) missing from {self.path}: {', '.join(absent)}"
            )
        return dict(weight_map)

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            handle = safe_open(str(self.path / shard), framework="pt", device="cpu")
            if hasattr(self, "_shard_of"):
                held = set(handle.keys())
                absent = [n for n, s in self._shard_of.items() if s == shard and n not in held]
                if absent:
                    handle.__exit__(None, None, None)
                    raise CheckpointError(
                        f"{SAFE_INDEX_NAME} in {self.path} places {len(absent)} tensor(s) in {shard}, "
                        f"which does not hold them: {', '.join(absent)}"
                    )
            self._handles[shard] = handle
        return handle

    def _shard(self, name: str) -> str:
        try:
            return self._shard_of[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in checkpoint {self.path}") from None

    def keys(self) -> list[str]:
        return list(self._shard_of)

    def __contains__(self, name: object) -> bool:
        return name in self._shard_of

    def __len__(self) -> int:
        return len(self._shard_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._shard(name)).get_slice(name).get_shape())

    def is_float(self, name: str) -> bool:
        """Whether tensor ``name`` is stored as floating point (from the header: F32, BF16, F8_E4M3, ...)."""
        return self._open(self._shard(name)).get_slice(name).get_dtype().startswith(("F", "BF"))

    def dtype(self, name: str) -> torch.dtype | None:
        """The torch dtype tensor ``name`` is stored in (from the header); None for one torch lacks."""
        stored = self._open(self._shard(name)).get_slice(name).get_dtype()
        return getattr(torch, _SAFETENSORS_DTYPES.get(stored, ""), None)

    def get(self, name: str) -> torch.Tensor:
        """Tensor ``name`` on the CPU, in the dtype it is stored in."""
        return self._open(self._shard(name)).get_tensor(name)

    def close(self) -> None:
        for handle in self._handles.values():
            handle.__exit__(None, None, None)
        self._handles.clear()

    def __enter__(self) -> HFCheckpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        shard_of = getattr(self, "_shard_of", {})
        return f"HFCheckpoint({str(self.path)!r}, {len(shard_of)} tensors in {len(set(shard_of.values()))} file(s))"


def _owning_cpu_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors, each the sole user of its storage: safetensors refuses shared memory
    (tied embeddings, or the q/k/v views of one fused weight)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        t = t.detach().to("cpu").contiguous()
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() != t.nbytes:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Names grouped into shards in their given order; a tensor larger than the limit gets its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        n = t.nbytes
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write_atomic(final: Path, write: Callable[[str], None]) -> None:
    """``write(tmp)`` then rename over ``final``: a reader sees the old file or the whole new one."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def _write_json_atomic(final: Path, obj: object) -> None:
    _write_atomic(final, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n"))


def save_hf_checkpoint(
    path: str | os.PathLike,
    config: Mapping,
    tensors: Mapping[str, torch.Tensor],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Write ``config`` as config.json and ``tensors`` (HF names) as safetensors, as transformers does.

    One ``model.safetensors`` when everything fits in ``max_shard_bytes``, else
    ``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
    (``metadata.total_size``, ``weight_map``). Each file is written under a temporary name and
    renamed; weights go first and config.json last, and weight files of an earlier save that the new
    one does not use are removed. Returns the weight file names written.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    owned = _owning_cpu_copies(tensors)
    shards = _plan_shards(owned, max_shard_bytes)
    n = len(shards)
    files = [SAFE_WEIGHTS_NAME] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for file, names in zip(files, shards):
        part = {k: owned[k] for k in names}
        _write_atomic(d / file, lambda tmp, part=part: save_file(part, tmp, metadata={"format": "pt"}))
    if n > 1:
        weight_map = {k: file for file, names in zip(files, shards) for k in names}
        total = sum(t.nbytes for t in owned.values())
        _write_json_atomic(d / SAFE_INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    for old in d.iterdir():
        stale_weights = old.name == SAFE_WEIGHTS_NAME or _SHARD_NAME.fullmatch(old.name)
        if (stale_weights and old.name not in files) or (old.name == SAFE_INDEX_NAME and n == 1):
            old.unlink()
    _write_json_atomic(d / CONFIG_NAME, dict(config))
    return files
