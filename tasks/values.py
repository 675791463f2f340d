"""values node: the critic's value of every response position."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="values", retries=2, roles=("critic",))
def values(run: RunContext, rollout: Batch, critic_version: int | None = None) -> Batch:
    """Returns values [batch, response_len] float32. critic_version: as rollout's policy_version."""
    out = pool_of(run, "critic", at_version=critic_version).compute_values(rollout)
    return out.select(["uid", "values"])
