"""DeepSeek-V4 checkpoint names <-> ours, in both namings a user meets: transformers' (``DeepseekV4ForCausalLM``:
``model.layers.{i}.self_attn.q_a_proj.weight``, experts stacked as ``mlp.experts.gate_up_proj``) and DeepSeek's
release (``layers.{i}.attn.wq_a.weight``, one tensor per expert ``ffn.experts.{e}.w1.weight``, ``embed.weight``,
``head.weight``).  A release checkpoint is read through ``ReleaseNames``, which renames its keys as transformers'
``conversion_mapping`` does; the rest is one name map.

Ours, per layer i (fused only where one GEMM reads several HF projections of one input into one SwiGLU):
  layers.{i}.attn_hc.{fn,base,scale} / ffn_hc.{fn,base,scale}   mHC coefficients (FP32): fn ((2 + N) N, N H)
  layers.{i}.attn_norm / mlp_norm          input_layernorm / post_attention_layernorm (FP32)
  attention:  attn.q_a (Rq, H), attn.q_a_norm (Rq,) FP32, attn.q_b (Hq D, Rq), attn.kv (D, H) -- one row is K and V,
              attn.kv_norm (D,) FP32, attn.o_a (G Ro, Hq D / G) -- per group, attn.o_b (H, G Ro), attn.sinks (Hq,) FP32
  compressor (CSA and HCA layers; c = 2 on CSA: [overlap half | own half], 1 on HCA):
              compressor.kv (c D, H), compressor.gate (c D, H), compressor.position_bias (rate, c D) FP32,
              compressor.kv_norm (D,) FP32
  indexer (CSA layers): indexer.kv (2 Di, H), indexer.gate (2 Di, H), indexer.position_bias (rate, 2 Di) FP32,
              indexer.kv_norm (Di,) FP32, indexer.q_b (Hi Di, Rq), indexer.weights_proj (Hi, H)
  MoE (every layer): moe.gate (E, H); moe.correction_bias (E,) FP32 as ``.weight`` (learned layers);
              moe.tid2eid (V, k) int64 as ``.weight`` (hash layers); moe.gate_up (E, 2I, H) [w1 | w3];
              moe.down (E, H, I); moe.shared_gate_up (2 Is, H) [w1 | w3]; moe.shared_down (H, Is)
  hc_head.{fn,base,scale} (N, N H), (N,), (1,) FP32; embed, norm (FP32), lm_head
  MXFP4 experts (quantization_config expert_dtype "fp4"): moe.gate_up.weight (E, 2I, H/2) and moe.down.weight
              (E, H, I/2) are uint8 codes, two E2M1 a byte, with their E8M0 scales moe.gate_up.weight_scale
              (E, 2I, H/32) and moe.down.weight_scale (E, H, I/32) uint8, one per 32 along K

Quantized checkpoints (the release: FP8 e4m3 linears with one scale per 128x128 block in ``X.scale``, E8M0 when
scale_fmt is "ue8m0"; experts one tensor per expert, int8 codes with float8_e8m0fnu ``.scale``): an FP8 linear reads
as code x scale (exact for E8M0 scales: a 4-bit significand times a power of two fits bf16 and fp32), MXFP4
experts as stored, byte for byte, never through a float.  ``to_hf`` writes MXFP4 experts back the release's way.

The release's multi-token-prediction layers (``mtp.*``) are not part of the model: left out on load, and the
log says how many.
"""
from __future__ import annotations

import logging
import os
import re

import torch

from ...weights import (
    FP8_BLOCK128,
    FP8_BLOCK128_E8M0,
    MXFP4,
    CheckpointError,
    DequantizedSource,
    Fuse,
    HFCheckpoint,
    NameMap,
    OneOf,
    QuantRule,
    Stack,
    check_model_type,
    open_source,
    read_hf_config,
)
from ...weights.lora_names import LoraNames
from .config import CSA, HCA

