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

The release's multi-token-prediction layers (``mtp.*``) are not part of the model: left out on load, and the
log says how many.
"""
from __future__ import annotations

import logging
import os
import re

import torch

from ...weights import (
    CheckpointError,
    Fuse,
    HFCheckpoint,
    NameMap,
    OneOf,
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


def check_checkpoint_config(config: dict) -> None:
    """Raise, naming what it is, unless ``config`` (config.json) is a DeepSeek-V4 causal LM."""
    check_model_type(config, MODEL_TYPE, ARCHITECTURES)


def hf_names(cfg) -> dict:
    """{our template: transformers' template, a tuple (fused along dim 0), a Fuse, a Stack or a OneOf}."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    L = "model.layers.{}."
    A, C, X = L + "self_attn.", L + "self_attn.compressor.", L + "self_attn.compressor.indexer."
    ex = L + "mlp.experts.{expert}."
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
        # transformers' stacked tensors first (what it saves), then one tensor per expert (the release's, renamed)
        "layers.{}.moe.gate_up.weight": OneOf((
            L + "mlp.experts.gate_up_proj",
            Fuse((Stack(ex + "gate_proj.weight", E), Stack(ex + "up_proj.weight", E)), dim=1, sizes=(I, I)),
        )),
        "layers.{}.moe.down.weight": OneOf((L + "mlp.experts.down_proj", Stack(ex + "down_proj.weight", E))),
        "layers.{}.moe.shared_gate_up.weight": (L + "mlp.shared_experts.gate_proj.weight",
                                                L + "mlp.shared_experts.up_proj.weight"),
        "layers.{}.moe.shared_down.weight": L + "mlp.shared_experts.down_proj.weight",
    }
    for p in ("attn_hc", "ffn_hc"):
        for f in ("fn", "base", "scale"):
            names[f"layers.{{}}.{p}.{f}"] = L + f"{p}.{f}"
    return names


def name_map(cfg) -> NameMap:
    return NameMap(hf_names(cfg), split_sizes={"layers.{}.moe.shared_gate_up.weight": (cfg.shared_intermediate_size,) * 2},
                   tied={"lm_head.weight": "embed.weight"}, tie_word_embeddings=cfg.tie_word_embeddings,
                   ignore=(r"(^|\.)rotary_emb\.\w*inv_freq$", MTP_IGNORE), name=MODEL_TYPE,
                   integer_names=INT_NAMES)


def expected(cfg, dtype: torch.dtype) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{our name: (shape, dtype)}: ``dtype``, FP32 for ``FP32_NAMES``, int64 for the hash layers' tid2eid."""
    H, V, Hq, D, Rq, N = cfg.hidden_size, cfg.vocab_size, cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.hc_mult
    G, Ro, Hi, Di = cfg.o_groups, cfg.o_lora_rank, cfg.index_n_heads, cfg.index_head_dim
    E, I, Is, k = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.shared_intermediate_size, cfg.num_experts_per_tok
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
        if cfg.mlp_layer_types[i] == "hash_moe":
            shapes[p + "moe.tid2eid.weight"] = (V, k)
        else:
            shapes[p + "moe.correction_bias.weight"] = (E,)
    out = {}
    for name, s in shapes.items():
        dt = torch.int64 if name.endswith(INT_NAMES) else torch.float32 if name.endswith(FP32_NAMES) else dtype
        out[name] = (s, dt)
    return out


def _check_directory(source) -> None:
    if isinstance(source, (str, os.PathLike, HFCheckpoint)):
        check_checkpoint_config(read_hf_config(source.path if isinstance(source, HFCheckpoint) else source))


def _named(src):
    """``src`` under transformers' names: a release checkpoint is renamed, the other kept."""
    return ReleaseNames(src) if is_release(src.keys()) else src


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
    """Our tensors from a checkpoint (directory, ``HFCheckpoint`` or {name: tensor}) in either naming; a
    directory's config.json must be deepseek_v4.  Unquantized tensors only, for now (the FP8 / MXFP4 release
    is read by ``from_hf_quantized``)."""
    _check_directory(source)
    with open_source(source) as src:
        src = _named(src)
        _log_mtp(src.keys())
        out = name_map(cfg).from_hf(src, expected(cfg, dtype), device=device)
    check_tid2eid(out, cfg, str(getattr(src, "path", "the checkpoint")))
    return out


def to_hf(tensors: dict[str, torch.Tensor], cfg) -> dict[str, torch.Tensor]:
    """transformers-named tensors (views of ours), as ``DeepseekV4ForCausalLM`` saves them: experts stacked."""
    return name_map(cfg).to_hf(tensors)
