"""Ordered collectives and layout-invariant data parallelism on gloo (CPU): forked ranks, world sizes 1, 2, 4.

Bitwise promises: the ordered all-reduce / reduce-scatter / all-gather equal the single-process tree for
any assignment of logical contributors to ranks, padding rows ignored; an Adam step on qwen3 tiny over
8 leaves gives the same weights on one device and on DP 2 / DP 4."""
from __future__ import annotations

import datetime
import os
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import alignzoo
from alignzoo.common.tree import tree_reduce_fwd
from alignzoo.parallel import (
    TreeAccumulator,
    ordered_all_gather,
    ordered_all_reduce,
    ordered_reduce_scatter,
    step_gradients,
)


def _worker(rank, world, tmp, fn, args):
    torch.set_num_threads(1)  # 4 ranks on 2 cores; the bits must not care
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        torch.save(fn(rank, world, *args), f"{tmp}/out{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tmp, fn, *args) -> list:
    """fn(rank, world, *args) on ``world`` forked gloo ranks (fork: ~0.1 s a rank, no re-import);
    its return values by rank."""
    tmp = str(tmp)
    os.makedirs(tmp, exist_ok=True)
    mp.start_processes(_worker, args=(world, tmp, fn, args), nprocs=world, start_method="fork")
    return [torch.load(f"{tmp}/out{r}.pt") for r in range(world)]


def spread(world: int, k: int, seed: int):
    """R·k rows (5, 37) of mixed magnitude (a 60-bit spread per element: float64 sums round, so the order shows in the bits), a random assignment of
    logical positions to (rank, slot), every third-ish row invalid padding."""
    g = torch.Generator().manual_seed(seed)
    n = world * k
    rows = torch.randn(n, 5, 37, generator=g) * torch.exp2(torch.randint(-30, 30, (n, 5, 37), generator=g).float())
    positions = torch.randperm(n, generator=g) * 3 + 1  # sparse, not 0..n-1: only their order matters
    valid = torch.rand(n, generator=g) > 0.3
    valid[positions.argmin()] = True
    return rows.view(world, k, 5, 37), positions.view(world, k), valid.view(world, k)


def tree_of(rows, positions, valid, dtype):
    keep = valid.reshape(-1).nonzero().reshape(-1)
    order = keep[positions.reshape(-1)[keep].argsort()]
    return tree_reduce_fwd(rows.reshape(-1, *rows.shape[2:])[order], dtype)


def _collectives(rank, world, seed):
    rows, positions, valid = spread(world, 3, seed)
    out = {"all_reduce": ordered_all_reduce(rows[rank], positions[rank], valid[rank]),
           "all_reduce_bf16": ordered_all_reduce(rows[rank].bfloat16(), positions[rank], valid[rank]),
           "reduce_scatter": ordered_reduce_scatter(rows[rank], positions[rank], valid[rank], out_dtype=torch.float64)}
    g = torch.Generator().manual_seed(seed)
    shard_pos = torch.randperm(world, generator=g)  # rank r holds vocabulary shard shard_pos[r]
    widths = [7 + 2 * p for p in range(world)]
    logits = torch.randn(63, sum(widths), generator=g)
    lo = sum(widths[: shard_pos[rank]])
    out["all_gather"] = ordered_all_gather(logits[:, lo: lo + widths[shard_pos[rank]]], int(shard_pos[rank]))
    out["logits"] = logits
    return out


@pytest.mark.parametrize("world", [1, 2, 4], ids=lambda w: f"R{w}")
def test_ordered_collectives_equal_the_tree(world, tmp_path):
    seed = 10 + world
    outs = run_ranks(world, tmp_path, _collectives, seed)
    rows, positions, valid = spread(world, 3, seed)
    ref = tree_of(rows, positions, valid, torch.float32)
    flat64 = tree_of(rows, positions, valid, torch.float64).reshape(-1)
    by_rank = tree_of(rows, torch.arange(positions.numel()).view_as(positions), valid, torch.float64)
    if world > 1:
        assert not torch.equal(flat64, by_rank.reshape(-1))  # the data shows the order: rank-id order is caught
    S = -(-flat64.numel() // world)
    for r, o in enumerate(outs):
        assert torch.equal(o["all_reduce"], ref)
        assert torch.equal(o["all_reduce_bf16"], tree_of(rows.bfloat16(), positions, valid, torch.bfloat16))
        assert torch.equal(o["reduce_scatter"][: max(0, min(S, flat64.numel() - r * S))], flat64[r * S: (r + 1) * S])
        assert torch.equal(o["all_gather"], o["logits"])


def test_tree_accumulator_is_the_tree():
    g = torch.Generator().manual_seed(0)
    for n in (1, 2, 3, 5, 6, 7, 8, 11, 13, 33):
        leaves = torch.randn(n, 61, generator=g) * torch.exp2(torch.randint(-30, 30, (n, 1), generator=g).float())
        acc = TreeAccumulator()
        for x in leaves:
            acc.push(x)
        assert torch.equal(acc.result(torch.float32), tree_reduce_fwd(leaves, torch.float32)), n


def test_bad_labels_are_refused():
    rows = torch.ones(3, 4)
    with pytest.raises(ValueError, match="position 2 is held by more than one"):
        ordered_all_reduce(rows, [2, 0, 2])
    with pytest.raises(ValueError, match="3 rows but 2 positions"):
        ordered_all_reduce(rows, [0, 1])
    with pytest.raises(ValueError, match="no valid row"):
        ordered_all_reduce(rows, [0, 1, 2], [False] * 3)
    with pytest.raises(ValueError, match="one dtype"):
        step_gradients(lambda leaf: leaf, [torch.ones(2), torch.ones(2, dtype=torch.float64)], [0])


# --- an Adam step on qwen3 tiny: one device vs DP 2 vs DP 4 -------------------------------------------

LEAF_LENS = [(5, 9), (13, 7), (3, 11), (9, 9), (21,), (7, 3, 5), (15, 3), (11, 5)]  # 8 leaves, odd lengths


@pytest.fixture(scope="module")
def tiny():
    pair = alignzoo.load_pair("qwen3", config="tiny", device="cpu", seed=3)
    g = torch.Generator().manual_seed(4)
    leaves = [[torch.randint(0, pair.config.vocab_size, (n,), generator=g).tolist() for n in lens]
              for lens in LEAF_LENS]
    state = {n: p.detach().clone() for n, p in pair.trainer.named_parameters()}
    return pair.trainer, leaves, state


def adam_step(trainer, leaves, state, group=None, position=None):
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            p.copy_(state[n])
    params = list(trainer.parameters())
    tokens = sum(len(s) - 1 for leaf in leaves for s in leaf)  # the batch's normaliser: a constant on every rank

    def loss_fn(leaf):
        return -sum(lp.sum() for lp in trainer.logprobs(leaf, [1] * len(leaf))) / tokens

    step_gradients(loss_fn, params, leaves, group=group, position=position)
    opt = torch.optim.Adam(params, lr=3e-3)
    opt.step()
    return {n: p.detach().clone() for n, p in trainer.named_parameters()}


def _one_device_step(rank, world, trainer, leaves, state):
    return adam_step(trainer, leaves, state)  # group None: no collective, leaves 0..N-1 in order


@pytest.fixture(scope="module")
def reference(tiny, tmp_path_factory):
    """The one-device step, in a forked process with one thread like the ranks (2 threads in the pytest
    process gave the same bits, ~6x slower on the 2-core CI machine)."""
    (ref,) = run_ranks(1, tmp_path_factory.mktemp("one_device"), _one_device_step, *tiny)
    _, _, state = tiny
    assert any(not torch.equal(ref[n], state[n]) for n in ref)
    return ref


def _dp_step(rank, world, trainer, leaves, state):
    return adam_step(trainer, leaves, state, group=dist.group.WORLD, position=(rank + 1) % world)


def test_adam_step_is_layout_invariant(tiny, reference, tmp_path):
    """8 leaves: DP 1 (a gloo group of one), DP 2 (4 slots a rank) and DP 4 (2 slots, positions rotated
    off the rank ids) give the one-device weights bit for bit, on every rank."""
    ref = reference
    outs = {R: run_ranks(R, tmp_path / f"R{R}", _dp_step, *tiny) for R in (1, 2, 4)}
    for R, ranks in outs.items():
        for r, w in enumerate(ranks):
            bad = [n for n in ref if not torch.equal(w[n], ref[n])]
            assert not bad, f"DP {R} rank {r}: {bad[:4]}"


def _fsdp_step(rank, world, trainer, leaves, state):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

    from alignzoo.parallel.fsdp import shard_ordered

    # logprobs returns split views; the loss below reads them out of place, as FSDP asks
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    with torch.no_grad():
        for n, p in trainer.named_parameters():
            p.copy_(state[n])
    d = (rank + 1) % world
    mesh = init_device_mesh("cpu", (world,))
    for layer in trainer.layers:  # one parameter group a block, as torchtitan shards, then the rest
        fully_shard(layer, mesh=mesh)
    fully_shard(trainer, mesh=mesh)
    register_fsdp_forward_method(trainer, "logprobs")  # the trainer's entry point is logprobs, not forward
    shard_ordered(trainer, len(leaves), position=d)
    tokens = sum(len(s) - 1 for leaf in leaves for s in leaf)
    for j in range(d, len(leaves), world):
        leaf = leaves[j]
        (-sum(lp.sum() for lp in trainer.logprobs(leaf, [1] * len(leaf))) / tokens).backward()
    torch.optim.Adam(trainer.parameters(), lr=3e-3).step()
    return {n: p.full_tensor().detach().clone() for n, p in trainer.named_parameters()}


def test_fsdp2_adam_step_is_layout_invariant(tiny, reference, tmp_path):
    """fully_shard with the ordered reduce-scatter: FSDP 2 and FSDP 4 give the one-device weights
    (FSDP's own reduce-scatter, summing in bf16, does not)."""
    ref = reference
    outs = {R: run_ranks(R, tmp_path / f"R{R}", _fsdp_step, *tiny) for R in (2, 4)}
    for R, ranks in outs.items():
        for r, w in enumerate(ranks):
            bad = [n for n in ref if not torch.equal(w[n], ref[n])]
            assert not bad, f"FSDP {R} rank {r}: {bad[:4]}"


def toy_leaves(n: int):
    """A (5, 7) fp32 parameter W and n leaves c_j with loss (c_j * W).sum(): leaf j's gradient is c_j.
    Leaves 4m and 4m + 1 are +B and -B (~2^40), the rest ~2^-20: the tree cancels B before adding the
    small ones, another order loses them (a 60-bit spread), so the order shows in the bits."""
    g = torch.Generator().manual_seed(n)
    c = torch.randn(n, 5, 7, generator=g) * 2.0 ** -20
    for j in range(0, n - 1, 4):
        c[j] = torch.randn(5, 7, generator=g) * 2.0 ** 40
        c[j + 1] = -c[j]
    return torch.nn.Parameter(torch.randn(5, 7, generator=g)), list(c)


def toy_grads(w, leaves, group=None, position=None):
    step_gradients(lambda c: (c * w).sum(), [w], leaves, group=group, position=position)
    return w.grad.clone()


def _toy(rank, world, n):
    w, leaves = toy_leaves(n)
    return toy_grads(w, leaves, dist.group.WORLD, (rank + 1) % world)  # reversal would be a symmetry of the tree


@pytest.mark.parametrize("n", [5, 8], ids=lambda n: f"N{n}")
def test_dp_gradients_any_leaf_count(n, tmp_path):
    """N = 5 leaves (R = 2, 4: the last slot partly padding) and N = 8, positions rotated against
    rank ids: the DP gradients equal one device's, whose order is visible in the bits."""
    w, leaves = toy_leaves(n)
    ref = toy_grads(w, leaves)
    assert torch.equal(ref, tree_reduce_fwd(torch.stack(leaves), torch.float32))
    rank_by_rank = [leaves[j] for j in sorted(range(n), key=lambda j: (j % 2, j))]  # DP 2, rank 0's leaves first
    assert not torch.equal(ref, tree_reduce_fwd(torch.stack(rank_by_rank), torch.float32))
    for R in (1, 2, 4):
        for r, grad in enumerate(run_ranks(R, tmp_path / f"R{R}", _toy, n)):
            assert torch.equal(grad, ref), f"R{R} rank {r}"
