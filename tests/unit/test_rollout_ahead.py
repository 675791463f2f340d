"""The driver's schedule of rollouts in flight (flows/rollout_ahead.py), with a scripted submit:
which versions each rollout gets, the order they run in, the bound with ``wait`` and ``drop``,
what a checkpoint records and what a resume takes back."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from flows.rollout_ahead import REGENERATE_KEY_OFFSET, RolloutsAhead
from flows.trainer_state import TrainerState, TrainerStateError
from hybridflow.batch import BatchRef
from hybridflow.config import ConfigError, load_config
from tasks.types import NodeResult, RolloutResult


def _ref(it: int, rows: int = 4) -> BatchRef:
    return BatchRef(run_id="r", iteration=it, node="rollout", uri=f"/x/{it}", rows=rows, keys=["response_ids"],
                    checksum=f"c{it}")


class _Done:
    """A finished Prefect future."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value.to_json()  # as Prefect hands a persisted result back: JSON


@dataclass
class _State:
    max_staleness: int = 1
    staleness_policy: str = "wait"
    total_iterations: int = 6
    prompts_left: int = 100
    trainer: TrainerState = field(default_factory=lambda: TrainerState(kl_coef=0.0))
    drawn: list[int] = field(default_factory=list)

    @property
    def cfg(self):
        class T:  # the two trainer keys the schedule reads, and total_iterations
            pass
        t = T()
        t.max_staleness, t.staleness_policy, t.total_iterations = (self.max_staleness, self.staleness_policy,
                                                                    self.total_iterations)
        c = T()
        c.trainer = t
        return c

    def next_prompts(self, it: int):
        if len(self.drawn) >= self.prompts_left:
            return None
        self.drawn.append(it)
        return NodeResult(node="prompts", ref=BatchRef(run_id="r", iteration=it, node="prompts", uri=f"/p/{it}",
                                                       rows=2, keys=["prompt_ids"], checksum=f"p{it}"))


class _Submitter:
    def __init__(self):
        self.calls: list[tuple[int, int, int, int]] = []  # (iteration, version, key, waits on)

    def __call__(self, iteration, prompts, version, key, wait_for):
        self.calls.append((iteration, version, key, len(wait_for)))
        return _Done(RolloutResult(node="rollout", ref=_ref(iteration), rollout_version=version,
                                   started_at=1.0, finished_at=2.0))


def _ahead(state: _State, submit: _Submitter) -> RolloutsAhead:
    """The schedule over the fake's prompts, live trainer state and trainer config."""
    return RolloutsAhead(state, state.trainer, state.cfg.trainer, submit)


def _trained(state: _State, ahead: RolloutsAhead, it: int):
    taken = ahead.take(it)
    if taken is not None and taken.first is not None:
        state.trainer.policy_version += 1  # the update applied
    return taken


@pytest.mark.parametrize("bound", [0, 1, 2])
def test_iteration_j_generates_with_the_weights_after_iteration_j_minus_1_minus_bound(bound):
    state, submit = _State(max_staleness=bound), _Submitter()
    ahead = _ahead(state, submit)
    for it in range(1, 7):
        taken = _trained(state, ahead, it)
        assert taken.metrics["rollout/staleness/max"] == min(it - 1, bound)
        assert taken.metrics["rollout/dropped_stale"] == 0
    assert [(it, v) for it, v, _, _ in submit.calls] == [(j, max(0, j - 1 - bound)) for j in range(1, 7)]
    assert [k for _, _, k, _ in submit.calls] == list(range(1, 7))  # Prefect's dynamic key = iteration
    assert state.drawn == list(range(1, 7))  # prompts drawn once each, in order, never past total_iterations
    assert len(ahead.ahead) == 0


def test_at_most_bound_plus_one_in_flight_and_each_waits_for_the_one_before():
    state, submit = _State(max_staleness=2), _Submitter()
    ahead = _ahead(state, submit)
    ahead.fill(1)
    assert sorted(ahead.ahead) == [1, 2, 3]
    assert [w for *_, w in submit.calls] == [0, 1, 1]  # rollout j is submitted after rollout j-1


def test_data_running_out_stops_the_schedule():
    state, submit = _State(max_staleness=1, prompts_left=3), _Submitter()
    ahead = _ahead(state, submit)
    got = [_trained(state, ahead, it) for it in range(1, 6)]
    assert [g is not None for g in got] == [True, True, True, False, False]


def _stale_state(policy: str) -> tuple[_State, _Submitter, RolloutsAhead]:
    """A resume whose checkpoint recorded iteration 3's rollout of weights v1 while the trainer is at
    v3 (two versions behind) under a bound of 1."""
    state, submit = _State(max_staleness=1, staleness_policy=policy), _Submitter()
    state.trainer.policy_version = 3
    old = RolloutResult(node="rollout", ref=_ref(3), rollout_version=1, started_at=1.0, finished_at=2.0)
    prompts = NodeResult(node="prompts", ref=_ref(3))
    state.trainer.rollouts = {"3": {"prompts": prompts.to_json(), "rollout": old.to_json()}}
    return state, submit, _ahead(state, submit)