MODEL_TYPE = "deepseek_v4"
ARCHITECTURES = ("DeepseekV4ForCausalLM",)
# FP32 in any dtype: transformers' _keep_in_fp32_modules_strict (mHC, sinks, position biases, norms, the correction
# bias); the router's weight stays in the model dtype, as transformers keeps it
FP32_NAMES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.fn", "hc_head.base", "hc_head.scale", "attn.sinks",
              "position_bias", "q_a_norm.weight", "kv_norm.weight", "attn_norm.weight", "mlp_norm.weight",
              "moe.correction_bias.weight", "norm.weight")
INT_NAMES = ("moe.tid2eid.weight",)
# MXFP4 experts' codes and scales: uint8 here, read and written byte for byte
MX_NAMES = (".moe.gate_up.weight", ".moe.gate_up.weight_scale", ".moe.down.weight", ".moe.down.weight_scale")
# Saved as the release stores them: transformers' Fp8Dequantize decodes int8 (or float4) codes as E2M1 pairs, but
# reads uint8 ones as FP8 values
SAVED_CODES, SAVED_SCALES = torch.int8, MXFP4.scale_dtypes[-1]
# transformers' modules that an MXFP4 save leaves unquantized (every linear but the experts), for modules_to_not_convert
UNQUANTIZED_MODULES = ("lm_head", "model.layers.*.self_attn", "model.layers.*.mlp.shared_experts")
_EXPERT = re.compile(r"\.mlp\.experts\.")
MTP_IGNORE = r"^(model\.)?mtp\."
log = logging.getLogger("alignzoo.models")

# LoRA targets {HF projection: its module under model.layers.{i}}: the attention's projections.  o_a_proj is a
# grouped linear (each head group through its own row block), which one adapter pair over the whole matrix cannot
# follow; the compressors and the indexer are left frozen (the indexer takes no gradient).  In PEFT, "q_b_proj" and
# "kv_proj" also name the compressor's and indexer's modules: there they get B = 0 adapters, which change nothing.
LORA_TARGETS = {"q_a_proj": "self_attn.q_a_proj", "q_b_proj": "self_attn.q_b_proj", "kv_proj": "self_attn.kv_proj",
                "o_b_proj": "self_attn.o_b_proj"}
# LoRA on the routed experts (PEFT's target_parameters): HF parameter -> (our experts module, which)
LORA_PARAM_SLOTS = {"mlp.experts.gate_up_proj": ("moe", "gate_up"), "mlp.experts.down_proj": ("moe", "down")}
# transformers' DeepseekV4Experts registers gate_up_proj before down_proj: PEFT nests their adapters in that order
LORA_PARAM_ORDER = ("gate_up_proj", "down_proj")


def lora_slices(cfg) -> dict[str, tuple[tuple[str, int, int], ...]]:
    """{our layer: ((HF projection, first row, end row),)}: one projection each (none is fused)."""
    return {"attn.q_a": (("q_a_proj", 0, cfg.q_lora_rank),),
            "attn.q_b": (("q_b_proj", 0, cfg.num_heads * cfg.head_dim),),
            "attn.kv": (("kv_proj", 0, cfg.head_dim),),
            "attn.o_b": (("o_b_proj", 0, cfg.hidden_size),)}


_LORA_NAMES = LoraNames(LORA_TARGETS, LORA_PARAM_SLOTS)
lora_to_hf = _LORA_NAMES.to_hf  # layers.{i}.kv_proj -> model.layers.{i}.self_attn.kv_proj; experts: <module>:<param>
lora_from_hf = _LORA_NAMES.from_hf

