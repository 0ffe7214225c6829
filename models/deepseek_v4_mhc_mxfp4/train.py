"""DeepSeek-V4 training module: packed varlen forward over mHC residual streams; each layer collapses its four
streams (``common/mhc``), attends (shared-KV MQA over a sliding window of token rows plus compressed history,
with per-head sinks), mixes the output back, then does the same around a MoE block (hash- or learned-routed
experts, one shared expert, the SwiGLU clamp).  FP32 chosen-token log-probabilities under the sampler's
transforms; autograd through every kernel but the indexer.

Shapes: T packed tokens, N = hc_mult streams, H hidden, Hq heads of D (K and V are one row of D), Dr the rotated
trailing dims, G output groups of Ro, W the window, C a sequence's compressed rows, Hi x Di the indexer's heads.

One attention row per query token sees, in this order (``attention_rows``):
  compressed rows: HCA every row w < (p + 1) // rate; CSA the indexer's top-k of those; sliding none;
  token rows:      positions max(0, p - W + 1) .. p;
  the sink:        one logit per head, no value.
A sequence's rows are laid out [its compressed rows | its token rows] (``kv_rows``), so the row list is
ascending, and the sparse attention (``common/sparse_attention``) runs it as it runs GLM-5's selection.

The indexer takes no gradient: its selection is discrete and its scores feed nothing else, so transformers'
autograd gives its weights none either.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.compress import compress
from ...common.dsa import index_scores, index_topk
from ...common.layers import AdapterRows, Fp8Linear, Linear, Weight
from ...common.matmul import matmul
from ...common.mhc import hc_mix, hyper_connection, hyper_head
from ...common.rmsnorm import rmsnorm, rmsnorm_unweighted
from ...common.rope import rope
from ...common.sparse_attention import sparse_attention
from ..base import INDEX_SELECTED, TrainerBase, first_bad_selection
from ..capture import no_tap
from ..moe_block import BF16, MXFP4, HashRouter, MoEBlock, MoESpec, SharedExpert, SqrtSoftplusRouter
from .config import CSA, HCA, DeepseekV4Config
from .weights import LORA_PARAM_SLOTS, LORA_TARGETS, lora_slices

NAME = "deepseek_v4_mhc_mxfp4"


def moe_spec(cfg: DeepseekV4Config, layer: int) -> MoESpec:
    """The layer's MoE block (``models/moe_block.py``): hash routing on the hash_moe layers, the learned
    sqrt-softplus router after; MXFP4 experts when the checkpoint's experts are fp4, the model dtype otherwise;
    one shared expert; both clamped at ``swiglu_limit``."""
    if not cfg.norm_topk_prob:
        raise NotImplementedError("deepseek_v4_mhc_mxfp4 with norm_topk_prob=False: its routers renormalise")
    k, scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
    router = (HashRouter(k, cfg.vocab_size, scale) if cfg.mlp_layer_types[layer] == "hash_moe"
              else SqrtSoftplusRouter(k, scale))
    q = cfg.quantization
    experts = MXFP4 if q is not None and q.expert_dtype == "fp4" else BF16
    return MoESpec(cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size, router, experts=experts,
                   shared=SharedExpert(cfg.shared_intermediate_size), limit=cfg.swiglu_limit)


class OwnParams(nn.Module):
    """A module whose bare parameters (mHC's fn / base / scale, the sinks, a compressor's position_bias) the
    server reads as ``<prefix><name>``; its ``Linear`` children say theirs themselves."""

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + n: p.detach() for n, p in self.named_parameters(recurse=False)}


class HyperParams(OwnParams):
    """One hyper-connection's fp32 coefficients: fn (M, N H), base (M,), scale (n_scales,)."""

    def __init__(self, rows: int, width: int, n_scales: int, *, device=None):
        super().__init__()
        kw = dict(device=device, dtype=torch.float32)
        self.fn = nn.Parameter(torch.empty(rows, width, **kw))
        self.base = nn.Parameter(torch.empty(rows, **kw))
        self.scale = nn.Parameter(torch.empty(n_scales, **kw))


