"""workers/weight_sync.py: WeightSync over fake role handles (no Ray): object store, collective,
fall-back, re-forming the group, and bringing the rollout ranks to a version."""

from __future__ import annotations

import types

import pytest

from workers.handles import call_together
from workers.pool_errors import RankTimeout
from workers.weight_sync import SyncReport, VersionError, WeightSync, WeightSyncTimeout, versions_kept


class Method:
    """A bound method of a fake role handle: records its calls; ``start`` runs it at once and hands
    back its result the way :class:`workers.handles.PendingCall` does."""

    def __init__(self, log: list, name: str, fn):
        self.log, self.name, self.fn = log, name, fn
        self.timeouts: list = []  # the timeout_s of each call (a role handle's bound methods take one)

    def __call__(self, *args, timeout_s=None, **kwargs):
        self.log.append((self.name, args, kwargs))
        self.timeouts.append(timeout_s)
        return self.fn(*args, **kwargs)

    def start(self, *args, **kwargs):
        self.log.append(("start " + self.name, args, kwargs))
        result = self.fn(*args, **kwargs)
        return types.SimpleNamespace(result=lambda timeout_s=None: result)


class FakePolicy:
    role = "policy"

    def __init__(self, log: list, version: int = 1):
        self.version, self.epoch, self.fail_broadcast = version, None, False
        self.published = {0: {"version": 0, "refs": ["ref0"], "bytes": 10}}
        m = lambda name, fn: Method(log, "policy." + name, fn)  # noqa: E731
        self.publish_weights = m("publish_weights", lambda *, keep: {"version": self.version,
                                                                      "refs": [f"ref{self.version}"], "bytes": 100})
        self.published_weights = m("published_weights", lambda v: self.published.get(v))
        self.weight_group_epoch = m("weight_group_epoch", lambda: self.epoch)
        self.rendezvous_address = m("rendezvous_address", lambda *, timeout_s=None: ("127.0.0.1", 4567))
        self.init_weight_group = m("init_weight_group", self._init)
        self.leave_weight_group = m("leave_weight_group", lambda: setattr(self, "epoch", None))
        self.weights_layout = m("weights_layout", lambda: [("w", [2], "float32")])
        self.broadcast_weights = m("broadcast_weights", self._broadcast)

    def _init(self, host, port, world, epoch):
        self.epoch = epoch
        return epoch

    def _broadcast(self, version):
        if self.fail_broadcast:
            raise RuntimeError("gloo: connection reset")
        return {"version": version, "bytes": 8}


class FakeRollout:
    role = "rollout"

    def __init__(self, log: list, ranks: int = 2):
        self.pool = types.SimpleNamespace(world_size=ranks, name="gen")
        self.loaded, self.inbox, self.epochs = [0] * ranks, [set() for _ in range(ranks)], [None] * ranks
        m = lambda name, fn: Method(log, "rollout." + name, fn)  # noqa: E731
        self.receive_weights = m("receive_weights", self._receive)
        self.receive_broadcast = m("receive_broadcast", lambda layout, *, version, keep: self._receive([], version=version, keep=keep))
        self.get_weights_version = m("get_weights_version", lambda: list(self.loaded))
        self.inbox_versions = m("inbox_versions", lambda: [sorted(i) for i in self.inbox])
        self.use_weights = m("use_weights", self._use)
        self.weight_group_epoch = m("weight_group_epoch", lambda: list(self.epochs))
        self.init_weight_group = m("init_weight_group", self._init)

    def _receive(self, refs, *, version, keep):
        for held in self.inbox:
            held.add(version)
        return [1] * len(self.inbox)

    def _use(self, version):
        assert all(version in held for held in self.inbox)
        self.loaded = [version] * len(self.loaded)
        return self.loaded

    def _init(self, host, port, world, epoch):
        self.epochs = [epoch] * len(self.epochs)
        return self.epochs


def _sync(mode="object_store", version=1, ranks=2):
    log: list = []
    policy, rollout = FakePolicy(log, version), FakeRollout(log, ranks)
    asked: list = []
    warnings: list = []

    def policy_handle():
        asked.append(1)
        return policy

    sync = WeightSync(policy=policy_handle, rollout=rollout, mode=mode, keep=versions_kept(1), warn=warnings.append)
    return sync, policy, rollout, log, asked, warnings


def _names(log):
    return [name for name, _, _ in log]


def _methods(*handles) -> list[Method]:
    return [m for h in handles for m in vars(h).values() if isinstance(m, Method)]


