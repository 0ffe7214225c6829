"""The RL example (ladder rung 5): K3 == 0 on every token of every step, the
reward rises from the random-init baseline, streaming == one batch."""
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import deepseek_v4_mhc_mxfp4_rl  # noqa: E402
import glm5_sparse_fp8_rl  # noqa: E402
import qwen3_rl  # noqa: E402
from rl_common import OrderedGradSum, group_advantages, reward_summary, token_objective  # noqa: E402


def read_log(out):
    with open(os.path.join(out, "log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_short_run_is_exact_and_learns(tmp_path):
    out = str(tmp_path / "run")
    assert qwen3_rl.main(["--steps", "24", "--out", out, "--save", str(tmp_path / "ckpt")]) == 0
    log = read_log(out)
    assert len(log) == 24
    assert all(r["differing_tokens"] == 0 and r["k3_max"] == 0.0 for r in log)
    assert all(r["sampled_under_version"] == [r["weight_version"] - 1] for r in log)
    first = sum(r["reward"] for r in log[:4]) / 4
    last = sum(r["reward"] for r in log[-4:]) / 4
    assert last > first + 0.03, (first, last)
    assert os.path.getsize(os.path.join(out, "rl.png")) > 1000
    assert os.path.exists(tmp_path / "ckpt" / "config.json")


def test_streaming_equals_one_batch_bitwise():
    """Same rollouts (sampling is batch-invariant and seeded per request);
    groups arrive in completion order vs index order; the updated weights are
    bitwise equal."""
    results = []
    for stream in (False, True):
        args = qwen3_rl.parse(["--stream"] if stream else [])
        pair = qwen3_rl.build_pair(args)
        opt = torch.optim.Adam(pair.trainer.parameters(), lr=args.lr)
        g = torch.Generator().manual_seed(0)
        for step in range(2):
            qwen3_rl.train_step(pair, opt, step, args, g)
        results.append([p.detach().clone() for p in pair.trainer.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_ordered_grad_sum_is_order_free():
    p = torch.zeros(5, 3)
    grads = [[torch.randn(5, 3) * 10 ** i] for i in range(6)]
    sums = []
    for order in ([0, 1, 2, 3, 4, 5], [5, 3, 1, 0, 4, 2]):
        acc = OrderedGradSum([p], 6)
        for i in order:
            acc.add(i, grads[i])
        acc.write_grads()
        sums.append(p.grad.clone())
    assert torch.equal(*sums)
    with pytest.raises(ValueError, match="twice"):
        acc.add(0, grads[0])


@pytest.mark.parametrize("kind", ["cispo", "ppo", "is"])
def test_objectives_on_policy_gradient(kind):
    """At the sampling weights (ratio exactly 1), every objective's gradient
    is the policy gradient A * d lp."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    obj = token_objective(kind, lp, lp.detach(), 0.7).sum()
    (g,) = torch.autograd.grad(obj, lp)
    assert torch.allclose(g, torch.full((3,), 0.7))
    assert torch.allclose(group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0])), torch.tensor([1.0, -1.0, 1.0, -1.0]), atol=1e-5)


def test_unaligned_mode_shows_the_mismatch(tmp_path, capsys):
    out = str(tmp_path / "u")
    assert qwen3_rl.main(["--steps", "2", "--unaligned", "--out", out, "--no-plot"]) == 0
    log = read_log(out)
    assert all(r["differing_tokens"] > 0 and r["k3_max"] > 0 for r in log)
    first, last = (f"{r['reward']:.3f}" for r in log)
    assert f"mean reward {first} over the first step -> {last} over the last step (of 2)" in capsys.readouterr().out


@pytest.mark.parametrize("n", [2, 3, 4, 7, 9, 10, 24])
def test_reward_summary_windows_are_disjoint(n):
    """Step i's reward is 10**i, so each window's mean names exactly the steps in it."""
    rewards = [10.0 ** i for i in range(n)]
    k = min(5, n // 2)
    text = reward_summary(rewards)
    first, last = sum(rewards[:k]) / k, sum(rewards[n - k:]) / k
    assert k <= n - k
    assert text.startswith(f"mean reward {first:.3f} over the first ") and f"-> {last:.3f} over the last " in text
    assert text.count(f"{k} steps" if k > 1 else "step ") == 2 and text.endswith(f"(of {n})")


def test_reward_summary_one_step_and_steps_at_least_one():
    assert reward_summary([0.25]) == "mean reward 0.250 (one step)"
    with pytest.raises(SystemExit):
        qwen3_rl.parse(["--steps", "0"])


def test_multi_adapter_tasks_are_exact_and_reload(tmp_path, capsys):
    """Two LoRA adapters ("reverse", "copy") trained in the same batches: every
    row served and scored under its task's adapter with K3 == 0; each adapter
    saved as PEFT and reloaded bit for bit."""
    out = str(tmp_path / "m")
    argv = ["--steps", "3", "--prompts", "4", "--group-size", "3", "--lora", "4", "--lora-mode", "multi",
            "--out", out, "--no-plot", "--save", str(tmp_path / "adapters")]
    assert qwen3_rl.main(argv) == 0
    log = read_log(out)
    assert all(r["differing_tokens"] == 0 and r["k3_max"] == 0.0 and r["tokens"] > 0 for r in log)
    assert all(os.path.exists(tmp_path / "adapters" / t / "adapter_config.json") for t in qwen3_rl.TASKS)
    assert "reloaded bit-identical" in capsys.readouterr().out
    assert qwen3_rl.reward([10, 1, 2, 11], [1, 2, 12], "copy") == 1.0
    assert qwen3_rl.reward([10, 1, 2, 11], [2, 1, 12], "reverse") == 1.0


@pytest.mark.parametrize("lora", [[], ["--lora", "4", "--lora-mode", "separate"], ["--lora", "4", "--lora-mode", "merged"]],
                         ids=["full", "lora-separate", "lora-merged"])
def test_qwen35_gdn_steps_are_exact(tmp_path, lora):
    """Rung 5 on the second model: every token of every step K3 == 0 (GDN states decoded from the slots).
    16 rollouts a step (4 prompts x 4), a mixed batch: the default 64 took 13 s a run for no other path."""
    out = str(tmp_path / "q35")
    argv = ["--model", "qwen35_gdn", "--steps", "3", "--prompts", "4", "--group-size", "4", "--out", out, "--no-plot"]
    assert qwen3_rl.main(argv + lora) == 0
    log = read_log(out)
    assert all(r["differing_tokens"] == 0 and r["k3_max"] == 0.0 and r["tokens"] > 0 for r in log)


def test_qwen35_gdn_example_describes_itself():
    """``qwen35_gdn_rl.py --help`` is its own text and defaults, not the qwen3 script's."""
    import subprocess

    script = os.path.join(os.path.dirname(__file__), "..", "examples", "qwen35_gdn_rl.py")
    out = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, check=True).stdout
    assert out.count("RL on qwen35_gdn (Gated DeltaNet + MoE)") == 1 and "A tiny Qwen3 learns" not in out


@pytest.mark.parametrize("mode", [["--lora", "4", "--lora-mode", "separate"], ["--fp8"]], ids=["lora-separate", "fp8"])
def test_glm5_sparse_fp8_steps_are_exact(tmp_path, capsys, mode):
    """Rung 5 on GLM-5: prompts of 34 tokens, past the tiny preset's top-32 selection, so every sampled token's
    query attends to the positions the indexer picks; K3 == 0 on every token of every step, in adapter training
    and in full-weight unified FP8 alike, and each sync ships the changed blocks only (the indexer's, which take
    no gradient, never change; separate LoRA ships the adapters alone)."""
    out = str(tmp_path / "glm5")
    argv = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--out", out, "--no-plot", *mode]
    assert glm5_sparse_fp8_rl.main(argv) == 0
    text = capsys.readouterr().out
    assert "prompts of 34 tokens, top-32 selection" in text and "served weights == the trainer's" in text
    assert ("full-weight unified FP8" in text) == ("--fp8" in mode)
    log = read_log(out)
    assert len(log) == 2
    assert all(r["differing_tokens"] == 0 and r["k3_max"] == 0.0 and r["tokens"] > 0 for r in log)
    assert all(r["sampled_under_version"] == [r["weight_version"] - 1] for r in log)
    for r in log:
        changed, total = map(int, r["sync_blocks"].split("/"))
        assert 0 < changed < total and 0 < r["sync_bytes"] < r["sync_bytes_full"], r
        assert f"({r['sync_blocks']} blocks, {r['sync_bytes'] / 1024:.1f} of " in text
    if "--lora" in mode:
        assert all(r["sync_bytes"] < r["sync_bytes_full"] / 10 for r in log)


def test_deepseek_v4_mhc_mxfp4_lora_steps_are_exact(tmp_path, capsys):
    """Rung 5 on DeepSeek-V4 with MXFP4 experts: prompts of 42 tokens, past the tiny preset's 40-token window, so
    every sampled token reads compressed rows; LoRA on the attention and inside the packed experts (separate);
    K3 == 0 on every token of every step and each sync ships the adapters alone (the codes never change)."""
    out = str(tmp_path / "v4")
    argv = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--mxfp4", "--out", out, "--no-plot"]
    assert deepseek_v4_mhc_mxfp4_rl.main(argv) == 0
    text = capsys.readouterr().out
    assert "prompts of 42 tokens, a 40-token window" in text and "MXFP4 experts" in text
    assert "served weights == the trainer's" in text
    log = read_log(out)
    assert len(log) == 2
    assert all(r["differing_tokens"] == 0 and r["k3_max"] == 0.0 and r["tokens"] > 0 for r in log)
    assert all(r["sampled_under_version"] == [r["weight_version"] - 1] for r in log)
    assert all(0 < r["sync_bytes"] < r["sync_bytes_full"] / 4 for r in log)