def grouped_o(o: torch.Tensor, w: torch.Tensor, groups: int, mm) -> torch.Tensor:
    """The grouped output projection (transformers' DeepseekV4GroupedLinear): o (T, Hq D) in G groups, group g
    through rows g Ro .. (g + 1) Ro of w (G Ro, Hq D / G) -> (T, G Ro), one fixed-order matmul per group."""
    T, width = o.shape[0], w.shape[1]
    rows = w.shape[0] // groups
    x = o.view(T, groups, width)
    return torch.cat([mm(x[:, g].contiguous(), w[g * rows:(g + 1) * rows]) for g in range(groups)], dim=-1)


@torch.no_grad()
def attention_rows(positions: torch.Tensor, cu_seqlens: torch.Tensor, cu_rows: torch.Tensor, window: int,
                   rate: int, picked: torch.Tensor | None) -> torch.Tensor:
    """Each query row's entries into its sequence's [compressed rows | token rows] (``kv_rows``), ascending, -1
    pads last: (T, K + W) int32.  ``rate`` 0: no compressed rows; ``picked`` (T, K): the CSA indexer's
    selection of compressed rows (else, HCA: every visible row, K = the most any sequence has)."""
    T, dev = positions.shape[0], positions.device
    counts = (cu_rows[1:] - cu_rows[:-1]).long()
    seq = torch.repeat_interleave(torch.arange(counts.shape[0], device=dev), (cu_seqlens[1:] - cu_seqlens[:-1]).long(),
                                  output_size=T)
    C = counts[seq]  # (T,) this row's sequence's compressed rows
    j = positions[:, None] - window + 1 + torch.arange(window, device=dev)  # (T, W)
    tok = torch.where(j >= 0, C[:, None] + j, -1)
    if rate == 0:
        return tok.to(torch.int32).contiguous()
    if picked is None:
        K = int(counts.max()) if counts.numel() else 0
        w = torch.arange(K, device=dev).expand(T, K)
        picked = torch.where(w < torch.div(positions + 1, rate, rounding_mode="floor")[:, None], w, -1)
    ent = torch.cat([picked.long(), tok], dim=1)
    order = torch.argsort((ent < 0).to(torch.uint8), dim=1, stable=True)  # the pads of both parts last
    return torch.gather(ent, 1, order).to(torch.int32).contiguous()


def kv_rows(compressed: torch.Tensor | None, cu_rows, tokens: torch.Tensor, cu_seqlens):
    """Each sequence's [compressed rows | token rows], packed -> (rows, cu_kv); differentiable in both."""
    if compressed is None:
        return tokens, cu_seqlens
    cu, cr = cu_seqlens.tolist(), cu_rows.tolist()
    parts = []
    for s in range(len(cu) - 1):
        parts += [compressed[cr[s]:cr[s + 1]], tokens[cu[s]:cu[s + 1]]]
    return torch.cat(parts), cu_seqlens + cu_rows.to(cu_seqlens.dtype)


