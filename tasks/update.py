"""update_policy / update_critic nodes: exactly-once updates of a trained role's weights.

Not cached; Prefect retries them (a worker that died mid-update is restarted by Ray), which is
safe: each retry goes through the version check of :mod:`tasks.versions` — at the expected
version the update is applied, one version past it with the same batch the recorded metrics come
back, and nothing is ever applied twice. With a rollout pool, the ``publish_weights`` node
(:mod:`tasks.weight_sync`) sends the new weights on.
"""

from __future__ import annotations

from prefect import get_run_logger

from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of
from tasks.types import NodeResult, UpdateResult
from tasks.versions import apply_update


def _run_update(run: RunContext, role: str, advantage: NodeResult, expected_version: int) -> UpdateResult:
    if advantage.ref is None:
        raise ValueError(f"update_{role}: the advantage node returned no batch")
    handle = pool_of(run, role)
    result = apply_update(run, role, handle, advantage.ref, expected_version)
    get_run_logger().info("%s update at version %d%s: %s", role, expected_version,
                          "" if result.applied else " (skipped: NaN/inf)",
                          ", ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())[:10]))
    return result


@node(name="update_critic", cache=False, retries=2, roles=("critic",))
def update_critic(run: RunContext, advantage: NodeResult, critic_version: int) -> UpdateResult:
    """Value-model update on the training batch (needs values, returns)."""
    return _run_update(run, "critic", advantage, critic_version)


@node(name="update_policy", cache=False, retries=2, roles=("policy",))
def update_policy(run: RunContext, advantage: NodeResult, policy_version: int) -> UpdateResult:
    """Policy update on the training batch (needs old_log_probs, advantages, response_mask)."""
    return _run_update(run, "policy", advantage, policy_version)