def test_every_call_of_a_sync_has_the_timeout():
    sync, policy, rollout, log, _, _ = _sync()
    sync.timeout_s = 7.0
    sync.publish(1)
    sync.ensure(1)
    rollout.inbox = [set(), set()]  # both ranks restarted: ensure and deliver fetch the version again
    rollout.loaded = [0, 0]
    policy.published[1] = {"version": 1, "refs": ["ref1"], "bytes": 100}
    sync.ensure(1)
    rollout.inbox, rollout.loaded = [set(), set()], [0, 0]
    sync.deliver(1)
    called = [m for m in _methods(policy, rollout) if m.timeouts]
    assert {m.name for m in called} >= {"policy.publish_weights", "rollout.receive_weights", "rollout.use_weights",
                                        "rollout.get_weights_version", "rollout.inbox_versions",
                                        "policy.published_weights"}
    assert all(t == 7.0 for m in called for t in m.timeouts), [(m.name, m.timeouts) for m in called]


def _hangs(handle, name: str, pool: str, rank: int):
    def hung(*a, **k):
        raise RankTimeout(pool, rank, f"{handle.role}.{name}", 7.0)
    setattr(handle, name, Method([], f"{handle.role}.{name}", hung))


def test_a_rollout_rank_that_does_not_answer_is_restarted_and_the_sync_fails_in_one_line():
    sync, policy, rollout, _, _, _ = _sync()
    restarted = []
    sync.timeout_s, sync.restart = 7.0, lambda pool, rank: restarted.append((pool.name, rank))
    _hangs(rollout, "receive_weights", "gen", 1)
    with pytest.raises(WeightSyncTimeout) as e:
        sync.publish(1)
    assert restarted == [("gen", 1)]
    line = str(e.value)
    assert "\n" not in line and "v1" in line and "rank 1" in line and "rollout.receive_weights" in line
    assert "restarted, the sync is retried" in line and "trainer.weight_sync_timeout_s" in line


def test_a_policy_rank_that_does_not_answer_fails_the_sync_and_is_not_restarted():
    sync, policy, rollout, _, _, _ = _sync()
    restarted = []
    sync.timeout_s, sync.restart = 7.0, lambda pool, rank: restarted.append((pool.name, rank))
    _hangs(policy, "publish_weights", "main", 0)
    with pytest.raises(WeightSyncTimeout, match="the policy's rank is left as it is"):
        sync.publish(1)
    assert restarted == []


def test_versions_kept_is_the_rollouts_in_flight_plus_the_one_published():
    assert versions_kept(0) == 2 and versions_kept(3) == 5


def test_an_object_store_publish_files_the_version_in_every_inbox():
    sync, _, rollout, log, _, _ = _sync()
    report = sync.publish(1)
    assert isinstance(report, SyncReport) and (report.version, report.bytes, report.collective) == (1, 100, False)
    assert report.seconds >= 0.0
    assert log == [("policy.publish_weights", (), {"keep": 3}),
                   ("rollout.receive_weights", (["ref1"],), {"version": 1, "keep": 3})]
    assert rollout.inbox == [{1}, {1}]


def test_a_policy_at_another_version_is_a_version_error():
    sync, *_ = _sync(version=2)
    with pytest.raises(VersionError, match="policy published weights_version 2, expected 1"):
        sync.publish(1)


def test_the_collective_group_forms_on_the_first_publish_and_again_after_a_restart():
    sync, policy, rollout, log, _, _ = _sync(mode="collective", ranks=2)
    report = sync.publish(1)
    assert (report.bytes, report.collective) == (8, True) and rollout.inbox == [{1}, {1}]
    group = ("127.0.0.1", 4567, 3, 1)  # world: policy rank 0 + 2 rollout ranks; epoch 1
    assert [e for e in log if e[0].startswith("start")] == [
        ("start policy.init_weight_group", group, {}), ("start rollout.init_weight_group", group, {}),
        ("start policy.broadcast_weights", (1,), {}),
        ("start rollout.receive_broadcast", ([("w", [2], "float32")],), {"version": 1, "keep": 3})]
    log.clear()
    policy.version = 2
    sync.publish(2)  # same epoch everywhere: the group is kept
    assert "start policy.init_weight_group" not in _names(log)
    log.clear()
    rollout.epochs[1] = None  # a rollout rank restarted
    policy.version = 3
    sync.publish(3)
    assert ("start rollout.init_weight_group", ("127.0.0.1", 4567, 3, 2), {}) in log  # epoch 2


def test_a_failed_broadcast_falls_back_to_the_object_store_and_forms_the_group_anew():
    sync, policy, rollout, log, _, warnings = _sync(mode="collective")
    policy.fail_broadcast = True
    report = sync.publish(1)
    assert (report.bytes, report.collective) == (100, False) and rollout.inbox == [{1}, {1}]
    assert "policy.leave_weight_group" in _names(log) and policy.epoch is None
    assert warnings == ["weight-sync broadcast of v1 failed (RuntimeError: gloo: connection reset); "
                        "sending it through Ray's object store"]


def test_ensure_loads_from_the_inbox_without_asking_the_policy():
    sync, _, rollout, log, asked, _ = _sync()
    sync.ensure(0)  # already loaded: nothing to do
    assert _names(log) == ["rollout.get_weights_version"]
    sync.publish(1)
    asked.clear()
    sync.ensure(1)
    assert rollout.loaded == [1, 1] and asked == []  # a policy busy updating is never waited on