class Compressor(OwnParams):
    """A layer's compressor (``overlap``: C4, [overlap half | own half] channels) or the indexer's:
    kv / gate projections, the fp32 position_bias and kv_norm; rows of width ``width`` at their group's first
    position, normed and rotated with the compress table."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, width: int, overlap: bool, *, device=None, dtype=None):
        super().__init__()
        self.cfg, self.rate, self.overlap = cfg, cfg.rate(layer), overlap
        c = 2 if overlap else 1
        self.kv = Linear(c * width, cfg.hidden_size, device=device, dtype=dtype)
        self.gate = Linear(c * width, cfg.hidden_size, device=device, dtype=dtype)
        self.position_bias = nn.Parameter(torch.empty(self.rate, c * width, device=device, dtype=torch.float32))
        self.kv_norm = Weight(width, device=device, dtype=torch.float32)

    def forward(self, h, cu_seqlens):
        """-> (rows (R, width), cu_rows (N + 1,))."""
        c = self.cfg
        rows, pos, cu_rows = compress(self.kv(h), self.gate(h), self.position_bias, cu_seqlens, rate=self.rate,
                                      overlap=self.overlap)
        rows = rmsnorm(rows, self.kv_norm.weight, c.rms_norm_eps)
        R, width = rows.shape
        return rope(rows.view(R, 1, width), pos, c.compress_rope).view(R, width), cu_rows


class Indexer(Compressor):
    """A CSA layer's lightning indexer: its own C4 compressor at index_head_dim (this module's kv / gate /
    position_bias / kv_norm), q_b on the q residual, the head weights; picks each query's index_topk visible
    compressed rows (ties to the smaller row).  No grad."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, *, device=None, dtype=None):
        super().__init__(cfg, layer, cfg.index_head_dim, True, device=device, dtype=dtype)
        self.index = layer
        Hi, Di = cfg.index_n_heads, cfg.index_head_dim
        self.q_b = Linear(Hi * Di, cfg.q_lora_rank, device=device, dtype=dtype)
        self.weights_proj = Linear(Hi, cfg.hidden_size, device=device, dtype=dtype)
        for p in self.parameters():
            p.requires_grad_(False)

    tap = staticmethod(no_tap)

    @torch.no_grad()
    def select(self, h, q_resid, positions, cu_seqlens, replay=None):
        """-> (T, index_topk) int32 compressed rows of each query's sequence, ascending, -1 pads."""
        c, T, L = self.cfg, h.shape[0], self.index
        rows, cu_rows = self(h, cu_seqlens)
        q = rope(self.q_b(q_resid).view(T, c.index_n_heads, c.index_head_dim), positions, c.compress_rope)
        w = self.weights_proj(h).float() * (c.index_n_heads ** -0.5)
        visible = torch.div(positions + 1, self.rate, rounding_mode="floor")
        sel = torch.full((T, c.index_topk), -1, dtype=torch.int32, device=h.device)
        cu, cr = cu_seqlens.tolist(), cu_rows.tolist()
        for s in range(len(cu) - 1):
            a, b = cu[s], cu[s + 1]
            first = a + int((visible[a:b] == 0).sum())  # rows before it see no compressed row yet
            if first < b:
                scores = index_scores(q[first:b], rows[cr[s]:cr[s + 1]], w[first:b], c.indexer_scale)
                sel[first:b] = index_topk(scores, visible[first:b] - 1, c.index_topk)
        if replay is not None:
            sel = torch.where(replay[1][:, None], replay[0], sel)
        self.tap("indexer.selected", sel, L)
        return sel


