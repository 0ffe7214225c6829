"""Ladder rows for the fused q/k RMSNorm + RoPE + KV write (``alignzoo check qk_norm_rope``):
rung 1, rung 2 (tokens as rows), fused == the unfused launchers, accuracy vs float64."""
from __future__ import annotations

import torch

from .._host import cdiv
from ..kv_cache import PAGE_SIZE, allocate_kv_cache, write_kv_fwd
from ..ladder import RungResult, accuracy, bitwise_equal, rung1_repeat, rung2_rows
from ..rmsnorm import rmsnorm_fwd
from ..rope import RopeSpec, rope_fwd
from .naive import qk_norm_rope_ref
from .op import qk_norm_rope_kv_fwd

EPS = 1e-6
# ||out - ref|| / ||ref|| vs float64, bf16: the norm's two roundings then the rotation's one (~2.9e-3 measured)
BOUND = 6e-3
# (Hq, Hkv, D): Qwen3-8B's heads, and the tiny preset's odd head_dim (a padded row tree)
SHAPES = {"qwen3-8b": (32, 8, 128), "tiny": (4, 2, 24)}


def unfused(qkv, q_w, k_w, eps, positions, spec, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads):
    """What ``qk_norm_rope_kv_fwd`` replaces: the server's former eight launches
    (copies, ``rmsnorm_fwd`` and ``rope_fwd`` of q and k, ``write_kv_fwd``) -> q."""
    T, D = qkv.shape[0], q_w.shape[0]
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q = rmsnorm_fwd(q.reshape(T, num_heads, D).contiguous(), q_w, eps)[0]
    k = rmsnorm_fwd(k.reshape(T, num_kv_heads, D).contiguous(), k_w, eps)[0]
    q = rope_fwd(q, positions, spec, check=False)
    k = rope_fwd(k, positions, spec, check=False)
    write_kv_fwd(k, v.reshape(T, num_kv_heads, D).contiguous(), k_cache, v_cache, slot_mapping)
    return q


def run(fn, qkv, positions, q_w, k_w, spec, num_heads, num_kv_heads, **kw):
    """``fn`` (fused or ``unfused``) into a fresh NaN-filled cache, token i at
    slot i -> (q (T, Hq, D), k rows (T, Hkv, D), v rows (T, Hkv, D))."""
    T, D = qkv.shape[0], q_w.shape[0]
    kc, vc = allocate_kv_cache(max(1, cdiv(T, PAGE_SIZE)), num_kv_heads, D, dtype=qkv.dtype, device=qkv.device)
    kc.fill_(float("nan"))
    vc.fill_(float("nan"))
    slots = torch.arange(T, device=qkv.device)
    q = fn(qkv, q_w, k_w, EPS, positions, spec, kc, vc, slots, num_heads, num_kv_heads, **kw)
    return q, kc.view(-1, num_kv_heads, D)[:T], vc.view(-1, num_kv_heads, D)[:T]


def _configs(device: torch.device) -> list[dict]:
    if device.type == "cuda":
        return [{}, {"heads_per_program": 1, "num_warps": 1}, {"heads_per_program": 8, "num_warps": 4}]
    return [{}]


def ladder(device: torch.device) -> list[RungResult]:
    g = torch.Generator().manual_seed(0)
    T = 333
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)  # past 593 and 2048
    out: list[RungResult] = []
    for name, (Hq, Hkv, D) in SHAPES.items():
        spec = RopeSpec(D, 1e6, 4096)
        qkv = (3 * torch.randn(T, (Hq + 2 * Hkv) * D, generator=g)).to(device, torch.bfloat16)
        q_w, k_w = ((1 + 0.1 * torch.randn(D, generator=g)).to(device, torch.bfloat16) for _ in range(2))
        shared = dict(q_w=q_w, k_w=k_w, spec=spec, num_heads=Hq, num_kv_heads=Hkv)
        fused = lambda qkv, pos, **kw: run(qk_norm_rope_kv_fwd, qkv, pos, **kw)  # noqa: E731
        got, want = fused(qkv, positions, **shared), run(unfused, qkv, positions, **shared)
        bad = sum(not bitwise_equal(a, b) for a, b in zip(got, want))
        ref = qk_norm_rope_ref(qkv, q_w, k_w, EPS, positions, spec, Hq, Hkv)
        rows = [
            rung1_repeat("qk_norm_rope", fused, qkv, positions, **shared),
            rung2_rows("qk_norm_rope", fused, [qkv, positions], shared=shared, configs=_configs(device)),
            RungResult("qk_norm_rope", 2, "fused == rmsnorm_fwd + rope_fwd + write_kv_fwd", bad == 0, 3, bad),
            accuracy("qk_norm_rope", got[0], ref[0], BOUND, "q bf16 vs float64"),
            accuracy("qk_norm_rope", got[1], ref[1], BOUND, "cached k bf16 vs float64"),
        ]
        for r in rows:
            r.check = f"{name}: {r.check}"
        out += rows
    return out
