"""values node: the critic's value of every response position."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="values", retries=2)
def values(run: RunContext, rollout: Batch, critic_version: int | None = None) -> Batch:
    """Returns values [batch, response_len] float32. critic_version: as rollout's policy_version."""
    from tasks.update import sync_to_version

    critic = pool_of(run, "critic")
    sync_to_version(run, "critic", critic, critic_version)
    out = critic.call("critic", "compute_values", rollout)
    return out.select(["uid", "values"])