# DeepSeek's release names -> transformers' (after the ``layers.{i}.`` prefix; longest first, as the
# nested indexer compressor must win over the outer compressor)
_RELEASE_LAYER = (
    ("attn.indexer.compressor.ape", "self_attn.compressor.indexer.position_bias"),
    ("attn.indexer.compressor.wkv.", "self_attn.compressor.indexer.kv_proj."),
    ("attn.indexer.compressor.wgate.", "self_attn.compressor.indexer.gate_proj."),
    ("attn.indexer.compressor.norm.", "self_attn.compressor.indexer.kv_norm."),
    ("attn.indexer.wq_b.", "self_attn.compressor.indexer.q_b_proj."),
    ("attn.indexer.weights_proj.", "self_attn.compressor.indexer.scorer.weights_proj."),
    ("attn.compressor.ape", "self_attn.compressor.position_bias"),
    ("attn.compressor.wkv.", "self_attn.compressor.kv_proj."),
    ("attn.compressor.wgate.", "self_attn.compressor.gate_proj."),
    ("attn.compressor.norm.", "self_attn.compressor.kv_norm."),
    ("attn.attn_sink", "self_attn.sinks"),
    ("attn.wq_a.", "self_attn.q_a_proj."),
    ("attn.wq_b.", "self_attn.q_b_proj."),
    ("attn.q_norm.", "self_attn.q_a_norm."),
    ("attn.wkv.", "self_attn.kv_proj."),
    ("attn.kv_norm.", "self_attn.kv_norm."),
    ("attn.wo_a.", "self_attn.o_a_proj."),
    ("attn.wo_b.", "self_attn.o_b_proj."),
    ("attn_norm.", "input_layernorm."),
    ("ffn_norm.", "post_attention_layernorm."),
    ("hc_attn_fn", "attn_hc.fn"), ("hc_attn_base", "attn_hc.base"), ("hc_attn_scale", "attn_hc.scale"),
    ("hc_ffn_fn", "ffn_hc.fn"), ("hc_ffn_base", "ffn_hc.base"), ("hc_ffn_scale", "ffn_hc.scale"),
    ("ffn.gate.bias", "mlp.gate.e_score_correction_bias"),
    ("ffn.gate.tid2eid", "mlp.gate.tid2eid"),
    ("ffn.gate.weight", "mlp.gate.weight"),
    ("ffn.shared_experts.w1.", "mlp.shared_experts.gate_proj."),
    ("ffn.shared_experts.w3.", "mlp.shared_experts.up_proj."),
    ("ffn.shared_experts.w2.", "mlp.shared_experts.down_proj."),
)
_RELEASE_GLOBAL = {"embed.weight": "model.embed_tokens.weight", "head.weight": "lm_head.weight",
                   "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                   "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_RELEASE_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w[123])\.(.+)$")
_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def release_to_hf(name: str) -> str | None:
    """transformers' name of a release tensor (a per-expert one as ``mlp.experts.{e}.gate_proj.weight``, which the
    name map stacks), or None for a name the release does not use (``mtp.*`` is kept as is, to be skipped)."""
    if name in _RELEASE_GLOBAL:
        return _RELEASE_GLOBAL[name]
    m = _RELEASE_EXPERT.match(name)
    if m:
        i, e, w, rest = m.groups()
        return f"model.layers.{i}.mlp.experts.{e}.{_EXPERT_PROJ[w]}.{rest}"
    m = re.match(r"^layers\.(\d+)\.(.+)$", name)
    if m:
        i, rest = m.groups()
        for src, dst in _RELEASE_LAYER:
            if rest.startswith(src):
                return f"model.layers.{i}.{dst}{rest[len(src):]}"
    return None


def hf_to_release(name: str) -> str | None:
    """The inverse of ``release_to_hf`` for one tensor (transformers' stacked experts have no single release name:
    None, as for a name outside both namings)."""
    for ours, theirs in _RELEASE_GLOBAL.items():
        if name == theirs:
            return ours
    m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(.+)$", name)
    if m:
        i, e, proj, rest = m.groups()
        w = {v: k for k, v in _EXPERT_PROJ.items()}[proj]
        return f"layers.{i}.ffn.experts.{e}.{w}.{rest}"
    m = re.match(r"^model\.layers\.(\d+)\.(.+)$", name)
    if m:
        i, rest = m.groups()
        for src, dst in _RELEASE_LAYER:
            if rest.startswith(dst):
                return f"layers.{i}.{src}{rest[len(dst):]}"
    return None


def is_release(names) -> bool:
    """DeepSeek's naming: ``embed.weight`` and ``layers.{i}.attn.*`` with no ``model.`` prefix."""
    names = set(names)
    return "embed.weight" in names or any(n.startswith("layers.") and ".attn." in n for n in names)


