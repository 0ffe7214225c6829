"""CPU path of DeepSeek-V4's hyper-connections (mHC), batch-invariant by construction.

Every value is built from element-wise fp32 ops (add, mul, div, rsqrt, exp; each rounds an element on its own
whatever the tensor's shape, see ``rmsnorm/cpu.py``) and the fixed trees of ``tree/cpu.py``: no BLAS, no torch
reduction.  A token's outputs depend only on that token's streams and the weights, for any batch.

Weights of one token (x: its hc streams of D values, flattened k = i·D + d, K = hc·D; fn: M rows of K, fp32):

    rstd      = rsqrt(tree_sum_k(x·x) / K + norm_eps)       the sum in ``rmsnorm.cpu.row_tree_sum``'s order
    n[k]      = fl(x[k] · rstd)                              (transformers' UnweightedRMSNorm on fp32 x)
    mix[j]    = tree_sum_k fl(n[k] · fn[j, k])               the same order: K padded with +0.0 to P = next_pow2(K);
                                                             P <= 256: one pairwise tree over the P lanes; else the
                                                             P / 256 chunks added lane-wise in order from 0, then
                                                             the 8-level tree over the 256 lanes
    pre       = fl(sig(fl(fl(mix_pre · s0) + b_pre)) + hc_eps)       sig(z) = fl(1 / fl(1 + exp(-z)))
    post      = 2 · sig(fl(fl(mix_post · s1) + b_post))              (× 2 is exact)
    z[i, j]   = fl(fl(mix_comb[i·hc + j] · s2) + b_comb[i·hc + j])
    comb      = fl(e / rowtree(e)) + hc_eps,  e = exp(z - max_j z)   softmax over j (the output stream)
    comb      = comb / (coltree(comb) + hc_eps), then (iters - 1) × (row, column)   Sinkhorn

``rowtree`` / ``coltree``: the pairwise tree over the hc entries of a row / column (hc padded with +0.0 to a power
of two; hc = 4: (c0 + c1) + (c2 + c3)).  The max is exact in any order.  The head is the same with only ``pre``.

Collapse and mix (transformers' rounding points, dtype = the streams' dtype):

    collapsed = dtype(((p0·x0 + p1·x1) + p2·x2) + ...)             fp32 products, left to right over the streams
    mix[k]    = dtype(fp32(dtype(fl(dtype(post_k) · out)))  +  fp32(dtype(Σ_j dtype(comb[j, k]) · h_j)))
                Σ_j left to right in fp32 (a bf16 product is exact in fp32), rounded once; then the add, rounded

Backward (run-to-run deterministic, not batch-invariant): the same element-wise ops and trees; sums over tokens
(dfn, dbase, dscale) in ``rmsnorm.cpu.dw_sum``'s order, per-token sums over D by ``row_tree_sum``, over streams
left to right.  The whole path is torch element-wise ops, so it also runs on CUDA tensors (the launchers use it
there for the collapse, the mix and every backward).
"""
from __future__ import annotations

import torch

from ..matmul.cpu import fixed_order_dot
from ..rmsnorm.cpu import ROW_CHUNK, dw_sum, row_tree_sum
from ..tree.cpu import pad_to, pairwise_tree, tree_width

DOT_ROWS = 1024  # tokens a rows_dot pass: its (rows, M, 256) fp32 accumulator is 25 MB (memory, not order)
DFN_SLAB = 1 << 24  # elements of one (T, M, columns) product slab of the dfn sum (memory, not order: columns never mix)


def rows_dot(n: torch.Tensor, fn: torch.Tensor) -> torch.Tensor:
    """n (T, K), fn (M, K) fp32 -> (T, M): Σ_k fl(n[t, k] · fn[j, k]) in ``row_tree_sum``'s order (the bits of
    ``row_tree_sum`` on the (T·M, K) products) without holding the products."""
    T, K = n.shape
    if T > DOT_ROWS:
        return torch.cat([rows_dot(part, fn) for part in n.split(DOT_ROWS)])
    P = tree_width(K)
    n, fn = pad_to(n, 1, P, 0.0), pad_to(fn, 1, P, 0.0)
    if P <= ROW_CHUNK:
        return pairwise_tree(n[:, None, :] * fn[None])
    acc = n.new_zeros(T, fn.shape[0], ROW_CHUNK)
    for c in range(0, P, ROW_CHUNK):
        acc = acc + n[:, None, c:c + ROW_CHUNK] * fn[None, :, c:c + ROW_CHUNK]
    return pairwise_tree(acc)


