"""GLM-5 checkpoint names (transformers ``GlmMoeDsaForCausalLM``) <-> ours, and
FP8 block checkpoints read as their codes and scales.

Ours, per layer i (fused only where one GEMM reads several HF projections of
the same input into one SwiGLU):
  layers.{i}.attn_norm / mlp_norm           input_layernorm / post_attention_layernorm (RMSNorm)
  MLA:        layers.{i}.attn.q_a            q_a_proj (Rq, H)
              layers.{i}.attn.q_a_norm       q_a_layernorm (Rq,)  RMSNorm, eps 1e-6
              layers.{i}.attn.q_b            q_b_proj (Hq (Dn + Dr), Rq): per head [nope | rope]
              layers.{i}.attn.kv_a           kv_a_proj_with_mqa (Rkv + Dr, H): [latent | rope key]
              layers.{i}.attn.kv_a_norm      kv_a_layernorm (Rkv,)  RMSNorm, eps 1e-6
              layers.{i}.attn.kv_b           kv_b_proj (Hq (Dn + Dv), Rkv): per head [k nope | v]
              layers.{i}.attn.o              o_proj (H, Hq Dv)
  indexer ("full" layers only):
              layers.{i}.indexer.wq_b        (Hi Di, Rq), on the q residual q_a_norm(q_a(x))
              layers.{i}.indexer.wk          (Di, H)
              layers.{i}.indexer.k_norm      LayerNorm weight and .bias (Di,), eps 1e-6
              layers.{i}.indexer.weights_proj  (Hi, H)
  dense MLP:  layers.{i}.mlp.gate_up         (2 I_dense, H) [gate_proj | up_proj];  layers.{i}.mlp.down
  MoE:        layers.{i}.moe.gate            the router (E, H), FP32
              layers.{i}.moe.correction_bias e_score_correction_bias (E,) as ``.weight``, FP32 (selection only)
              layers.{i}.moe.gate_up         (E, 2I, H): expert e's [gate_proj | up_proj], stacked from the
                                             per-expert tensors (as published and as transformers saves), or
                                             transformers' in-memory experts.gate_up_proj
              layers.{i}.moe.down            (E, H, I)
              layers.{i}.moe.shared_gate_up / shared_down   shared_experts (n_shared I wide)

The MTP layer a released checkpoint carries (``model.layers.{num_layers}.*``,
which transformers also skips) is left out on load, and the log says so.

FP8 block checkpoints (GLM-5-FP8: every linear but the indexer's weights_proj,
the router, the embedding and lm_head as e4m3 ``X.weight`` with fp32
``X.weight_scale_inv``, one scale per 128x128 block):

- ``from_hf`` reads them as FP32 values (code x scale, one rounding, then the
  cast to ``dtype``): the masters of full-weight training;
- ``from_hf_fp8`` reads them as they are stored: ``<ours>.weight`` e4m3 codes
  and ``<ours>.weight_scale_inv`` fp32 scales, stacked / fused like the
  weights, no value ever formed in another dtype; ``to_hf_fp8`` writes them
  back byte for byte.  A fused weight's scales are its parts' grids
  concatenated along the fused dim, so a block never mixes two projections:
  the experts' gate_up is ``common.moe.quantize_experts_fp8``'s layout
  (E, 2 ceil(I/128), ceil(H/128)); a 2-D gate_up whose gate rows are a
  multiple of 128 (GLM-5's 12,288 and 2,048) is exactly the single grid that
  ``fp8_matmul_fwd`` reads; otherwise it must run as two GEMMs, one per part.
"""
from __future__ import annotations

import logging
import os
import re

import torch

from ...common._host import cdiv
from ...weights import (
    FP8_BLOCK128,
    CheckpointError,
    DequantizedSource,
    Fuse,
    HFCheckpoint,
    NameMap,
    OneOf,
    Stack,
    check_model_type,
    open_source,
    read_hf_config,
)
from ...weights.fp8 import SCALE_SUFFIX
from ...weights.lora_names import LoraNames

