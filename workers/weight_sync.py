"""Weights from the trainer to a separate rollout pool (asynchronous training, docs/async.md).

:class:`WeightSync` works on role handles (:class:`workers.handles.RoleHandle`, or anything with
the same bound methods). :meth:`WeightSync.publish` sends the policy's current weights to every
rollout rank: the policy's rank 0 puts CPU tensors in Ray's object store, tagged with their
``weights_version``, and every rollout rank keeps the object refs' tensors in an inbox by version
(:mod:`workers.rollout_worker`); the transfer goes from the policy's node to each rollout node
through Ray's object store. :meth:`WeightSync.ensure` makes the rollout ranks generate with one
exact version; when a restarted rollout rank lost its inbox, the version is fetched again from the
policy, which keeps the ``trainer.max_staleness + 2`` newest versions referenced.

``mode="collective"`` (``trainer.weight_sync: collective``, ``auto`` on GPUs) sends them instead by
a torch.distributed broadcast from the policy's rank 0 to the rollout ranks
(:mod:`workers.weight_group`: NCCL on GPUs, Gloo on CPU), formed on the first publish and formed
again when a member restarted (its epoch differs). The members are called together through
:func:`workers.handles.call_together`. A broadcast that fails falls back to the object store for
that version (and the next publish forms the group anew).

Every call of a sync has a timeout (``timeout_s``, ``trainer.weight_sync_timeout_s``). A rollout
rank that does not answer in time is restarted (:func:`workers.pool.restart_rank`: it comes back
without an inbox and gets the version again from the policy) and the publish fails in one line
(:class:`WeightSyncTimeout`), so the ``publish_weights`` node's retry runs against the restarted
rank; a policy rank that does not answer fails the publish in one line and is left as it is (its
weights are the run's state).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

from workers.handles import call_together
from workers.pool_errors import RankTimeout
from workers.weight_group import GROUP_TIMEOUT_S

_log = logging.getLogger(__name__)


class VersionError(RuntimeError):
    """A pool's weights cannot be brought to the version the run expects (names role and versions)."""


class WeightSyncTimeout(RuntimeError):
    """A call of a weight sync did not answer within ``trainer.weight_sync_timeout_s`` (names the
    version, pool, rank and method, and whether the rank was restarted)."""


def _restart_rank(pool: Any, rank: int) -> None:
    from workers.pool import restart_rank

    restart_rank(pool, rank)


def weights_version(handle: Any, timeout_s: float | None = None) -> int:
    """A role handle's weights_version (all ranks must agree; VersionError otherwise; each rank
    answers within ``timeout_s``, else RankTimeout)."""
    got = handle.get_weights_version() if timeout_s is None else handle.get_weights_version(timeout_s=timeout_s)
    versions = set(got) if isinstance(got, list) else {got}
    if len(versions) != 1:
        raise VersionError(f"{handle.role} pool ranks disagree on weights_version: {sorted(versions)}")
    return versions.pop()


def versions_kept(max_staleness: int) -> int:
    """How many published versions the policy and each rollout rank keep: the rollouts in flight
    (``max_staleness + 1``) need at most that many, plus the one being published."""
    return max_staleness + 2


@dataclass(frozen=True)
class SyncReport:
    """One publish: ``version`` sent, ``seconds`` (publish + transfer + filing in the inboxes, wall
    clock), ``bytes`` (of the tensors sent once), ``collective`` (True: broadcast; False: object store)."""

    version: int
    seconds: float
    bytes: int
    collective: bool