def test_a_stale_rollout_is_generated_again_with_wait():
    state, submit, ahead = _stale_state("wait")
    assert state.trainer.rollouts == {}  # taken over by the schedule
    taken = ahead.take(3)
    assert taken.first.rollout_version == 3
    assert taken.metrics["rollout/staleness/max"] == 0 and taken.metrics["rollout/regenerated_stale"] == 4
    assert (3, 3, 3 + REGENERATE_KEY_OFFSET, 0) in submit.calls  # its own Prefect key: not the stale run's


def test_a_stale_rollout_is_dropped_and_counted_with_drop():
    state, submit, ahead = _stale_state("drop")
    taken = ahead.take(3)
    assert taken.first is None
    assert taken.metrics["rollout/dropped_stale"] == 4 and taken.metrics["rollout/staleness/max"] == 2
    assert all(it != 3 for it, *_ in submit.calls)  # nothing regenerated for iteration 3


def test_the_checkpoint_records_the_rollouts_in_flight_and_a_resume_takes_them_back():
    state, submit = _State(max_staleness=2), _Submitter()
    ahead = _ahead(state, submit)
    _trained(state, ahead, 1)
    record = ahead.in_flight()
    assert sorted(record) == ["2", "3"] and record["3"]["rollout"]["rollout_version"] == 0
    saved = TrainerState.from_dict({**TrainerState(kl_coef=0.0, policy_version=1).to_dict(), "rollouts": record})
    resumed_state = _State(max_staleness=2, trainer=saved)
    resumed_submit = _Submitter()
    resumed = _ahead(resumed_state, resumed_submit)
    taken = resumed.take(2)
    assert taken.first.rollout_version == 0 and taken.first.ref.iteration == 2
    assert [(it, v) for it, v, *_ in resumed_submit.calls] == [(4, 1)]  # only the next one is generated


def test_trainer_state_rollouts_is_optional_and_checked():
    base = TrainerState(kl_coef=0.1).to_dict()
    assert "rollouts" not in base  # a synchronous run's file keeps its format
    assert TrainerState.from_dict(base).rollouts == {}  # a checkpoint from before asynchronous training
    with pytest.raises(TrainerStateError, match="rollouts"):
        TrainerState.from_dict({**base, "rollouts": [1]})


def test_config_asks_for_a_rollout_pool_of_its_own():
    with pytest.raises(ConfigError, match="trainer.max_staleness=1 needs a rollout pool"):
        load_config(None, ["model.path=tiny", "trainer.max_staleness=1"])
    with pytest.raises(ConfigError, match="roles 'rollout' and 'policy' in one pool"):
        load_config(None, ["model.path=tiny", "placement.pools.main.roles=[policy,rollout]"])
    cfg = load_config(None, ["model.path=tiny", "trainer.max_staleness=1", "placement.pools.gen.roles=[rollout]"])
    assert cfg.uses_rollout_pool and not cfg.old_log_probs_from_rollout  # 'auto' recomputes the trainer's


def test_updates_per_sync_generates_with_the_newest_published_version_and_keeps_the_bound():
    """trainer.updates_per_sync=2, max_staleness=1: weights reach the rollout pool after iterations 2,
    4, 6 only; each rollout is generated with the newest published version and none is submitted so
    early that it would be older than the bound when it trains (nothing regenerated)."""
    state, submit = _State(max_staleness=1, total_iterations=6), _Submitter()
    ahead = _ahead(state, submit)
    stalenesses = []
    for it in range(1, 7):
        taken = _trained(state, ahead, it)
        stalenesses.append(taken.metrics["rollout/staleness/max"])
        assert "rollout/regenerated_stale" not in taken.metrics
        if it % 2 == 0:  # what flows/train.py records after a publishing iteration
            state.trainer.published_version = state.trainer.policy_version
        elif state.trainer.published_version is None:
            state.trainer.published_version = state.trainer.policy_version - 1
    assert [(it, v) for it, v, _, _ in submit.calls] == [(1, 0), (2, 0), (3, 2), (4, 2), (5, 4), (6, 4)]
    assert stalenesses == [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]


def test_without_updates_per_sync_the_schedule_is_unchanged():
    state, submit = _State(max_staleness=1, total_iterations=4), _Submitter()
    ahead = _ahead(state, submit)
    for it in range(1, 5):
        _trained(state, ahead, it)
    assert [(it, v) for it, v, _, _ in submit.calls] == [(1, 0), (2, 0), (3, 1), (4, 2)]
