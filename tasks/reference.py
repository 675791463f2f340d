"""reference node: log-probs of the frozen initial policy (for KL in reward or KL loss)."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="reference", retries=2, roles=("reference",))
def reference(run: RunContext, rollout: Batch) -> Batch:
    """Returns ref_log_probs [batch, response_len] float32 (nats)."""
    out = pool_of(run, "reference").compute_ref_log_probs(rollout)
    return out.select(["uid", "ref_log_probs"])
