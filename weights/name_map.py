"""Our parameter names <-> Hugging Face checkpoint names, with fused weights and tied embeddings
(in the manner of torchtitan's ``state_dict_adapter``)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence

import torch
from tqdm import tqdm

from .checkpoint import CheckpointError, HFCheckpoint

log = logging.getLogger(__name__)

# Buffers some exporters write that no model parameter comes from.
DEFAULT_IGNORE = (r"(^|\.)rotary_emb\.inv_freq$",)


class WeightMismatchError(CheckpointError):
    """A checkpoint whose tensors do not match the model: lists every missing, unexpected and
    mis-shaped tensor at once."""

    def __init__(self, where: str, missing: list[str], unexpected: list[str], misshaped: list[str], notes=()):
        self.missing, self.unexpected, self.misshaped = missing, unexpected, misshaped
        lines = [
            f"{where} does not match the model: {len(missing)} missing, {len(unexpected)} unexpected, "
            f"{len(misshaped)} mis-shaped tensor(s)"
        ]
        for title, items in (("missing", missing), ("unexpected", unexpected), ("mis-shaped", misshaped)):
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines += [f"  {item}" for item in items]
        lines += list(notes)
        super().__init__("\n".join(lines))


class _DictSource:
    """A ``{hf_name: tensor}`` dict read through the same calls as ``HFCheckpoint``."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = tensors

    def keys(self):
        return list(self._tensors)

    def __contains__(self, name):
        return name in self._tensors

    def shape(self, name):
        return tuple(self._tensors[name].shape)

    def is_float(self, name):
        return self._tensors[name].dtype.is_floating_point

    def get(self, name):
        return self._tensors[name]

    def __repr__(self):
        return f"state dict of {len(self._tensors)} tensors"


@contextlib.contextmanager
def open_source(source) -> Iterator[HFCheckpoint | _DictSource]:
    """A checkpoint directory (opened and closed here), an open ``HFCheckpoint``, or a dict of HF tensors."""
    if isinstance(source, (str, os.PathLike)):
        with HFCheckpoint(source) as ckpt:
            yield ckpt
    elif isinstance(source, Mapping):
        yield _DictSource(source)
    else:
        yield source


def _template_regex(template: str) -> re.Pattern:
    return re.compile("^" + r"(\d+)".join(re.escape(p) for p in template.split("{}")) + "$")


def _fmt(shape: Sequence[int]) -> str:
    return str(tuple(shape))


