"""The metrics of multi-turn rollouts (:mod:`workers.rollout.multi_turn`): ``multi_turn/*``,
``tool/*``, ``env/*`` over a rollout's trajectories, and their join over prompt groups computed
apart (the streaming rollout, :mod:`workers.group_stream`)."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from workers.rollout.multi_turn import Trajectory


def multi_turn_metrics(trajs: list[Trajectory], tool_names: list[str] = (), reduce: bool = True) -> dict[str, float]:
    """multi_turn/num_turns/{mean,max}, multi_turn/finish/<reason> (fractions), tool/calls/mean,
    tool/<name>/calls (for ``tool_names``), tool/errors, tool/timeouts, tool/parse_errors, tool/truncated (counts),
    env/errors, response_length/observation_tokens/mean, env/invalid_moves/mean and env/win_rate (over the
    trajectories whose environment reported ``invalid_moves`` / ``won`` in a step's info; absent when
    none did), sandbox/walls (1/0: whether the ``python``
    tool's sandbox has its walls here; only with that tool) — over the trajectories of every rank
    (summed / maxed across a data-parallel group, like the policy's other generation metrics), or
    with ``reduce`` False over ``trajs`` alone (no collective)."""
    from workers import distributed as D

    reasons = ("stop", "length", "max_turns", "env_done", "env_error")
    calls: Counter[str] = Counter()
    for t in trajs:
        calls.update(t.tool_calls)
    local = [float(len(trajs)), sum(t.turns for t in trajs), sum(calls.values()), sum(t.tool_errors for t in trajs),
             sum(t.tool_timeouts for t in trajs), sum(t.parse_errors for t in trajs),
             sum(t.observation_tokens for t in trajs), *(sum(t.finish == r for t in trajs) for r in reasons),
             *(calls[name] for name in tool_names),
             sum(t.invalid_moves or 0 for t in trajs), sum(t.invalid_moves is not None for t in trajs),
             sum(t.won or 0.0 for t in trajs), sum(t.won is not None for t in trajs),
             sum(t.truncated for t in trajs)]  # fmt: skip
    top_local = torch.tensor([max((t.turns for t in trajs), default=0)], dtype=torch.float64)
    if reduce:
        sums = D.all_reduce_sum(torch.tensor(local, dtype=torch.float64)).tolist()
        top = float(D.all_reduce_max(top_local)[0])
    else:
        sums, top = [float(x) for x in local], float(top_local[0])
    n = max(sums[0], 1.0)
    out = {
        "multi_turn/num_turns/mean": sums[1] / n,
        "multi_turn/num_turns/max": top,
        "tool/calls/mean": sums[2] / n,
        "tool/errors": sums[3],
        "tool/timeouts": sums[4],
        "tool/parse_errors": sums[5],
        "tool/truncated": sums[-1],
        "response_length/observation_tokens/mean": sums[6] / n,
        "env/errors": sums[7 + reasons.index("env_error")],
    }
    for i, reason in enumerate(reasons):
        out[f"multi_turn/finish/{reason}"] = sums[7 + i] / n
    for i, name in enumerate(tool_names):
        out[f"tool/{name}/calls"] = sums[7 + len(reasons) + i]
    invalid, reporting_invalid, won, reporting_won = sums[-5:-1]
    if reporting_invalid:
        out["env/invalid_moves/mean"] = invalid / reporting_invalid
    if reporting_won:
        out["env/win_rate"] = won / reporting_won
    if "python" in tool_names:
        from hybridflow.rewards.sandbox import walls_check

        out["sandbox/walls"] = float(walls_check().available)
    return out

def merge_prompt_metrics(per_prompt: list[dict[str, float]]) -> dict[str, float]:
    """Join :func:`multi_turn_metrics` computed per prompt group (each over the same number of
    trajectories, ``samples_per_prompt``): means and fractions are averaged over the groups (exact,
    the groups being equal in size), ``.../max`` and ``sandbox/walls`` maxed, counts summed;
    ``env/win_rate`` and ``env/invalid_moves/mean`` are averaged over the groups that report them
    (exact when every trajectory of a reporting group reports). Empty input: {}."""
    keys = sorted({k for m in per_prompt for k in m})
    out: dict[str, float] = {}
    for key in keys:
        vals = [m[key] for m in per_prompt if key in m]
        if key.endswith("/max") or key == "sandbox/walls":
            out[key] = max(vals)
        elif key.endswith("/mean") or key.startswith("multi_turn/finish/") or key == "env/win_rate":
            out[key] = sum(vals) / len(vals)
        else:  # tool/errors, tool/timeouts, tool/parse_errors, tool/truncated, env/errors, tool/<name>/calls
            out[key] = sum(vals)
    return out


__all__ = ["multi_turn_metrics", "merge_prompt_metrics"]
