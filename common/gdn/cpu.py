"""Gated DeltaNet in torch ops, batch-invariant and path-invariant by construction.

Device-agnostic (CPU for CI; on CUDA it is the exact but slow fallback), and
differentiable: every op is an element-wise torch op, a slice, a gather or a
``where``, so torch autograd gives the true gradient of the forward that ran.

The recurrence, per value head h (GVA: qk head h // (Hv / Hk)), in chunks of
CHUNK = 64 positions aligned to position 0 of the sequence.  Chunk c holds
rows i = 0..63 (positions 64c + i) and starts from the FP32 state S0 (K, V):

    G_i    = G_{i-1} + g_i                          G_{-1} = -0.0, left to right
    E_ij   = exp(where(j <= i, G_i - G_j, -inf))    masked before the exp
    kk_ij  = tree_K(k_i[k] * k_j[k]),  qk_ij = tree_K(q_i[k] * k_j[k])
    L_ij   = (beta_i * kk_ij) * E_ij                j < i
    b_i    = [v_i * beta_i | (k_i * beta_i) * exp(G_i)]           (V + K,)
    x_i    = b_i - tree_j(where(j < i, L_ij * x_j, -0.0))         x_i = [u_i | w_i]
    vn_i   = u_i - tree_K(w_i[k] * S0[k, :])                      v_new
    o_i    = tree_K((q_i[k] * exp(G_i)) * S0[k, :])
             + tree_j(where(j <= i, (qk_ij * E_ij) * vn_j, -0.0))
    S_next = S0 * exp(G_63) + tree_j((k_j * exp(G_63 - G_j))[:, None] * vn_j[None, :])

(transformers' ``torch_chunk_gated_delta_rule`` in other words: its
``solve_triangular`` on the unit lower triangle, ``v_new``, inter + intra
output and state update; ``tests/test_gdn.py`` checks the two agree.)

``tree_K``: the K products padded with -0.0 to a power of two, then the
pairwise tree over adjacent lanes (x[2m] + x[2m+1], level by level).
``tree_j``: the same tree over all 64 rows of the chunk, a row that is not
there (j > i, or j >= i in the substitution) contributing -0.0.  Since
x + (-0.0) == x for every x (+0.0 included), the value of a sum depends on
the present terms only and its shape never on how many rows are present:
row i is one function of S0 and rows 0..i of its chunk.  Every path below
calls the same row functions (``row_dots``, ``decay``, ``solve_row``,
``vnew_row``, ``out_row``, ``next_state``) on the same operands; they are
element-wise over their leading dims, so evaluating one row, or all 64 rows
of a chunk at once, or rows of many sequences together gives each row the
same bits:

* ``chunked``: the trainer (every sequence from position 0) and the server's
  (chunked) prefill (a sequence may continue an open chunk from the cache).
  The 64 substitution steps run in order, each vectorized over every chunk
  of every sequence (the substitution does not read S0); then one scan step
  per chunk index does v_new, the outputs of all rows and the state.
* ``decode_step``: one new row per sequence, from S0 and the open chunk's
  cached rows (k_j, G_j, x_j, v_new_j): O(64 (K + V) + K V) work per row, no
  earlier row re-run; at row 63 it makes S_next and the chunk closes.

Element-wise ops round each element on its own (IEEE add, sub, mul), and
fp32 ``torch.exp``/``torch.rsqrt`` give an element the same bits whatever
the tensor's shape (measured for the other CPU paths, docs/DESIGN.md); no
torch reduction (``sum``, ``cumsum``, ``mm``) is used.
"""
from __future__ import annotations

import torch

from ..swiglu.cpu import silu
from ..tree.cpu import pad_to, pairwise_tree, tree_width

CHUNK = 64
_NEG0 = -0.0
# The trainer/prefill path evaluates its largest products (the (64, 64, K) dots, the (64, 64, V)
# output terms) a block of chunk pieces at a time, at most this many elements: a launch knob
# (rows are element-wise independent), 8 MiB of fp32 temporaries instead of hundreds of MiB.
_BLOCK_ELEMS = 1 << 21


def host_lists(cu_seqlens, starts, slots) -> tuple[list[int], list[int], list[int]]:
    """(cu_seqlens, starts, slots) as host lists, in one device read."""
    B = cu_seqlens.shape[0] - 1
    flat = torch.cat([cu_seqlens.long(), starts.long(), slots.long()]).tolist()
    return flat[: B + 1], flat[B + 1 : 2 * B + 1], flat[2 * B + 1 :]


