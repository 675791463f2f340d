"""values node: the critic's value of every response position."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="values", retries=2)
def values(run: RunContext, rollout: Batch) -> Batch:
    """Returns values [batch, response_len] float32."""
    out = pool_of(run, "critic").call("critic", "compute_values", rollout)
    return out.select(["uid", "values"])
