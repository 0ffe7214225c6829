"""Our parameter names <-> Hugging Face checkpoint names, with fused weights, stacked experts and
tied embeddings (in the manner of torchtitan's ``state_dict_adapter``)."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm import tqdm

from ..sync.checksum import dtype_name
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

    def dtype(self, name):
        return self._tensors[name].dtype

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


def _widened(t: torch.Tensor) -> torch.Tensor:
    """``t``, or its exact fp32 values for a 1-byte float8 dtype (FP8 codes read as stored), which
    torch's ``isfinite`` does not take."""
    return t.float() if t.element_size() == 1 else t


def _fmt(shape: Sequence[int]) -> str:
    return str(tuple(shape))


@dataclass(frozen=True)
class Stack:
    """``count`` per-expert HF tensors stacked along a new leading dim: ``template`` names expert
    ``{expert}`` (layer indices stay ``{}``), e.g. ``"model.layers.{}.mlp.experts.{expert}.down_proj.weight"``;
    ours[j] is expert j's tensor, and ``to_hf`` unstacks it into views."""
    template: str
    count: int

    def __post_init__(self):
        if "{expert}" not in self.template:
            raise ValueError(f"Stack template {self.template!r} has no {{expert}} field")
        if isinstance(self.count, bool) or not isinstance(self.count, int) or self.count < 1:
            raise ValueError(f"Stack {self.template!r}: count must be an int >= 1, got {self.count!r}")

    def names(self, index: Sequence[str]) -> tuple[str, ...]:
        return tuple(self.template.format(*index, expert=j) for j in range(self.count))

    def label(self, index: Sequence[str]) -> str:
        """The experts' names at once: ``...experts.{0..255}.down_proj.weight``."""
        return self.template.format(*index, expert=f"{{0..{self.count - 1}}}")


@dataclass(frozen=True)
class Fuse:
    """Ours is the concatenation of ``parts`` (HF templates or ``Stack``) along ``dim`` (negative
    counts from the end); ``to_hf`` splits it back by ``sizes`` (each part's extent along ``dim``),
    or by the extents ``from_hf`` found in the checkpoint.  Fused gate/up experts, as transformers
    stores them: ``Fuse((Stack(gate, E), Stack(up, E)), dim=1)`` -> (E, 2I, H)."""
    parts: tuple[str | Stack, ...]
    dim: int = 0
    sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        parts = (self.parts,) if isinstance(self.parts, (str, Stack)) else tuple(self.parts)
        if not parts or not all(isinstance(p, (str, Stack)) for p in parts):
            raise TypeError(f"Fuse parts must be HF templates or Stack, got {self.parts!r}")
        object.__setattr__(self, "parts", parts)
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(self.sizes))
            if len(self.sizes) != len(parts):
                raise ValueError(f"Fuse of {len(parts)} parts has {len(self.sizes)} sizes")


@dataclass(frozen=True)
class OneOf:
    """Alternative checkpoint layouts of one tensor, e.g. per-expert tensors or transformers' fused
    ``experts.gate_up_proj``: ``from_hf`` reads the first one the checkpoint holds completely and
    ``to_hf`` writes the one it read (the first before any read)."""
    options: tuple

    def __post_init__(self):
        if not self.options:
            raise ValueError("OneOf needs at least one option")
        object.__setattr__(self, "options", tuple(_as_fuse(o) for o in self.options))


def _as_fuse(spec) -> Fuse:
    if isinstance(spec, Fuse):
        return spec
    if isinstance(spec, (str, Stack)):
        return Fuse((spec,))
    if isinstance(spec, Sequence):
        return Fuse(tuple(spec))
    raise TypeError(f"a name map entry is an HF template, a Stack, a Fuse, a OneOf or a tuple of templates, "
                    f"got {spec!r}")


