"""GLM-5 training module: packed varlen forward over MLA layers whose attended
positions the DSA indexer selects, each followed by a dense SwiGLU MLP or a MoE
block (sigmoid router, shared expert); FP32 chosen-token log-probabilities under
the sampler's transforms; autograd through every kernel but the indexer.

It calls the public (differentiable) functions of the kernels whose ``_fwd``
launchers ``serve.py`` calls, op for op, and shares the block math that is the
same on both sides (``absorb_q``, ``unabsorb_o``, ``indexer_weights``), given the
side's matmul.  Shapes: T packed tokens, H hidden, Hq heads, Rq / Rkv the q / kv
ranks, Dn / Dr / Dv the nope / rope / value head dims, Hi x Di the indexer's heads.

MLA runs in the absorbed form the server caches for: a token's cache row is
[kv_a_layernorm(latent) (Rkv) | rope key (Dr)], one row for all heads; the query
head h becomes [q_nope_h · W_UK_h (Rkv) | q_rope_h (Dr)] and the attention output
o_h (Rkv) is read back through W_UV_h, where kv_b = per head [W_UK_h (Dn) ; W_UV_h (Dv)].
The trainer does exactly that arithmetic, so both sides get the same bits; it is
transformers' (which expands every key and value) up to rounding.

The indexer takes no gradient: transformers runs it under ``no_grad``, so the
policy loss never trains ``wq_b``, ``wk``, ``k_norm`` or ``weights_proj``.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.dsa import index_key_norm, index_select
from ...common.layers import AdapterRows, Fp8Linear, Linear, Weight, WeightBias
from ...common.matmul import matmul
from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...common.rope import rope
from ...common.sparse_attention import sparse_attention
from ...common.swiglu import swiglu_gate_up
from ..base import INDEX_SELECTED, TrainerBase, first_bad_selection
from ..capture import no_tap
from ..moe_block import FP8, MoEBlock, MoESpec, SharedExpert, SigmoidRouter
from .config import INDEXER_NORM_EPS, LATENT_NORM_EPS, Glm5Config
from .weights import LORA_PARAM_SLOTS, LORA_TARGETS, lora_slices

NAME = "glm5_sparse_fp8"


def moe_spec(cfg: Glm5Config, fp8: bool = False) -> MoESpec:
    """GLM-5's MoE block (``models/moe_block.py``): the sigmoid router with its correction bias and
    groups, the weights renormalised times ``routed_scaling_factor`` in fp32, one shared expert of
    n_shared x I; experts in the model dtype, or FP32 masters read as FP8 codes (``fp8``)."""
    if not cfg.norm_topk_prob:
        raise NotImplementedError("glm5_sparse_fp8 with norm_topk_prob=False: the sigmoid router renormalises")
    from ..moe_block import BF16

    router = SigmoidRouter(cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
    return MoESpec(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, router,
                   experts=FP8 if fp8 else BF16, shared=SharedExpert(cfg.shared_intermediate_size))


def kv_b_heads(kv_b: torch.Tensor, cfg: Glm5Config) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b (Hq (Dn + Dv), Rkv) -> (W_UK (Hq, Dn, Rkv), W_UV (Hq, Dv, Rkv)), views."""
    w = kv_b.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]


def absorb_q(q: torch.Tensor, kv_b: torch.Tensor, cfg: Glm5Config, mm) -> torch.Tensor:
    """q (T, Hq, Dn + Dr) after RoPE -> the absorbed query (T, Hq, Rkv + Dr): head h's
    [q_nope_h · W_UK_h | q_rope_h], one fixed-order matmul per head (``mm``: the side's matmul)."""
    Dn = cfg.qk_nope_head_dim
    w_uk, _ = kv_b_heads(kv_b, cfg)
    nope = [mm(q[:, h, :Dn].contiguous(), w_uk[h].t().contiguous()) for h in range(cfg.num_heads)]
    return torch.cat([torch.stack(nope, 1), q[:, :, Dn:]], dim=-1).contiguous()


def unabsorb_o(o: torch.Tensor, kv_b: torch.Tensor, cfg: Glm5Config, mm) -> torch.Tensor:
    """The attention output in the latent (T, Hq, Rkv) -> the heads' values (T, Hq · Dv): o_h · W_UVᵀ_h."""
    _, w_uv = kv_b_heads(kv_b, cfg)
    return torch.cat([mm(o[:, h].contiguous(), w_uv[h]) for h in range(cfg.num_heads)], dim=-1)


def indexer_weights(x: torch.Tensor, weights_proj: torch.Tensor, cfg: Glm5Config, mm) -> torch.Tensor:
    """The indexer's per-head weights (T, Hi) fp32: weights_proj (kept FP32, as transformers keeps it)
    on the hidden state in fp32, times Hi^-0.5."""
    return mm(x.float(), weights_proj) * (cfg.index_n_heads ** -0.5)


