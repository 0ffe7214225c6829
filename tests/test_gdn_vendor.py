"""The vendor baseline's delta rule (``common/gdn/vendor.py``): the per-token recurrent decode kernel
in place at each sequence's slot, against the float64 recurrence; on the GPU, against fla's."""
import pytest
import torch

from interpreted import run_interpreted

_DECODE = r"""
import torch
from alignzoo.common.gdn import l2norm_fwd
from alignzoo.common.gdn.naive import gdn_ref
from alignzoo.common.gdn.vendor_kernel import recurrent_decode

gen = torch.Generator().manual_seed(0)
Hk, Hv, K, V, steps = 2, 4, 24, 40, 5  # GVA, K and V not powers of two
slots = torch.tensor([2, -1, 0])  # row 1 pads a graph bucket
state = torch.randn(4, Hv, K, V, generator=gen) * 0.1
start = state.clone()
live = [0, 2]
S = start[slots[live]].double()
for t in range(steps):
    q = l2norm_fwd(torch.randn(3, Hk, K, generator=gen)) * K ** -0.5
    k = l2norm_fwd(torch.randn(3, Hk, K, generator=gen))
    v = torch.randn(3, Hv, V, generator=gen)
    g = -torch.rand(3, Hv, generator=gen)
    beta = torch.rand(3, Hv, generator=gen)
    o = recurrent_decode(q, k, v, g, beta, slots, state)
    o_ref, S = gdn_ref(q[live], k[live], v[live], g[live], beta[live], torch.arange(3), initial_state=S)
    assert (o[live].double() - o_ref).abs().max() < 1e-5, (o[live].double() - o_ref).abs().max()
    assert torch.equal(o[1], torch.zeros(Hv, V))
assert (state[slots[live]].double() - S).abs().max() < 1e-5
assert torch.equal(state[[1, 3]], start[[1, 3]])  # slots no row names keep their bits
print("ok")
"""


def test_vendor_recurrent_decode_interpreted():
    run_interpreted(_DECODE, expect="ok")


@pytest.mark.gpu
def test_gpu_vendor_decode_matches_fla():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    from alignzoo.common.gdn import l2norm_fwd
    from alignzoo.common.gdn.vendor_kernel import recurrent_decode

    gen = torch.Generator(device="cuda").manual_seed(0)
    B, Hk, Hv, K, V = 64, 16, 32, 128, 128  # Qwen3.5-35B-A3B
    state = torch.randn(B + 3, Hv, K, V, generator=gen, device="cuda") * 0.05
    slots = torch.randperm(B + 3, generator=gen, device="cuda")[:B]
    q = l2norm_fwd(torch.randn(B, Hk, K, generator=gen, device="cuda")) * K ** -0.5
    k = l2norm_fwd(torch.randn(B, Hk, K, generator=gen, device="cuda"))
    v = torch.randn(B, Hv, V, generator=gen, device="cuda")
    g = -torch.rand(B, Hv, generator=gen, device="cuda")
    beta = torch.rand(B, Hv, generator=gen, device="cuda")
    h0 = state[slots].clone()
    o_fla, ht = fla.fused_recurrent_gated_delta_rule(q[:, None], k[:, None], v[:, None], g[:, None], beta=beta[:, None],
                                                     scale=1.0, initial_state=h0, output_final_state=True)
    o = recurrent_decode(q, k, v, g, beta, slots, state)
    torch.testing.assert_close(o, o_fla[:, 0].float(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[slots], ht, rtol=1e-5, atol=1e-5)
