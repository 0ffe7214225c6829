"""Qwen3 (dense): config, trainer (``train.py``) and server (``serve.py``)
calling the same kernels, and the Hugging Face name map (``weights.py``)."""
from __future__ import annotations

import logging
import os
import time

import torch

from .config import PRESETS, Qwen3Config
from .serve import Qwen3Server
from .train import Qwen3Trainer

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
        from ...weights import read_hf_config

        return Qwen3Config.from_hf(read_hf_config(checkpoint))
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
    """The server's own copy of the tensors the trainer's forward reads."""
    return {name: t.clone() for name, t in trainer.forward_weights().items()}


def load(checkpoint=None, config=None, device=None, dtype=torch.bfloat16, *, seed: int = 0,
         activation_checkpointing: bool = False, server_kernels: str = "aligned", fp8: bool = False,
         **engine_kwargs):
    """A Qwen3 ``Pair``; see ``alignzoo.load_pair``.  ``server_kernels="vendor"``
    serves with torch's own kernels (``serve_vendor.py``): a deliberately
    misaligned pair, for showing and measuring the mismatch.  ``fp8=True``:
    unified FP8 — FP32 masters quantized once per optimizer step, the server
    runs the same FP8 GEMMs on the same codes."""
    if server_kernels not in ("aligned", "vendor"):
        raise ValueError(f"server_kernels must be 'aligned' or 'vendor', got {server_kernels!r}")
    from ...common.engine import Engine
    from ..pair import Pair

    cfg = resolve_config(checkpoint, config)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, checkpoint, device=device, dtype=dtype, seed=seed,
                            activation_checkpointing=activation_checkpointing, fp8=fp8)
    log.info("qwen3 trainer built on %s in %.1fs (%s)", device, time.perf_counter() - t0,
             "checkpoint " + os.fspath(checkpoint) if checkpoint is not None else f"random init, seed {seed}")
    t0 = time.perf_counter()
    if server_kernels == "vendor":
        from .serve_vendor import Qwen3VendorServer as server_cls
    else:
        server_cls = Qwen3Server
    server = Engine(server_cls(cfg, server_weights(trainer)), **engine_kwargs)
    log.info("qwen3 server engine ready in %.1fs (%d KV pages)", time.perf_counter() - t0, server.num_pages)
    return Pair(NAME, cfg, trainer, server)


def save_pretrained(trainer: Qwen3Trainer, directory, *, max_shard_bytes: int | None = None) -> None:
    """Write the trainer's weights as a transformers Qwen3 checkpoint."""
    from ...weights import save_hf_checkpoint
    from .weights import qwen3_to_hf

    cfg = trainer.cfg
    dtype = str(trainer.embed.weight.dtype).replace("torch.", "")
    tensors = {n: p.detach().to(trainer.embed.weight.dtype) for n, p in trainer.named_parameters()}  # FP8 masters: fp32
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    save_hf_checkpoint(directory, cfg.to_hf(dtype), qwen3_to_hf(tensors, cfg), **kw)


__all__ = ["NAME", "PRESETS", "Qwen3Config", "Qwen3Server", "Qwen3Trainer", "load", "save_pretrained"]
