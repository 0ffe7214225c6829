"""Triton writer for the paged KV cache (one program per token and kv head).

A copy: loads and stores of the same dtype, no arithmetic, so the cache holds
the exact bytes of k/v whichever path (prefill or decode) wrote them.
A negative slot skips the token (CUDA-graph padding).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import next_power_of_2
from .._launch import FP_FUSION
from .._pdl import pdl_options, wait_prior


@triton.jit
def _write_kv_kernel(
    k, v, k_cache, v_cache, slot_mapping,
    stride_kn, stride_kh, stride_vn, stride_vh,
    stride_cs, stride_ch,
    D: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr = False,
):
    wait_prior(PDL)  # PDL: first, before any global load or store
    i_n = tl.program_id(0)
    i_h = tl.program_id(1)
    i_slot = tl.load(slot_mapping + i_n).to(tl.int64)
    if i_slot < 0:
        return
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    b_k = tl.load(k + i_n.to(tl.int64) * stride_kn + i_h * stride_kh + o_d, mask=m_d)
    b_v = tl.load(v + i_n.to(tl.int64) * stride_vn + i_h * stride_vh + o_d, mask=m_d)
    tl.store(k_cache + i_slot * stride_cs + i_h * stride_ch + o_d, b_k, mask=m_d)
    tl.store(v_cache + i_slot * stride_cs + i_h * stride_ch + o_d, b_v, mask=m_d)


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    n, h, d = k.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.is_contiguous() and v_cache.is_contiguous()
    # slot s is row s of the cache viewed as (P * PAGE_SIZE, Hkv, D)
    _write_kv_kernel[(n, h)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(1), k_cache.stride(2),
        D=d, BLOCK_D=next_power_of_2(d), **pdl_options(k.device, k.shape[0]), enable_fp_fusion=FP_FUSION, num_warps=4,
    )
