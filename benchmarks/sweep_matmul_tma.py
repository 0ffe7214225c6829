"""Experiment: a persistent TMA variant of the segmented GEMM for large M.

Same reduction contract as common/matmul/kernel.py (SEG_K = 1024 segments,
each a chain of tl.dot steps from zero, merged left to right in fp32): this
checks on the GPU that its bits equal the library kernel's and how fast it is
against cuBLAS.  Not used by the library until it proves both.

    python benchmarks/sweep_matmul_tma.py
"""
import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

from alignzoo.common.matmul.kernel import matmul_fwd_triton


@triton.jit
def _mm_tma_persistent(a_desc, b_desc, c_desc, M, N, K, N_SEG,
                       SEG_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    n_m = tl.cdiv(M, BLOCK_M)
    n_n = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_m * n_n, NUM_SMS, flatten=False):
        group = tile // (GROUP_M * n_n)
        first_m = group * GROUP_M
        size_m = min(n_m - first_m, GROUP_M)
        i_m = first_m + (tile % size_m)
        i_n = (tile % (GROUP_M * n_n)) // size_m
        b_total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(0, N_SEG):
            b_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, SEG_K, BLOCK_K):
                b_a = a_desc.load([i_m * BLOCK_M, s * SEG_K + kk])
                b_b = b_desc.load([i_n * BLOCK_N, s * SEG_K + kk])
                b_acc = tl.dot(b_a, b_b.T, b_acc)
            b_total += b_acc
        c_desc.store([i_m * BLOCK_M, i_n * BLOCK_N], b_total.to(tl.bfloat16))


def mm_tma(x, w, BM=128, BN=256, BK=64, nw=8, ns=3, SEG_K=1024):
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    a_d = TensorDescriptor.from_tensor(x, [BM, BK])
    b_d = TensorDescriptor.from_tensor(w, [BN, BK])
    c_d = TensorDescriptor.from_tensor(y, [BM, BN])
    sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    n_seg = triton.cdiv(K, SEG_K)
    seg_k = SEG_K if n_seg > 1 else triton.cdiv(K, BK) * BK
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    _mm_tma_persistent[(min(sms, tiles),)](a_d, b_d, c_d, M, N, K, n_seg, SEG_K=seg_k, BLOCK_M=BM, BLOCK_N=BN,
                                          BLOCK_K=BK, GROUP_M=8, NUM_SMS=min(sms, tiles), num_warps=nw, num_stages=ns)
    return y


def t(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


if __name__ == "__main__":
    torch.manual_seed(0)
    dev = torch.device("cuda")
    for N, K in [(4096, 4096), (12288, 4096), (4096, 12288), (1024, 4096)]:
        x = torch.randn(8192, K, device=dev).bfloat16()
        w = (torch.randn(N, K, device=dev) / K**0.5).bfloat16()
        for M in (256, 1024, 4096, 8192):
            xm = x[:M]
            ref = matmul_fwd_triton(xm, w)
            cub, lib = t(lambda: torch.mm(xm, w.t())), t(lambda: matmul_fwd_triton(xm, w))
            line = [f"N={N} K={K} M={M} cublas={cub:.4f} lib={lib:.4f} ({cub / lib:.2f})"]
            for cfg in [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 8, 4), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4)]:
                try:
                    f = lambda: mm_tma(xm, w, *cfg)
                    same = torch.equal(f(), ref)
                    tt = t(f)
                    line.append(f"  tma{cfg}: {tt:.4f} ({cub / tt:.2f}) same_bits={same}")
                except Exception as e:
                    line.append(f"  tma{cfg}: {type(e).__name__}: {str(e)[:80]}")
            print("\n".join(line), flush=True)
