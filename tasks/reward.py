"""reward node: score each trajectory (rule rewards by data_source, or a custom function)."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="reward", retries=2, roles=("reward",))
def reward(run: RunContext, rollout: Batch) -> Batch:
    """Returns token_level_scores [batch, response_len] (score on the last response token) and
    per-row score fields; failures of user reward code are scored reward.on_error and counted."""
    out = pool_of(run, "reward").compute_rewards(rollout)
    new_keys = [k for k in out.keys() if k not in rollout or k == "uid"]
    return out.select(new_keys)
