"""One loader for every model of the zoo: a model folder describes itself
in a ``ModelSpec`` (``models/spec.py``) and these functions do the rest:
config resolution, the trainer from a checkpoint or a seeded init, LoRA in
three modes with PEFT adapters, unified FP8, the server and its engine, the
``Pair``, and saving back in the Hugging Face format.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping

import torch

from ..common.layers import LoRALinear, MultiLoRALinear
from ..common.lora import LoRAConfig
from ..common.moe.lora import ExpertsAdapter
from .base import check_lora_mode
from .spec import ModelSpec
from .text import read_checkpoint_text

log = logging.getLogger("alignzoo.models")


def resolve_config(spec: ModelSpec, checkpoint=None, config=None):
    """The config from a checkpoint's config.json, a preset name, a
    config object of the model's class, a transformers config dict (has
    ``model_type``) or a dict of field overrides on the ``tiny`` preset."""
    cls, presets = spec.config_cls, spec.presets
    if checkpoint is not None:
        if config is not None:
            raise ValueError("pass either checkpoint= or config=, not both (the checkpoint carries its config)")
        if not os.path.isdir(os.fspath(checkpoint)):
            raise FileNotFoundError(f"checkpoint directory {os.fspath(checkpoint)!r} does not exist")
        return cls.from_hf(checkpoint)
    if config is None:
        return presets["tiny"]
    if isinstance(config, cls):
        return config
    if isinstance(config, str):
        return cls.preset(config)
    if isinstance(config, dict):
        if "model_type" in config:
            return cls.from_hf(config)
        unknown = set(config) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"unknown {spec.name} config fields {sorted(unknown)}; fields: {sorted(cls.__dataclass_fields__)}")
        return presets["tiny"].replace(**config)
    raise TypeError(f"config must be a preset name ({', '.join(presets)}), a dict or a {cls.__name__}, got {type(config).__name__}")


def _by_suffix(rules: Mapping | None, name: str):
    return next((r for suffix, r in (rules or {}).items() if name.endswith(suffix)), None)


def init_weights(trainer, seed: int = 0, *, fill: Mapping | None = None, std: Mapping | None = None,
                 vector: float = 1.0) -> None:
    """transformers' default init (normal, std 0.02; 1-D weights (norms) at one), drawn on
    the trainer's device from a fixed seed, so a (config, seed, device type)
    names a model.  A model's own rules, by parameter-name suffix: ``fill``
    {suffix: value, or fn(parameter) -> tensor} sets a parameter without a
    draw; ``std`` {suffix: std} of a drawn matrix; ``vector`` the value of
    every other 1-D weight.  Parameters go in name order, and only drawn ones
    advance the generator."""
    device = trainer.device
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(trainer.named_parameters()):
            value = _by_suffix(fill, name)
            if callable(value):
                p.copy_(value(p))
            elif value is not None:
                p.fill_(value)
            elif p.dim() == 1:
                p.fill_(vector)
            else:
                s = _by_suffix(std, name)
                p.copy_(torch.empty(p.shape, dtype=torch.float32, device=device).normal_(
                    0.0, 0.02 if s is None else s, generator=g))


def build_trainer(spec: ModelSpec, cfg, checkpoint=None, *, device="cpu", dtype=torch.bfloat16, seed: int = 0,
                  activation_checkpointing: bool = False, fp8: bool = False):
    """The model's trainer, from a checkpoint or from the model's seeded init."""
    trainer = spec.trainer_cls(cfg, device=device, dtype=dtype, activation_checkpointing=activation_checkpointing, fp8=fp8)
    if checkpoint is None:
        spec.init_weights(trainer, seed)
        return trainer
    from ..weights import HFCheckpoint, read_hf_config
    from ..weights.fp8 import DequantizedSource, is_fp8_checkpoint

    fp8_ckpt = is_fp8_checkpoint(read_hf_config(checkpoint))
    with HFCheckpoint(checkpoint) as ckpt:
        tensors = spec.from_hf(DequantizedSource(ckpt) if fp8_ckpt else ckpt, cfg,
                                dtype=torch.float32 if fp8 else dtype, device=device)
    with torch.no_grad():
        for name, p in trainer.named_parameters():
            p.copy_(tensors.pop(name))
        for name, b in frozen_buffers(trainer).items():  # quantized stacks read as stored, byte for byte
            b.copy_(tensors.pop(name))
    return trainer


def frozen_buffers(trainer) -> dict[str, torch.Tensor]:
    """The trainer's saved tensors that are not parameters (DeepSeek-V4's MXFP4 experts: codes and E8M0 scales),
    which a checkpoint fills and ``save_pretrained`` writes as they are."""
    return {n: t for n, t in trainer.state_dict(keep_vars=True).items() if not isinstance(t, torch.nn.Parameter)}


def server_weights(trainer) -> dict[str, torch.Tensor]:
    """The server's own tensors, shaped as the ones the trainer's forward
    reads; left unfilled: the pair's first sync writes every byte (a clone
    here would copy the whole model twice at start-up)."""
    return {name: torch.empty_like(t) for name, t in trainer.forward_weights().items()}


def read_lora_adapter(spec: ModelSpec, directory) -> tuple[dict[str, tuple[torch.Tensor, torch.Tensor]], LoRAConfig]:
    """A PEFT adapter directory of a model of ``spec`` -> ({``layers.{i}.<projection>``: (A, B)}, config)."""
    from ..common.lora import load_peft_adapter

    adapters, lora = load_peft_adapter(directory, from_hf=spec.lora_from_hf, param_order=spec.lora_param_order)
    return adapters, spec.trainer_cls.check_lora(lora)


def _check_same_lora(spec: ModelSpec, have, want, where) -> None:
    a, b = spec.trainer_cls.check_lora(have), spec.trainer_cls.check_lora(want)
    if (a.r, a.scale, a.target_modules) != (b.r, b.scale, b.target_modules):
        raise ValueError(f"{where} has r={b.r}, scale={b.scale}, target_modules={b.target_modules}, but the model's "
                         f"LoRA has r={a.r}, scale={a.scale}, target_modules={a.target_modules}")


def load(spec: ModelSpec, checkpoint=None, config=None, device=None, dtype=torch.bfloat16, *, seed: int = 0,
         activation_checkpointing: bool = False, server_kernels: str = "aligned", fp8: bool = False,
         lora=None, lora_mode: str | None = None, lora_adapter=None, lora_adapters: Mapping | None = None,
         **engine_kwargs):
    """A ``Pair`` of the model ``spec`` describes; see ``alignzoo.load_pair``.  A checkpoint's
    tokenizer, chat template and generation_config.json come with it (``models/text.py``): the
    engine stops at the model's EOS ids (``eos_token_ids=`` overrides them) and decodes stop
    strings with the tokenizer.  ``server_kernels="vendor"``
    serves with torch's own kernels (the model's ``serve_vendor.py``): a deliberately
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
    check_lora_mode(lora_mode)
    if (lora_mode == "multi") != (lora_adapters is not None) or lora_mode == "multi" and (
            lora is not None or lora_adapter is not None):
        raise ValueError("multi-adapter LoRA takes lora_adapters={name: LoRAConfig, dict or PEFT dir} (and neither "
                         "lora= nor lora_adapter=); lora_mode 'merged' and 'separate' take lora= or lora_adapter=")
    from ..common.engine import Engine
    from .pair import Pair

    adapters = None
    if lora_mode == "multi":
        if not isinstance(lora_adapters, Mapping):
            raise TypeError(f"lora_adapters must be a dict {{name: LoRAConfig, dict or PEFT dir}}, "
                            f"got {type(lora_adapters).__name__}")
        lora, adapters = {}, {}  # {name: config}, {name: tensors} of those read from PEFT directories
        for name, source in lora_adapters.items():
            if isinstance(source, (str, os.PathLike)):
                adapters[name], lora[name] = read_lora_adapter(spec, source)
            else:
                lora[name] = source
    elif lora_adapter is not None:
        adapters, from_file = read_lora_adapter(spec, lora_adapter)
        if lora is None:
            lora = from_file
        else:
            _check_same_lora(spec, lora, from_file, f"the adapter in {os.fspath(lora_adapter)!r}")
    if lora is not None:
        lora = spec.trainer_cls.check_adapters(lora) if lora_mode == "multi" else spec.trainer_cls.check_lora(lora)
        check_lora_mode(lora_mode, fp8, None if lora_mode == "multi" else lora)
        if lora_mode != "merged" and server_kernels == "vendor":
            raise NotImplementedError(f"the vendor server does not apply {lora_mode} LoRA adapters; "
                                      f"use lora_mode='merged'")
    cfg = resolve_config(spec, checkpoint, config)
    text = read_checkpoint_text(checkpoint, cfg.vocab_size)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    t0 = time.perf_counter()
    trainer = build_trainer(spec, cfg, checkpoint, device=device, dtype=dtype, seed=seed,
                            activation_checkpointing=activation_checkpointing, fp8=fp8)
    if lora is not None:
        trainer.add_lora(lora, lora_mode, seed=seed)
        if lora_mode == "multi":
            for name, tensors in adapters.items():
                trainer.set_lora_adapters(tensors, adapter=name)
        elif adapters is not None:
            trainer.set_lora_adapters(adapters)
    log.info("%s trainer built on %s in %.1fs (%s%s)", spec.name, device, time.perf_counter() - t0,
             "checkpoint " + os.fspath(checkpoint) if checkpoint is not None else f"random init, seed {seed}",
             "" if lora is None else f"; LoRA adapters {', '.join(lora)}" if lora_mode == "multi"
             else f"; LoRA r={lora.r} {lora_mode} on {','.join(lora.target_modules)}")
    t0 = time.perf_counter()
    server_cls = spec.vendor_server_cls() if server_kernels == "vendor" else spec.server_cls
    if lora_mode == "multi":
        model = server_cls(cfg, server_weights(trainer),
                           lora_adapters=tuple((n, c.scale) for n, c in trainer.adapter_configs.items()))
    else:
        lora_scale = lora.scale if lora is not None and lora_mode == "separate" else None
        model = server_cls(cfg, server_weights(trainer), lora_scale=lora_scale)
    server = Engine(model, **{"eos_token_ids": text.eos_token_ids, "tokenizer": text.tokenizer, **engine_kwargs})
    log.info("%s server engine ready in %.1fs (%d KV pages)", spec.name, time.perf_counter() - t0, server.num_pages)
    return Pair(spec.name, cfg, trainer, server, text)


