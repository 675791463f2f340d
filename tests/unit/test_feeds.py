"""flows/feeds.py: the driver's input seam. ``take(iteration)`` on the prompt feed (a scripted
sampler, a fake dataset, real saving into a temporary run folder) and on the rollouts-ahead
schedule (a fake prompt source and submit, no Ray, no Prefect); which feed a config gets; the
flow inputs built from what a feed took; the ``generate_ahead`` task's name and cache key."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch

from flows.feeds import Feed, PromptFeed, Taken, open_feed
from flows.iteration import IterationResult, flow_input_values, flow_inputs
from flows.rollout_ahead import RolloutsAhead
from flows.trainer_state import TrainerState
from hybridflow.batch import Batch, BatchRef
from tasks.common import RunContext
from tasks.types import NodeResult, RolloutResult
from tests.unit._worker_helpers import tiny_cfg


class _Sampler:
    """Steps of two indices; ``steps_per_epoch`` steps make an epoch."""

    def __init__(self, steps_per_epoch: int = 2):
        self.steps_per_epoch, self.step = steps_per_epoch, 0

    @property
    def epoch(self) -> int:
        return self.step // self.steps_per_epoch

    def next_indices(self) -> list[int]:
        self.step += 1
        return [2 * self.step - 2, 2 * self.step - 1]


class _Dataset:
    def collate(self, indices: list[int]) -> Batch:
        return Batch.from_dict({"prompt_ids": torch.tensor([[i] for i in indices])}, {"uid": [f"u{i}" for i in indices]})


def _feed(tmp_path, total_epochs: int = 1) -> PromptFeed:
    def context(it: int) -> RunContext:
        return RunContext("r", str(tmp_path), it, "ns", 0, {})

    return PromptFeed(_Sampler(), _Dataset(), total_epochs, context)


def test_prompt_feed_takes_each_iterations_prompts_until_the_epochs_run_out(tmp_path):
    feed = _feed(tmp_path, total_epochs=1)  # 1 epoch of 2 steps
    first, second = feed.take(1), feed.take(2)
    assert isinstance(first, Taken) and first.metrics == {}
    assert first.first.node == "prompts" and first.first.ref.iteration == 1
    assert first.first.load()["uid"] == ["u0", "u1"] and second.first.load()["uid"] == ["u2", "u3"]
    assert (tmp_path / "iter_000002" / "prompts.safetensors").is_file()  # the run folder's name, unchanged
    assert feed.take(3) is None  # the epoch is done
    assert feed.in_flight() == {}


def test_prompt_feed_settle_adds_nothing(tmp_path):
    feed = _feed(tmp_path)
    taken = feed.take(1)
    out = IterationResult({"rollout": NodeResult(node="rollout")}, {"a": 1.0})
    feed.settle(taken, out, (0.0, 1.0), 1.0)
    assert out.metrics == {"a": 1.0} and list(out.results) == ["rollout"]


class _Future:
    def __init__(self, value):
        self.value = value
        self.state = SimpleNamespace(is_completed=lambda: True)

    def result(self):
        return self.value.to_json()


def _ahead(tmp_path, trainer: TrainerState, max_staleness: int = 1):
    calls = []

    def submit(iteration, prompts, version, key, wait_for):
        calls.append((iteration, version, prompts.ref.iteration))
        ref = BatchRef("r", iteration, "rollout", f"/x/{iteration}", 4, ("response_ids",), "c")
        return _Future(RolloutResult(node="rollout", ref=ref, rollout_version=version, started_at=1.0, finished_at=2.0,
                                     metrics={"timing_s/gen": 1.0}))

    cfg = tiny_cfg(f"trainer.max_staleness={max_staleness}", "placement.pools.gen.roles=[rollout]",
                   "trainer.total_iterations=4")
    return open_feed(cfg, _feed(tmp_path, total_epochs=5), trainer, submit), calls


def test_rollouts_ahead_take_gives_the_rollout_of_the_iteration_generated_from_the_feeds_prompts(tmp_path):
    trainer = TrainerState(kl_coef=0.0)
    feed, calls = _ahead(tmp_path, trainer)
    assert isinstance(feed, RolloutsAhead)
    taken = feed.take(1)
    assert isinstance(taken.first, RolloutResult) and taken.first.ref.iteration == 1
    assert calls == [(1, 0, 1), (2, 0, 2)]  # iteration 1 and one ahead (max_staleness=1), both with v0
    assert taken.metrics["rollout/staleness/max"] == 0.0
    trainer.policy_version = 1  # iteration 1's update applied
    assert feed.take(2).metrics["rollout/staleness/max"] == 1.0
    assert calls[-1] == (3, 1, 3)


def test_rollouts_ahead_settle_puts_the_rollout_into_the_iterations_results(tmp_path):
    feed, _ = _ahead(tmp_path, TrainerState(kl_coef=0.0))
    taken = feed.take(1)
    out = IterationResult({}, {"x": 2.0})
    feed.settle(taken, out, (1.0, 2.0), 1.0)
    assert out.results["rollout"] is taken.first
    assert out.metrics["x"] == 2.0 and out.metrics["timing_s/gen"] == 1.0
    assert "async/overlap_fraction" in out.metrics


def test_both_feeds_offer_the_seam(tmp_path):
    for feed in (_feed(tmp_path), _ahead(tmp_path, TrainerState(kl_coef=0.0))[0]):
        assert isinstance(feed, Feed)
    assert not isinstance(object(), Feed)


def test_a_synchronous_resume_of_an_asynchronous_checkpoint_drops_its_rollouts(tmp_path, caplog):
    trainer = TrainerState(kl_coef=0.0)
    trainer.rollouts = {"3": {"prompts": {}, "rollout": {}}}
    prompts = _feed(tmp_path)
    with caplog.at_level(logging.WARNING):
        feed = open_feed(tiny_cfg(), prompts, trainer, submit=None)
    assert feed is prompts and trainer.rollouts == {}
    assert "iterations 3 in flight" in caplog.text


def test_flow_input_values_follow_flow_inputs():
    trainer = TrainerState(kl_coef=0.25, policy_version=3, critic_version=2)
    first = NodeResult(node="prompts")
    sync = tiny_cfg()
    assert flow_input_values(sync, first, trainer) == {"prompts": first, "kl_coef": 0.25, "policy_version": 3}
    gae = tiny_cfg("algorithm.adv_estimator=gae")
    values = flow_input_values(gae, first, trainer)
    assert tuple(values) == flow_inputs(gae) and values["critic_version"] == 2


def test_generate_ahead_is_its_own_task_writing_the_rollout_nodes_output():
    from tasks.rollout import generate_ahead, rollout

    assert generate_ahead.task.name == "generate_ahead" and generate_ahead.task.task_run_name.startswith("generate_ahead-")
    assert generate_ahead.roles == ("rollout",) and generate_ahead.task.retries == rollout.task.retries
    run = RunContext("r", "/nowhere", 7, "ns", 0, {})
    ref = BatchRef("r", 7, "prompts", "/p/7", 2, ("prompt_ids",), "p7")
    params = {"run": run, "prompts": NodeResult(node="prompts", ref=ref), "policy_version": 2}
    ahead_key = generate_ahead.task.cache_key_fn(SimpleNamespace(task=generate_ahead.task), params)
    rollout_key = rollout.task.cache_key_fn(SimpleNamespace(task=rollout.task), params)
    assert ahead_key == rollout_key and ahead_key.startswith("r-iter000007-rollout-")  # the cache key as before
