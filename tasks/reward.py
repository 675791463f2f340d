"""reward node: score each trajectory (rule rewards by data_source, or a custom function)."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of
from tasks.types import RewardResult


@node(name="reward", retries=2, roles=("reward",))
def reward(run: RunContext, rollout: Batch, judge: Batch | None = None) -> tuple[Batch, RewardResult]:
    """Returns token_level_scores [batch, response_len] (score on the last response token) and
    per-row score fields; failures of user reward code are scored reward.on_error and counted in
    the result's ``failed_rows`` / ``last_error`` (the run's stop decision) and the reward/* metrics.
    ``judge``: the judge node's scores (``reward.judge``), combined with the others by the reward
    worker; its unparsed rows are not reward failures."""
    scored_rows = rollout if judge is None else rollout.union(judge)
    out = pool_of(run, "reward").compute_rewards(scored_rows)
    new_keys = [k for k in out.keys() if k not in scored_rows or k == "uid"]
    return out.select(new_keys), reward_result(out)


def reward_result(scored: Batch) -> RewardResult:
    """The reward node's decision fields from a scored batch's ``reward_failure`` (None | kind per
    row) and ``reward_error`` (None | one line per row) non-tensors; a batch without them failed nowhere."""
    failures = scored.non_tensors.get("reward_failure") or []
    errors = [e for e in scored.non_tensors.get("reward_error") or [] if e]
    return RewardResult(node="reward", failed_rows=sum(f is not None for f in failures),
                        last_error=errors[-1] if errors else None)