def save_pretrained(spec: ModelSpec, trainer, directory, *, max_shard_bytes: int | None = None,
                    adapter_only: bool = False, adapter: str | None = None,
                    quantization_config: Mapping | None = None) -> None:
    """Write the trainer's weights as a transformers checkpoint of the model.

    With LoRA: every adapter merged into its weight (W' = ``lora_merge_fwd``,
    the bytes a merged-mode pair serves, so a plain pair loaded from it
    gives that pair's log-probs bitwise; a separate-mode pair's log-probs
    round differently).  ``adapter_only=True``: only the adapters, as a PEFT
    directory (adapter_config.json + adapter_model.safetensors, modules
    ``base_model.model.model.layers.{i}.self_attn.q_proj`` ...).  Multi-mode
    LoRA: ``adapter`` names the one adapter to merge or write.  Frozen buffers
    (``frozen_buffers``: quantized codes and scales) go to ``spec.to_hf`` as
    they are; ``quantization_config`` replaces the config's in config.json
    (how ``spec.to_hf`` stored them)."""
    from ..weights import save_hf_checkpoint

    lora = trainer.lora_config(adapter)  # raises unless adapter fits the mode
    if adapter_only:
        if trainer.lora_mode is None:
            raise ValueError("adapter_only=True needs a LoRA model (load_pair(..., lora=...))")
        from ..common.lora import save_peft_adapter

        save_peft_adapter(directory, trainer.lora_adapters(adapter), lora, to_hf=spec.lora_to_hf,
                          param_order=spec.lora_param_order)
        return
    cfg = trainer.cfg
    wdtype = trainer.embed.weight.dtype
    dtype = str(wdtype).replace("torch.", "")
    tensors = {n: p.detach() for n, p in trainer.named_parameters() if ".lora_" not in n}
    j = trainer.adapter_index(adapter) if trainer.lora_mode == "multi" else None
    for name, m in trainer.named_modules():
        if isinstance(m, LoRALinear):
            tensors[name + ".weight"] = m.merge()
        elif isinstance(m, MultiLoRALinear):
            tensors[name + ".weight"] = m.merge(j)
        elif isinstance(m, ExpertsAdapter):  # W' = W + s·B·A per expert, as merged mode serves it
            parent = name.rsplit(".", 1)[0]
            tensors |= {f"{parent}.{p}.weight": w for p, w in m.merge().items()}
    # FP8 masters (fp32) go in the checkpoint's dtype; what the model keeps FP32 in any dtype stays FP32, and an
    # integer table (DeepSeek-V4's tid2eid) stays integer
    tensors = {n: t if not t.dtype.is_floating_point else t.to(torch.float32 if n.endswith(spec.fp32_names) else wdtype)
               for n, t in tensors.items()}
    tensors |= {n: b.detach() for n, b in frozen_buffers(trainer).items()}
    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    config = cfg.to_hf(dtype)
    if quantization_config is not None:
        config["quantization_config"] = dict(quantization_config)
    save_hf_checkpoint(directory, config, spec.to_hf(tensors, cfg), **kw)


def load_adapter(spec: ModelSpec, pair, directory, adapter: str | None = None) -> int:
    """Load a PEFT adapter directory into ``pair``'s LoRA adapters (multi
    mode: into the one named ``adapter``; same r, scale and target modules
    as it has) and sync; returns the new weight version."""
    t = pair.trainer
    if t.lora_mode is None:
        raise ValueError("the pair has no LoRA adapters: load it with load_pair(..., lora_adapter=directory)")
    have = t.lora_config(adapter)  # a clear error unless ``adapter`` fits the mode
    adapters, lora = read_lora_adapter(spec, directory)
    _check_same_lora(spec, have, lora, f"the adapter in {os.fspath(directory)!r}")
    t.set_lora_adapters(adapters, adapter=adapter)
    return pair.sync()
