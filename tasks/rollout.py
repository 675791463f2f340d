"""rollout node: generate n responses per prompt and recompute old_log_probs on the same weights."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="rollout", retries=2)
def rollout(run: RunContext, prompts: Batch) -> tuple[Batch, dict]:
    """prompts: one row per prompt (prompt_ids, prompt_mask, uid, ...). Returns the trajectories
    (n rows per prompt) with response_ids/mask, rollout_log_probs and old_log_probs."""
    policy = pool_of(run, "policy")
    batch = policy.call("policy", "generate_sequences", prompts, seed=run.node_seed("rollout"))
    gen_metrics = batch.meta.pop("metrics", {})
    batch = policy.call("policy", "compute_log_probs", batch)
    return batch, {**gen_metrics, **batch.meta.pop("metrics", {})}
