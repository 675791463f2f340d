"""rollout node: generate n responses per prompt and recompute old_log_probs on the same weights."""

from __future__ import annotations

from hybridflow.batch import Batch
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="rollout", retries=2)
def rollout(run: RunContext, prompts: Batch, policy_version: int | None = None) -> tuple[Batch, dict]:
    """prompts: one row per prompt (prompt_ids, prompt_mask, uid, ...). Returns the trajectories
    (n rows per prompt) with response_ids/mask, rollout_log_probs and old_log_probs.
    policy_version: the weights_version this iteration generates with; a policy worker that
    restarted from an older checkpoint is first brought to it by replaying the update ledger."""
    from tasks.update import sync_to_version

    policy = pool_of(run, "policy")
    sync_to_version(run, "policy", policy, policy_version)
    batch = policy.call("policy", "generate_sequences", prompts, seed=run.node_seed("rollout"))
    gen_metrics = batch.meta.pop("metrics", {})
    batch = policy.call("policy", "compute_log_probs", batch)
    return batch, {**gen_metrics, **batch.meta.pop("metrics", {})}
