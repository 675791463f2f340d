"""Weights from the trainer to a separate rollout pool (asynchronous training, docs/async.md).

After every applied policy update the update node publishes the new weights (the policy's rank 0
puts CPU tensors in Ray's object store, tagged with their ``weights_version``) and hands the
object refs to every rollout rank, which keeps them in an inbox by version
(:mod:`workers.rollout_worker`); the transfer goes from the policy's node to each rollout node
through Ray's object store, not through the node task. A rollout node then asks for the exact
version its iteration's schedule names (:func:`rollout_weights_at`); when a restarted rollout
rank lost its inbox, the version is fetched again from the policy, which keeps the
``trainer.max_staleness + 2`` newest versions referenced.

GPUs: the same protocol; CPU state dicts through the object store is what runs today (an NCCL
collective group between the two pools is not built: docs/async.md says so).
"""

from __future__ import annotations

import time
from typing import Any

from hybridflow.config import ExperimentConfig
from tasks.common import RunContext
from tasks.versions import VersionError, weights_version


def versions_kept(cfg: ExperimentConfig) -> int:
    """How many published versions the policy and each rollout rank keep: the rollouts in flight
    (max_staleness + 1) need at most that many, plus the one being published."""
    return cfg.trainer.max_staleness + 2


def publish_weights(run: RunContext, policy: Any, version: int) -> dict[str, float]:
    """Publish the policy's weights (``version`` = its weights_version now) to every rollout rank.
    Returns ``timing_s/weight_sync`` (seconds, publish + transfer + store) and
    ``perf/weight_sync_bytes``. Raises VersionError when the policy is not at ``version``."""
    from tasks.pools import pool_of

    start = time.perf_counter()
    keep = versions_kept(run.cfg())
    published = policy.publish_weights(keep=keep)
    if published["version"] != version:
        raise VersionError(f"policy published weights_version {published['version']}, expected {version}")
    rollout = pool_of(run, "rollout")
    rollout.receive_weights(published["refs"], version=version, keep=keep)
    return {"timing_s/weight_sync": time.perf_counter() - start,
            "perf/weight_sync_bytes": float(published["bytes"])}


def rollout_weights_at(run: RunContext, rollout: Any, version: int) -> None:
    """Make every rollout rank generate with the weights of ``version``: from its inbox, or (a rank
    that restarted and lost it) fetched again from the policy. Raises VersionError naming the
    version when neither holds it (resume the run from its checkpoint)."""
    from tasks.pools import pool_of

    versions = rollout.get_weights_version()
    if set(versions) == {version}:
        return
    if not all(version in held for held in rollout.inbox_versions()):
        published = pool_of(run, "policy").published_weights(version)
        if published is None:
            raise VersionError(
                f"rollout pool needs policy weights_version {version}: its ranks are at {sorted(set(versions))} "
                f"and the policy keeps only the {versions_kept(run.cfg())} newest versions; resume the run "
                "from its latest checkpoint")
        rollout.receive_weights(published["refs"], version=version, keep=versions_kept(run.cfg()))
    rollout.use_weights(version)
    if weights_version(rollout) != version:
        raise VersionError(f"rollout pool did not load weights_version {version}")


__all__ = ["publish_weights", "rollout_weights_at", "versions_kept"]
