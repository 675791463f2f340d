"""judge node: a frozen generative model scores each trajectory by a rubric (``reward.judge``)."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="judge", retries=2, roles=("judge",))
def judge(run: RunContext, rollout: Batch) -> Batch:
    """Returns per-row ``judge_score`` ([0, 1], None when the verdict did not parse or the judge prompt
    was over the judge's context), ``judge_failure`` and ``judge_verdict``, for the reward node to
    combine; the judge's throughput and failure counts are its metrics."""
    out = pool_of(run, "judge").judge_responses(rollout, seed=run.node_seed("judge"))
    return out.select([k for k in out.keys() if k not in rollout or k == "uid"])
