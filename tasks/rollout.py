"""rollout node: generate n responses per prompt; old_log_probs are recomputed on the same weights,
or taken from the engine's rollout_log_probs (``actor.old_log_probs``)."""

from __future__ import annotations

from hybridflow.batch import Batch, BatchError
from tasks.common import RunContext
from tasks.node import node
from tasks.pools import pool_of


@node(name="rollout", retries=2, roles=("policy",))
def rollout(run: RunContext, prompts: Batch, policy_version: int | None = None) -> Batch:
    """prompts: one row per prompt (prompt_ids, prompt_mask, uid, ...). Returns the trajectories
    (n rows per prompt) with response_ids/mask, rollout_log_probs and old_log_probs.
    policy_version: the weights_version this iteration generates with; a policy worker that
    restarted from an older checkpoint is first brought to it by replaying the update ledger."""
    policy = pool_of(run, "policy", at_version=policy_version)
    trajectories = policy.generate_sequences(prompts, seed=run.node_seed("rollout"))
    if run.cfg().old_log_probs_from_rollout:
        return policy_log_probs_from_rollout(trajectories)
    return policy.compute_log_probs(trajectories)  # its report keeps the generation's metrics


def policy_log_probs_from_rollout(batch: Batch) -> Batch:
    """old_log_probs := rollout_log_probs [B, R] float32, zero outside response_mask (the policy
    update then measures the rollout-vs-trainer gap on its first mini-batch). Raises BatchError
    when the engine gave no rollout_log_probs."""
    if "rollout_log_probs" not in batch:
        raise BatchError("actor.old_log_probs='rollout' but the rollout engine returned no rollout_log_probs; "
                         "set actor.old_log_probs=recompute")
    out = batch.shallow_copy()
    out.set("old_log_probs", batch["rollout_log_probs"].float().masked_fill(~batch["response_mask"], 0.0))
    return out