def test_ensure_fetches_a_lost_version_again_or_names_it():
    sync, policy, rollout, log, asked, _ = _sync()
    policy.published[1] = {"version": 1, "refs": ["ref1"], "bytes": 100}
    sync.ensure(1)  # a restarted rank lost its inbox: fetched again from the policy
    assert asked == [1] and ("rollout.receive_weights", (["ref1"],), {"version": 1, "keep": 3}) in log
    assert rollout.loaded == [1, 1]
    with pytest.raises(VersionError, match=r"needs policy weights_version 7: its ranks are at \[1\] and the policy "
                                           r"keeps only the 3 newest versions"):
        sync.ensure(7)


def test_call_together_starts_every_call_before_waiting_for_any():
    order: list = []

    class Pending:
        def __init__(self, name):
            self.name = name

        def result(self, timeout_s=None):
            order.append(("wait", self.name, timeout_s))
            return self.name

    def method(name):
        fn = types.SimpleNamespace()
        fn.start = lambda *a, **k: order.append(("start", name, a, k)) or Pending(name)
        return fn

    out = call_together([(method("a"), (1,), {}), (method("b"), (), {"v": 2})], timeout_s=5.0)
    assert out == ["a", "b"]
    assert order == [("start", "a", (1,), {}), ("start", "b", (), {"v": 2}), ("wait", "a", 5.0), ("wait", "b", 5.0)]


# ---- the publish_weights node (tasks/weight_sync.py) -------------------------------------------

ROLLOUT_POOL = ("trainer.max_staleness=1", "placement.pools.gen.workers=1", "placement.pools.gen.roles=[rollout]")


def test_publish_weights_is_a_node_after_the_update_only_with_a_rollout_pool():
    from flows.iteration import builtin_dataflow
    from tests.unit._worker_helpers import tiny_cfg

    df = builtin_dataflow(tiny_cfg(*ROLLOUT_POOL))
    names = [n.name for n in df.nodes]
    assert names[-2:] == ["update_policy", "publish_weights"]
    assert df.wiring["publish_weights"] == {"update_policy": "update_policy"}
    assert "publish_weights" not in [n.name for n in builtin_dataflow(tiny_cfg()).nodes]


def test_an_update_not_applied_publishes_nothing_and_an_applied_one_reports_the_sync(monkeypatch):
    import tasks.weight_sync as T
    from tasks.types import UpdateResult

    def no_pools(*a, **k):
        raise AssertionError("a skipped update must not reach the pools")

    monkeypatch.setattr(T, "weight_sync", no_pools)
    assert T.publish_weights.fn(_run(3), UpdateResult(node="update_policy", applied=False, version=4)) == {}
    seen = []
    sync = types.SimpleNamespace(publish=lambda v: seen.append(v) or SyncReport(v, 0.25, 1024, True))
    monkeypatch.setattr(T, "weight_sync", lambda run, *, policy_version: seen.append(policy_version) or sync)
    out = T.publish_weights.fn(_run(3), UpdateResult(node="update_policy", applied=True, version=5))
    assert seen == [5, 5]  # the policy brought to the update's version, and that version published
    assert out == {"timing_s/weight_sync": 0.25, "perf/weight_sync_bytes": 1024.0, "perf/weight_sync_collective": 1.0}


def _run(iteration: int, *extra: str):
    from tasks.common import RunContext
    from tests.unit._worker_helpers import tiny_cfg

    cfg = tiny_cfg(*ROLLOUT_POOL, "trainer.total_iterations=10", *extra)
    return RunContext("r", "/tmp/unused", iteration, "ns", 0, cfg.model_dump(mode="json"))


def test_updates_per_sync_publishes_every_nth_iteration_and_at_every_checkpoint(monkeypatch):
    """trainer.updates_per_sync=3, save_every=4, total 10: iterations 3, 4 (a checkpoint), 6, 8, 9 and
    10 publish; a skipped update at a publishing iteration still sends its (older) version, which
    the rollout pool may lack."""
    import tasks.weight_sync as T
    from tasks.types import UpdateResult

    seen = []
    sync = types.SimpleNamespace(publish=lambda v: seen.append(v) or SyncReport(v, 0.25, 1024, False))
    monkeypatch.setattr(T, "weight_sync", lambda run, *, policy_version: sync)
    extra = ("trainer.updates_per_sync=3", "trainer.max_staleness=2", "trainer.save_every=4")
    published = [it for it in range(1, 11)
                 if T.publish_weights.fn(_run(it, *extra), UpdateResult(node="update_policy", version=it))]
    assert published == [3, 4, 6, 8, 9, 10] and seen == published
    assert [it for it in range(1, 11) if _run(it, *extra).cfg().publishes_after(it)] == published
    seen.clear()
    assert T.publish_weights.fn(_run(6, *extra), UpdateResult(node="update_policy", applied=False, version=5))
    assert seen == [5]
