"""The gated delta rule by batched matmuls: what the Triton path's backward differentiates.

The trainer's forward runs the exact kernels (``kernel.py`` / ``chunk_kernel.py``); its gradient
only has to be the true gradient of that function and repeat run to run (it is not part of the
K3 contract).  The exact torch path (``cpu.py``) would give it too, under autograd, but as
thousands of small element-wise launches per layer; the same function written with matmuls and a
triangular solve, as transformers' and fla's chunked forms are, is ~40 a chunk.  Same chunks
(64 rows aligned to each sequence's start), in fp32:

    G = cumsum(g) within the chunk,  E_ij = exp(G_i - G_j) (j <= i, masked before the exp)
    (I + L) [u | w] = [v * beta | k * beta * exp(G)],  L_ij = beta_i (k_i . k_j) E_ij  (j < i)
    v_new = u - w S0,  o = (q * exp(G)) S0 + (where(j <= i, (q_i . k_j) E_ij)) v_new
    S_next = S0 * exp(G_63) + (k * exp(G_63 - G))^T v_new

Sequences are padded to whole chunks (zero k, v, beta and g past the end: the rows before are
causal and never see them).  fp32 matmuls at torch's default "highest" precision (TF32 is not fp32).
"""
from __future__ import annotations

import torch

from .cpu import CHUNK


def gdn_matmul(q, k, v, g, beta, cu_seqlens) -> torch.Tensor:
    """q, k (T, Hk, K) (q L2-normalized and scaled), v (T, Hv, V), g, beta (T, Hv), cu_seqlens
    (B + 1,) (read on the host) -> o (T, Hv, V) fp32, differentiable in q, k, v, g and beta."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1:]
    dev = q.device
    cu = [int(c) for c in cu_seqlens.tolist()]
    lens = [b - a for a, b in zip(cu, cu[1:])]
    N, C = len(lens), CHUNK
    nc = max(-(-max(lens, default=0) // C), 1)
    idx = torch.full((N, nc * C), T, dtype=torch.long)
    for b, (a, n) in enumerate(zip(cu, lens)):
        idx[b, :n] = torch.arange(a, a + n)
    idx = idx.to(dev)

    def chunks(x, heads_rep=1):  # (T, H, D) or (T, H) -> (N, Hv, nc, C[, D])
        x = torch.cat([x.float(), x.new_zeros(1, *x.shape[1:], dtype=torch.float32)])[idx]
        if heads_rep > 1:
            x = x.repeat_interleave(heads_rep, 2)
        return x.reshape(N, nc, C, *x.shape[2:]).movedim(3, 1)

    rep = Hv // Hk
    qc, kc, vc = chunks(q, rep), chunks(k, rep), chunks(v)
    gc, bc = chunks(g), chunks(beta)
    G = gc.cumsum(-1)  # (N, Hv, nc, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = causal.tril(-1)
    E = torch.exp(torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")))
    eye = torch.eye(C, device=dev)
    L = torch.where(strict, bc[..., :, None] * (kc @ kc.transpose(-1, -2)) * E, 0.0)
    rhs = torch.cat([vc * bc[..., None], kc * (bc * torch.exp(G))[..., None]], -1)
    x = torch.linalg.solve_triangular(eye + L, rhs, upper=False, unitriangular=True)
    u, w = x[..., :V], x[..., V:]
    A = torch.where(causal, (qc @ kc.transpose(-1, -2)) * E, 0.0)
    qe = qc * torch.exp(G)[..., None]
    kd = kc * torch.exp(G[..., -1:] - G)[..., None]
    # the chunk recurrence over (sequence, head) pairs as one batch dim, each chunk's operands views of
    # one unbind, every product with its add one baddbmm: 5 ops a chunk forward, ~38 with the backward
    # (the loop is the backward's launch count: 32 chunks a 2048-token sequence)
    B = N * Hv
    per_chunk = [t.reshape(B, nc, *t.shape[3:]).unbind(1) for t in (u, w, qe, A)]
    kdt = kd.reshape(B, nc, C, K).transpose(-1, -2).unbind(1)  # (B, K, C) each
    decay = torch.exp(G[..., -1]).reshape(B, nc, 1, 1).unbind(1)
    S = q.new_zeros(B, K, V, dtype=torch.float32)
    outs = []
    for uc, wc, qc_, ac, kc_, dc in zip(*per_chunk, kdt, decay):
        vn = torch.baddbmm(uc, wc, S, alpha=-1)  # u - w S0
        outs.append(torch.baddbmm(torch.bmm(qc_, S), ac, vn))  # (q exp(G)) S0 + A v_new
        S = torch.baddbmm(S * dc, kc_, vn)  # S0 exp(G_63) + (k exp(G_63 - G))^T v_new
    o = torch.stack(outs, 1).view(N, Hv, nc, C, V).movedim(1, 3).reshape(N * nc * C, Hv, V)  # (N, nc, C, Hv, V)
    pos = [torch.arange(n) + b * nc * C for b, n in enumerate(lens)]
    return o[torch.cat(pos).to(dev)] if pos else o[:0]