class ReleaseNames:
    """A checkpoint in DeepSeek's release naming read under transformers' names (``release_to_hf``); unknown
    names stay as they are, so the name map reports them as unexpected."""

    def __init__(self, source):
        self.source = source
        self.path = getattr(source, "path", source)
        self._to_src = {}
        for n in source.keys():
            hf = release_to_hf(n) or n
            if hf in self._to_src:
                raise CheckpointError(f"{self.path}: {n} and {self._to_src[hf]} are both {hf}")
            self._to_src[hf] = n

    def keys(self):
        return list(self._to_src)

    def __contains__(self, name):
        return name in self._to_src

    def shape(self, name):
        return self.source.shape(self._to_src[name])

    def is_float(self, name):
        return self.source.is_float(self._to_src[name])

    def dtype(self, name):
        return self.source.dtype(self._to_src[name])

    def get(self, name):
        return self.source.get(self._to_src[name])

    def source_name(self, name: str) -> str:
        return self._to_src[name]

    def __repr__(self):
        return f"{self.path} (DeepSeek release names)"


def mxfp4_experts(cfg) -> bool:
    """The routed experts are MXFP4 codes: the config's quantization_config has expert_dtype "fp4"."""
    return cfg.quantization is not None and cfg.quantization.expert_dtype == "fp4"


def saved_quantization(cfg) -> dict:
    """config.json's quantization_config for ``to_hf``'s MXFP4 layout: the config's, with scale_fmt "ue8m0" (the
    experts' scales are E8M0 bytes, which transformers' FP8Experts then holds as float8_e8m0fnu) and every other
    linear named in modules_to_not_convert (saved unquantized, in the model's dtype)."""
    return {**cfg.quantization.to_hf(), "scale_fmt": "ue8m0", "modules_to_not_convert": list(UNQUANTIZED_MODULES)}


def check_checkpoint_config(config: dict) -> None:
    """Raise, naming what it is, unless ``config`` (config.json) is a DeepSeek-V4 causal LM."""
    check_model_type(config, MODEL_TYPE, ARCHITECTURES)