MODEL_TYPE = "glm_moe_dsa"
ARCHITECTURES = ("GlmMoeDsaForCausalLM",)
BLOCK = FP8_BLOCK128.block[0]
# FP32 in any dtype: the router (transformers' _keep_in_fp32_modules_strict) and the indexer's
# weights_proj (its _keep_in_fp32_modules; GLM-5-FP8 leaves it unquantized too)
FP32_NAMES = ("moe.gate.weight", "moe.correction_bias.weight", "indexer.weights_proj.weight")
# LoRA targets {HF projection: its module under model.layers.{i}}: MLA's projections.  kv_b_proj is read
# per head in the absorbed form, which a separate adapter branch cannot enter; the indexer takes no gradient.
LORA_TARGETS = {"q_a_proj": "self_attn.q_a_proj", "q_b_proj": "self_attn.q_b_proj",
                "kv_a_proj_with_mqa": "self_attn.kv_a_proj_with_mqa", "o_proj": "self_attn.o_proj"}
log = logging.getLogger("alignzoo.models")


def check_checkpoint_config(config: dict) -> None:
    """Raise, naming what it is, unless ``config`` (config.json) is a GLM-5 (glm_moe_dsa) causal LM."""
    check_model_type(config, MODEL_TYPE, ARCHITECTURES)


# LoRA on the routed experts (PEFT's target_parameters): HF parameter -> (our experts module, which)
LORA_PARAM_SLOTS = {"mlp.experts.gate_up_proj": ("moe", "gate_up"), "mlp.experts.down_proj": ("moe", "down")}
# transformers' GlmMoeDsaExperts registers gate_up_proj before down_proj: PEFT nests their adapters in that order
LORA_PARAM_ORDER = ("gate_up_proj", "down_proj")


def lora_slices(cfg) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """{our layer: ((HF projection, first row, end row),)}: one projection each (none is fused)."""
    return {"attn.q_a": (("q_a_proj", 0, cfg.q_lora_rank),),
            "attn.q_b": (("q_b_proj", 0, cfg.num_heads * cfg.qk_head_dim),),
            "attn.kv_a": (("kv_a_proj_with_mqa", 0, cfg.kv_lora_rank + cfg.qk_rope_head_dim),),
            "attn.o": (("o_proj", 0, cfg.hidden_size),)}


_LORA_NAMES = LoraNames(LORA_TARGETS, LORA_PARAM_SLOTS)
lora_to_hf = _LORA_NAMES.to_hf  # layers.{i}.<projection> -> model.layers.{i}.self_attn.<module>; experts: <module>:<param>
lora_from_hf = _LORA_NAMES.from_hf


