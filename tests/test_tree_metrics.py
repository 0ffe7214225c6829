"""Reduction tree (bitwise vs the recursive reference, row invariance) and mismatch metrics."""
import math

import pytest
import torch

from alignzoo.common.ladder import bitwise_equal, rel_err, rung1_repeat, rung2_rows
from alignzoo.common.metrics import k3, mismatch
from alignzoo.common.tree import tree_reduce, tree_reduce_fwd, tree_reduce_ref


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13, 16], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_tree_equals_reference_pairing_bitwise(device, n, dtype):
    parts = torch.randn(n, 97, 33).to(device, dtype)
    parts[0, 0, :4] = -0.0  # signed zeros must survive padding and carries
    parts[:, 1, :] = -0.0
    got = tree_reduce(parts, torch.float32)
    want = tree_reduce_ref(parts.cpu()).float().to(device)
    assert bitwise_equal(got, want)
    assert got[1].signbit().all()


def test_tree_order_is_the_given_logical_order(device):
    """Reordering contributors may change bits; the tree must use the order given."""
    parts = torch.tensor([[1e16], [1.0], [-1e16], [1.0]], dtype=torch.float64, device=device)
    assert tree_reduce(parts).item() == 0.0 + ((1e16 + 1.0) + (-1e16 + 1.0))
    assert tree_reduce(parts[[0, 2, 1, 3]]).item() == 2.0


def test_tree_rows_invariant_and_repeatable(device):
    parts = torch.randn(7, 257, 65).to(device, torch.bfloat16)
    assert rung1_repeat("tree", tree_reduce_fwd, parts, torch.bfloat16).passed
    rows = parts.transpose(0, 1).contiguous()
    cfgs = [{}] if device.type == "cpu" else [{}, {"block": 32}]
    r = rung2_rows("tree", lambda x, **kw: tree_reduce_fwd(x.transpose(0, 1).contiguous(), torch.bfloat16, **kw),
                   (rows,), configs=cfgs)
    assert r.passed, r.detail


def test_tree_check_catches_a_batch_dependent_order():
    # a wide dynamic range, so float64 sums are not exact and order shows
    parts = torch.randn(6, 40, 16) * torch.exp2(torch.randint(-40, 40, (6, 40, 16)).float())

    def order_by_batch(x):  # (T, N, H): contributor order follows the batch size
        p = x.transpose(0, 1)
        return tree_reduce_fwd(p if x.shape[0] > 8 else p.flip(0).contiguous(), torch.float64)

    assert not rung2_rows("bad", order_by_batch, (parts.transpose(0, 1).contiguous(),)).passed


def test_tree_accuracy_and_gradient(device):
    parts = torch.randn(5, 300).to(device, torch.float32).requires_grad_()
    out = tree_reduce(parts, torch.float32)
    assert rel_err(out, parts.detach().double().sum(0)) < 1e-7  # one fp32 rounding
    out.backward(torch.arange(300.0, device=device))
    assert torch.equal(parts.grad, torch.arange(300.0, device=device).expand(5, 300))


def test_tree_bad_input():
    with pytest.raises(ValueError, match="at least one"):
        tree_reduce([])
    with pytest.raises(ValueError, match="different shapes"):
        tree_reduce([torch.zeros(3), torch.zeros(4)])
    with pytest.raises(TypeError, match="parts has dtype int64"):
        tree_reduce(torch.zeros(3, 4, dtype=torch.long))


def test_k3_is_zero_only_when_equal():
    lp = torch.randn(1000) - 3
    assert torch.equal(k3(lp, lp.clone()), torch.zeros(1000, dtype=torch.float64))
    m = mismatch(lp, lp.clone())
    assert m.exact and m.k3_max == 0.0 and m.max_abs_diff == 0.0 and m.tokens == 1000
    nudged = lp.clone()
    nudged[17] = torch.nextafter(nudged[17], torch.tensor(0.0))
    m = mismatch(lp, nudged)
    assert m.differing == 1 and m.k3_max > 0.0
    d = 0.3
    assert math.isclose(k3(torch.tensor([d], dtype=torch.float64), torch.zeros(1, dtype=torch.float64)).item(), math.exp(d) - 1 - d, rel_tol=1e-12)


def test_metrics_bad_input():
    with pytest.raises(ValueError, match="shape"):
        k3(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="compare like with like"):
        mismatch(torch.zeros(3), torch.zeros(3, dtype=torch.float64))
