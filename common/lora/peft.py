"""LoRA adapters in the Hugging Face PEFT layout: ``adapter_config.json`` plus
``adapter_model.safetensors`` whose tensors are named
``base_model.model.<hf module>.lora_A.weight`` (r, K) and ``...lora_B.weight`` (N, r).

Only safetensors is read or written (a pickled ``adapter_model.bin`` is refused).
The caller maps module names: ``to_hf("layers.0.q")`` -> ``"model.layers.0.self_attn.q_proj"``
and ``from_hf`` back.

LoRA on a parameter (PEFT's ``target_parameters``: an MoE layer's stacked experts): the caller's
name maps to ``"<hf module>:<parameter>"``, its tensors are A (E, r, in) and B (E, out, r) per
expert.  PEFT stores them as one ``nn.Linear`` pair, A (E·r, in) and B (out, r·E) (expert e's
rank block is A rows e·r.., B columns e, e + E, ...), and nests the wrappers of one module's
parameters in the module's registration order (``param_order``): the last targeted one is
``<module>.lora_A.weight``, the one before it ``<module>.base_layer.lora_A.weight``, and so on.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
SUFFIXES = {"lora_A": ".lora_A.weight", "lora_B": ".lora_B.weight"}


@dataclass
class LoRAConfig:
    """The fields of ``adapter_config.json`` this package uses.  ``scale`` is
    lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA)."""

    r: int
    lora_alpha: float
    target_modules: list[str] | str = field(default_factory=list)
    use_rslora: bool = False
    base_model_name_or_path: str | None = None
    # PEFT's LoRA on parameters (nn.Parameter, e.g. an MoE layer's stacked experts "mlp.experts.gate_up_proj")
    target_parameters: list[str] = field(default_factory=list)

    @property
    def scale(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)

    def to_peft(self) -> dict:
        alpha = int(self.lora_alpha) if float(self.lora_alpha).is_integer() else self.lora_alpha
        return {
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.r, "lora_alpha": alpha,
            "target_modules": self.target_modules, "use_rslora": self.use_rslora, "lora_dropout": 0.0,
            "bias": "none", "fan_in_fan_out": False, "use_dora": False, "modules_to_save": None,
            "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": self.base_model_name_or_path,
            "target_parameters": list(self.target_parameters) or None,
        }

    @classmethod
    def from_peft(cls, d: Mapping, where: str = CONFIG_NAME) -> LoRAConfig:
        unsupported = {
            "peft_type": d.get("peft_type", "LORA") != "LORA",
            "use_dora": bool(d.get("use_dora")),
            "bias": d.get("bias", "none") != "none",
            "fan_in_fan_out": bool(d.get("fan_in_fan_out")),
            "modules_to_save": bool(d.get("modules_to_save")),
            "rank_pattern": bool(d.get("rank_pattern")),
            "alpha_pattern": bool(d.get("alpha_pattern")),
        }
        bad = [f"{k}={d.get(k)!r}" for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"{where}: unsupported LoRA settings: {', '.join(bad)} (plain LoRA with one r and "
                             f"lora_alpha for every module only)")
        try:
            r, alpha = d["r"], d["lora_alpha"]
        except KeyError as e:
            raise ValueError(f"{where} lacks {e.args[0]!r}") from None
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(f"{where}: r must be an integer >= 1, got {r!r}")
        return cls(r=r, lora_alpha=alpha, target_modules=d.get("target_modules") or [],
                   use_rslora=bool(d.get("use_rslora")), base_model_name_or_path=d.get("base_model_name_or_path"),
                   target_parameters=list(d.get("target_parameters") or []))


def _identity(name: str) -> str:
    return name


def _param_to_peft(hf: str, a, b, r: int, params, order, name):
    """A parameter adapter (A (E, r, in), B (E, out, r)) -> (its PEFT module name, A (E·r, in), B (out, r·E))."""
    module, param = hf.split(":")
    if a.dim() != 3 or b.dim() != 3 or a.shape[1] != r or b.shape[2] != r or a.shape[0] != b.shape[0]:
        raise ValueError(f"{name}: A {tuple(a.shape)}, B {tuple(b.shape)} are not (E, r={r}, in), (E, out, r)")
    ps = [p for p in order if p in params[module]]
    if len(ps) != len(params[module]):
        raise ValueError(f"{module}: parameters {params[module]} not all in the nesting order {tuple(order)}")
    depth = len(ps) - 1 - ps.index(param)
    E, _, K = a.shape
    return module + ".base_layer" * depth, a.reshape(E * r, K), b.permute(1, 2, 0).reshape(b.shape[1], r * E)


def _param_from_peft(module: str, a, b, config: LoRAConfig, order, where: str):
    """The inverse of ``_param_to_peft`` for a module of ``config.target_parameters`` -> (hf, A, B),
    or None when ``module`` holds no parameter adapter."""
    depth = 0
    while module.endswith(".base_layer"):
        module, depth = module[: -len(".base_layer")], depth + 1
    ps = [p for p in order if any(matches_target(f"{module}.{p}", t) for t in config.target_parameters)]
    if not ps:
        return None
    if depth >= len(ps):
        raise ValueError(f"{where}: {module} nests {depth + 1} adapters, its targeted parameters are {ps}")
    r = config.r
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] % r or b.shape[1] != a.shape[0]:
        raise ValueError(f"{where}: {module} ({ps[len(ps) - 1 - depth]}) has A {tuple(a.shape)}, B {tuple(b.shape)}; "
                         f"want (E·r, in), (out, r·E) at r={r}")
    E = a.shape[0] // r
    return (f"{module}:{ps[len(ps) - 1 - depth]}", a.reshape(E, r, a.shape[1]),
            b.reshape(b.shape[0], r, E).permute(2, 0, 1).contiguous())


def matches_target(full: str, target: str) -> bool:
    """PEFT's target_parameters match a parameter's full name or a dotted suffix of it."""
    return full == target or full.endswith("." + target)


def save_peft_adapter(path: str | os.PathLike, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      config: LoRAConfig, to_hf: Callable[[str], str] = _identity,
                      param_order: tuple[str, ...] = ()) -> None:
    """Write ``{our module name: (A (r, K), B (N, r))}`` as a PEFT adapter directory
    (parameter adapters: the module docstring; ``param_order`` their nesting order).

    Tensors are saved in their own dtype.  ``config.target_modules``, when
    empty, becomes the sorted last name parts of the HF module names.
    """
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    hf_of = {name: to_hf(name) for name in adapters}
    params = {}  # {hf module: [targeted parameters]} of the parameter adapters
    for hf in hf_of.values():
        if ":" in hf:
            params.setdefault(hf.split(":")[0], []).append(hf.split(":")[1])
    for name, (a, b) in adapters.items():
        hf = hf_of[name]
        if ":" in hf:
            hf, a, b = _param_to_peft(hf, a, b, config.r, params, param_order, name)
        elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"{name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not have rank r={config.r}")
        else:
            modules.append(hf)
        for part, t in (("lora_A", a), ("lora_B", b)):
            key = PREFIX + hf + SUFFIXES[part]
            if key in tensors:
                raise ValueError(f"to_hf maps two modules to {hf!r}")
            tensors[key] = t.detach().to("cpu").contiguous().clone()
    if not config.target_modules and modules:
        config = LoRAConfig(**{**config.__dict__, "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})})
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    _replace(d / WEIGHTS_NAME, lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    _replace(d / CONFIG_NAME, lambda tmp: Path(tmp).write_text(json.dumps(config.to_peft(), indent=2) + "\n"))


def _replace(final: Path, write: Callable[[str], None]) -> None:
    """Write under a temporary name, then rename: a reader never sees half a file."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        write(str(tmp))
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