class Indexer(nn.Module):
    """A "full" layer's DSA indexer (transformers' GlmMoeDsaIndexer); no gradient."""

    def __init__(self, cfg: Glm5Config, index: int, *, device=None, dtype=None):
        super().__init__()
        self.cfg, self.index = cfg, index
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(Hi * Di, cfg.q_lora_rank, device=device, dtype=dtype)
        self.wk = Linear(Di, cfg.hidden_size, device=device, dtype=dtype)
        self.k_norm = WeightBias(Di, device=device, dtype=dtype)
        self.weights_proj = Weight(Hi, cfg.hidden_size, device=device, dtype=torch.float32)
        for p in self.parameters():
            p.requires_grad_(False)

    tap = staticmethod(no_tap)

    @torch.no_grad()
    def forward(self, x, q_resid, positions, cu_seqlens, replay=None):
        """-> the selection (T, index_topk) int32: positions from each sequence's start, ascending, -1 pads.
        ``replay``: (selection (T, index_topk), rows that have one (T,)): the server's, taken as given."""
        c, T, L = self.cfg, x.shape[0], self.index
        q = rope(self.wq_b(q_resid).view(T, c.index_n_heads, c.index_head_dim), positions, c.indexer_rope)
        k = index_key_norm(self.wk(x), self.k_norm.weight, self.k_norm.bias, INDEXER_NORM_EPS)
        k = rope(k.view(T, 1, c.index_head_dim), positions, c.indexer_rope).view(T, c.index_head_dim)
        w = indexer_weights(x, self.weights_proj.weight, c, matmul)
        self.tap("indexer.k", k, L)
        sel = index_select(q, k, w, cu_seqlens, positions, scale=c.indexer_scale, top_k=c.index_topk)
        if replay is not None:
            sel = torch.where(replay[1][:, None], replay[0], sel)
        self.tap("indexer.selected", sel, L)
        return sel


class MLA(nn.Module):
    """Multi-head latent attention over the selected positions (transformers' GlmMoeDsaAttention)."""

    def __init__(self, cfg: Glm5Config, index: int, *, linear=Linear, device=None, dtype=None):
        super().__init__()
        self.cfg, self.index = cfg, index
        kw = dict(device=device, dtype=dtype)
        Hq, Dv, Rq, Rkv = cfg.num_heads, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        self.q_a = linear(Rq, cfg.hidden_size, **kw)
        self.q_a_norm = Weight(Rq, **kw)
        self.q_b = linear(Hq * cfg.qk_head_dim, Rq, **kw)
        self.kv_a = linear(Rkv + cfg.qk_rope_head_dim, cfg.hidden_size, **kw)
        self.kv_a_norm = Weight(Rkv, **kw)
        self.kv_b = Linear(Hq * (cfg.qk_nope_head_dim + Dv), Rkv, **kw)  # read per head, absorbed
        self.o = linear(cfg.hidden_size, Hq * Dv, **kw)

    tap = staticmethod(no_tap)

    def q_and_row(self, h, positions, adapters=None):
        """-> (q_resid (T, Rq), the absorbed query (T, Hq, Rkv + Dr), the cache row (T, Rkv + Dr))."""
        c, T, L = self.cfg, h.shape[0], self.index
        Rkv, Dr = c.kv_lora_rank, c.qk_rope_head_dim
        q_resid = rmsnorm(self.q_a(h, adapters), self.q_a_norm.weight, LATENT_NORM_EPS)
        q = rope(self.q_b(q_resid, adapters).view(T, c.num_heads, c.qk_head_dim), positions, c.rope)
        kv = self.kv_a(h, adapters)
        latent = rmsnorm(kv[:, :Rkv].contiguous(), self.kv_a_norm.weight, LATENT_NORM_EPS)
        k_rope = rope(kv[:, Rkv:].contiguous().view(T, 1, Dr), positions, c.rope).view(T, Dr)
        row = torch.cat([latent, k_rope], dim=-1)
        q_abs = absorb_q(q, self.kv_b.weight, c, matmul)
        self.tap("attn.q", q_abs, L)
        self.tap("attn.kv_row", row, L)
        return q_resid, q_abs, row

    def out(self, q_abs, row, sel, cu_seqlens, adapters=None):
        c, L = self.cfg, self.index
        o = sparse_attention(q_abs, row, sel, cu_seqlens, scale=c.softmax_scale, v_dim=c.kv_lora_rank)
        self.tap("attn.out", o, L)
        y = self.o(unabsorb_o(o, self.kv_b.weight, c, matmul), adapters)
        self.tap("attn.o_proj", y, L)
        return y


class DenseMLP(nn.Module):
    def __init__(self, cfg: Glm5Config, *, linear=Linear, device=None, dtype=None):
        super().__init__()
        self.gate_up = linear(2 * cfg.intermediate_size, cfg.hidden_size, device=device, dtype=dtype)
        self.down = linear(cfg.hidden_size, cfg.intermediate_size, device=device, dtype=dtype)

    def forward(self, h, adapters=None):
        return self.down(swiglu_gate_up(self.gate_up(h, adapters)), adapters)


