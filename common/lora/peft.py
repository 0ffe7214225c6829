"""LoRA adapters in the Hugging Face PEFT layout: ``adapter_config.json`` plus
``adapter_model.safetensors`` whose tensors are named
``base_model.model.<hf module>.lora_A.weight`` (r, K) and ``...lora_B.weight`` (N, r).

Only safetensors is read or written (a pickled ``adapter_model.bin`` is refused).
The caller maps module names: ``to_hf("layers.0.q")`` -> ``"model.layers.0.self_attn.q_proj"``
and ``from_hf`` back.
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
                   use_rslora=bool(d.get("use_rslora")), base_model_name_or_path=d.get("base_model_name_or_path"))


def _identity(name: str) -> str:
    return name


def save_peft_adapter(path: str | os.PathLike, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
                      config: LoRAConfig, to_hf: Callable[[str], str] = _identity) -> None:
    """Write ``{our module name: (A (r, K), B (N, r))}`` as a PEFT adapter directory.

    Tensors are saved in their own dtype.  ``config.target_modules``, when
    empty, becomes the sorted last name parts of the HF module names.
    """
    tensors: dict[str, torch.Tensor] = {}
    modules = []
    for name, (a, b) in adapters.items():
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"{name}: A {tuple(a.shape)}, B {tuple(b.shape)} do not have rank r={config.r}")
        hf = to_hf(name)
        modules.append(hf)
        for part, t in (("lora_A", a), ("lora_B", b)):
            key = PREFIX + hf + SUFFIXES[part]
            if key in tensors:
                raise ValueError(f"to_hf maps two modules to {hf!r}")
            tensors[key] = t.detach().to("cpu").contiguous().clone()
    if not config.target_modules:
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
                      device: torch.device | str = "cpu") -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], LoRAConfig]:
    """Read a PEFT adapter directory -> ({our module name: (A, B)}, config).

    Every tensor must be a ``lora_A``/``lora_B`` weight under ``base_model.model.``,
    each module needs both, with A (r, K) and B (N, r) at the config's r.
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
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"{weights}: {module} has A {tuple(a.shape)}, B {tuple(b.shape)}; config says r={config.r}")
        name = from_hf(module)
        if name is None:
            raise KeyError(f"{weights}: no module of ours for {module!r}")
        out[name] = (a.to(device), b.to(device))
    return out, config