def hf_names(cfg) -> dict:
    """{our template: transformers' template, a tuple (fused along dim 0), a Fuse, a Stack or a OneOf}.  MXFP4
    experts list one tensor per expert first (what ``to_hf`` writes) and add their scales: the release's ``.scale``,
    ``.weight_scale_inv``, or transformers' stacked ``gate_up_proj_scale_inv``."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    L = "model.layers.{}."
    A, C, X = L + "self_attn.", L + "self_attn.compressor.", L + "self_attn.compressor.indexer."
    ex = L + "mlp.experts.{expert}."

    def gate_up(w):  # [w1 | w3] along the rows, one tensor per expert
        return Fuse((Stack(ex + f"gate_proj.{w}", E), Stack(ex + f"up_proj.{w}", E)), dim=1, sizes=(I, I))

    # transformers' stacked tensors first (what it saves), then one tensor per expert (the release's, renamed)
    experts = {"gate_up": (L + "mlp.experts.gate_up_proj", gate_up("weight")),
               "down": (L + "mlp.experts.down_proj", Stack(ex + "down_proj.weight", E))}
    names = {
        "embed.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
        "lm_head.weight": "lm_head.weight",
        "hc_head.fn": "model.hc_head.hc_fn", "hc_head.base": "model.hc_head.hc_base",
        "hc_head.scale": "model.hc_head.hc_scale",
        "layers.{}.attn_norm.weight": L + "input_layernorm.weight",
        "layers.{}.mlp_norm.weight": L + "post_attention_layernorm.weight",
        "layers.{}.attn.q_a.weight": A + "q_a_proj.weight",
        "layers.{}.attn.q_a_norm.weight": A + "q_a_norm.weight",
        "layers.{}.attn.q_b.weight": A + "q_b_proj.weight",
        "layers.{}.attn.kv.weight": A + "kv_proj.weight",
        "layers.{}.attn.kv_norm.weight": A + "kv_norm.weight",
        "layers.{}.attn.o_a.weight": A + "o_a_proj.weight",
        "layers.{}.attn.o_b.weight": A + "o_b_proj.weight",
        "layers.{}.attn.sinks": A + "sinks",
        "layers.{}.compressor.kv.weight": C + "kv_proj.weight",
        "layers.{}.compressor.gate.weight": C + "gate_proj.weight",
        "layers.{}.compressor.position_bias": C + "position_bias",
        "layers.{}.compressor.kv_norm.weight": C + "kv_norm.weight",
        "layers.{}.indexer.kv.weight": X + "kv_proj.weight",
        "layers.{}.indexer.gate.weight": X + "gate_proj.weight",
        "layers.{}.indexer.position_bias": X + "position_bias",
        "layers.{}.indexer.kv_norm.weight": X + "kv_norm.weight",
        "layers.{}.indexer.q_b.weight": X + "q_b_proj.weight",
        "layers.{}.indexer.weights_proj.weight": X + "scorer.weights_proj.weight",
        "layers.{}.moe.gate.weight": L + "mlp.gate.weight",
        "layers.{}.moe.correction_bias.weight": L + "mlp.gate.e_score_correction_bias",
        "layers.{}.moe.tid2eid.weight": L + "mlp.gate.tid2eid",
        "layers.{}.moe.shared_gate_up.weight": (L + "mlp.shared_experts.gate_proj.weight",
                                                L + "mlp.shared_experts.up_proj.weight"),
        "layers.{}.moe.shared_down.weight": L + "mlp.shared_experts.down_proj.weight",
    }
    for p in ("attn_hc", "ffn_hc"):
        for f in ("fn", "base", "scale"):
            names[f"layers.{{}}.{p}.{f}"] = L + f"{p}.{f}"
    if mxfp4_experts(cfg):
        experts = {s: o[::-1] for s, o in experts.items()}
        names["layers.{}.moe.gate_up.weight_scale"] = OneOf((gate_up("scale"), gate_up("weight_scale_inv"),
                                                              L + "mlp.experts.gate_up_proj_scale_inv"))
        names["layers.{}.moe.down.weight_scale"] = OneOf((Stack(ex + "down_proj.scale", E),
                                                           Stack(ex + "down_proj.weight_scale_inv", E),
                                                           L + "mlp.experts.down_proj_scale_inv"))
    for s, options in experts.items():
        names[f"layers.{{}}.moe.{s}.weight"] = OneOf(options)
    return names


def name_map(cfg) -> NameMap:
    return NameMap(hf_names(cfg), split_sizes={"layers.{}.moe.shared_gate_up.weight": (cfg.shared_intermediate_size,) * 2},
                   tied={"lm_head.weight": "embed.weight"}, tie_word_embeddings=cfg.tie_word_embeddings,
                   ignore=(r"(^|\.)rotary_emb\.\w*inv_freq$", MTP_IGNORE), name=MODEL_TYPE,
                   integer_names=INT_NAMES + (MX_NAMES if mxfp4_experts(cfg) else ()))


def expected(cfg, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{our name: (shape, dtype)}: ``dtype``, FP32 for ``FP32_NAMES``, int64 for the hash layers' tid2eid, uint8
    for MXFP4 experts' codes and scales."""
    H, V, Hq, D, Rq, N = cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    G, Ro, Hi, Di = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, I, Is, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.num_experts_per_tok
    mx = mxfp4_experts(cfg)
    shapes = {"embed.weight": (V, H), "norm.weight": (H,), "hc_head.fn": (N, N * H), "hc_head.base": (N,),
              "hc_head.scale": (1,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        for hc in ("attn_hc", "ffn_hc"):
            shapes |= {p + hc + ".fn": (cfg.hc_weights, N * H), p + hc + ".base": (cfg.hc_weights,),
                       p + hc + ".scale": (3,)}
        shapes |= {p + "attn_norm.weight": (H,), p + "mlp_norm.weight": (H,),
                   p + "attn.q_a.weight": (Rq, H), p + "attn.q_a_norm.weight": (Rq,), p + "attn.q_b.weight": (Hq * D, Rq),
                   p + "attn.kv.weight": (D, H), p + "attn.kv_norm.weight": (D,),
                   p + "attn.o_a.weight": (G * Ro, Hq * D // G), p + "attn.o_b.weight": (H, G * Ro),
                   p + "attn.sinks": (Hq,)}
        t = cfg.layer_types[i]
        if t in (CSA, HCA):
            c, rate = (2 if t == CSA else 1), cfg.rate(i)
            shapes |= {p + "compressor.kv.weight": (c * D, H), p + "compressor.gate.weight": (c * D, H),
                       p + "compressor.position_bias": (rate, c * D), p + "compressor.kv_norm.weight": (D,)}
        if t == CSA:
            shapes |= {p + "indexer.kv.weight": (2 * Di, H), p + "indexer.gate.weight": (2 * Di, H),
                       p + "indexer.position_bias": (cfg.rate(i), 2 * Di), p + "indexer.kv_norm.weight": (Di,),
                       p + "indexer.q_b.weight": (Hi * Di, Rq), p + "indexer.weights_proj.weight": (Hi, H)}
        shapes |= {p + "moe.gate.weight": (E, H), p + "moe.gate_up.weight": (E, 2 * I, H),
                   p + "moe.down.weight": (E, H, I), p + "moe.shared_gate_up.weight": (2 * Is, H),
                   p + "moe.shared_down.weight": (H, Is)}
        if mx:
            for s in ("gate_up", "down"):
                w = shapes[p + f"moe.{s}.weight"]
                shapes |= {p + f"moe.{s}.weight": MXFP4.codes_shape(w),
                           p + f"moe.{s}.weight_scale": MXFP4.scales_shape(w)}
        if cfg.mlp_layer_types[i] == "hash_moe":
            shapes[p + "moe.tid2eid.weight"] = (V, k)
        else:
            shapes[p + "moe.correction_bias.weight"] = (E,)
    out = {}
    for name, s in shapes.items():
        dt = (torch.uint8 if mx and name.endswith(MX_NAMES) else torch.int64 if name.endswith(INT_NAMES)
              else torch.float32 if name.endswith(FP32_NAMES) else dtype)
        out[name] = (s, dt)
    return out


def _check_directory(source) -> None:
    if isinstance(source, (str, os.PathLike, HFCheckpoint)):
        check_checkpoint_config(read_hf_config(source.path if isinstance(source, HFCheckpoint) else source))


def _named(src):
    """``src`` under transformers' names: a release checkpoint is renamed, the other kept."""
    return ReleaseNames(src) if is_release(src.keys()) else src


def _is_scale(name: str) -> bool:
    return name.endswith((".scale", "_scale_inv"))


class _ExpertBytes:
    """``source`` with the MXFP4 experts' codes and scales (transformers' names under ``mlp.experts.``) read as their
    uint8 bytes: int8 / float4_e2m1fn_x2 codes and float8_e8m0fnu scales are the same bytes, which no cast touches.
    Each code tensor's dtypes and shapes are checked with its scale's (``weights.formats.MXFP4``) from the headers,
    a bad one named as the checkpoint names it (``named``: the release's name of a renamed one)."""

    def __init__(self, source, path, named=lambda n: n):
        self.source, self.path = source, path
        keys = source.keys()
        present = set(keys)
        self._bytes = set()
        for n in keys:
            if not _EXPERT.search(n) or _is_scale(n):
                continue
            self._bytes.add(n)
            s = next((c for c in (n + "_scale_inv", n.removesuffix("weight") + "scale") if c != n and c in present),
                     None)
            if s is None:
                continue  # the name map names it missing
            self._bytes.add(s)
            try:
                MXFP4.check_dtypes(named(n), source.dtype(n), named(s), source.dtype(s))
                MXFP4.check_shapes(named(n), source.shape(n), named(s), source.shape(s))
            except CheckpointError as e:
                raise CheckpointError(f"{path}: {e}") from None

    def keys(self):
        return self.source.keys()

    def __contains__(self, name):
        return name in self.source

    def shape(self, name):
        return self.source.shape(name)

    def is_float(self, name):
        return name not in self._bytes and self.source.is_float(name)

    def dtype(self, name):
        return torch.uint8 if name in self._bytes else self.source.dtype(name)

    def get(self, name):
        t = self.source.get(name)
        return t.view(torch.uint8) if name in self._bytes else t

    def __repr__(self):
        return repr(self.source)


def _readable(src, cfg):
    """``src`` (transformers' names) with its FP8 linears read as code x scale (``DequantizedSource``: the release's
    ``X.weight`` + ``X.scale`` or transformers' ``X.weight_scale_inv``; E8M0 scales when the config's scale_fmt is
    "ue8m0", else FP32) and, with MXFP4 experts, their codes and scales as bytes (``_ExpertBytes``)."""
    q, mx = cfg.quantization, mxfp4_experts(cfg)
    fmt = FP8_BLOCK128_E8M0 if q is not None and q.scale_fmt == "ue8m0" else FP8_BLOCK128
    dense = r"^(?!.*\.mlp\.experts\.)" if mx else None  # MXFP4 experts are read as stored, not dequantized
    path, named = getattr(src, "path", src), getattr(src, "source_name", lambda n: n)
    fp8 = DequantizedSource(src, (QuantRule(fmt, "scale", "weight", dense), QuantRule(fmt, "_scale_inv", "", dense)))
    if fp8.stored:  # filled from the headers: the checkpoint has FP8 linears
        src = fp8
    return _ExpertBytes(src, path, named) if mx else src


def _log_mtp(names) -> None:
    mtp = [n for n in names if re.search(MTP_IGNORE, n)]
    if mtp:
        log.info("deepseek_v4_mhc_mxfp4: left out the %d tensors of the multi-token-prediction layers (%s...)",
                 len(mtp), mtp[0])


def check_tid2eid(tensors: dict[str, torch.Tensor], cfg, where: str = "the checkpoint") -> None:
    """A hash layer's table must name experts in [0, E): refused with the tensor's name otherwise."""
    E = cfg.n_routed_experts
    for name, t in tensors.items():
        if name.endswith(INT_NAMES):
            bad = (t < 0) | (t >= E)
            if bool(bad.any()):
                tok, slot = (int(x) for x in bad.nonzero()[0])
                raise CheckpointError(f"{where}: {name}[{tok}, {slot}] = {int(t[tok, slot])} is not an expert of "
                                      f"the {E} (n_routed_experts); {int(bad.sum())} entries are out of range")


def from_hf(source, cfg, dtype: torch.dtype = torch.bfloat16, device="cpu") -> dict[str, torch.Tensor]:
    """Our tensors (``expected``) from a checkpoint (directory, ``HFCheckpoint`` or {name: tensor}) in either
    naming; a directory's config.json must be deepseek_v4.  FP8 linears read as code x scale, cast to ``dtype``
    (exact for E8M0 scales); MXFP4 experts (``cfg``'s expert_dtype "fp4") as their codes and scales, byte for byte
    (``_readable``).  A ``DequantizedSource`` (``models/loading.py``'s HF FP8 reader) is read through these
    rules instead."""
    _check_directory(source)
    with open_source(source) as src:
        if isinstance(src, DequantizedSource):
            src = src.source
        src = _named(src)
        _log_mtp(src.keys())
        out = name_map(cfg).from_hf(_readable(src, cfg), expected(cfg, dtype), device=device)
    check_tid2eid(out, cfg, str(getattr(src, "path", "the checkpoint")))
    return out


def to_hf(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """transformers-named tensors (views of ours), as ``DeepseekV4ForCausalLM`` saves them: experts stacked.  MXFP4
    experts: the release's layout (transformers reads it, ``saved_quantization``'s config): DeepSeek's names, one
    tensor per expert, int8 codes ``w1.weight`` and float8_e8m0fnu scales ``w1.scale``, views of our bytes; the
    rest unquantized."""
    hf = name_map(cfg).to_hf(tensors)
    if not mxfp4_experts(cfg):
        return hf
    out = {}
    for name, t in hf.items():
        release = hf_to_release(name)
        if release is None:
            raise KeyError(f"{name} has no name in DeepSeek's release naming")
        out[release] = t.view(SAVED_SCALES if _is_scale(name) else SAVED_CODES) if _EXPERT.search(name) else t
    return out