def hf_names(cfg) -> dict:
    """{our template: HF template, a tuple of them (fused along dim 0), a Fuse, a Stack or a OneOf}."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    L = "model.layers.{}."
    A, X = L + "self_attn.", L + "self_attn.indexer."
    ex = L + "mlp.experts.{expert}."
    return {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
        "layers.{}.attn_norm.weight": L + "input_layernorm.weight",
        "layers.{}.mlp_norm.weight": L + "post_attention_layernorm.weight",
        "layers.{}.attn.q_a.weight": A + "q_a_proj.weight",
        "layers.{}.attn.q_a_norm.weight": A + "q_a_layernorm.weight",
        "layers.{}.attn.q_b.weight": A + "q_b_proj.weight",
        "layers.{}.attn.kv_a.weight": A + "kv_a_proj_with_mqa.weight",
        "layers.{}.attn.kv_a_norm.weight": A + "kv_a_layernorm.weight",
        "layers.{}.attn.kv_b.weight": A + "kv_b_proj.weight",
        "layers.{}.attn.o.weight": A + "o_proj.weight",
        "layers.{}.indexer.wq_b.weight": X + "wq_b.weight",
        "layers.{}.indexer.wk.weight": X + "wk.weight",
        "layers.{}.indexer.k_norm.weight": X + "k_norm.weight",
        "layers.{}.indexer.k_norm.bias": X + "k_norm.bias",
        "layers.{}.indexer.weights_proj.weight": X + "weights_proj.weight",
        "layers.{}.mlp.gate_up.weight": (L + "mlp.gate_proj.weight", L + "mlp.up_proj.weight"),
        "layers.{}.mlp.down.weight": L + "mlp.down_proj.weight",
        "layers.{}.moe.gate.weight": L + "mlp.gate.weight",
        "layers.{}.moe.correction_bias.weight": L + "mlp.gate.e_score_correction_bias",
        # per-expert first: what the released checkpoints hold and what to_hf writes before any read
        "layers.{}.moe.gate_up.weight": OneOf((
            Fuse((Stack(ex + "gate_proj.weight", E), Stack(ex + "up_proj.weight", E)), dim=1, sizes=(I, I)),
            L + "mlp.experts.gate_up_proj",
        )),
        "layers.{}.moe.down.weight": OneOf((Stack(ex + "down_proj.weight", E), L + "mlp.experts.down_proj")),
        "layers.{}.moe.shared_gate_up.weight": (L + "mlp.shared_experts.gate_proj.weight",
                                                L + "mlp.shared_experts.up_proj.weight"),
        "layers.{}.moe.shared_down.weight": L + "mlp.shared_experts.down_proj.weight",
    }


def _split_sizes(cfg) -> dict[str, tuple[int, ...]]:
    return {"layers.{}.mlp.gate_up.weight": (cfg.intermediate_size,) * 2,
            "layers.{}.moe.shared_gate_up.weight": (cfg.shared_intermediate_size,) * 2}


def mtp_ignore(cfg) -> str:
    """The released checkpoints' MTP layer, ``model.layers.{num_layers}.*``: not part of this model."""
    return rf"^model\.layers\.{cfg.num_layers}\."


def name_map(cfg) -> NameMap:
    return NameMap(
        hf_names(cfg),
        split_sizes=_split_sizes(cfg),
        tied={"lm_head.weight": "embed.weight"},
        tie_word_embeddings=cfg.tie_word_embeddings,
        ignore=(r"(^|\.)rotary_emb\.inv_freq$", mtp_ignore(cfg)),
        name=MODEL_TYPE,
    )


