"""Qwen3 (dense): config, trainer (``train.py``) and server (``serve.py``)
calling the same kernels, and the Hugging Face name map (``weights.py``).

LoRA (``load(..., lora=LoRAConfig(...), lora_mode="merged" | "separate")``):
the base is frozen and each targeted projection trains an adapter; K3 == 0
holds in both modes.  ``save_pretrained(trainer, dir)`` writes the merged
model (a plain Qwen3 checkpoint), ``adapter_only=True`` the PEFT adapter;
``load(..., lora_adapter=dir)`` or ``load_adapter(pair, dir)`` read one back.
Several named adapters on one base, chosen per request and per scored
sequence (``load(..., lora_adapters={name: LoRAConfig or PEFT dir})``, mode
"multi"): K3 == 0 on every row of a mixed batch.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import torch

from ...common.lora import LoRAConfig
from .config import PRESETS, Qwen3Config
from .serve import Qwen3Server
from .train import LORA_MODES, LoRALinear, MultiLoRALinear, Qwen3Trainer, check_adapter_configs, check_lora_config

NAME = "qwen3"
log = logging.getLogger("alignzoo.models")


def resolve_config(checkpoint=None, config=None) -> Qwen3Config:
    """The config from a checkpoint's config.json, a preset name, a
    ``Qwen3Config``, a transformers config dict (has ``model_type``) or a dict
    of field overrides on the ``tiny`` preset."""
    if checkpoint is not None:
        if config is not None:
            raise ValueError("pass either checkpoint= or config=, not both (the checkpoint carries its config)")
        if not os.path.isdir(os.fspath(checkpoint)):
            raise FileNotFoundError(f"checkpoint directory {os.fspath(checkpoint)!r} does not exist")
        return Qwen3Config.from_hf(checkpoint)
    if config is None:
        return PRESETS["tiny"]
    if isinstance(config, Qwen3Config):
        return config
    if isinstance(config, str):
        return Qwen3Config.preset(config)
    if isinstance(config, dict):
        if "model_type" in config:
            return Qwen3Config.from_hf(config)
        unknown = set(config) - set(Qwen3Config.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown qwen3 config fields {sorted(unknown)}; fields: {sorted(Qwen3Config.__dataclass_fields__)}")
        return PRESETS["tiny"].replace(**config)
    raise TypeError(f"config must be a preset name ({', '.join(PRESETS)}), a dict or a Qwen3Config, got {type(config).__name__}")


def init_weights(trainer: Qwen3Trainer, seed: int = 0) -> None:
    """transformers' Qwen3 init (normal, std 0.02; norms at one), drawn on
    the trainer's device from a fixed seed, so a (config, seed, device type)
    names a model."""
    device = trainer.embed.weight.device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(trainer.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=device).normal_(0.0, 0.02, generator=g))


def build_trainer(cfg: Qwen3Config, checkpoint=None, *, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                  activation_checkpointing: bool = False, fp8: bool = False) -> Qwen3Trainer:
    trainer = Qwen3Trainer(cfg, device=device, dtype=dtype, activation_checkpointing=activation_checkpointing, fp8=fp8)
    if checkpoint is None:
        init_weights(trainer, seed)
        return trainer
    from .weights import qwen3_from_hf

    from ...weights import HFCheckpoint, read_hf_config
    from ...weights.fp8 import DequantizedSource, is_fp8_checkpoint

    fp8_ckpt = is_fp8_checkpoint(read_hf_config(checkpoint))
    with HFCheckpoint(checkpoint) as ckpt:
        tensors = qwen3_from_hf(DequantizedSource(ckpt) if fp8_ckpt else ckpt, cfg,
                                dtype=torch.float32 if fp8 else dtype, device=device)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(tensors.pop(name))
    return trainer


def server_weights(trainer: Qwen3Trainer) -> dict[str, torch.Tensor]:
    """The server's own tensors, shaped as the ones the trainer's forward
    reads; left unfilled: the pair's first sync writes every byte (a clone
    here would copy the whole model twice at start-up)."""
    return {name: torch.empty_like(t) for name, t in trainer.forward_weights().items()}


def read_lora_adapter(directory) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], LoRAConfig]:
    """A PEFT adapter directory of a Qwen3 model -> ({``layers.{i}.<projection>``: (A, B)}, config)."""
    from ...common.lora import load_peft_adapter
    from .weights import lora_from_hf

    adapters, lora = load_peft_adapter(directory, from_hf=lora_from_hf)
    return adapters, check_lora_config(lora)


def _check_same_lora(have, want, where) -> None:
    a, b = check_lora_config(have), check_lora_config(want)
    if (a.r, a.scale, a.target_modules) != (b.r, b.scale, b.target_modules):
        raise ValueError(f"{where} has r={b.r}, scale={b.scale}, target_modules={b.target_modules}, but the model's "
                         f"LoRA has r={a.r}, scale={a.scale}, target_modules={a.target_modules}")


def load(checkpoint=None, config=None, device=None, dtype=torch.bfloat16, *, seed: int = 0,
         activation_checkpointing: bool = False, server_kernels: str = "aligned", fp8: bool = False,
         lora=None, lora_mode: str | None = None, lora_adapter=None, lora_adapters: Mapping | None = None,
         **engine_kwargs):
    """A Qwen3 ``Pair``; see ``alignzoo.load_pair``.  ``server_kernels="vendor"``
    serves with torch's own kernels (``serve_vendor.py``): a deliberately
    misaligned pair, for showing and measuring the mismatch.  ``fp8=True``:
    unified FP8 — FP32 masters quantized once per optimizer step, the server
    runs the same FP8 GEMMs on the same codes.

    LoRA: ``lora`` a ``LoRAConfig`` (or a dict of its fields: r, lora_alpha,
    target_modules from q_proj k_proj v_proj o_proj gate_proj up_proj
    down_proj, or "all-linear"; use_rslora) freezes the base and adds one
    adapter per targeted projection and layer (B = 0: the model is unchanged
    until it trains; A seeded from ``seed``); only the adapters are
    trainable.  ``lora_mode``: "merged" (W' = W + s·B·A is rebuilt once per
    optimizer step, read by the trainer and shipped to the server as the
    layer's weight) or "separate" (base output plus the adapter branch on
    both sides; the sync ships the adapters alone).  ``lora_adapter``: a PEFT
    adapter directory to start from (its config is used when ``lora`` is None).

    Multi-adapter LoRA (``lora_mode="multi"``, the default with
    ``lora_adapters``): ``lora_adapters`` = ``{name: LoRAConfig, dict of its
    fields, or PEFT adapter directory}``, each adapter its own rank, scale
    and targets on one frozen base.  A request picks one
    (``pair.server.generate(prompts, sampling, adapters=name or [one per
    prompt])``, None: the base model) and many share one engine batch;
    ``pair.trainer.logprobs(..., adapters=...)`` scores the same way, and
    ``pair.trainer.adapter_parameters(name)`` are what an optimizer on one
    adapter steps.  The sync ships every adapter's A and B (changed blocks).
    """
    if server_kernels not in ("aligned", "vendor"):
        raise ValueError(f"server_kernels must be 'aligned' or 'vendor', got {server_kernels!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not -(2**63) <= seed < 2**63:
        raise ValueError(f"seed must be an int that fits in int64 (it seeds torch.Generator), got {seed!r}")
    if lora_mode is None:
        lora_mode = "multi" if lora_adapters is not None else "merged"
    if lora_mode not in LORA_MODES:
        raise ValueError(f"lora_mode must be one of {LORA_MODES}, got {lora_mode!r}")
    if (lora_mode == "multi") != (lora_adapters is not None) or lora_mode == "multi" and (
            lora is not None or lora_adapter is not None):
        raise ValueError("multi-adapter LoRA takes lora_adapters={name: LoRAConfig, dict or PEFT dir} (and neither "
                         "lora= nor lora_adapter=); lora_mode 'merged' and 'separate' take lora= or lora_adapter=")
    from ...common.engine import Engine
    from ..pair import Pair

    adapters = None
    if lora_mode == "multi":
        if not isinstance(lora_adapters, Mapping):
            raise TypeError(f"lora_adapters must be a dict {{name: LoRAConfig, dict or PEFT dir}}, "
                            f"got {type(lora_adapters).__name__}")
        lora, adapters = {}, {}  # {name: config}, {name: tensors} of those read from PEFT directories
        for name, spec in lora_adapters.items():
            if isinstance(spec, (str, os.PathLike)):
                adapters[name], lora[name] = read_lora_adapter(spec)
            else:
                lora[name] = spec
    elif lora_adapter is not None:
        adapters, from_file = read_lora_adapter(lora_adapter)
        if lora is None:
            lora = from_file
        else:
            _check_same_lora(lora, from_file, f"the adapter in {os.fspath(lora_adapter)!r}")
    if lora is not None:
        lora = check_adapter_configs(lora) if lora_mode == "multi" else check_lora_config(lora)
        if fp8:
            raise NotImplementedError("LoRA with fp8=True is not supported yet; use bf16 or fp32 with LoRA")
        if lora_mode != "merged" and server_kernels == "vendor":
            raise NotImplementedError(f"the vendor server does not apply {lora_mode} LoRA adapters; "
                                      f"use lora_mode='merged'")
    cfg = resolve_config(checkpoint, config)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, checkpoint, device=device, dtype=dtype, seed=seed,
                            activation_checkpointing=activation_checkpointing, fp8=fp8)
    if lora is not None:
        trainer.add_lora(lora, lora_mode, seed=seed)
        if lora_mode == "multi":
            for name, tensors in adapters.items():
                trainer.set_lora_adapters(tensors, adapter=name)
        elif adapters is not None:
            trainer.set_lora_adapters(adapters)
    log.info("qwen3 trainer built on %s in %.1fs (%s%s)", device, time.perf_counter() - t0,
             "checkpoint " + os.fspath(checkpoint) if checkpoint is not None else f"random init, seed {seed}",
             "" if lora is None else f"; LoRA adapters {', '.join(lora)}" if lora_mode == "multi"
             else f"; LoRA r={lora.r} {lora_mode} on {','.join(lora.target_modules)}")
    t0 = time.perf_counter()
    if server_kernels == "vendor":
        from .serve_vendor import Qwen3VendorServer as server_cls
    else:
        server_cls = Qwen3Server
    if lora_mode == "multi":
        model = server_cls(cfg, server_weights(trainer),
                           lora_adapters=tuple((n, c.scale) for n, c in trainer.adapter_configs.items()))
    else:
        lora_scale = lora.scale if lora is not None and lora_mode == "separate" else None
        model = server_cls(cfg, server_weights(trainer), lora_scale=lora_scale)
    server = Engine(model, **engine_kwargs)
    log.info("qwen3 server engine ready in %.1fs (%d KV pages)", time.perf_counter() - t0, server.num_pages)
    return Pair(NAME, cfg, trainer, server)


def save_pretrained(trainer: Qwen3Trainer, directory, *, max_shard_bytes: int | None = None,
                    adapter_only: bool = False, adapter: str | None = None) -> None:
    """Write the trainer's weights as a transformers Qwen3 checkpoint.

    With LoRA: every adapter merged into its weight (W' = ``lora_merge_fwd``,
    the bytes a merged-mode pair serves, so a plain pair loaded from it
    gives that pair's log-probs bitwise; a separate-mode pair's log-probs
    round differently).  ``adapter_only=True``: only the adapters, as a PEFT
    directory (adapter_config.json + adapter_model.safetensors, modules
    ``base_model.model.model.layers.{i}.self_attn.q_proj`` ...).  Multi-mode
    LoRA: ``adapter`` names the one adapter to merge or write."""
    from ...weights import save_hf_checkpoint
    from .weights import lora_to_hf, qwen3_to_hf

    lora = trainer.lora_config(adapter)  # raises unless adapter fits the mode
    if adapter_only:
        if trainer.lora_mode is None:
            raise ValueError("adapter_only=True needs a LoRA model (load_pair(..., lora=...))")
        from ...common.lora import save_peft_adapter

        save_peft_adapter(directory, trainer.lora_adapters(adapter), lora, to_hf=lora_to_hf)
        return
    cfg = trainer.cfg
    dtype = str(trainer.embed.weight.dtype).replace("torch.", "")
    tensors = {n: p.detach() for n, p in trainer.named_parameters() if ".lora_" not in n}
    j = trainer.adapter_index(adapter) if trainer.lora_mode == "multi" else None
    for name, m in trainer.named_modules():
        if isinstance(m, LoRALinear):
            tensors[name + ".weight"] = m.merge()
        elif isinstance(m, MultiLoRALinear):
            tensors[name + ".weight"] = m.merge(j)
    tensors = {n: t.to(trainer.embed.weight.dtype) for n, t in tensors.items()}  # FP8 masters: fp32
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_hf_checkpoint(directory, cfg.to_hf(dtype), qwen3_to_hf(tensors, cfg), **kw)


def load_adapter(pair, directory, adapter: str | None = None) -> int:
    """Load a PEFT adapter directory into ``pair``'s LoRA adapters (multi
    mode: into the one named ``adapter``; same r, scale and target modules
    as it has) and sync; returns the new weight version."""
    t = pair.trainer
    if t.lora_mode is None:
        raise ValueError("the pair has no LoRA adapters: load it with load_pair(..., lora_adapter=directory)")
    have = t.lora_config(adapter)  # a clear error unless ``adapter`` fits the mode
    adapters, lora = read_lora_adapter(directory)
    _check_same_lora(have, lora, f"the adapter in {os.fspath(directory)!r}")
    t.set_lora_adapters(adapters, adapter=adapter)
    return pair.sync()


__all__ = ["NAME", "PRESETS", "Qwen3Config", "Qwen3Server", "Qwen3Trainer", "load", "load_adapter",
           "save_pretrained"]
