"""rollout node: generate n responses per prompt; old_log_probs are recomputed on the same weights,
or taken from the engine's rollout_log_probs (``actor.old_log_probs``).

With a separate rollout pool (asynchronous training, ``trainer.max_staleness``) the train flow's
``generate_ahead`` task generates each iteration's rollout there, ahead of the iteration, with
the weights version the schedule names (:mod:`flows.rollout_ahead`) and returns a
:class:`~tasks.types.RolloutResult`; the ``old_log_probs`` node then computes the trainer's
(proximal) log-probs on the policy pool at the version the update starts from. Its output is the
iteration's ``rollout`` (``iter_<k>/rollout``, the ``rollout`` cache key, ``timing_s`` and
execution-log name), as when the rollout node itself ran ahead."""

from __future__ import annotations

import dataclasses
import functools
import time

from hybridflow.batch import Batch, BatchError
from tasks.common import RunContext, node_cache_key
from tasks.node import Node, node
from tasks.pools import pool_of
from tasks.types import RolloutResult


@node(name="rollout", retries=2, roles=("policy",))
def rollout(run: RunContext, prompts: Batch, policy_version: int | None = None) -> Batch:
    """prompts: one row per prompt (prompt_ids, prompt_mask, uid, ...). Returns the trajectories
    (n rows per prompt) with response_ids/mask, rollout_log_probs and old_log_probs.
    policy_version: the weights_version this iteration generates with; a policy worker that
    restarted from an older checkpoint is first brought to it by replaying the update ledger.
    (A separate rollout pool generates in :data:`generate_ahead` instead.)"""
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


def rollout_on_pool(run: RunContext, prompts: Batch, version: int) -> tuple[Batch, RolloutResult]:
    """Generate on the rollout pool with the policy weights of ``version`` (published by the update
    nodes, :func:`tasks.weight_sync.rollout_weights_at`). Every trajectory carries
    ``rollout_version`` = ``version``; old_log_probs are left to the ``old_log_probs`` node."""
    from tasks.weight_sync import rollout_weights_at

    engine = pool_of(run, "rollout")
    rollout_weights_at(run, engine, version)
    trajectories = engine.generate_sequences(prompts, seed=run.node_seed("rollout"))
    finished = time.time()
    generating_s = trajectories.meta.get("metrics", {}).get("timing_s/gen", 0.0)  # the engine's own time
    return trajectories, RolloutResult(node="rollout", rollout_version=version, started_at=finished - generating_s,
                                       finished_at=finished)


@node(name="rollout", retries=2, roles=("rollout",))
def _rollout_ahead(run: RunContext, prompts: Batch, policy_version: int | None = None) -> tuple[Batch, RolloutResult]:
    """The body of :data:`generate_ahead`: :func:`rollout_on_pool` at ``policy_version``."""
    return rollout_on_pool(run, prompts, policy_version or 0)


def driver_rollout_task(rollout_node: Node, name: str) -> Node:
    """``rollout_node`` as a task the train flow submits itself (``generate_ahead``, the stream's
    ``take_groups``): its own Prefect name (the UI shows ``<name>-000007``), the ``rollout`` node's
    cache key, files and metrics."""
    task = rollout_node.task.with_options(name=name, task_run_name=name + "-{run.iteration:06d}",
                                          cache_key_fn=functools.partial(node_cache_key, node="rollout"))
    return dataclasses.replace(rollout_node, name=name, task=task)


generate_ahead = driver_rollout_task(_rollout_ahead, "generate_ahead")  # (prompts, policy_version) -> RolloutResult, on the rollout pool


@node(name="old_log_probs", retries=2, roles=("policy",))
def old_log_probs(run: RunContext, rollout: Batch, policy_version: int | None = None) -> Batch:
    """The trainer's log-probs of a rollout generated on the rollout pool: ``old_log_probs`` [B, R]
    float32 on the policy weights of ``policy_version`` (the proximal policy of the update that
    follows; rollout_log_probs stay the behaviour policy's). ``actor.old_log_probs=rollout``:
    the behaviour log-probs are used as they are."""
    if run.cfg().old_log_probs_from_rollout:
        return policy_log_probs_from_rollout(rollout)
    return pool_of(run, "policy", at_version=policy_version).compute_log_probs(rollout)