def expected(cfg, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{our name: (shape, dtype)}: ``dtype``, but FP32 for the router's weight and bias (as transformers
    keeps them in any dtype; the seeds saw a bf16 bias change the selected experts).  Indexer weights
    only on "full" layers, dense MLP or MoE per ``mlp_layer_types``."""
    H, V, Hq, Rq, Rkv = cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    Dn, Dr, Dv, Hi, Di = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    E, I, Is, Id = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.intermediate_size
    shapes = {"embed.weight": (V, H), "norm.weight": (H,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm.weight": (H,), p + "mlp_norm.weight": (H,),
                   p + "attn.q_a.weight": (Rq, H), p + "attn.q_a_norm.weight": (Rq,),
                   p + "attn.q_b.weight": (Hq * (Dn + Dr), Rq), p + "attn.kv_a.weight": (Rkv + Dr, H),
                   p + "attn.kv_a_norm.weight": (Rkv,), p + "attn.kv_b.weight": (Hq * (Dn + Dv), Rkv),
                   p + "attn.o.weight": (H, Hq * Dv)}
        if cfg.indexer_types[i] == "full":
            shapes |= {p + "indexer.wq_b.weight": (Hi * Di, Rq), p + "indexer.wk.weight": (Di, H),
                       p + "indexer.k_norm.weight": (Di,), p + "indexer.k_norm.bias": (Di,),
                       p + "indexer.weights_proj.weight": (Hi, H)}
        if cfg.mlp_layer_types[i] == "dense":
            shapes |= {p + "mlp.gate_up.weight": (2 * Id, H), p + "mlp.down.weight": (H, Id)}
        else:
            shapes |= {p + "moe.gate.weight": (E, H), p + "moe.correction_bias.weight": (E,),
                       p + "moe.gate_up.weight": (E, 2 * I, H), p + "moe.down.weight": (E, H, I),
                       p + "moe.shared_gate_up.weight": (2 * Is, H), p + "moe.shared_down.weight": (H, Is)}
    return {k: (s, torch.float32 if k.endswith(FP32_NAMES) else dtype) for k, s in shapes.items()}


def _check_directory(source) -> None:
    if isinstance(source, (str, os.PathLike, HFCheckpoint)):
        check_checkpoint_config(read_hf_config(source.path if isinstance(source, HFCheckpoint) else source))


def _log_mtp(cfg, names) -> None:
    mtp = [n for n in names if re.search(mtp_ignore(cfg), n)]
    if mtp:
        log.info("glm5_sparse_fp8: left out the %d tensors of the MTP layer (%s...)", len(mtp), mtp[0])


def _has_scales(src) -> bool:
    return any(n.endswith(SCALE_SUFFIX) for n in src.keys())


def from_hf(source, cfg, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """Our tensors from a checkpoint (directory, ``HFCheckpoint`` or {hf_name: tensor}); a directory's
    config.json must be glm_moe_dsa.  FP8 weights (those with a ``weight_scale_inv``) read as their FP32
    values code x scale (``weights.formats.DequantizedSource``) before the cast to ``dtype``: pass
    ``torch.float32`` for masters, or use ``from_hf_fp8`` to keep the codes."""
    _check_directory(source)
    with open_source(source) as src:
        if not isinstance(src, DequantizedSource) and _has_scales(src):
            src = DequantizedSource(src)
        _log_mtp(cfg, src.keys())
        return name_map(cfg).from_hf(src, expected(cfg, dtype), device=device)


def to_hf(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """HF-named tensors (views of ours) for ``save_hf_checkpoint``, as ``GlmMoeDsaForCausalLM`` saves them:
    experts one tensor each; lm_head dropped when tied."""
    return name_map(cfg).to_hf(tensors)


# ---------------------------------------------------------------- FP8 codes and scales as stored
def _scaled(spec):
    """The same layout as ``spec`` with every HF template's ``.weight`` -> ``.weight_scale_inv``."""
    if isinstance(spec, str):
        return spec + SCALE_SUFFIX
    if isinstance(spec, Stack):
        return Stack(_scaled(spec.template), spec.count)
    if isinstance(spec, Fuse):
        return Fuse(tuple(_scaled(p) for p in spec.parts), dim=spec.dim,
                    sizes=None if spec.sizes is None else tuple(cdiv(s, BLOCK) for s in spec.sizes))
    if isinstance(spec, OneOf):
        return OneOf(tuple(_scaled(o) for o in spec.options))
    return tuple(_scaled(p) for p in spec)


def _templates(spec) -> list[str]:
    """Every HF template of ``spec`` (each layout's, each part's)."""
    if isinstance(spec, str):
        return [spec]
    if isinstance(spec, Stack):
        return [spec.template]
    parts = spec.options if isinstance(spec, OneOf) else spec.parts if isinstance(spec, Fuse) else spec
    return [t for p in parts for t in _templates(p)]


def _scale_grid(shape: tuple[int, ...], part_rows: tuple[int, ...] | None, dim: int) -> tuple[int, ...]:
    """The scales' shape of a (..., N, K) weight: one per 128x128 block, each fused part its own grid
    along the fused ``dim`` (rows of each part in ``part_rows``)."""
    grid = list(FP8_BLOCK128.scales_shape(shape))
    if part_rows is not None:
        grid[dim] = sum(cdiv(r, BLOCK) for r in part_rows)
    return tuple(grid)


def _fp8_layout(cfg, quantized: set[str]):
    """(NameMap of codes and scales, {our template: (part rows, fused dim)}) for the templates in
    ``quantized``: ``<template>_scale_inv`` maps to the HF scales in the weights' own layout."""
    names, sizes = hf_names(cfg), _split_sizes(cfg)
    parts = {t: (rows, 0) for t, rows in sizes.items()}
    parts["layers.{}.moe.gate_up.weight"] = ((cfg.moe_intermediate_size,) * 2, 1)
    mapping, split = dict(names), dict(sizes)
    for t in quantized:
        spec = names[t]
        if t in sizes:
            spec = Fuse(tuple(spec), dim=0, sizes=sizes[t])
        mapping[t + SCALE_SUFFIX] = _scaled(spec)
    nm = NameMap(mapping, split_sizes=split, tied={"lm_head.weight": "embed.weight"},
                 tie_word_embeddings=cfg.tie_word_embeddings,
                 ignore=(r"(^|\.)rotary_emb\.inv_freq$", mtp_ignore(cfg)), name=MODEL_TYPE)
    return nm, parts