class Attention(OwnParams):
    """Shared-KV MQA with sinks over the window and the compressed rows (transformers' DeepseekV4Attention)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int, *, linear=Linear, device=None, dtype=None):
        super().__init__()
        self.cfg, self.index = cfg, layer
        kw = dict(device=device, dtype=dtype)
        Hq, D, Rq, G, Ro = cfg.num_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
        self.q_a = linear(Rq, cfg.hidden_size, **kw)
        self.q_a_norm = Weight(Rq, device=device, dtype=torch.float32)
        self.q_b = linear(Hq * D, Rq, **kw)
        self.kv = linear(D, cfg.hidden_size, **kw)
        self.kv_norm = Weight(D, device=device, dtype=torch.float32)
        self.o_a = Linear(G * Ro, Hq * D // G, **kw)  # read per group
        self.o_b = linear(cfg.hidden_size, G * Ro, **kw)
        self.sinks = nn.Parameter(torch.empty(Hq, device=device, dtype=torch.float32))

    tap = staticmethod(no_tap)

    def q_and_kv(self, h, positions, adapters=None):
        """-> (q_resid (T, Rq), q (T, Hq, D) normed per head and rotated, the token rows (T, D))."""
        c, T, L = self.cfg, h.shape[0], self.index
        spec, eps = c.rope_for(L), c.rms_norm_eps
        q_resid = rmsnorm(self.q_a(h, adapters), self.q_a_norm.weight, eps)
        q = rmsnorm_unweighted(self.q_b(q_resid, adapters).view(T, c.num_heads, c.head_dim), eps)
        q = rope(q, positions, spec)
        kv = rmsnorm(self.kv(h, adapters), self.kv_norm.weight, eps)
        kv = rope(kv.view(T, 1, c.head_dim), positions, spec).view(T, c.head_dim)
        self.tap("attn.q", q, L)
        self.tap("attn.kv_row", kv, L)
        return q_resid, q, kv

    def out(self, q, rows, sel, positions, cu_seqlens, cu_kv, adapters=None):
        c, T, L = self.cfg, q.shape[0], self.index
        o = sparse_attention(q, rows, sel, cu_seqlens, scale=c.softmax_scale, v_dim=c.head_dim, cu_seqlens_kv=cu_kv,
                             sinks=self.sinks)
        o = rope(o, positions, c.rope_for(L), conjugate=True)
        self.tap("attn.out", o, L)
        y = self.o_b(grouped_o(o.reshape(T, -1), self.o_a.weight, c.o_groups, matmul), adapters)
        self.tap("attn.o_proj", y, L)
        return y


class Block(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, index: int, *, fp8: bool = False, device=None, dtype=None):
        super().__init__()
        self.cfg, self.index = cfg, index
        kw = dict(device=device, dtype=dtype)
        linear = Fp8Linear if fp8 else Linear
        N, H, t = cfg.hc_mult, cfg.hidden_size, cfg.layer_types[index]
        self.attn_hc = HyperParams(cfg.hc_weights, N * H, 3, device=device)
        self.attn_norm = Weight(H, device=device, dtype=torch.float32)
        self.attn = Attention(cfg, index, linear=linear, **kw)
        self.compressor = Compressor(cfg, index, cfg.head_dim, t == CSA, **kw) if t in (CSA, HCA) else None
        self.indexer = Indexer(cfg, index, **kw) if t == CSA else None
        self.ffn_hc = HyperParams(cfg.hc_weights, N * H, 3, device=device)
        self.mlp_norm = Weight(H, device=device, dtype=torch.float32)
        self.moe = MoEBlock(moe_spec(cfg, index), index, linear=linear, **kw)

    tap = staticmethod(no_tap)

    def _collapse(self, streams, hc: HyperParams):
        c = self.cfg
        return hyper_connection(streams, hc.fn, hc.base, hc.scale, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)

    def forward(self, streams, positions, cu_seqlens, tokens, adapters=None, replay=None, index_replay=None):
        """streams (T, N, H) -> (T, N, H)."""
        c, L = self.cfg, self.index
        post, comb, x = self._collapse(streams, self.attn_hc)
        h = rmsnorm(x, self.attn_norm.weight, c.rms_norm_eps)
        self.tap("attn_norm", h, L)
        q_resid, q, kv = self.attn.q_and_kv(h, positions, adapters)
        compressed, cu_rows, picked = None, None, None
        if self.compressor is not None:
            compressed, cu_rows = self.compressor(h, cu_seqlens)
        if self.indexer is not None:
            picked = self.indexer.select(h, q_resid.detach(), positions, cu_seqlens, index_replay)
        sel = attention_rows(positions, cu_seqlens, cu_rows if cu_rows is not None else torch.zeros_like(cu_seqlens),
                             c.sliding_window, c.rate(L), picked)
        rows, cu_kv = kv_rows(compressed, cu_rows, kv, cu_seqlens)
        a = self.attn.out(q, rows, sel, positions, cu_seqlens, cu_kv, adapters)
        streams = hc_mix(a, streams, post, comb)
        post, comb, x = self._collapse(streams, self.ffn_hc)
        h = rmsnorm(x, self.mlp_norm.weight, c.rms_norm_eps)
        self.tap("mlp_norm", h, L)
        return hc_mix(self.moe(h, adapters, replay, tokens), streams, post, comb)


class DeepseekV4Trainer(TrainerBase):
    """Parameters are named as in ``weights.py``.  LoRA, ``logprobs`` and ``forward_weights``: ``models/base.py``
    (on MXFP4 experts the adapters run separate, inside the packed kernel); router replay: ``logprobs(...,
    replay=completion extras)``.

    ``fp8=True``: the attention's q_a, q_b, kv and o_b and the shared expert's gate_up / down are ``Fp8Linear``
    (FP32 masters, read as e4m3 128x128 block codes made once per optimizer step; the server reads those codes).
    The rest stays in the model dtype: o_a, read by ``grouped_o`` as G matmuls on row slices of its weight, not
    through a linear module (FP8 would need a grouped FP8 GEMM); the indexer, which takes no gradient and whose
    q_b / weights_proj the server reads through ``matmul_fwd``; the compressors, which share the indexer's class
    (``Compressor``); mHC's fp32 coefficients, the router, the norms, the embedding and the head.  The routed
    experts keep their own format (the model dtype, or MXFP4 codes when the checkpoint's are)."""

    model_name = NAME
    lora_targets = tuple(LORA_TARGETS)
    lora_slices_of = staticmethod(lora_slices)
    lora_param_slots = LORA_PARAM_SLOTS

    def __init__(self, cfg: DeepseekV4Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__(cfg, activation_checkpointing=activation_checkpointing, fp8=fp8)
        kw = dict(device=device, dtype=dtype)
        N, H = cfg.hc_mult, cfg.hidden_size
        self.embed = Weight(cfg.vocab_size, H, **kw)
        self.layers = nn.ModuleList(Block(cfg, i, fp8=fp8, **kw) for i in range(cfg.num_layers))
        self.hc_head = HyperParams(N, N * H, 1, device=device)
        self.norm = Weight(H, device=device, dtype=torch.float32)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, H, **kw)

    def add_lora(self, lora, mode: str = "merged", seed: int = 0) -> None:
        """``TrainerBase.add_lora``; MXFP4 experts take their adapters in separate mode only: merged, W' would be
        requantized every step and the codes would no longer be the checkpoint's."""
        if mode == "merged" and self._mxfp4 and self.check_lora(lora).target_parameters:
            raise NotImplementedError("LoRA on MXFP4 experts (target_parameters) runs in lora_mode='separate' (the "
                                      "adapter inside the packed kernel, the codes frozen); merged would requantize "
                                      "W' every step")
        super().add_lora(lora, mode, seed)

    @property
    def _mxfp4(self) -> bool:
        return any(layer.moe.spec.experts is MXFP4 for layer in self.layers)

    def experts_base(self, experts) -> tuple[torch.Tensor, torch.Tensor]:
        """MXFP4 stacks are packed codes: the adapters take the unpacked (E, 2I, H), (E, H, I) in the activations'
        dtype (``TrainerBase.experts_base``)."""
        if experts.spec.experts is not MXFP4:
            return super().experts_base(experts)
        s, like = experts.spec, torch.zeros((), dtype=self.embed.weight.dtype, device=self.device)
        E, I, H = s.num_experts, s.intermediate_size, s.hidden_size
        return like.expand(E, 2 * I, H), like.expand(E, H, I)

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None, adapters: AdapterRows | None = None,
               replay=None, index_replay=None):
        """Final normed hidden states (R, H) of ``rows``.  ``replay``: per layer (ids (T, k), weights (T, k), rows
        that have them (T,), mode) to route by instead of the router; ``index_replay``: per CSA layer
        (selection (T, index_topk), rows that have one (T,))."""
        c = self.cfg
        x = self.embed.weight[tokens]
        streams = x[:, None].expand(x.shape[0], c.hc_mult, x.shape[1]).contiguous()
        csa = {L: j for j, L in enumerate(c.csa_layers)}
        for i, layer in enumerate(self.layers):
            rep = None if replay is None else replay[i]
            irep = None if index_replay is None or i not in csa else index_replay[csa[i]]
            args = (streams, positions, cu_seqlens, tokens, adapters, rep, irep)
            if self.activation_checkpointing and torch.is_grad_enabled():
                streams = checkpoint(layer, *args, use_reentrant=False)
            else:
                streams = layer(*args)
        hd = self.hc_head
        x = hyper_head(streams[rows], hd.fn, hd.base, hd.scale, c.hc_eps, c.rms_norm_eps)
        h = rmsnorm(x, self.norm.weight, c.rms_norm_eps)
        self.tap("norm", h, rows="logits")
        return h

    def index_replay_shape(self) -> tuple[int, int]:
        return len(self.cfg.csa_layers), self.cfg.index_topk

    def check_index_selection(self, s: torch.Tensor, entry: int) -> None:
        """s (n, L_csa, k) of one sequence (token t at position t): ValueError naming the first entry, layer and
        token whose selection is out of range, not yet complete at that token, or not ascending with the -1 pads
        last."""
        c = self.cfg
        rate = c.rate(c.csa_layers[0]) if c.csa_layers else 1
        vis = torch.div(torch.arange(s.shape[0]) + 1, rate, rounding_mode="floor")
        bad = first_bad_selection(s, vis)
        if bad is not None:
            t, j, e = bad
            row, v = s[t, j].tolist(), int(vis[t])
            why = ("below -1" if row[e] < -1 else f"not a complete row at token {t} (rows 0..{v - 1} are)"
                   if row[e] >= v else "not strictly ascending with the -1 pads last")
            raise ValueError(f"replay entry {entry}: {INDEX_SELECTED} of CSA layer {j}, token {t}: entry {e} = "
                             f"{row[e]} is {why}: {row[:8]}...")
