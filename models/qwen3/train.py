"""Qwen3 training module: packed variable-length forward, FP32 chosen-token
log-probabilities under the sampler's transforms, autograd through every kernel.

It calls the public (differentiable) functions of the same kernels whose
``_fwd`` launchers ``serve.py`` calls, layer for layer, so a token's
log-probability has the server's bits.  Shapes: T packed tokens, H hidden,
Hq / Hkv heads of D channels, I intermediate, V vocabulary, R scored rows.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ...common.attention import attention
from ...common.fp8 import Fp8WeightCache, fp8_linear
from ...common.lm_head import lm_head_logits
from ...common.matmul import matmul
from ...common.rmsnorm import rmsnorm, rmsnorm_residual
from ...common.rope import rope
from ...common.sampling import SamplingParams, params_to_tensors, sampling_logprobs
from ...common.swiglu import swiglu_gate_up
from .config import Qwen3Config
from .._packing import pack_scored, sampling_list


class Weight(nn.Module):
    """One named parameter (``<name>.weight``), so module paths are the
    checkpoint names of ``weights.py``."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, device=device, dtype=dtype))


class Linear(Weight):
    """y = x · Wᵀ with the batch-invariant matmul."""

    def forward(self, x):
        return matmul(x, self.weight)

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        return {prefix + "weight": self.weight.detach()}


class Fp8Linear(Weight):
    """An FP32 master weight whose forward reads its FP8 quantization (e4m3,
    128x128 blocks), made once per optimizer step (``Fp8WeightCache``): the
    trainer, the server and the weight sync all read those very codes."""

    def __init__(self, *shape: int, device=None, dtype=None):
        super().__init__(*shape, device=device, dtype=torch.float32)
        self.cache = Fp8WeightCache(self.weight)

    def forward(self, x):
        return fp8_linear(x, self.weight, *self.cache.get())

    def forward_weights(self, prefix: str) -> dict[str, torch.Tensor]:
        codes, scale_inv = self.cache.get()
        return {prefix + "weight": codes, prefix + "weight_scale_inv": scale_inv}


class Qwen3Block(nn.Module):
    def __init__(self, cfg: Qwen3Config, device=None, dtype=None, fp8: bool = False):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        H, D = cfg.hidden_size, cfg.head_dim
        linear = Fp8Linear if fp8 else Linear
        self.attn_norm = Weight(H, **kw)
        self.qkv = linear(cfg.qkv_size, H, **kw)  # [q | k | v] rows
        self.q_norm = Weight(D, **kw)
        self.k_norm = Weight(D, **kw)
        self.o = linear(H, cfg.num_heads * D, **kw)
        self.mlp_norm = Weight(H, **kw)
        self.gate_up = linear(2 * cfg.intermediate_size, H, **kw)  # [gate | up] rows
        self.down = linear(H, cfg.intermediate_size, **kw)
        self.cfg = cfg

    def forward(self, x, residual, positions, cu_seqlens, max_seqlen):
        """x: (T, H) the previous block's output; residual: (T, H) or None
        (first block, x is the embedding) -> (mlp_out, residual)."""
        cfg = self.cfg
        T, Hq, Hkv, D = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        if residual is None:
            h, residual = rmsnorm(x, self.attn_norm.weight, eps), x
        else:
            h, residual = rmsnorm_residual(x, residual, self.attn_norm.weight, eps)
        q, k, v = self.qkv(h).split([Hq * D, Hkv * D, Hkv * D], dim=-1)
        q = rope(rmsnorm(q.reshape(T, Hq, D).contiguous(), self.q_norm.weight, eps), positions, cfg.rope)
        k = rope(rmsnorm(k.reshape(T, Hkv, D).contiguous(), self.k_norm.weight, eps), positions, cfg.rope)
        o = attention(q, k, v.reshape(T, Hkv, D).contiguous(), cu_seqlens, max_seqlen=max_seqlen)
        x = self.o(o.reshape(T, Hq * D))
        h, residual = rmsnorm_residual(x, residual, self.mlp_norm.weight, eps)
        return self.down(swiglu_gate_up(self.gate_up(h))), residual


class Qwen3Trainer(nn.Module):
    """Parameters are named as in ``weights.py`` (``embed.weight``,
    ``layers.{i}.qkv.weight``, ...); ``lm_head`` is absent when tied.  With
    ``fp8`` the four projections of each block are FP32 masters read through
    their FP8 quantization; embeddings, norms and the LM head stay in dtype."""

    def __init__(self, cfg: Qwen3Config, *, device=None, dtype=torch.bfloat16, activation_checkpointing=False,
                 fp8: bool = False):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.cfg = cfg
        self.fp8 = fp8
        self.embed = Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(Qwen3Block(cfg, **kw, fp8=fp8) for _ in range(cfg.num_layers))
        self.norm = Weight(cfg.hidden_size, **kw)
        self.lm_head = None if cfg.tie_word_embeddings else Weight(cfg.vocab_size, cfg.hidden_size, **kw)
        self.activation_checkpointing = activation_checkpointing

    def forward_weights(self) -> dict[str, torch.Tensor]:
        """The tensors the forward reads, named as the server's weights: the
        parameters, and for FP8 layers their cached codes and scales
        (``<layer>.weight`` e4m3, ``<layer>.weight_scale_inv`` fp32)."""
        out = {}
        for name, module in self.named_modules():
            prefix = name + "." if name else ""
            if isinstance(module, (Linear, Fp8Linear)):
                out.update(module.forward_weights(prefix))
            elif isinstance(module, Weight):
                out[prefix + "weight"] = module.weight.detach()
        return out

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def hidden(self, tokens, positions, cu_seqlens, rows, max_seqlen=None):
        """Final normed hidden states of ``rows``.

        tokens, positions: (T,) int64; cu_seqlens: (B + 1,) int32;
        rows: (R,) int64 indices into T -> (R, H)."""
        x, residual = self.embed.weight[tokens], None
        for layer in self.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                x, residual = checkpoint(layer, x, residual, positions, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                x, residual = layer(x, residual, positions, cu_seqlens, max_seqlen)
        return rmsnorm_residual(x[rows], residual[rows], self.norm.weight, self.cfg.rms_norm_eps)[0]

    def logits(self, tokens, positions, cu_seqlens, rows, max_seqlen=None):
        """FP32 next-token logits (R, V) of ``rows``; differentiable."""
        return lm_head_logits(self.hidden(tokens, positions, cu_seqlens, rows, max_seqlen), self.lm_head_weight)

    def logprobs(
        self,
        sequences: Sequence[Sequence[int] | torch.Tensor],
        prompt_lens: Sequence[int],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[torch.Tensor]:
        """FP32 log-probs of ``sequence[prompt_len:]`` for each sequence, under
        the sampling transforms of its ``SamplingParams`` (default: plain
        softmax), bitwise equal to the server's; differentiable."""
        params = sampling_list(sampling, len(sequences))
        batch = pack_scored(sequences, prompt_lens, self.cfg.vocab_size, self.cfg.max_position, self.embed.weight.device)
        logits = self.logits(batch.tokens, batch.positions, batch.cu_seqlens, batch.rows, batch.max_seqlen)
        per_row = [p for p, n in zip(params, batch.counts) for _ in range(n)]
        t = params_to_tensors(per_row, [0] * len(per_row), device=logits.device)
        lp = sampling_logprobs(logits, batch.targets, t["temperature"], t["top_k"], t["top_p"], t["min_p"])
        return list(lp.split(batch.counts))
