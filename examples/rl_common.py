"""Small RL helpers shared by the examples: GRPO advantages, the three
objectives, an order-fixed gradient accumulator and the K3 check.

Loss normalisation is a constant (groups x group size x max new tokens, as in
Dr. GRPO), so a group's loss is known the moment the group completes: the
streaming mode can run its backward right away.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

import torch

from alignzoo.common.metrics import mismatch

OBJECTIVES = ("cispo", "ppo", "is")


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (G,) rewards of one prompt's samples -> (G,) (r - mean) / (std + eps)."""
    r = rewards.double()
    return ((r - r.mean()) / (r.std(unbiased=False) + eps)).float()


def token_objective(kind: str, lp: torch.Tensor, lp_old: torch.Tensor, adv: float, *,
                    clip_low: float = 0.2, clip_high: float = 0.28) -> torch.Tensor:
    """Per-token surrogate to *maximise* for one sequence.

    lp: (n,) trainer log-probs (with grad); lp_old: (n,) the sampler's; adv: its advantage.
    is:    ratio * A                                 (unbounded importance sampling)
    ppo:   min(ratio * A, clip(ratio, 1-el, 1+eh) * A)
    cispo: sg(min(ratio, 1+eh)) * A * lp             (clipped IS weight, REINFORCE-style gradient)
    """
    ratio = torch.exp(lp - lp_old.to(lp.device))
    if kind == "is":
        return ratio * adv
    if kind == "ppo":
        return torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)
    if kind == "cispo":
        return ratio.clamp(max=1 + clip_high).detach() * adv * lp
    raise ValueError(f"unknown objective {kind!r}; choose one of {OBJECTIVES}")


class OrderedGradSum:
    """Sums per-group gradients in group-index order, whatever order they
    arrive in: out-of-order groups wait in a buffer.  So streaming (groups
    as they complete) and one-batch (groups in index order) give the same
    bits.  Sums in fp32."""

    def __init__(self, params: Sequence[torch.Tensor], n_groups: int):
        self.params = list(params)
        self.n_groups = n_groups
        self.next = 0
        self.waiting: dict[int, list[torch.Tensor]] = {}
        self.total = [torch.zeros_like(p, dtype=torch.float32) for p in self.params]

    def add(self, index: int, grads: Sequence[torch.Tensor | None]) -> None:
        if not 0 <= index < self.n_groups or index < self.next or index in self.waiting:
            raise ValueError(f"group {index} given twice or out of range [0, {self.n_groups})")
        self.waiting[index] = [torch.zeros_like(p) if g is None else g for p, g in zip(self.params, grads)]
        while self.next in self.waiting:
            for t, g in zip(self.total, self.waiting.pop(self.next)):
                t.add_(g.float())
            self.next += 1

    def write_grads(self) -> None:
        if self.next != self.n_groups:
            raise RuntimeError(f"only {self.next} of {self.n_groups} groups were added")
        for p, t in zip(self.params, self.total):
            p.grad = t.to(p.dtype)


def check_alignment(lp_trainer: Sequence[torch.Tensor], lp_server: Sequence[torch.Tensor]) -> dict:
    """K3 stats between the trainer's and the sampler's log-probs of the same tokens."""
    a = torch.cat([t.detach().float().cpu() for t in lp_trainer])
    b = torch.cat([t.float().cpu() for t in lp_server])
    m = mismatch(a, b)
    return {"tokens": m.tokens, "differing": m.differing, "k3_mean": m.k3_mean, "k3_max": m.k3_max,
            "max_abs_dlogprob": m.max_abs_diff}