def load_peft_adapter(path: str | os.PathLike, from_hf: Callable[[str], str] = _identity, *,
                      device: torch.device | str = "cpu", param_order: tuple[str, ...] = ()
                      ) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], LoRAConfig]:
    """Read a PEFT adapter directory -> ({our module name: (A, B)}, config).

    Every tensor must be a ``lora_A``/``lora_B`` weight under ``base_model.model.``,
    each module needs both, with A (r, K) and B (N, r) at the config's r; a module
    of the config's ``target_parameters`` gives (E, r, in), (E, out, r) under the
    name ``from_hf("<module>:<parameter>")`` (``param_order``: the module docstring).
    """
    d = Path(path)
    cfg_file, weights = d / CONFIG_NAME, d / WEIGHTS_NAME
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} is missing")
    if not weights.is_file():
        if (d / "adapter_model.bin").is_file():
            raise ValueError(f"{d} holds only adapter_model.bin: pickled adapters are refused (unpickling runs code); "
                             f"re-save it with safetensors")
        raise FileNotFoundError(f"{weights} is missing")
    try:
        config = LoRAConfig.from_peft(json.loads(cfg_file.read_text()), str(cfg_file))
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file} is not valid JSON: {e}") from e
    parts: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights), framework="pt", device="cpu") as f:
        for key in f.keys():
            part = next((p for p, s in SUFFIXES.items() if key.endswith(s)), None)
            if part is None or not key.startswith(PREFIX):
                raise ValueError(f"{weights}: unexpected tensor {key!r} (expected {PREFIX}<module>.lora_A/B.weight)")
            module = key[len(PREFIX):-len(SUFFIXES[part])]
            parts.setdefault(module, {})[part] = f.get_tensor(key)
    out = {}
    for module, ab in parts.items():
        if set(ab) != set(SUFFIXES):
            raise ValueError(f"{weights}: {module} has {', '.join(sorted(ab))} but not both lora_A and lora_B")
        a, b = ab["lora_A"], ab["lora_B"]
        param = _param_from_peft(module, a, b, config, param_order, str(weights)) if config.target_parameters else None
        if param is not None:
            module, a, b = param
        elif a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"{weights}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; config says r={config.r}")
        name = from_hf(module)
        if name is None:
            raise KeyError(f"{weights}: no module of ours for {module!r}")
        out[name] = (a.to(device), b.to(device))
    return out, config