def _template_of(name: str) -> str:
    return re.sub(r"^layers\.\d+\.", "layers.{}.", name)


def _layer_of(name: str) -> tuple[str, ...]:
    m = re.match(r"^layers\.(\d+)\.", name)
    return (m.group(1),) if m else ()


def fp8_names(cfg, src) -> set[str]:
    """Our weight names whose checkpoint tensors are FP8 (carry a ``weight_scale_inv``) in ``src``;
    CheckpointError when one fused or stacked weight mixes FP8 and unquantized parts."""
    names, E = hf_names(cfg), cfg.n_routed_experts
    present = set(src.keys())
    out, mixed = set(), []
    for ours in expected(cfg, torch.float32):
        index = _layer_of(ours)
        hf = [t.format(*index, expert=e) for t in _templates(names[_template_of(ours)])
              for e in (range(E) if "{expert}" in t else (0,))]
        hf = [h for h in hf if h in present]  # the layout the checkpoint holds
        scaled = [h for h in hf if h + SCALE_SUFFIX in present]
        if scaled and len(scaled) != len(hf):
            plain = next(h for h in hf if h + SCALE_SUFFIX not in present)
            mixed.append(f"{ours}: {len(scaled)} of its {len(hf)} checkpoint tensors are FP8 "
                         f"(e.g. {scaled[0]}), {plain} is not")
        elif scaled:
            out.add(ours)
    if mixed:
        raise CheckpointError(f"{MODEL_TYPE} checkpoint {getattr(src, 'path', src)}: a fused or stacked weight must "
                              f"be stored in one format:\n  " + "\n  ".join(mixed))
    return out


def from_hf_fp8(source, cfg, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """Our tensors from an FP8 block checkpoint, the FP8 ones as stored: ``<ours>.weight`` float8_e4m3fn
    codes (stacked / fused like the weight) and ``<ours>.weight_scale_inv`` fp32 scales (E, ., .) or
    (., .), each fused part its own 128x128 grid, concatenated along the fused dim (the module
    docstring).  The tensors without scales read as ``from_hf`` reads them (``dtype``; the router FP32).
    Codes stored as anything but e4m3fn, or scales as anything but fp32, are refused, naming them."""
    _check_directory(source)
    with open_source(source) as src:
        if isinstance(src, DequantizedSource):
            src = src.source
        _log_mtp(cfg, src.keys())
        quantized = fp8_names(cfg, src)
        templates = {_template_of(n) for n in quantized}
        nm, parts = _fp8_layout(cfg, templates)
        want = expected(cfg, dtype)
        for ours in quantized:
            shape = want[ours][0]
            rows, dim = parts.get(_template_of(ours), (None, 0))
            want[ours] = (shape, torch.float8_e4m3fn)
            want[ours + SCALE_SUFFIX] = (_scale_grid(shape, rows, dim), torch.float32)
        dtype_of = getattr(src, "dtype", None)
        if dtype_of is not None:
            for ours in quantized:
                for h in nm.hf_names(ours) or ():
                    if h in src:
                        FP8_BLOCK128.check_dtypes(h, dtype_of(h), h + SCALE_SUFFIX, dtype_of(h + SCALE_SUFFIX))
        return nm.from_hf(src, want, device=device)


def to_hf_fp8(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """The inverse of ``from_hf_fp8``: HF-named codes and ``weight_scale_inv`` (views of ours, split per
    part and unstacked per expert) for every ``<ours>.weight`` that has its ``<ours>.weight_scale_inv``;
    the other tensors as ``to_hf`` writes them."""
    quantized = {_template_of(n[: -len(SCALE_SUFFIX)]) for n in tensors if n.endswith(SCALE_SUFFIX)}
    return _fp8_layout(cfg, quantized)[0].to_hf(tensors)