@dataclass
class WeightSync:
    """The policy's weights, published to the rollout pool (see the module docstring).

    policy: returns the policy's role handle, asked only when needed (:meth:`ensure` asks only when
    a rank must fetch a version again: a rollout generating ahead must not wait on a policy pool
    busy updating); rollout: the rollout role's handle; mode: "collective" or "object_store" (as
    ``ExperimentConfig.weight_sync_mode`` resolves it); keep: versions kept (:func:`versions_kept`);
    warn: where a fallback to the object store is reported (one line); timeout_s: seconds each call
    of the sync may take per rank (None: no limit); restart: ``(pool, rank)``, starts a hung rank
    again (:func:`workers.pool.restart_rank`).
    """

    policy: Callable[[], Any]
    rollout: Any
    mode: Literal["collective", "object_store"]
    keep: int
    warn: Callable[[str], None] = _log.warning
    timeout_s: float | None = None
    restart: Callable[[Any, int], None] = _restart_rank

    def publish(self, version: int) -> SyncReport:
        """Send the policy's weights (``version`` = its weights_version now) to every rollout rank's
        inbox. Raises VersionError when the policy is not at ``version``; a failed broadcast falls
        back to the object store. Publishing a version already published sends it again (safe).
        Raises WeightSyncTimeout when a call does not answer within ``timeout_s`` (a rollout rank
        that hung is restarted first)."""
        with self._timeouts(version):
            return self._publish(version)

    def _publish(self, version: int) -> SyncReport:
        start = time.perf_counter()
        policy = self.policy()
        sent, collective = None, self.mode == "collective"
        if collective:
            try:
                sent = self._broadcast(policy, version)
            except Exception as e:  # noqa: BLE001 - a broken group: this version goes through the object store
                self.warn(f"weight-sync broadcast of v{version} failed ({type(e).__name__}: {e}); "
                          "sending it through Ray's object store")
                policy.leave_weight_group()  # the next publish forms the group anew
                collective = False
        if sent is None:
            sent = self._through_object_store(policy, version)
        return SyncReport(version=version, seconds=time.perf_counter() - start, bytes=int(sent), collective=collective)

    def ensure(self, version: int) -> None:
        """Make every rollout rank generate with the weights of ``version``: from its inbox, or (a
        rank that restarted and lost it) fetched again from the policy. Raises VersionError naming
        the version when neither holds it (resume the run from its checkpoint), WeightSyncTimeout
        as :meth:`publish`."""
        t = self._timeout()
        with self._timeouts(version):
            versions = self.rollout.get_weights_version(**t)
            if set(versions) == {version}:
                return
            if not all(version in held for held in self.rollout.inbox_versions(**t)):
                self._fetch_again(version, versions)
            self.rollout.use_weights(version, **t)
            if weights_version(self.rollout, self.timeout_s) != version:
                raise VersionError(f"rollout pool did not load weights_version {version}")

    def deliver(self, version: int) -> None:
        """Make every rollout rank hold the weights of ``version``, loaded or in its inbox (a rank that
        restarted and lost it gets them again from the policy), without loading them: the streaming
        rollout loads versions itself (workers/group_stream.py). Raises VersionError and
        WeightSyncTimeout as :meth:`ensure`."""
        t = self._timeout()
        with self._timeouts(version):
            loaded, held = self.rollout.get_weights_version(**t), self.rollout.inbox_versions(**t)
            if all(v >= version or version in h for v, h in zip(loaded, held, strict=True)):
                return
            self._fetch_again(version, loaded)

    def _fetch_again(self, version: int, loaded: list[int]) -> None:
        """Send ``version`` from the policy's kept versions into every rollout rank's inbox (ranks
        that restarted lost it; ``loaded``: the ranks' versions, for the error). Raises VersionError
        when the policy no longer keeps it."""
        published = self.policy().published_weights(version, **self._timeout())
        if published is None:
            raise VersionError(
                f"rollout pool needs policy weights_version {version}: its ranks are at {sorted(set(loaded))} "
                f"and the policy keeps only the {self.keep} newest versions; resume the run from its latest "
                "checkpoint")
        self.rollout.receive_weights(published["refs"], version=version, keep=self.keep, **self._timeout())

    def _timeout(self) -> dict[str, float]:
        """The ``timeout_s`` keyword of each call (none when unbounded: a handle-like object without
        the keyword still works)."""
        return {} if self.timeout_s is None else {"timeout_s": self.timeout_s}

    @contextlib.contextmanager
    def _timeouts(self, version: int) -> Iterator[None]:
        """A call that timed out (RankTimeout) as one WeightSyncTimeout line; a rollout rank that
        timed out is restarted first."""
        try:
            yield
        except RankTimeout as e:
            rollout_pool = getattr(self.rollout, "pool", None)
            restarted = rollout_pool is not None and e.pool == rollout_pool.name
            if restarted:
                self.restart(rollout_pool, e.rank)
            raise WeightSyncTimeout(
                f"weight sync of v{version}: {e} (trainer.weight_sync_timeout_s); "
                + (f"rank {e.rank} of pool {e.pool!r} restarted, the sync is retried" if restarted
                   else "the policy's rank is left as it is")) from None

    def _through_object_store(self, policy: Any, version: int) -> int:
        published = policy.publish_weights(keep=self.keep, **self._timeout())
        if published["version"] != version:
            raise VersionError(f"policy published weights_version {published['version']}, expected {version}")
        self.rollout.receive_weights(published["refs"], version=version, keep=self.keep, **self._timeout())
        return published["bytes"]

    def _broadcast(self, policy: Any, version: int) -> int:
        rollout = self.rollout
        epochs = [policy.weight_group_epoch(), *rollout.weight_group_epoch()]
        if None in epochs or len(set(epochs)) != 1:  # first publish, or a member restarted: form it (again)
            # the store listens on the policy rank 0's node (the pool's own rendezvous helper)
            host, port = policy.rendezvous_address(timeout_s=GROUP_TIMEOUT_S)
            epoch = max((e for e in epochs if e is not None), default=0) + 1
            group = (host, port, rollout.pool.world_size + 1, epoch)
            call_together([(policy.init_weight_group, group, {}), (rollout.init_weight_group, group, {})],
                          timeout_s=GROUP_TIMEOUT_S)
        layout = policy.weights_layout()
        sent, _ = call_together([(policy.broadcast_weights, (version,), {}),
                                 (rollout.receive_broadcast, (layout,), {"version": version, "keep": self.keep})],
                                timeout_s=GROUP_TIMEOUT_S)
        return sent["bytes"]


__all__ = ["SyncReport", "VersionError", "WeightSync", "WeightSyncTimeout", "versions_kept", "weights_version"]
