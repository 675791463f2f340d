"""validate node: greedy (by default) generation on held-out prompts, scored by the reward pool."""

from __future__ import annotations

from collections import defaultdict

from prefect import get_run_logger

from hybridflow.batch import Batch
from tasks.common import RunContext, forward_logs, take_report
from tasks.node import node
from tasks.pools import pool_of


def _validation_metrics(scored: Batch, k: int) -> dict[str, float]:
    """val-core/<data_source>/acc/mean@k (and pass@k when k > 1), per data source."""
    acc_key = "acc" if "acc" in scored else "score"
    per_source: dict[str, list[list[float]]] = defaultdict(list)
    groups: dict[str, list[float]] = defaultdict(list)
    for uid, src, a in zip(scored["uid"], scored["data_source"], scored[acc_key], strict=True):
        groups[(src, uid)].append(float(a))
    for (src, _uid), vals in groups.items():
        per_source[src].append(vals)
    out: dict[str, float] = {}
    for src, rows in per_source.items():
        out[f"val-core/{src}/acc/mean@{k}"] = sum(sum(r) / len(r) for r in rows) / len(rows)
        if k > 1:
            out[f"val-core/{src}/acc/pass@{k}"] = sum(float(max(r) > 0) for r in rows) / len(rows)
    return out


#: generation metrics of multi-turn rollouts reported for validation too (as val-aux/tool/calls/mean, ...)
MULTI_TURN_PREFIXES = ("tool/", "multi_turn/", "env/")


@node(name="validate", retries=1, roles=("policy", "reward", "judge"))
def validate(run: RunContext, val_prompts: Batch, policy_version: int | None = None) -> tuple[Batch, dict]:
    """Returns the scored validation generations, val-core metrics, (multi-turn) the tool metrics
    as val-aux/tool/..., val-aux/multi_turn/... and (reward.judge) the judge's as val-aux/judge/...,
    val-aux/judge_unparsed, val-aux/judge_rule_agreement.... policy_version: the
    weights_version to evaluate (a restarted worker is brought to it first)."""
    cfg = run.cfg()
    policy = pool_of(run, "policy", at_version=policy_version)
    generated = policy.generate_sequences(val_prompts, seed=run.node_seed("validate"), validate=True)
    gen_report, _ = take_report(generated)  # the training rollout's names: only the multi-turn ones are kept
    agents = {f"val-aux/{k}": v for k, v in gen_report.items() if k.startswith(MULTI_TURN_PREFIXES)}
    judge_report: dict[str, float] = {}
    if cfg.reward.judge.enable:  # scored as in training: the judge's verdicts combined by the reward worker
        generated = pool_of(run, "judge").judge_responses(generated, seed=run.node_seed("validate/judge"))
        judge_report, judge_logs = take_report(generated)
        forward_logs(get_run_logger(), "validate", judge_logs)
    scored = pool_of(run, "reward").compute_rewards(generated)
    report, logs = take_report(scored)
    forward_logs(get_run_logger(), "validate", logs)
    judged = {**judge_report, **{k: v for k, v in report.items() if k.startswith("reward/judge_")}}
    judge_metrics = {f"val-aux/{k.removeprefix('reward/')}": v for k, v in judged.items()}  # val-aux/judge_unparsed
    metrics = {**report, **agents, **judge_metrics, **_validation_metrics(scored, cfg.rollout.val_samples_per_prompt)}
    return scored, {k.replace("critic/", "val-aux/", 1): v for k, v in metrics.items()}