def tree_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over ``dim`` by the fixed pairwise tree: padded with -0.0 to a power
    of two, then x[2m] + x[2m+1] level by level.  Element-wise adds only."""
    return pairwise_tree(x, torch.add, dim, _NEG0)


def l2norm_cpu(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fp32 x * rsqrt(tree(x * x) + eps) over the last dim."""
    xf = x.float()
    return xf * torch.rsqrt(tree_sum(xf * xf, -1) + eps).unsqueeze(-1)


# -- the row functions: every path calls these (leading dims are free) -----------------------


def row_dots(a: torch.Tensor, ctx: torch.Tensor) -> torch.Tensor:
    """a (..., K), ctx (..., 64, K) -> (..., 64): tree_K(a[k] * ctx[j, k]).

    The K lanes are padded on the operands, a with +0.0 and ctx with -0.0,
    so a padded product is (+0.0) * (-0.0) == -0.0 exactly: the tree_K of
    the -0.0-padded products without building the large (..., 64, 64, K)
    product twice (padding it would copy it again)."""
    p = tree_width(a.shape[-1])
    return tree_sum(pad_to(a, -1, p, 0.0).unsqueeze(-2) * pad_to(ctx, -1, p, _NEG0), -1)


def decay(G_i: torch.Tensor, G_ctx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """G_i (...,), G_ctx (..., 64), mask (..., 64) (j <= i) -> exp(G_i - G_j),
    0 where masked (masked before the exp: no inf, no NaN gradient)."""
    d = G_i.unsqueeze(-1) - G_ctx
    return torch.exp(torch.where(mask, d, float("-inf")))


def rhs(v: torch.Tensor, k: torch.Tensor, beta: torch.Tensor, G: torch.Tensor) -> torch.Tensor:
    """b = [v * beta | (k * beta) * exp(G)]: v (..., V), k (..., K), beta/G (...,) -> (..., V + K)."""
    bt = beta.unsqueeze(-1)
    return torch.cat([v * bt, (k * bt) * torch.exp(G).unsqueeze(-1)], -1)


def solve_row(beta_i, kk_i, E_i, b_i, x_ctx, lower):
    """One forward-substitution step.  beta_i (...,), kk_i/E_i (..., 64),
    b_i (..., W), x_ctx (..., 64, W), lower (..., 64) (j < i) -> x_i (..., W)."""
    L = (beta_i.unsqueeze(-1) * kk_i) * E_i
    term = L.unsqueeze(-1) * x_ctx
    term = torch.where(lower.unsqueeze(-1), term, _NEG0)
    return b_i - tree_sum(term, -2)


def state_dot(a: torch.Tensor, S: torch.Tensor) -> torch.Tensor:
    """a (..., K), S (..., K, V) -> (..., V): tree_K(a[k] * S[k, :]), padded as
    ``row_dots`` is (a with +0.0, S with -0.0: each padded product is -0.0)."""
    p = tree_width(a.shape[-1])
    return tree_sum(pad_to(a, -1, p, 0.0).unsqueeze(-1) * pad_to(S, -2, p, _NEG0), -2)


def vnew_row(u, w, S0):
    """u (..., V), w (..., K), S0 (..., K, V) -> u - tree_K(w[k] * S0[k, :])."""
    return u - state_dot(w, S0)


def out_row(q, G_i, S0, qk_i, E_i, vn_ctx, causal):
    """q (..., K), G_i (...,), S0 (..., K, V), qk_i/E_i (..., 64),
    vn_ctx (..., 64, V), causal (..., 64) (j <= i) -> o_i (..., V)."""
    inter = state_dot(q * torch.exp(G_i).unsqueeze(-1), S0)
    term = (qk_i * E_i).unsqueeze(-1) * vn_ctx
    term = torch.where(causal.unsqueeze(-1), term, _NEG0)
    return inter + tree_sum(term, -2)


def next_state(S0, k_ctx, G_ctx, vn_ctx):
    """S0 (..., K, V), k_ctx (..., 64, K), G_ctx (..., 64), vn_ctx (..., 64, V) -> S_next (..., K, V)."""
    G_last = G_ctx[..., CHUNK - 1]
    kd = k_ctx * torch.exp(G_last.unsqueeze(-1) - G_ctx).unsqueeze(-1)
    upd = tree_sum(kd.unsqueeze(-1) * vn_ctx.unsqueeze(-2), -3)
    return S0 * torch.exp(G_last)[..., None, None] + upd


# -- cache writes without host reads ----------------------------------------------------------


def scatter_slots(dst: torch.Tensor, slots: torch.Tensor, vals: torch.Tensor, rows: torch.Tensor | None = None):
    """dst[slots[b]] = vals[b] (or dst[slots[b], rows[b]]) for slots[b] >= 0,
    graph-capturable: a padding row (slot -1) rewrites the first valid row's
    value to its slot (or, with no valid row, slot 0's own value), so duplicate
    indices always carry equal values and nothing is read on the host."""
    B = slots.shape[0]
    valid = slots >= 0
    first = torch.argmax(valid.to(torch.int32)).reshape(1)  # a (1,) index: a 0-d one would be read on the host
    src = torch.where(valid, torch.arange(B, device=slots.device), first)
    tgt = torch.where(valid, slots, slots.index_select(0, first).clamp(min=0))
    idx = (tgt,) if rows is None else (tgt, torch.where(valid, rows, rows.index_select(0, first)))
    new = vals[src]
    new = torch.where(valid.any().reshape((1,) * new.dim()), new, dst[idx])
    dst.index_put_(idx, new.to(dst.dtype))


# -- paths ------------------------------------------------------------------------------------


def _masks(device):
    j = torch.arange(CHUNK, device=device)
    return j, j.unsqueeze(0) <= j.unsqueeze(1), j.unsqueeze(0) < j.unsqueeze(1)  # (64,), causal, strict (i, j)


def chunked(q, k, v, g, beta, cu, starts, *, cache=None, slots=None, return_states=False):
    """The trainer / prefill path.  q, k (T, Hk, K) fp32, v (T, Hv, V) fp32,
    g, beta (T, Hv) fp32; ``cu``, ``starts``, ``slots``: host lists (B + 1,
    B, B).  With ``cache``, a sequence with start > 0 continues from its slot
    (state, open-chunk rows) and every sequence with slot >= 0 writes its new
    state and open chunk back.  -> o (T, Hv, V) fp32 [, boundary states
    (N, Hv, K, V): the state after each complete chunk, by sequence then chunk]."""
    T, Hk, K = k.shape
    Hv, V = v.shape[1], v.shape[2]
    dev = q.device
    B = len(cu) - 1
    head = torch.arange(Hv, device=dev) // (Hv // Hk)
    # chunk pieces: (b, chunk, r0, r1, token of row r0); sequences by descending piece count
    per_seq = []
    for b in range(B):
        s, n = starts[b], cu[b + 1] - cu[b]
        ps = []
        if n > 0:
            for c in range(s // CHUNK, (s + n - 1) // CHUNK + 1):
                r0, r1 = max(s, c * CHUNK) - c * CHUNK, min(s + n, (c + 1) * CHUNK) - c * CHUNK
                ps.append((b, c, r0, r1, cu[b] + c * CHUNK + r0 - s))
        per_seq.append(ps)
    order = sorted((b for b in range(B) if per_seq[b]), key=lambda b: -len(per_seq[b]))
    steps = len(per_seq[order[0]]) if order else 0
    pieces, bounds = [], [0]
    for st in range(steps):
        pieces += [per_seq[b][st] for b in order if len(per_seq[b]) > st]
        bounds.append(len(pieces))
    P = len(pieces)
    o = q.new_zeros(T, Hv, V)
    if P == 0:
        return (o, q.new_zeros(0, Hv, K, V)) if return_states else o
    tok = torch.full((P, CHUNK), T, dtype=torch.long)
    r0s = torch.tensor([p[2] for p in pieces])
    r1s = torch.tensor([p[3] for p in pieces])
    rows = torch.arange(CHUNK)
    for p, (_, _, r0, r1, t0) in enumerate(pieces):
        tok[p, r0:r1] = torch.arange(t0, t0 + r1 - r0)
    tok = tok.to(dev)
    active = ((rows >= r0s[:, None]) & (rows < r1s[:, None])).to(dev)  # (P, 64)

    def ws(x):  # (T, H, D) -> (P, H, 64, D); absent rows 0
        x = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[tok]
        return x.movedim(1, 2) if x.dim() == 4 else x.transpose(1, 2)

    q_w, k_w, v_w, g_w, beta_w = ws(q), ws(k), ws(v), ws(g), ws(beta)
    # open-chunk rows from the cache (first piece of a sequence that starts mid-chunk)
    cp = [p for p in range(bounds[1]) if pieces[p][2] > 0]
    G_old = x_old = vn_old = None
    if cp:
        cp_t = torch.tensor(cp, device=dev)
        sl = torch.tensor([slots[pieces[p][0]] for p in cp], device=dev)
        keep = (rows.to(dev)[None, :] < r0s.to(dev)[cp_t][:, None])  # (n, 64) cached rows
        k_w = k_w.index_put((cp_t,), torch.where(keep[:, None, :, None], cache["k"][sl].movedim(1, 2), k_w[cp_t]))
        G_old = q.new_zeros(P, Hv, CHUNK).index_put((cp_t,), cache["g_cum"][sl].transpose(1, 2))
        x_old = q.new_zeros(P, Hv, CHUNK, V + K).index_put((cp_t,), cache["x"][sl].movedim(1, 2))
        vn_old = q.new_zeros(P, Hv, CHUNK, V).index_put((cp_t,), cache["v_new"][sl].movedim(1, 2))
    act = active[:, None, :]  # (P, 1, 64)
    # G, left to right; cached rows keep their bits
    cols, prev = [], q.new_full((P, Hv), _NEG0)
    tail = (rows[None, :] >= r1s[:, None]).to(dev)[:, None, :]  # (P, 1, 64) rows past the piece's end
    for i in range(CHUNK):
        new = prev + g_w[..., i]
        keep_i = G_old[..., i] if G_old is not None else torch.zeros_like(new)
        # a row past the end keeps the last G: exp(G_i - G_j) of a discarded row stays <= 1, so no inf
        # reaches the backward through the masked products (0 * inf = NaN)
        prev = torch.where(act[..., i], new, torch.where(tail[..., i], prev, keep_i))
        cols.append(prev)
    G_w = torch.stack(cols, -1)  # (P, Hv, 64)
    _, causal, strict = _masks(dev)
    kh_w = k_w[:, head]  # (P, Hv, 64, K)
    Kp = tree_width(K)
    nb = max(1, _BLOCK_ELEMS // (Hk * CHUNK * CHUNK * Kp))  # pieces per product block
    kk = torch.cat([row_dots(k_w[a : a + nb], k_w[a : a + nb].unsqueeze(-3)) for a in range(0, P, nb)])[:, head]
    qk = torch.cat([row_dots(q_w[a : a + nb], k_w[a : a + nb].unsqueeze(-3)) for a in range(0, P, nb)])[:, head]
    q_w = q_w[:, head]
    E = decay(G_w, G_w.unsqueeze(-2).expand(*G_w.shape, CHUNK), causal)  # (P, Hv, 64 i, 64 j)
    b_w = rhs(v_w, kh_w, beta_w, G_w)  # (P, Hv, 64, V + K)
    # Step i reads rows j < i only: the 64-tree with rows >= p = tree_width(i) all -0.0 is the
    # p-tree of rows < p (every subtree of -0.0 is -0.0, and x + -0.0 == x), so the step
    # evaluates rows < p, the same bits with a third less work.
    x_rows, zero = [], b_w.new_zeros(b_w.shape[:2] + b_w.shape[3:])
    for i in range(CHUNK):
        p = tree_width(i)
        ctx = torch.stack(x_rows[:p] + [zero] * (p - len(x_rows[:p])), -2)
        x_i = solve_row(beta_w[..., i], kk[..., i, :p], E[..., i, :p], b_w[..., i, :], ctx, strict[i, :p])
        if x_old is not None:
            x_i = torch.where(act[..., i, None], x_i, x_old[..., i, :])
        x_rows.append(x_i)
    x_w = torch.stack(x_rows, -2)  # (P, Hv, 64, V + K)
    u_w, w_w = x_w[..., :V], x_w[..., V:]
    # the scan over chunks: S0 per sequence in ``order``
    S = q.new_zeros(len(order), Hv, K, V)
    cont = [i for i, b in enumerate(order) if starts[b] > 0]
    if cont:
        sl = torch.tensor([slots[order[i]] for i in cont], device=dev)
        S = S.index_put((torch.tensor(cont, device=dev),), cache["state"][sl].float())
    outs, vns, states = [], [], []
    nb = max(1, _BLOCK_ELEMS // (Hv * CHUNK * V * max(CHUNK, Kp)))  # pieces per scan block
    for st in range(steps):
        S_after = []
        for a in range(bounds[st], bounds[st + 1], nb):
            e = min(a + nb, bounds[st + 1])
            S0 = S[a - bounds[st] : e - bounds[st]]
            vn = vnew_row(u_w[a:e], w_w[a:e], S0.unsqueeze(2))
            if vn_old is not None:
                vn = torch.where(act[a:e].unsqueeze(-1), vn, vn_old[a:e])
            outs.append(out_row(q_w[a:e], G_w[a:e], S0.unsqueeze(2), qk[a:e], E[a:e], vn.unsqueeze(2), causal))
            vns.append(vn)
            comp = [p - a for p in range(a, e) if pieces[p][3] == CHUNK]
            if comp:
                ct = torch.tensor(comp, device=dev)
                Sn = next_state(S0[ct], kh_w[a:e][ct], G_w[a:e][ct], vn[ct])
                states += [(pieces[a + c][0], pieces[a + c][1], Sn[i]) for i, c in enumerate(comp)]
                S0 = S0.index_put((ct,), Sn)
            S_after.append(S0)
        S = torch.cat(S_after + [S[bounds[st + 1] - bounds[st]:]])
    o_w = torch.cat(outs).movedim(1, 2).reshape(P * CHUNK, Hv, V)
    inv = torch.empty(T, dtype=torch.long)
    flat = tok.cpu()
    m = flat < T
    inv[flat[m]] = torch.arange(P * CHUNK).reshape(P, CHUNK)[m]
    o = o_w[inv.to(dev)] if T else o
    if cache is not None:
        vn_w = torch.cat(vns)
        last = {pieces[p][0]: p for p in range(P)}  # a sequence's last piece
        wb = [b for b in order if slots[b] >= 0]
        if wb:
            lp = torch.tensor([last[b] for b in wb], device=dev)
            sl = torch.tensor([slots[b] for b in wb], device=dev)
            si = torch.tensor([order.index(b) for b in wb], device=dev)
            cache["state"][sl] = S[si].to(cache["state"].dtype)
            cache["k"][sl] = k_w[lp].movedim(2, 1)
            cache["g_cum"][sl] = G_w[lp].transpose(1, 2)
            cache["x"][sl] = x_w[lp].movedim(2, 1)
            cache["v_new"][sl] = vn_w[lp].movedim(2, 1)
            cache["n"][sl] = torch.tensor([(starts[b] + cu[b + 1] - cu[b]) % CHUNK for b in wb], device=dev)
    if not return_states:
        return o
    states.sort(key=lambda s: (s[0], s[1]))
    return o, (torch.stack([s[2] for s in states]) if states else q.new_zeros(0, Hv, K, V))


def decode_step(q, k, v, g, beta, pos, slots, cache):
    """One new row per sequence (the decode shape), no host reads.  q, k (B, Hk, K),
    v (B, Hv, V), g, beta (B, Hv) fp32; pos, slots (B,) int64 device tensors.
    Reads the slot's state and open-chunk rows (not at pos == 0), writes row
    pos % 64 and, at row 63, the next state.  -> o (B, Hv, V) fp32."""
    B, Hk = k.shape[:2]
    Hv, V = v.shape[1], v.shape[2]
    dev = q.device
    head = torch.arange(Hv, device=dev) // (Hv // Hk)
    j = torch.arange(CHUNK, device=dev)
    r = pos % CHUNK  # (B,)
    sl = slots.clamp(min=0)
    fresh = (pos == 0)[:, None, None, None]
    S0 = cache["state"][sl].float()
    S0 = torch.where(fresh, torch.zeros_like(S0), S0)  # (B, Hv, K, V)
    here = (j[None, :] == r[:, None])[:, None, :]  # (B, 1, 64)
    k_ctx = torch.where(here.unsqueeze(-1), k.unsqueeze(2), cache["k"][sl].movedim(1, 2))  # (B, Hk, 64, K)
    G_c = cache["g_cum"][sl].transpose(1, 2)  # (B, Hv, 64)
    G_prev = G_c.gather(2, (r - 1).clamp(min=0)[:, None, None].expand(B, Hv, 1)).squeeze(2)
    G_prev = torch.where((r > 0)[:, None], G_prev, torch.full_like(G_prev, _NEG0))
    G_i = G_prev + g  # (B, Hv)
    G_ctx = torch.where(here, G_i.unsqueeze(-1), G_c)
    kk = row_dots(k, k_ctx)[:, head]  # (B, Hv, 64)
    qk = row_dots(q, k_ctx)[:, head]
    kh, qh, kh_ctx = k[:, head], q[:, head], k_ctx[:, head]
    causal = j[None, None, :] <= r[:, None, None]
    strict = j[None, None, :] < r[:, None, None]
    E = decay(G_i, G_ctx, causal)
    x_i = solve_row(beta, kk, E, rhs(v, kh, beta, G_i), cache["x"][sl].movedim(1, 2), strict)  # (B, Hv, V + K)
    vn_i = vnew_row(x_i[..., :V], x_i[..., V:], S0)
    vn_ctx = torch.where(here.unsqueeze(-1), vn_i.unsqueeze(2), cache["v_new"][sl].movedim(1, 2))
    o = out_row(qh, G_i, S0, qk, E, vn_ctx, causal)
    S_new = torch.where((r == CHUNK - 1)[:, None, None, None], next_state(S0, kh_ctx, G_ctx, vn_ctx), S0)
    scatter_slots(cache["state"], slots, S_new)
    scatter_slots(cache["k"], slots, k, r)
    scatter_slots(cache["g_cum"], slots, G_i, r)
    scatter_slots(cache["x"], slots, x_i, r)
    scatter_slots(cache["v_new"], slots, vn_i, r)
    scatter_slots(cache["n"], slots, (r + 1) % CHUNK)
    return o


# -- causal depthwise conv1d (k = 4) + SiLU ---------------------------------------------------

CONV_K = 4


def conv1d_cpu(x, weight, cu_seqlens, tail=None, slots=None, starts=None):
    """x (T, C), weight (C, 4), cu_seqlens (B + 1,) int device tensor; with
    ``tail`` (S, 3, C) the slots' last three inputs, ``slots`` (B,) and
    ``starts`` (B,): a sequence at start > 0 reads taps before its first token
    from its tail, and every slot >= 0 gets its new tail.  No host reads.

    y[t] = dt(silu(dt(((w0 x[t-3] + w1 x[t-2]) + w2 x[t-1]) + w3 x[t])))
    in fp32 (a bf16 x bf16 product is exact in fp32), dt = x.dtype, taps
    before position 0 are 0, silu(z) = z / (1 + exp(-z)) in fp32.  The two
    roundings are transformers' torch path (F.conv1d in the input dtype, then
    SiLU); causal-conv1d / fla round once.  Element-wise: a row's bits depend
    on its own four taps only."""
    T = x.shape[0]
    dev = x.device
    B = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.long()
    t = torch.arange(T, device=dev)
    seq = torch.searchsorted(cu[1:], t, right=True).clamp(max=max(B - 1, 0))
    local = t - cu[seq]
    pos = local + (starts.long()[seq] if starts is not None else 0)
    xf, wf = x.float(), weight.float()
    zero = xf.new_zeros(())
    if tail is not None:
        tl_ = tail[slots.clamp(min=0).long()].float()  # (B, 3, C)
    acc = None
    for d in range(CONV_K):  # tap d reads position pos - (3 - d)
        back = CONV_K - 1 - d
        own = xf[(t - back).clamp(min=0)]
        if tail is not None:
            from_tail = tl_[seq, (CONV_K - 1 + local - back).clamp(min=0, max=CONV_K - 2)]
            past = torch.where(((pos - back) >= 0)[:, None], from_tail, zero)
        else:
            past = torch.zeros_like(own)
        xs = torch.where((local >= back)[:, None], own, past)
        term = wf[:, d] * xs
        acc = term if acc is None else acc + term
    z = acc.to(x.dtype).float()
    y = silu(z).to(x.dtype)
    if tail is not None:
        n = cu[1:] - cu[:-1]  # (B,)
        m = torch.arange(CONV_K - 1, device=dev)
        loc = n[:, None] - (CONV_K - 1) + m[None, :]  # (B, 3) local index of new tail row m
        st = starts.long()[:, None] if starts is not None else 0
        own = x[(cu[:-1, None] + loc).clamp(min=0, max=max(T - 1, 0))]
        old = tail[slots.clamp(min=0).long()]
        old = old[torch.arange(B, device=dev)[:, None], (CONV_K - 1 + loc).clamp(min=0, max=CONV_K - 2)]
        old = torch.where(((st + loc) >= 0)[..., None], old, torch.zeros_like(old))
        new = torch.where((loc >= 0)[..., None], own, old)
        scatter_slots(tail, slots.long(), new)
    return y
