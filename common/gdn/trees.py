"""The leaf trees the GDN kernels share: a fixed pairwise sum (``cpu.py``'s
trees: adjacent pairs, level by level, -0.0 for a lane or row not present)
unrolled over its leaves, each leaf the outer product of two loaded vectors,
so every level adds whole tiles element by element in registers and no sum
crosses lanes: ``chunk_kernel.py``'s state, output and solve kernels (and
``_neg0``, every GDN kernel's pad).  Each tree recurses on halves with its
first leaf a runtime value (a literal would make it a constexpr), so it
compiles as one function a level, not one a node."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _neg0():
    """-0.0, the trees' pad, from its bit pattern: Triton 3.6 compiles a -0.0 literal,
    ``other=-0.0`` included, as +0.0."""
    return tl.full([], -2147483648, tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _ks_tree(p_S, p_a, p_b, k0, N: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
             TWO: tl.constexpr):
    """Leaves k0..k0+N-1 (N a power of two) of the K trees over a_ik S0_kv and, with TWO, b_ik S0_kv
    (v_new's w_i S0, o's inter term (q_i exp(G_i)) S0), -0.0 past K, by the pairwise tree: tile-wise
    adds, in registers; two trees share each loaded row of S0.  a and b come from their transposes
    (row k: the tile's rows i, contiguous), loaded unmasked: the callers' rows and columns are in
    bounds, and a row past a piece's end only ever reaches that row's own result, which is not stored.
    k0 is a runtime value (a literal would make it a constexpr), so a tree compiles as one function a
    level, not one a node.  -> (a tree, b tree or the a tree again)."""
    if N == 1:
        k = tl.minimum(k0, K - 1)  # a lane past K reads row K - 1 and keeps -0.0
        b_s = tl.load(p_S + k * V)  # (BV,) row k of the S0 tile
        b_a = tl.load(p_a + k * C)  # (BR,)
        x = tl.where(k0 < K, b_a[:, None] * b_s[None, :], _neg0())
        y = x
        if TWO:
            b_b = tl.load(p_b + k * C)
            y = tl.where(k0 < K, b_b[:, None] * b_s[None, :], _neg0())
    else:
        x0, y0 = _ks_tree(p_S, p_a, p_b, k0, N // 2, K, V, C, TWO)
        x1, y1 = _ks_tree(p_S, p_a, p_b, k0 + N // 2, N // 2, K, V, C, TWO)
        x = x0 + x1
        y = x
        if TWO:
            y = y0 + y1
    return x, y


@triton.jit
def _av_tree(p_a, p_vn, o_i, j0, N: tl.constexpr, JE, RA: tl.constexpr, RV: tl.constexpr,
             BR: tl.constexpr, BV: tl.constexpr):
    """Leaves j0..j0+N-1 of where(j <= i, A_ij v_new_j, -0.0) (or the solve's L_ij x_j) by the
    pairwise tree; a subtree from row JE on is -0.0 for every row of the tile (j > i), so not formed.
    RA, RV: the strides of A's column j (A^T's rows) and v_new's rows.  Unmasked loads, as in
    ``_ks_tree``: a row j past the piece's end reaches only rows i >= j, themselves past it."""
    if j0 >= JE:
        x = tl.broadcast_to(_neg0(), (BR, BV))
    else:
        if N == 1:
            b_a = tl.load(p_a + j0 * RA)  # (BR,) A_ij
            b_vn = tl.load(p_vn + j0 * RV)  # (BV,)
            x = tl.where(j0 <= o_i[:, None], b_a[:, None] * b_vn[None, :], _neg0())
        else:
            x = (_av_tree(p_a, p_vn, o_i, j0, N // 2, JE, RA, RV, BR, BV)
                 + _av_tree(p_a, p_vn, o_i, j0 + N // 2, N // 2, JE, RA, RV, BR, BV))
    return x


@triton.jit
def _kv_tree(p_kd, p_vn, j0, N: tl.constexpr, RK: tl.constexpr, RV: tl.constexpr):
    """Leaves j0..j0+N-1 of k'_j v_new_j^T (k'_j = k_j exp(G_63 - G_j)) by the pairwise tree:
    ``kernel._state_tile``'s sum (of a complete piece: every row present).  RK, RV: k' and v_new's row
    strides; unmasked loads (the callers' columns are in bounds)."""
    if N == 1:
        b_kd = tl.load(p_kd + j0 * RK)  # (BKS,)
        b_vn = tl.load(p_vn + j0 * RV)  # (BV,)
        x = b_kd[:, None] * b_vn[None, :]
    else:
        x = (_kv_tree(p_kd, p_vn, j0, N // 2, RK, RV)
             + _kv_tree(p_kd, p_vn, j0 + N // 2, N // 2, RK, RV))
    return x


@triton.jit
def _in_bounds(o, N: tl.constexpr, B: tl.constexpr):
    """Lanes o of a tile of B from a multiple of B, as the trees' unmasked loads may read them:
    unchanged where N % B == 0 (every lane is below N), else clamped to N - 1 (a lane past N
    reaches only a result no store keeps)."""
    if N % B != 0:
        o = tl.minimum(o, N - 1)
    return o