@dataclass
class _Layout:
    """One option of one of our tensors, its layer indices filled in."""
    fuse: Fuse
    option: int
    names: list[tuple[str, ...]]  # per part: its HF name, or one per expert
    labels: list[str]  # per part, for messages

    @property
    def flat(self) -> tuple[str, ...]:
        return tuple(n for names in self.names for n in names)

    @property
    def single(self) -> bool:
        return len(self.names) == 1 and isinstance(self.fuse.parts[0], str)


class NameMap:
    """Templates from our names to HF names; ``"{}"`` is a layer index (several are filled in order).

    ``mapping[ours]`` is one HF template; a tuple of them for a FUSED weight: ours is the
    concatenation of the HF tensors along dim 0, and ``to_hf`` splits it back by
    ``split_sizes[our template]`` (rows of each part), or by the rows ``from_hf`` found in the
    checkpoint when no sizes are given; a ``Fuse`` to concatenate along another dim; a ``Stack`` of
    per-expert tensors (a new leading dim), alone or as parts of a ``Fuse``; or a ``OneOf`` of
    these, for checkpoints that store a tensor in more than one layout. With
    ``tie_word_embeddings``, each ``tied[a] = b`` (e.g. ``lm_head.weight`` -> ``embed.weight``) lets
    HF tensor ``a`` be absent from the checkpoint (b's is read instead) and drops ``a`` when saving;
    without it ``a`` is required like any other. HF names matching a regex of ``ignore`` are
    skipped, named in a debug log message.  Our names ending in one of ``integer_names`` (a routing table
    such as DeepSeek-V4's ``tid2eid``) are read from integer tensors, cast only where every value survives.
    """

    def __init__(
        self,
        mapping: Mapping[str, str | Sequence[str] | Stack | Fuse | OneOf],
        *,
        split_sizes: Mapping[str, Sequence[int]] | None = None,
        tied: Mapping[str, str] | None = None,
        tie_word_embeddings: bool = False,
        ignore: Sequence[str] = DEFAULT_IGNORE,
        name: str = "model",
        integer_names: Sequence[str] = (),
    ):
        self.integer_names = tuple(integer_names)
        self.mapping: dict[str, tuple[Fuse, ...]] = {
            k: v.options if isinstance(v, OneOf) else (_as_fuse(v),) for k, v in mapping.items()}
        self.split_sizes = {k: tuple(v) for k, v in (split_sizes or {}).items()}
        for ours, sizes in self.split_sizes.items():
            options = self.mapping.get(ours, ())
            if len(options) > 1:
                raise ValueError(f"split_sizes[{ours!r}]: {ours} has {len(options)} layouts; give each Fuse its sizes")
            n = len(options[0].parts) if options else 0
            if len(sizes) != n:
                raise ValueError(f"split_sizes[{ours!r}] has {len(sizes)} sizes for {n} HF parts")
            self.mapping[ours] = (replace(options[0], sizes=sizes),)
        self.tied = dict(tied or {})
        self.tie_word_embeddings = tie_word_embeddings
        self.ignore = [re.compile(p) for p in ignore]
        self.name = name
        self._patterns = [(_template_regex(t), t) for t in self.mapping if "{}" in t]
        self._recorded_sizes: dict[str, tuple[int, ...]] = {}
        self._chosen: dict[str, int] = {}  # ours -> the option from_hf read

    def _template(self, ours: str) -> tuple[str, tuple[str, ...]] | None:
        if ours in self.mapping:
            return ours, ()
        for regex, template in self._patterns:
            m = regex.match(ours)
            if m:
                return template, m.groups()
        return None

    def _layouts(self, ours: str) -> list[_Layout] | None:
        found = self._template(ours)
        if found is None:
            return None
        template, index = found
        out = []
        for i, fuse in enumerate(self.mapping[template]):
            names = [p.names(index) if isinstance(p, Stack) else (p.format(*index),) for p in fuse.parts]
            labels = [p.label(index) if isinstance(p, Stack) else p.format(*index) for p in fuse.parts]
            out.append(_Layout(fuse, i, names, labels))
        return out

    def _layout(self, ours: str) -> _Layout | None:
        """The layout ``from_hf`` read ``ours`` in, else its first."""
        layouts = self._layouts(ours)
        return None if layouts is None else layouts[self._chosen.get(ours, 0)]

    def hf_names(self, ours: str) -> tuple[str, ...] | None:
        """The HF names ``ours`` is read from (several for a fused or stacked weight), or None if unmapped."""
        layout = self._layout(ours)
        return None if layout is None else layout.flat

    def _layouts_or_raise(self, names) -> dict[str, list[_Layout]]:
        layouts = {n: self._layouts(n) for n in names}
        unmapped = [n for n, p in layouts.items() if p is None]
        if unmapped:
            raise KeyError(f"{self.name} name map has no HF name for {len(unmapped)} tensor(s): {', '.join(unmapped)}")
        return layouts

    @staticmethod
    def _dim(ours: str, fuse: Fuse, ndim: int) -> int:
        if not -ndim <= fuse.dim < ndim:
            raise ValueError(f"{ours}: fused along dim {fuse.dim}, but it has {ndim} dims")
        return fuse.dim % ndim

    def _check_shapes(self, ours, shape, lay: _Layout, src) -> tuple[list[str], tuple[int, ...] | None]:
        """(mis-shape messages, the parts' extents along the fused dim) for ``lay`` read into ``ours``."""
        if lay.single:
            p = lay.flat[0]
            found = tuple(src.shape(p))
            return ([] if found == shape else [f"{p}: expected {_fmt(shape)}, found {_fmt(found)}"]), None
        d = self._dim(ours, lay.fuse, len(shape))
        found = []  # per part: its shape as a part of ours (a Stack's with the experts' dim)
        for part, names in zip(lay.fuse.parts, lay.names):
            first = tuple(src.shape(names[0]))
            found.append((part.count, *first) if isinstance(part, Stack) else first)
        sizes = lay.fuse.sizes
        if sizes is None:
            if len(lay.names) == 1:
                sizes = (shape[d],)
            else:
                if any(len(f) != len(shape) for f in found):
                    return [f"{label}: expected a {len(shape)}-dim part of {ours} {_fmt(shape)}, found {_fmt(f)}"
                            for label, f in zip(lay.labels, found) if len(f) != len(shape)], None
                sizes = tuple(f[d] for f in found)
                if sum(sizes) != shape[d]:
                    along = "rows" if d == 0 else f"along dim {d}"
                    cat = f"cat({', '.join(lay.labels)})"
                    return [f"{cat} for {ours}: expected {shape[d]} {along}, found {sum(sizes)}"], None
        bad = []
        for part, names, size, got in zip(lay.fuse.parts, lay.names, sizes, found):
            want = shape[:d] + (size,) + shape[d + 1:]
            if not isinstance(part, Stack):
                if got != want:
                    bad.append(f"{names[0]}: expected {_fmt(want)}, found {_fmt(got)} (part of {ours} {_fmt(shape)})")
                continue
            if want[0] != part.count:
                bad.append(f"{part.template}: {part.count} experts, but {ours} {_fmt(shape)} stacks {want[0]}")
                continue
            for j, n in enumerate(names):
                got = tuple(src.shape(n))
                if got != want[1:]:
                    bad.append(f"{n}: expected {_fmt(want[1:])}, found {_fmt(got)} "
                               f"(expert {j} of {ours} {_fmt(shape)})")
        return bad, sizes

    def _missing(self, ours: str, lay: _Layout, src) -> list[str]:
        out = []
        for part, names, label in zip(lay.fuse.parts, lay.names, lay.labels):
            absent = [(j, n) for j, n in enumerate(names) if n not in src]
            if not absent:
                continue
            if not isinstance(part, Stack):
                out.append(label if lay.single else f"{label} (part of {ours})")
            elif len(absent) == len(names):
                out.append(f"{label} (all {part.count} experts of {ours})")
            else:
                out += [f"{n} (expert {j} of {ours})" for j, n in absent]
        return out

    def from_hf(
        self,
        source,
        expected: Mapping[str, tuple[Sequence[int], torch.dtype]],
        *,
        device: torch.device | str = "cpu",
    ) -> dict[str, torch.Tensor]:
        """Our tensors ``{name: tensor}`` for every ``expected[name] = (shape, dtype)``, cast to that dtype.

        ``source``: a checkpoint directory, an ``HFCheckpoint`` or a ``{hf_name: tensor}`` dict
        (wrap it in ``formats.DequantizedSource`` for quantized weights).  Shapes are checked from
        the headers before any tensor is read; every missing (a stack's absent experts by name),
        unexpected and mis-shaped tensor is reported in one ``WeightMismatchError``.  A tensor
        stored in an integer or bool dtype (a cast would invent its values), or holding NaN/Inf
        after the cast, raises ``CheckpointError`` naming it.
        """
        candidates = self._layouts_or_raise(expected)
        with open_source(source) as src:
            plan: dict[str, _Layout] = {}
            own: set[str] = set()  # read in a layout of its own, not its tied partner's
            sizes_of: dict[str, tuple[int, ...] | None] = {}
            missing, misshaped, notes, not_float = [], [], [], []
            for ours, layouts in candidates.items():
                complete = [lay for lay in layouts if all(p in src for p in lay.flat)]
                tied_to = self.tied.get(ours) if self.tie_word_embeddings else None
                if tied_to is not None and not complete:
                    log.debug("%s: %s is absent; tied embeddings, reading %s", self.name, ours, tied_to)
                    layouts = self._layouts(tied_to)
                    complete = [lay for lay in layouts if all(p in src for p in lay.flat)]
                else:
                    own.add(ours)
                lay = complete[0] if complete else max(layouts, key=lambda lay: sum(p in src for p in lay.flat))
                plan[ours] = lay
                if not complete:
                    absent = self._missing(ours, lay, src)
                    missing += absent
                    if not self.tie_word_embeddings and ours in self.tied:
                        notes += [f"{a} is required: config has tie_word_embeddings false" for a in absent]
                    if len(layouts) > 1:
                        notes.append(f"{ours}: no layout is complete ({' | '.join(', '.join(lay.labels) for lay in layouts)}); "
                                     f"missing lists the closest")
                    continue
                bad, sizes = self._check_shapes(ours, tuple(expected[ours][0]), lay, src)
                misshaped += bad
                sizes_of[ours] = sizes
                is_float = getattr(src, "is_float", None)
                if is_float is not None and not (self.integer_names and ours.endswith(self.integer_names)):
                    not_float += [p for p in lay.flat if not is_float(p)]

            claimed = {p for lay in plan.values() for p in lay.flat}
            optional = set()
            if self.tie_word_embeddings:
                optional = {p for a in self.tied for lay in (self._layouts(a) or ()) for p in lay.flat}
            extras = [k for k in src.keys() if k not in claimed]
            skipped, unexpected = [], []
            for k in extras:
                (skipped if k in optional or any(r.search(k) for r in self.ignore) else unexpected).append(k)
            where = f"{self.name} checkpoint {getattr(src, 'path', src)}"
            if missing or unexpected or misshaped:
                raise WeightMismatchError(where, missing, unexpected, misshaped, notes)
            if skipped:
                log.debug("%s: ignored %d checkpoint tensor(s): %s", self.name, len(skipped), ", ".join(skipped))
            if not_float:
                raise CheckpointError(f"{where}: {len(not_float)} weight(s) not stored as floating point (a cast "
                                      f"would invent their values): {', '.join(not_float)}")
            for ours, lay in plan.items():
                if ours in own:
                    self._chosen[ours] = lay.option
                if sizes_of[ours] is not None and lay.fuse.sizes is None:
                    self._recorded_sizes[ours] = sizes_of[ours]

            out = {}
            bar = tqdm(plan.items(), desc=f"loading {self.name}", unit="tensor", file=sys.stderr,
                       disable=not sys.stderr.isatty(), leave=False)
            for ours, lay in bar:
                shape, dtype = tuple(expected[ours][0]), expected[ours][1]
                out[ours] = self._read(where, src, ours, lay, shape, dtype, sizes_of[ours], device)
            return out

    def _read(self, where, src, ours, lay: _Layout, shape, dtype, sizes, device) -> torch.Tensor:
        integer = bool(self.integer_names) and ours.endswith(self.integer_names)

        def get(p):
            t = src.get(p)
            if integer:
                if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
                    raise CheckpointError(f"{where}: {p} is stored as {t.dtype}; an integer tensor is expected")
                if not torch.equal(t.to(dtype).to(t.dtype), t):
                    raise CheckpointError(f"{where}: {p} ({t.dtype}) has values that {dtype_name(dtype)} cannot hold")
                return t
            if not t.dtype.is_floating_point:
                raise CheckpointError(f"{where}: {p} is stored as {t.dtype}, not floating point (a cast "
                                      f"would invent its values)")
            return t

        if lay.single:
            t = get(lay.flat[0]).to(device=device, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=dtype, device=device)
            d, offset = self._dim(ours, lay.fuse, len(shape)), 0
            for part, names, size in zip(lay.fuse.parts, lay.names, sizes):
                dst = t.narrow(d, offset, size)
                offset += size
                if isinstance(part, Stack):
                    for j, p in enumerate(names):
                        dst[j].copy_(get(p))
                else:
                    dst.copy_(get(names[0]))
        if not bool(torch.isfinite(_widened(t)).all()):
            for p in lay.flat:
                bad = int((~torch.isfinite(_widened(src.get(p).to(dtype)))).sum())
                if bad:
                    raise CheckpointError(f"{where}: {p} holds {bad} NaN/Inf value(s) (as "
                                          f"{dtype_name(dtype)}); refusing to serve them")
        return t

    def to_hf(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """HF ``{name: tensor}`` for our ``tensors``: fused weights split into views along their dim,
        stacked experts unstacked into views, in the layout ``from_hf`` read (the first before)."""
        if self.tie_word_embeddings:
            tensors = {k: v for k, v in tensors.items() if k not in self.tied}
        out = {}
        for ours, layouts in self._layouts_or_raise(tensors).items():
            lay = layouts[self._chosen.get(ours, 0)]
            t = tensors[ours].detach()
            if lay.single:
                out[lay.flat[0]] = t
                continue
            d = self._dim(ours, lay.fuse, t.dim())
            sizes = lay.fuse.sizes or self._recorded_sizes.get(ours)
            if sizes is None and len(lay.names) == 1:
                sizes = (t.shape[d],)
            if sizes is None:
                raise KeyError(f"{self.name}: no split sizes for fused {ours}; give split_sizes or load with from_hf first")
            if sum(sizes) != t.shape[d]:
                along = "rows" if d == 0 else f"along dim {d}"
                raise ValueError(f"{self.name}: {ours} has {t.shape[d]} {along}, its parts {tuple(lay.labels)} need "
                                 f"{sum(sizes)} = {' + '.join(map(str, sizes))}")
            for part, names, piece in zip(lay.fuse.parts, lay.names, torch.split(t, list(sizes), dim=d)):
                if not isinstance(part, Stack):
                    out[names[0]] = piece
                    continue
                if piece.shape[0] != part.count:
                    raise ValueError(f"{self.name}: {ours} {_fmt(t.shape)} stacks {piece.shape[0]} experts, "
                                     f"{part.template} has {part.count}")
                out.update(zip(names, piece.unbind(0)))
        return out