class NameMap:
    """Templates from our names to HF names; ``"{}"`` is a layer index (several are filled in order).

    ``mapping[ours]`` is one HF template, or a tuple of them for a FUSED weight: ours is the
    concatenation of the HF tensors along dim 0, and ``to_hf`` splits it back by
    ``split_sizes[our template]`` (rows of each part), or by the rows ``from_hf`` found in the checkpoint
    when no sizes are given. With ``tie_word_embeddings``, each ``tied[a] = b`` (e.g.
    ``lm_head.weight`` -> ``embed.weight``) lets HF tensor ``a`` be absent from the checkpoint (b's is
    read instead) and drops ``a`` when saving; without it ``a`` is required like any other. HF names
    matching a regex of ``ignore`` are skipped, named in a debug log message.
    """

    def __init__(
        self,
        mapping: Mapping[str, str | Sequence[str]],
        *,
        split_sizes: Mapping[str, Sequence[int]] | None = None,
        tied: Mapping[str, str] | None = None,
        tie_word_embeddings: bool = False,
        ignore: Sequence[str] = DEFAULT_IGNORE,
        name: str = "model",
    ):
        self.mapping = {k: (v,) if isinstance(v, str) else tuple(v) for k, v in mapping.items()}
        self.split_sizes = {k: tuple(v) for k, v in (split_sizes or {}).items()}
        self.tied = dict(tied or {})
        self.tie_word_embeddings = tie_word_embeddings
        self.ignore = [re.compile(p) for p in ignore]
        self.name = name
        self._patterns = [(_template_regex(t), t) for t in self.mapping if "{}" in t]
        self._recorded_sizes: dict[str, tuple[int, ...]] = {}
        for ours, sizes in self.split_sizes.items():
            if len(sizes) != len(self.mapping.get(ours, ())):
                raise ValueError(f"split_sizes[{ours!r}] has {len(sizes)} sizes for {len(self.mapping.get(ours, ()))} HF parts")

    def _template(self, ours: str) -> tuple[str, tuple[str, ...]] | None:
        if ours in self.mapping:
            return ours, ()
        for regex, template in self._patterns:
            m = regex.match(ours)
            if m:
                return template, m.groups()
        return None

    def hf_names(self, ours: str) -> tuple[str, ...] | None:
        """The HF names ``ours`` is read from (several for a fused weight), or None if unmapped."""
        found = self._template(ours)
        if found is None:
            return None
        template, index = found
        return tuple(t.format(*index) for t in self.mapping[template])

    def _hf_names_or_raise(self, names) -> dict[str, tuple[str, ...]]:
        parts = {n: self.hf_names(n) for n in names}
        unmapped = [n for n, p in parts.items() if p is None]
        if unmapped:
            raise KeyError(f"{self.name} name map has no HF name for {len(unmapped)} tensor(s): {', '.join(unmapped)}")
        return parts

    def _check_shapes(self, ours, shape, parts, found) -> list[str]:
        """Mis-shape messages for HF ``parts`` (shapes ``found``) read into ``ours`` of ``shape``."""
        if len(parts) == 1:
            return [] if found[0] == shape else [f"{parts[0]}: expected {_fmt(shape)}, found {_fmt(found[0])}"]
        sizes = self.split_sizes.get(self._template(ours)[0])
        if sizes is None:
            rows = sum(f[0] for f in found if f)
            if rows != shape[0]:
                return [f"cat({', '.join(parts)}) for {ours}: expected {shape[0]} rows, found {rows}"]
            sizes = [f[0] for f in found]
        return [
            f"{p}: expected {_fmt(want)}, found {_fmt(got)} (part of {ours} {_fmt(shape)})"
            for p, want, got in zip(parts, [(n, *shape[1:]) for n in sizes], found)
            if want != got
        ]

    def from_hf(
        self,
        source,
        expected: Mapping[str, tuple[Sequence[int], torch.dtype]],
        *,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Our tensors ``{name: tensor}`` for every ``expected[name] = (shape, dtype)``, cast to that dtype.

        ``source``: a checkpoint directory, an ``HFCheckpoint`` or a ``{hf_name: tensor}`` dict.
        Shapes are checked from the headers before any tensor is read; every missing, unexpected
        and mis-shaped tensor is reported in one ``WeightMismatchError``.  A tensor stored in an
        integer or bool dtype (a cast would invent its values), or holding NaN/Inf after the cast,
        raises ``CheckpointError`` naming it.
        """
        plan = self._hf_names_or_raise(expected)
        with open_source(source) as src:
            missing, misshaped, notes, not_float = [], [], [], []
            for ours, parts in plan.items():
                tied_to = self.tied.get(ours) if self.tie_word_embeddings else None
                if tied_to is not None and not all(p in src for p in parts):
                    log.debug("%s: %s is absent; tied embeddings, reading %s", self.name, ours, tied_to)
                    parts = plan[ours] = self.hf_names(tied_to)
                absent = [p for p in parts if p not in src]
                for p in absent:
                    missing.append(p if len(parts) == 1 else f"{p} (part of {ours})")
                    if not self.tie_word_embeddings and ours in self.tied:
                        notes.append(f"{p} is required: config has tie_word_embeddings false")
                if absent:
                    continue
                found = [tuple(src.shape(p)) for p in parts]
                misshaped += self._check_shapes(ours, tuple(expected[ours][0]), parts, found)
                is_float = getattr(src, "is_float", None)
                if is_float is not None:
                    not_float += [p for p in parts if not is_float(p)]
                if len(parts) > 1 and self._template(ours)[0] not in self.split_sizes:
                    self._recorded_sizes[ours] = tuple(f[0] for f in found)

            claimed = {p for parts in plan.values() for p in parts}
            optional = set()
            if self.tie_word_embeddings:
                optional = {p for a in self.tied for p in (self.hf_names(a) or ())}
            extras = [k for k in src.keys() if k not in claimed]
            skipped, unexpected = [], []
            for k in extras:
                (skipped if k in optional or any(r.search(k) for r in self.ignore) else unexpected).append(k)
            if missing or unexpected or misshaped:
                raise WeightMismatchError(f"{self.name} checkpoint {getattr(src, 'path', src)}", missing, unexpected,
                                          misshaped, notes)
            if skipped:
                log.debug("%s: ignored %d checkpoint tensor(s): %s", self.name, len(skipped), ", ".join(skipped))
            where = f"{self.name} checkpoint {getattr(src, 'path', src)}"
            if not_float:
                raise CheckpointError(f"{where}: {len(not_float)} weight(s) not stored as floating point (a cast "
                                      f"would invent their values): {', '.join(not_float)}")

            out = {}
            bar = tqdm(plan.items(), desc=f"loading {self.name}", unit="tensor", file=sys.stderr,
                       disable=not sys.stderr.isatty(), leave=False)
            for ours, parts in bar:
                raw = [src.get(p) for p in parts]
                for p, t in zip(parts, raw):
                    if not t.dtype.is_floating_point:
                        raise CheckpointError(f"{where}: {p} is stored as {t.dtype}, not floating point (a cast "
                                              f"would invent its values)")
                dtype = expected[ours][1]
                t = (raw[0] if len(raw) == 1 else torch.cat(raw)).to(device=device, dtype=dtype)
                if not bool(torch.isfinite(t).all()):
                    for p, r in zip(parts, raw):
                        bad = int((~torch.isfinite(r.to(dtype))).sum())
                        if bad:
                            raise CheckpointError(f"{where}: {p} holds {bad} NaN/Inf value(s) (as "
                                                  f"{str(dtype).removeprefix('torch.')}); refusing to serve them")
                out[ours] = t
            return out

    def to_hf(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF ``{name: tensor}`` for our ``tensors``; fused weights are split into views (dim 0)."""
        if self.tie_word_embeddings:
            tensors = {k: v for k, v in tensors.items() if k not in self.tied}
        out = {}
        for ours, parts in self._hf_names_or_raise(tensors).items():
            t = tensors[ours].detach()
            if len(parts) == 1:
                out[parts[0]] = t
                continue
            sizes = self.split_sizes.get(self._template(ours)[0]) or self._recorded_sizes.get(ours)
            if sizes is None:
                raise KeyError(f"{self.name}: no split sizes for fused {ours}; give split_sizes or load with from_hf first")
            if sum(sizes) != t.shape[0]:
                raise ValueError(f"{self.name}: {ours} has {t.shape[0]} rows, its parts {parts} need {sum(sizes)} = {' + '.join(map(str, sizes))}")
            out.update(zip(parts, torch.split(t, list(sizes), dim=0)))
        return out
