"""Our concepts → the metric names they are logged under (verl's).

Why a table: metrics keep verl's names, so a dashboard, a verl run and our benchmarks read the
same curves — but verl's names use verl's words. Its ``timing_s/step`` is the wall time of one
RL *iteration* (here a *step* is one optimizer step, ``Optimization.steps_applied``), its
``gen`` is our *rollout*, its ``actor`` our *policy*. Code names things by our concept and looks
the metric name up here, so the translation lives in one place.

Pure python: no torch, no prefect.
"""

from __future__ import annotations

METRIC_NAMES: dict[str, str] = {
    # wall time, seconds
    "iteration_time_s": "timing_s/step",  # one RL iteration, from its start to its metrics
    "iteration_wall_s": "timing_s/iteration_wall",  # ours (no verl name): the iteration flow's wall clock
    "rollout_time_s": "timing_s/gen",
    "reward_time_s": "timing_s/reward",
    "reference_time_s": "timing_s/ref",
    "values_time_s": "timing_s/values",
    "advantage_time_s": "timing_s/adv",
    "update_policy_time_s": "timing_s/update_actor",
    "update_critic_time_s": "timing_s/update_critic",
    "validate_time_s": "timing_s/testing",
    "checkpoint_time_s": "timing_s/save_checkpoint",
    # the policy's update (verl: the actor)
    "policy_update_skipped": "actor/update_skipped",
    "policy_weights_version": "actor/weights_version",
    "policy_kl_coef": "actor/kl_coef",
    # off-policy correction (actor.rollout_correction; verl's rollout_corr names): the weight
    # π_old/π_rollout over the update's valid tokens before truncation or cap, and the share truncated/capped
    "importance_weight_mean": "rollout_corr/rollout_is_mean",
    "importance_weight_max": "rollout_corr/rollout_is_max",
    "importance_weight_clipped_fraction": "rollout_corr/rollout_is_ratio_fraction_high",
    # asynchronous training (trainer.max_staleness, docs/async.md): named in the issue, no verl name
    "weight_sync_time_s": "timing_s/weight_sync",  # publishing the new weights to the rollout pool
    "staleness_mean": "rollout/staleness/mean",  # policy_version − rollout_version when trained on
    "staleness_max": "rollout/staleness/max",
    "rollout_weights_version": "rollout/weights_version",
    # rollout.compile (workers/rollout/compiled.py): no verl name; cumulative over the engine's life (its pool)
    "rollout_compile_time_s": "rollout/compile_s",  # first-call seconds of every decode-step shape compiled so far
    "rollout_compiled_shapes": "rollout/compiled_shapes",
    # rollout.fused_decode (workers/rollout/fused_decode.py): 1 when every rank's last call ran fused
    "rollout_fused_decode": "rollout/fused_decode",
    "dropped_stale": "rollout/dropped_stale",  # trajectories older than the bound, dropped
    "regenerated_stale": "rollout/regenerated_stale",  # trajectories older than the bound, generated again
    "overlap_s": "async/overlap_s",  # seconds the rollout pool generated while the trainer's nodes ran
    "overlap_fraction": "async/overlap_fraction",  # that, as a share of the iteration's wall time
    # the advantage node: the score of each sequence, the KL coefficient of the next iteration
    "sequence_score": "critic/score",
    "kl_coef_next": "critic/kl_coef_next",
}

# Built-in node name → the concept of its wall time (a user's node is timed under its own name).
NODE_TIME = {
    "rollout": "rollout_time_s",
    "reward": "reward_time_s",
    "reference": "reference_time_s",
    "values": "values_time_s",
    "advantage": "advantage_time_s",
    "update_policy": "update_policy_time_s",
    "update_critic": "update_critic_time_s",
    "publish_weights": "weight_sync_time_s",  # the node's wall time is the publish's, as before it was a node
    "validate": "validate_time_s",
    "checkpoint": "checkpoint_time_s",
}


def node_time_metric(node: str) -> str:
    """The metric a node's wall time is logged under: ``"rollout"`` → ``"timing_s/gen"``; a node
    not in :data:`NODE_TIME` → ``"timing_s/<node>"``."""
    return METRIC_NAMES[NODE_TIME[node]] if node in NODE_TIME else f"timing_s/{node}"


__all__ = ["METRIC_NAMES", "NODE_TIME", "node_time_metric"]