def reward_summary(rewards: Sequence[float], window: int = 5) -> str:
    """Mean reward of the first k steps against the last k, k = min(window, steps // 2): the two windows
    never share a step (a fixed "first 3" and "last 5" were the same steps in a 4-step run)."""
    n = len(rewards)
    if n < 2:
        return f"mean reward {rewards[0]:.3f} (one step)" if n else "no steps"
    k = min(window, n // 2)
    steps = "step" if k == 1 else f"{k} steps"
    first, last = sum(rewards[:k]) / k, sum(rewards[n - k:]) / k
    return f"mean reward {first:.3f} over the first {steps} -> {last:.3f} over the last {steps} (of {n})"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now (the examples' server, a weight-sync group)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def add_rl_arguments(ap, *, steps: int, groups: int, group_size: int, groups_flag: str = "--prompts") -> None:
    """The flags every RL example shares: the task, the objective and optimizer, the sampling transforms."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument(groups_flag, type=int, default=groups, help="groups per step")
    ap.add_argument("--group-size", type=int, default=group_size)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--objective", choices=OBJECTIVES, default="cispo")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--max-grad-norm", type=float, default=0.5, help="clip the global gradient norm (0: off)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=12)
    ap.add_argument("--top-p", type=float, default=0.98)
    ap.add_argument("--min-p", type=float, default=0.01)


def add_run_arguments(ap, out: str, device_help: str = "the trainer's and the server's device") -> None:
    """dtype, device, seed and the output folder."""
    ap.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    ap.add_argument("--device", default="cpu", help=device_help)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=out)


def print_step(step: int, row: dict) -> None:
    """One progress line of an example's step (its log.jsonl row); the sync's bytes where the row has them."""
    shipped = (f", {row['sync_bytes'] / 1024:.1f} of {row['sync_bytes_full'] / 1024:.1f} KiB"
               if "sync_bytes" in row else "")
    print(f"step {step:3d}  reward {row['reward']:.3f}  K3 max {row['k3_max']:.3g}  "
          f"{row['differing_tokens']}/{row['tokens']} tokens differ  sampled under "
          f"v{row['sampled_under_version']}  -> v{row['weight_version']} ({row['sync_blocks']} blocks{shipped})  "
          f"{row['seconds']:.2f}s", flush=True)


def seeded(args) -> torch.Generator:
    """torch's seed and the rollouts' generator from --seed; a CPU run on one thread unless OMP_NUM_THREADS says
    otherwise (the tiny models gain nothing from more; spinning threads cost a busy machine)."""
    if args.device == "cpu" and not os.environ.get("OMP_NUM_THREADS"):
        torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    return torch.Generator().manual_seed(args.seed)


def run_steps(pair, args, g: torch.Generator, header: str, train_step) -> list[dict]:
    """``args.steps`` steps of ``train_step(pair, opt, step, args, g) -> row`` with Adam on the trainer's trainable
    parameters, the rate decaying linearly to 10% (late large steps undo what the policy learned); each row gets
    the in-process sync's blocks and bytes and its seconds, goes to OUT/log.jsonl and is printed after ``header``."""
    opt = torch.optim.Adam([p for p in pair.trainer.parameters() if p.requires_grad], lr=args.lr, betas=(0.9, 0.99))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 - 0.9 * min(i, args.steps) / max(args.steps, 1))
    os.makedirs(args.out, exist_ok=True)
    log_path = os.path.join(args.out, "log.jsonl")
    print(f"{header} -> {log_path}", flush=True)
    log = []
    with open(log_path, "w") as f:
        for step in range(args.steps):
            t0 = time.perf_counter()
            row = train_step(pair, opt, step, args, g)
            s = pair.last_sync
            row = {"step": step, **row, "sync_blocks": f"{s.blocks_changed}/{s.blocks_total}",
                   "sync_bytes": s.bytes_shipped, "sync_bytes_full": s.bytes_full,
                   "seconds": time.perf_counter() - t0}
            sched.step()
            log.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            print_step(step, row)
    return log


def finish(log: list[dict], same: bool, code: int | None) -> int:
    """An example's last line; its exit status: 0 when no token differed, the served weights are the
    trainer's and the server stopped cleanly (``code`` None: it runs in this process)."""
    differing, tokens = sum(r["differing_tokens"] for r in log), sum(r["tokens"] for r in log)
    stopped = "" if code is None else f"; server exit status {code}"
    print(f"{reward_summary([r['reward'] for r in log])}; {differing} of {tokens} tokens differ, K3 max "
          f"{max(r['k3_max'] for r in log):.3g}; served weights {'==' if same else '!='} the trainer's{stopped}")
    return 0 if same and not code and differing == 0 else 1