def sigmoid(z: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-z)) rounded op by op (``torch.sigmoid``'s scalar tail is not batch-invariant: rmsnorm/cpu.py)."""
    return 1.0 / (1.0 + torch.exp(-z))


def _tree(v: torch.Tensor, dim: int) -> torch.Tensor:
    return pairwise_tree(v, dim=dim, pad=0.0).unsqueeze(dim)


def softmax_rows(z: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim of (..., hc): e / rowtree(e), e = exp(z - max)."""
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / _tree(e, -1)


def sinkhorn(p: torch.Tensor, iters: int, eps: float, keep: bool = False):
    """comb from the softmax p (..., hc, hc): p + eps, one column step, then (iters - 1) × (row, column).
    -> comb, or with ``keep`` the list [p + eps, after step 1, after step 2, ...] for the backward."""
    c = p + eps
    steps = [c]
    for axis in [-2] + [-1, -2] * (iters - 1):
        c = c / (_tree(c, axis) + eps)
        steps.append(c)
    return steps if keep else c


def _split(v: torch.Tensor, hc: int):
    """(T, M) -> pre (T, hc), post (T, hc), comb (T, hc, hc) views (post, comb None for the head's M = hc)."""
    if v.shape[1] == hc:
        return v, None, None
    return v[:, :hc], v[:, hc:2 * hc], v[:, 2 * hc:].unflatten(1, (hc, hc))


def hc_weights_cpu(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, sinkhorn_iters: int,
                   hc_eps: float, norm_eps: float):
    """x (T, hc, D); fn (M, hc·D) fp32 with M = (2 + hc)·hc, or M = hc for the head; base (M,); scale (3,) or (1,)
    -> pre (T, hc), post (T, hc) | None, comb (T, hc, hc) | None, rstd (T,), mix (T, M): fp32."""
    T, hc, D = x.shape
    xf = x.reshape(T, hc * D).float()
    rstd = torch.rsqrt(row_tree_sum(xf * xf) / (hc * D) + norm_eps)
    mix = rows_dot(xf * rstd[:, None], fn)
    m_pre, m_post, m_comb = _split(mix, hc)
    b_pre, b_post, b_comb = _split(base[None], hc)
    pre = sigmoid(m_pre * scale[0] + b_pre) + hc_eps
    if m_post is None:
        return pre, None, None, rstd, mix
    post = 2.0 * sigmoid(m_post * scale[1] + b_post)
    comb = sinkhorn(softmax_rows(m_comb * scale[2] + b_comb), sinkhorn_iters, hc_eps)
    return pre, post, comb, rstd, mix


def hc_collapse_cpu(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """x (T, hc, D), pre (T, hc) fp32 -> dtype(Σ_i pre_i · x_i) (T, D), streams left to right."""
    xf = x.float()
    acc = pre[:, 0, None] * xf[:, 0]
    for i in range(1, x.shape[1]):
        acc = acc + pre[:, i, None] * xf[:, i]
    return acc.to(x.dtype)


def hc_mix_cpu(out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """out (T, D), h (T, hc, D) of one dtype; post (T, hc), comb (T, hc, hc) fp32 -> (T, hc, D) in h's dtype."""
    dt = h.dtype
    pb, cb, hf = post.to(dt).float(), comb.to(dt).float(), h.float()
    expand = (pb[:, :, None] * out.float()[:, None, :]).to(dt)
    res = cb[:, 0, :, None] * hf[:, 0, None, :]
    for j in range(1, h.shape[1]):
        res = res + cb[:, j, :, None] * hf[:, j, None, :]
    return (expand.float() + res.to(dt).float()).to(dt)


def hc_collapse_bwd_cpu(g: torch.Tensor, x: torch.Tensor, pre: torch.Tensor):
    """g (T, D) -> dx (T, hc, D) fp32 = pre_i · g, dpre (T, hc) fp32 = Σ_d g · x_i."""
    T, hc, D = x.shape
    gf = g.float()
    dpre = row_tree_sum((gf[:, None, :] * x.float()).reshape(T * hc, D)).view(T, hc)
    return pre[:, :, None] * gf[:, None, :], dpre


def hc_mix_bwd_cpu(dy: torch.Tensor, out: torch.Tensor, h: torch.Tensor, post: torch.Tensor, comb: torch.Tensor):
    """dy (T, hc, D) -> dout (T, D), dh (T, hc, D) in h's dtype; dpost (T, hc), dcomb (T, hc, hc) fp32.
    Straight through the forward's roundings; Σ_k left to right, Σ_d by ``row_tree_sum``."""
    T, hc, D = h.shape
    dt = h.dtype
    g, hf = dy.float(), h.float()
    pb, cb = post.to(dt).float(), comb.to(dt).float()
    dout = pb[:, 0, None] * g[:, 0]
    for k in range(1, hc):
        dout = dout + pb[:, k, None] * g[:, k]
    dpost = row_tree_sum((g * out.float()[:, None, :]).reshape(T * hc, D)).view(T, hc)
    dh = cb[:, :, 0, None] * g[:, None, 0]
    for k in range(1, hc):
        dh = dh + cb[:, :, k, None] * g[:, None, k]
    dcomb = torch.stack([row_tree_sum((hf[:, j, None, :] * g).reshape(T * hc, D)).view(T, hc) for j in range(hc)], 1)
    return dout.to(dt), dh.to(dt), dpost, dcomb


def _sinkhorn_bwd(steps: list, dc: torch.Tensor, eps: float) -> torch.Tensor:
    """Back through each step c_{s+1} = c_s / (tree_a(c_s) + eps):
    dc_s = (dc_{s+1} - tree_a(dc_{s+1} · c_{s+1})) / (tree_a(c_s) + eps)."""
    axes = [-2] + [-1, -2] * ((len(steps) - 2) // 2)
    for s in range(len(steps) - 2, -1, -1):
        a = axes[s]
        dc = (dc - _tree(dc * steps[s + 1], a)) / (_tree(steps[s], a) + eps)
    return dc


def _outer_dw_sum(dmix: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Σ_t dmix[t, j] · n[t, k] -> (M, K) in ``dw_sum``'s order over t, in column slabs of fixed width."""
    T, M = dmix.shape
    K = n.shape[1]
    w = max(1, min(K, DFN_SLAB // max(1, T * M)))
    slabs = [dw_sum((dmix[:, :, None] * n[:, None, c:c + w]).reshape(T, -1)).view(M, -1) for c in range(0, K, w)]
    return torch.cat(slabs, 1)


def hc_weights_bwd_cpu(x, fn, base, scale, rstd, mix, sinkhorn_iters, hc_eps, dpre, dpost=None, dcomb=None):
    """Backward of ``hc_weights_cpu`` -> dx (T, hc, D) fp32 (through the norm), dfn (M, K), dbase (M,), dscale.

    dpre (T, hc); dpost (T, hc), dcomb (T, hc, hc) fp32 or None (zero).  The softmax's max is a constant."""
    T, hc, D = x.shape
    K = hc * D
    m_pre, m_post, m_comb = _split(mix, hc)
    b_pre, b_post, b_comb = _split(base[None], hc)
    sg = sigmoid(m_pre * scale[0] + b_pre)
    dz = [dpre * (sg * (1.0 - sg))]
    if m_post is not None:
        sg = sigmoid(m_post * scale[1] + b_post)
        dz.append(torch.zeros_like(sg) if dpost is None else 2.0 * dpost * (sg * (1.0 - sg)))
        p = softmax_rows(m_comb * scale[2] + b_comb)
        if dcomb is None:
            dz.append(torch.zeros_like(p).flatten(1))
        else:
            dp = _sinkhorn_bwd(sinkhorn(p, sinkhorn_iters, hc_eps, keep=True), dcomb, hc_eps)
            dz.append((p * (dp - _tree(dp * p, -1))).flatten(1))
    sizes = [z.shape[1] for z in dz]
    dz = torch.cat(dz, 1)  # (T, M)
    s_rows = torch.cat([scale[i].expand(m) for i, m in enumerate(sizes)])
    dmix = dz * s_rows
    dbase = dw_sum(dz)
    ds_rows = dw_sum(dz * mix)
    dscale = torch.stack([pairwise_tree(part, pad=0.0) for part in ds_rows.split(sizes)])
    xf = x.reshape(T, K).float()
    n = xf * rstd[:, None]
    dfn = _outer_dw_sum(dmix, n)
    dn = fixed_order_dot(dmix, fn.t())
    c = row_tree_sum(dn * n)
    dx = rstd[:, None] * (dn - n * (c / K)[:, None])
    return dx.view(T, hc, D), dfn, dbase, dscale