class Block(nn.Module):
    def __init__(self, cfg: Glm5Config, index: int, *, fp8: bool = False, device=None, dtype=None):
        super().__init__()
        self.cfg, self.index = cfg, index
        kw = dict(device=device, dtype=dtype)
        linear = Fp8Linear if fp8 else Linear
        self.attn_norm = Weight(cfg.hidden_size, **kw)
        self.attn = MLA(cfg, index, linear=linear, **kw)
        self.indexer = Indexer(cfg, index, **kw) if cfg.indexer_types[index] == "full" else None
        self.mlp_norm = Weight(cfg.hidden_size, **kw)
        if cfg.mlp_layer_types[index] == "dense":
            self.mlp = DenseMLP(cfg, linear=linear, **kw)
        else:
            self.moe = MoEBlock(moe_spec(cfg, fp8), index, linear=linear, **kw)

    tap = staticmethod(no_tap)

    def forward(self, x, residual, sel, positions, cu_seqlens, adapters=None, replay=None, index_replay=None):
        """-> (x, residual, the selection this layer attended with: its own, or ``sel`` on a shared layer)."""
        eps, L = self.cfg.rms_norm_eps, self.index
        if residual is None:
            h, residual = rmsnorm(x, self.attn_norm.weight, eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, self.attn_norm.weight, eps)
        self.tap("attn_norm", h, L)
        q_resid, q_abs, row = self.attn.q_and_row(h, positions, adapters)
        if self.indexer is not None:
            sel = self.indexer(h, q_resid.detach(), positions, cu_seqlens, index_replay)
        x = self.attn.out(q_abs, row, sel, cu_seqlens, adapters)
        h, residual = rmsnorm_residual(x, residual, self.mlp_norm.weight, eps)
        self.tap("mlp_norm", h, L)
        x = self.mlp(h, adapters) if self.cfg.mlp_layer_types[L] == "dense" else self.moe(h, adapters, replay)
        return x, residual, sel


class Glm5Trainer(TrainerBase):
    """Parameters are named as in ``weights.py``.  LoRA, ``forward_weights`` and ``logprobs``:
    ``models/base.py``; router replay: ``logprobs(..., replay=completion extras)``."""

    model_name = NAME
    lora_targets = tuple(LORA_TARGETS)
    lora_slices_of = staticmethod(lora_slices)
    lora_param_slots = LORA_PARAM_SLOTS

    def __init__(self, cfg: Glm5Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__(cfg, activation_checkpointing=activation_checkpointing, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Block(cfg, i, fp8=fp8, **kw) for i in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self._moe_slot = {i: n for n, i in enumerate(cfg.sparse_layers)}

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None,
               replay=None, index_replay=None):
        """Final normed hidden states (R, H) of ``rows``.  ``replay``: per MoE layer (ids (T, k), weights
        (T, k), rows that have them (T,), mode) to route by instead of the router; ``index_replay``: per
        full indexer layer (selection (T, index_topk), rows that have one (T,)) to attend with."""
        x, residual, sel = self.embed.weight[tokens], None, None
        full = {L: j for j, L in enumerate(self.cfg.indexer_layers)}
        for i, layer in enumerate(self.layers):
            rep = None if replay is None or i not in self._moe_slot else replay[self._moe_slot[i]]
            irep = None if index_replay is None or i not in full else index_replay[full[i]]
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, residual, sel = checkpoint(layer, x, residual, sel, positions, cu_seqlens, adapters, rep, irep,
                                              use_reentrant=False)
            else:
                x, residual, sel = layer(x, residual, sel, positions, cu_seqlens, adapters, rep, irep)
        h = rmsnorm_residual(x[rows], residual[rows], self.norm.weight, self.cfg.rms_norm_eps)[0]
        self.tap("norm", h, rows="logits")
        return h

    def index_replay_shape(self) -> tuple[int, int]:
        return len(self.cfg.indexer_layers), self.cfg.index_topk

    def check_index_selection(self, s: torch.Tensor, entry: int) -> None:
        """s (n, L_full, k) of one sequence (token t at position t): ValueError naming the first entry, layer and
        token whose selection is out of range, not causal, not ascending or has a pad before a position."""
        bad = first_bad_selection(s, torch.arange(1, s.shape[0] + 1))
        if bad is not None:
            t, j, e = bad
            row = s[t, j].tolist()
            why = ("not causal" if row[e] > t else "out of range") if (row[e] > t or row[e] < -1) else \
                "not strictly ascending with the -1 pads last"
            raise ValueError(f"replay entry {entry}: {INDEX_SELECTED} of full layer {j}, token {t}: entry {e} = "
                             f"{row[e]} is {why} (a selection is positions 0..{t}, ascending, then -1 pads): "
                             f"{row[:8]}...")
