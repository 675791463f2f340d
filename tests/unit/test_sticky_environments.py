"""Sticky environment instances (issue 39): an environment class declaring ``picklable = False`` keeps
each instance in the worker process that built it for its whole trajectory, every call pinned there
(:class:`hybridflow.agents.remote.EnvRunner`), dropped at done or at the parent's close; a worker
replaced after a crash takes its instances with it, and their next step says so."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hybridflow.agents.remote import EnvCall, EnvRunner
from hybridflow.procpool import ProcessPool, Unit
from tests.unit.test_rollout_multi_turn import FIX, ScriptedEngine, rollout

LIVE = f"{FIX}:LiveCounterEnv"
ROW = {"prompt": [{"role": "user", "content": "q"}], "uid": "u"}


@pytest.fixture
def runner():
    r = EnvRunner(num_workers=2, timeout_s=10.0)
    yield r
    r.close()


def _pid(outcome) -> int:
    return int(re.search(r"in (\d+)$", outcome.result.observation).group(1))


def test_a_sticky_instance_lives_in_one_worker_and_keeps_its_state(runner, tmp_path):
    keys = [40, 41, 42, 43]
    resets = runner.run([EnvCall.reset(LIVE, {"log": str(tmp_path / "log"), "tag": str(k)}, ROW, key=k) for k in keys])
    assert all(o.ok and o.result.sticky and o.result.state == b"" for o in resets)
    pids: dict[int, set[int]] = {k: set() for k in keys}
    for n in (1, 2, 3):
        outs = runner.run([EnvCall.step(LIVE, b"", "go", key=k) for k in keys])
        for k, o in zip(keys, outs, strict=True):
            assert o.ok, o.message
            assert o.result.reward == float(n)  # the counter lives on in the same instance
            pids[k].add(_pid(o))
    assert all(len(p) == 1 for p in pids.values())  # every step of a trajectory in one process
    assert len(set().union(*pids.values())) == 2  # consecutive keys take turns over the 2 workers
    assert [runner.worker_of(k) for k in keys] == [0, 1, 0, 1]


def test_done_and_close_drop_the_instance_and_call_its_close(runner, tmp_path):
    log = tmp_path / "log"
    runner.run([EnvCall.reset(LIVE, {"log": str(log), "tag": t}, ROW, key=k) for t, k in (("a", 10), ("b", 11))])
    done, going = runner.run([EnvCall.step(LIVE, b"", "stop", key=10), EnvCall.step(LIVE, b"", "go", key=11)])
    assert done.result.done and not going.result.done
    assert runner.run([EnvCall.close(LIVE, 11)])[0].ok
    assert sorted(log.read_text().splitlines()) == ["a closed after 1", "b closed after 1"]
    gone = runner.run([EnvCall.step(LIVE, b"", "go", key=10), EnvCall.step(LIVE, b"", "go", key=11)])
    assert [o.status for o in gone] == ["error", "error"]
    assert all("instance of this trajectory is gone" in o.message for o in gone)


def test_an_environment_that_cannot_be_pickled_is_told_to_declare_itself(runner):
    (out,) = runner.run([EnvCall.reset(f"{FIX}:UndeclaredSocketEnv", {}, ROW, key=1)])
    assert out.status == "error"
    assert "cannot be pickled" in out.message and "picklable = False" in out.message


def test_a_crashed_worker_takes_its_instances_and_their_next_step_says_so(tmp_path):
    runner = EnvRunner(num_workers=1, timeout_s=10.0)
    try:
        assert runner.run([EnvCall.reset(LIVE, {}, ROW, key=5)])[0].ok
        assert runner.run([EnvCall.step(LIVE, b"", "go", key=5)])[0].result.reward == 1.0
        (reset,) = runner.run([EnvCall.reset(f"{FIX}:ExitEnv", {}, ROW)])
        (crash,) = runner.run([EnvCall.step(f"{FIX}:ExitEnv", reset.result.state, "x")])
        assert crash.status == "crash" and runner.restarts == 1
        (lost,) = runner.run([EnvCall.step(LIVE, b"", "go", key=5)])
        assert lost.status == "error" and "was replaced" in lost.message
    finally:
        runner.close()


def test_the_pool_runs_a_pinned_unit_only_on_its_worker():
    from tests.unit.test_procpool import TOY  # the toy call kind: ("pid",) answers with the worker's pid

    pool = ProcessPool(TOY, "toy:", [], 2)
    try:
        pool.wait_ready()
        out = pool.run([Unit("rows", [(i, ("pid",))], worker=i % 2) for i in range(6)], 30.0)
        pids = [out[i][1] for i in range(6)]
        assert pids[0] == pids[2] == pids[4] != pids[1] == pids[3] == pids[5]
        with pytest.raises(ValueError, match="pinned to worker 2"):
            pool.run([Unit("rows", [(0, ("pid",))], worker=2)], 1.0)
    finally:
        pool.close()


def test_the_rollout_keeps_sticky_instances_to_the_end_and_closes_the_ones_left(runner, tmp_path):
    """Through MultiTurnRollout: each trajectory's steps reach its own live instance (rewards 1 + 2 + 3
    over 3 turns); the rollout's max_turns ends them, and it closes every instance it leaves open."""
    log = tmp_path / "log"
    cfg = {"environment": LIVE, "max_response_tokens": 200, "multi_turn": {"max_turns": 3}}
    extra = [{"env_kwargs": {"log": str(log), "tag": q}} for q in ("QA", "QB")]
    out = rollout(runner, ScriptedEngine({"QA": ["go", "go", "go"], "QB": ["go", "go", "go"]}), cfg, ["QA", "QB"],
                  extra=extra)
    assert out.non_tensors["env_reward"] == [6.0, 6.0]
    assert sorted(Path(log).read_text().splitlines()) == ["QA closed after 3", "QB closed after 3"]
