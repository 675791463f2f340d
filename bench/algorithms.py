"""Micro-benchmark: hybridflow.algorithms against plain torch doing the same arithmetic.

    python bench/algorithms.py [--batch 4096] [--width 2048] [--repeats 5] [--threads N]

Times one call (median of ``--repeats`` after one warm-up) on [batch, width] float32 tensors
(right-padded responses of random lengths, groups of 8 samples), writes
bench/results/algorithms.json and prints a markdown table. The baselines are the shortest
plain-torch versions of the same maths (verl-style: float masks, contiguous groups, no input
checks, no masked-NaN safety); they exist to show what the library's safety costs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hybridflow.algorithms as A  # noqa: E402

GROUP = 8


def timed(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def make_inputs(batch: int, width: int, seed: int = 0) -> dict[str, torch.Tensor | list]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (batch,), generator=g)
    mask = torch.arange(width) < lengths.unsqueeze(-1)
    rewards = torch.zeros(batch, width)
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    return {
        "mask": mask,
        "rewards": rewards,
        "values": torch.randn(batch, width, generator=g),
        "log_probs": torch.randn(batch, width, generator=g) * 0.1 - 1.0,
        "old_log_probs": torch.randn(batch, width, generator=g) * 0.1 - 1.0,
        "advantages": torch.randn(batch, width, generator=g),
        "uid": [i // GROUP for i in range(batch)],
    }


# ---- plain-torch baselines -------------------------------------------------------------------


def plain_grpo(rewards, mask_f):
    scores = (rewards * mask_f).sum(-1).view(-1, GROUP)
    adv = (scores - scores.mean(-1, keepdim=True)) / (scores.std(-1, keepdim=True) + 1e-6)
    return adv.view(-1, 1) * mask_f


def plain_gae(rewards, values, mask_f, gamma=1.0, lam=0.95):
    next_v = 0.0
    last = 0.0
    out = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_v - values[:, t]
        cand = delta + gamma * lam * last
        next_v = values[:, t] * mask_f[:, t] + (1 - mask_f[:, t]) * next_v
        last = cand * mask_f[:, t] + (1 - mask_f[:, t]) * last
        out.append(last)
    adv = torch.stack(out[::-1], 1)
    returns = adv + values
    mean = (adv * mask_f).sum() / mask_f.sum()
    var = (((adv - mean) ** 2) * mask_f).sum() / (mask_f.sum() - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


def plain_ppo(log_probs, old_log_probs, advantages, mask_f, eps=0.2, c=3.0):
    ratio = torch.exp(torch.clamp(log_probs - old_log_probs, -20, 20))
    l1 = -advantages * ratio
    l2 = -advantages * torch.clamp(ratio, 1 - eps, 1 + eps)
    clipped = torch.maximum(l1, l2)
    dual = torch.minimum(clipped, -advantages * c)
    loss_mat = torch.where(advantages < 0, dual, clipped)
    return (loss_mat * mask_f).sum() / mask_f.sum()


# ---- cases -------------------------------------------------------------------------------------


def cases(x: dict) -> list[tuple[str, Callable[[], object], Callable[[], object]]]:
    mask, mask_f = x["mask"], x["mask"].float()
    grpo, gae = A.get_advantage_estimator("grpo"), A.get_advantage_estimator("gae")
    ppo = A.get_policy_loss("ppo")

    def ours_ppo():
        lp = x["log_probs"].clone().requires_grad_()
        loss, _ = ppo(lp, x["old_log_probs"], x["advantages"], mask)
        loss.backward()

    def plain_ppo_step():
        lp = x["log_probs"].clone().requires_grad_()
        plain_ppo(lp, x["old_log_probs"], x["advantages"], mask_f).backward()

    return [
        ("grpo advantage", lambda: grpo(x["rewards"], mask, uid=x["uid"]), lambda: plain_grpo(x["rewards"], mask_f)),
        (
            "gae advantage (γ=1, λ=0.95)",
            lambda: gae(x["rewards"], mask, values=x["values"], gamma=1.0, lam=0.95),
            lambda: plain_gae(x["rewards"], x["values"], mask_f),
        ),
        ("ppo loss forward+backward", ours_ppo, plain_ppo_step),
        (
            "aggregate_loss token-mean",
            lambda: A.aggregate_loss(x["advantages"], mask, "token-mean"),
            lambda: (x["advantages"] * mask_f).sum() / mask_f.sum(),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results" / "algorithms.json"))
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    x = make_inputs(args.batch, args.width)
    rows = []
    for name, ours, plain in cases(x):
        t_ours, t_plain = timed(ours, args.repeats), timed(plain, args.repeats)
        rows.append({"case": name, "ours_ms": 1e3 * t_ours, "plain_torch_ms": 1e3 * t_plain, "ratio": t_ours / t_plain})
    result = {
        "shape": [args.batch, args.width],
        "repeats": args.repeats,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_avg_1m": os.getloadavg()[0],
        "rows": rows,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"shape {args.batch}×{args.width} float32, torch {torch.__version__}, {result['threads']} threads, "
          f"median of {args.repeats}, load avg {result['load_avg_1m']:.1f}\n")
    print("| case | hybridflow (ms) | plain torch (ms) | ratio |\n|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['ours_ms']:.1f} | {r['plain_torch_ms']:.1f} | {r['ratio']:.2f} |")
    print(f"\nwritten to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
