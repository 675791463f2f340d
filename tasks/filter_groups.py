"""filter_groups node: DAPO dynamic sampling — drop groups whose rewards are all equal
(zero advantage, no learning signal). Yu et al. 2025, "DAPO", §3.2."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node


@node(name="filter_groups")
def filter_groups(run: RunContext, rollout: Batch, reward: Batch) -> tuple[Batch, dict]:
    """Returns rollout ∪ reward restricted to groups with reward variance. If every group is
    zero-variance the batch is kept whole (and reported), never emptied. The built-in dataflow
    wires the advantage node's ``rollout`` and ``reward`` to it (``flows.iteration``)."""
    from hybridflow.algorithms.pipeline import filter_zero_variance_groups

    joined = rollout.union(reward)
    kept, dropped = filter_zero_variance_groups(joined)
    n_groups = len(joined.groups())
    metrics = {"filter_groups/dropped_groups": float(dropped), "filter_groups/kept_groups": float(n_groups - dropped)}
    if len(kept) == 0:
        metrics["filter_groups/all_zero_variance"] = 1.0
        return joined, metrics
    return kept, metrics
