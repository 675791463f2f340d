"""Weights from the trainer to a separate rollout pool (asynchronous training, docs/async.md).

After every applied policy update the update node publishes the new weights (the policy's rank 0
puts CPU tensors in Ray's object store, tagged with their ``weights_version``) and hands the
object refs to every rollout rank, which keeps them in an inbox by version
(:mod:`workers.rollout_worker`); the transfer goes from the policy's node to each rollout node
through Ray's object store, not through the node task. A rollout node then asks for the exact
version its iteration's schedule names (:func:`rollout_weights_at`); when a restarted rollout
rank lost its inbox, the version is fetched again from the policy, which keeps the
``trainer.max_staleness + 2`` newest versions referenced.

``trainer.weight_sync: collective`` (``auto`` on GPUs) sends them instead by a torch.distributed
broadcast from the policy's rank 0 to the rollout ranks (:mod:`workers.weight_group`: NCCL on
GPUs, Gloo on CPU), formed on the first publish and formed again when a member restarted
(its epoch differs). A broadcast that fails falls back to the object store for that version.
"""

from __future__ import annotations

import time
from typing import Any

from hybridflow.config import ExperimentConfig
from hybridflow.metric_names import METRIC_NAMES
from tasks.common import RunContext
from tasks.versions import VersionError, weights_version


def versions_kept(cfg: ExperimentConfig) -> int:
    """How many published versions the policy and each rollout rank keep: the rollouts in flight
    (max_staleness + 1) need at most that many, plus the one being published."""
    return cfg.trainer.max_staleness + 2


def publish_weights(run: RunContext, policy: Any, version: int) -> dict[str, float]:
    """Publish the policy's weights (``version`` = its weights_version now) to every rollout rank,
    by ``trainer.weight_sync``. Returns ``timing_s/weight_sync`` (seconds, publish + transfer +
    store), ``perf/weight_sync_bytes`` and ``perf/weight_sync_collective`` (1: broadcast, 0: object
    store). Raises VersionError when the policy is not at ``version``."""
    from tasks.pools import pool_of

    start = time.perf_counter()
    rollout = pool_of(run, "rollout")
    sent, collective = None, run.cfg().weight_sync_mode == "collective"
    if collective:
        try:
            sent = _broadcast(run, policy, rollout, version)
        except Exception as e:  # noqa: BLE001 - a broken group: this version goes through the object store
            _warn(f"weight-sync broadcast of v{version} failed ({type(e).__name__}: {e}); "
                  "sending it through Ray's object store")
            policy.leave_weight_group()  # the next publish forms the group anew
            collective = False
    if sent is None:
        sent = _through_object_store(run, policy, rollout, version)
    return {METRIC_NAMES["weight_sync_time_s"]: time.perf_counter() - start, "perf/weight_sync_bytes": float(sent),
            "perf/weight_sync_collective": float(collective)}


def _through_object_store(run: RunContext, policy: Any, rollout: Any, version: int) -> int:
    keep = versions_kept(run.cfg())
    published = policy.publish_weights(keep=keep)
    if published["version"] != version:
        raise VersionError(f"policy published weights_version {published['version']}, expected {version}")
    rollout.receive_weights(published["refs"], version=version, keep=keep)
    return published["bytes"]


def _both(policy: Any, rollout: Any, method: str, args: tuple, kwargs: dict, timeout_s: float) -> list[Any]:
    """``method`` on the policy's rank 0 and every rollout rank at once (a collective needs them all)."""
    import ray

    refs = [policy.pool.actors[0].call.remote("policy", method, *args, **kwargs)]
    refs += [a.call.remote("rollout", method, *args, **kwargs) for a in rollout.pool.actors]
    return ray.get(refs, timeout=timeout_s)


def _broadcast(run: RunContext, policy: Any, rollout: Any, version: int) -> int:
    import ray

    from workers.weight_group import GROUP_TIMEOUT_S

    epochs = [policy.weight_group_epoch(), *rollout.weight_group_epoch()]
    if None in epochs or len(set(epochs)) != 1:  # first publish, or a member restarted: form it (again)
        # the store listens on the policy rank 0's node (the pool's own rendezvous helper)
        host, port = ray.get(policy.pool.actors[0].free_address.remote(), timeout=GROUP_TIMEOUT_S)
        epoch = max((e for e in epochs if e is not None), default=0) + 1
        _both(policy, rollout, "init_weight_group", (host, port, rollout.pool.world_size + 1, epoch), {},
              GROUP_TIMEOUT_S)
    layout = policy.weights_layout()
    refs = [policy.pool.actors[0].call.remote("policy", "broadcast_weights", version)]
    refs += [a.call.remote("rollout", "receive_broadcast", layout, version=version, keep=versions_kept(run.cfg()))
             for a in rollout.pool.actors]
    sent = ray.get(refs, timeout=GROUP_TIMEOUT_S)[0]
    return sent["bytes"]


def _warn(line: str) -> None:
    from prefect import get_run_logger

    get_run_logger().warning(line)


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
