"""Asynchronous training end to end on a tiny model (issue 20, docs/async.md): a rollout pool apart
from the trainer, rollouts ahead as Prefect futures, weights published after each update, the
staleness bound, and the fixed schedule that makes runs reproducible — also across a killed
rollout worker and a killed driver."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from tests.integration.conftest import tiny_overrides
from tests.integration.test_reliability_runs import VARIED_REWARD, assert_same_weights, executions
from tests.train_process import kill_group, start_train

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

ITERATIONS = 5
ROLLOUT_POOL = {"placement.pools.gen.workers": "1", "placement.pools.gen.cpus_per_worker": "0.5",
                "placement.pools.gen.roles": "[rollout]"}


@pytest.fixture(scope="module")
def varied_reward(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("async-reward") / "varied_reward.py"
    path.write_text(VARIED_REWARD)  # the tiny model never solves arithmetic: a varied score moves its weights
    return f"{path}:compute_score"


def _overrides(root: Path, arith_files, run_id: str, **extra: str) -> list[str]:
    train_file, val_file = arith_files
    return tiny_overrides(str(root / "runs"), train_file, val_file,
                          **{"trainer.run_id": run_id, "actor.old_log_probs": "recompute", **extra})


def _async(root: Path, arith_files, run_id: str, reward: str, **extra: str) -> list[str]:
    return _overrides(root, arith_files, run_id, **ROLLOUT_POOL, **{
        "trainer.max_staleness": "1", "trainer.total_iterations": str(ITERATIONS), "trainer.save_every": "2",
        "reward.function": reward, **extra})


def _rollouts(run_dir: Path, iterations: int) -> dict[int, list[int]]:
    """Each iteration's trajectories' rollout_version, read from the saved rollout batches."""
    from hybridflow.batch import Batch

    return {it: Batch.load(str(run_dir / f"iter_{it:06d}" / "rollout"))["rollout_version"].tolist()
            for it in range(1, iterations + 1)}


def _weights(step_dir: Path) -> dict[str, torch.Tensor]:
    from workers.checkpoint import read_safetensors_folder

    return read_safetensors_folder(step_dir / "policy")


@pytest.fixture(scope="module")
def reference(prefect_api, ray_cluster, arith_files, varied_reward, tmp_path_factory) -> dict:
    """The uninterrupted one-step-off-policy run (5 iterations, checkpoints after 2, 4 and 5)."""
    from flows.train import train

    return train(overrides=_async(tmp_path_factory.mktemp("async-ref"), arith_files, "async-ref", varied_reward))


def test_one_step_off_policy_keeps_the_bound_and_overlaps(reference):
    from tasks.versions import read_ledger

    run_dir = Path(reference["run_dir"])
    assert reference["iterations"] == ITERATIONS
    # the schedule: iteration j generates with the weights after iteration j-2's update
    versions = _rollouts(run_dir, ITERATIONS)
    assert versions == {1: [0] * 4, 2: [0] * 4, 3: [1] * 4, 4: [2] * 4, 5: [3] * 4}, versions
    ledger = read_ledger(str(run_dir), "policy")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(i - 1, i) for i in range(1, ITERATIONS + 1)]
    hist = {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for it, m in hist.items():
        trained_at = ledger[it - 1]["version_before"]
        assert 0 <= trained_at - min(versions[it]) <= 1  # never older than the bound
        assert m["rollout/staleness/max"] == trained_at - versions[it][0]
        assert m["rollout/dropped_stale"] == 0
        assert m["timing_s/weight_sync"] > 0 and 0 <= m["async/overlap_fraction"] <= 1
    # the checkpoint after iteration 2 recorded the rollout in flight (iteration 3's, weights v1)
    state = json.loads((run_dir / "checkpoints" / "iter_000002" / "trainer_state.json").read_text())
    assert list(state["rollouts"]) == ["3"] and state["rollouts"]["3"]["rollout"]["rollout_version"] == 1
    # the weights moved (a run that never updated would reproduce trivially)
    from hybridflow.config import load_config
    from hybridflow.models import load_causal_lm

    cfg = load_config(str(run_dir / "config.yaml"))
    initial = load_causal_lm(cfg.model, seed=cfg.trainer.seed).state_dict()
    final = _weights(Path(reference["checkpoint"]))
    assert any(not torch.equal(final[k], initial[k]) for k in final)

    # the rollouts are generate_ahead task runs of the train flow run itself, beside its iteration subflows
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter

    with get_client(sync_client=True) as client:
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [reference["prefect_flow_run_id"]]}))
        names = {t.name for t in tasks}
    assert {f"generate_ahead-{it:06d}" for it in range(1, ITERATIONS + 1)} <= names, sorted(names)


def _wait_for(run_dir: Path, entry: tuple[int, str], proc, log: Path, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while entry not in executions(run_dir):
        assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, f"{entry} never ran"
        time.sleep(0.05)


def killed_then_resumed(args: list[str], run_dir: Path, tmp_path: Path, kill_at: tuple[int, str],
                        first_waits_for=None) -> None:
    """Start ``hybridflow train args`` (log: tmp_path/first.log), call ``first_waits_for()`` if given,
    kill the driver's process group once node ``kill_at`` = (iteration, node) has started, check
    that the checkpoint after iteration 2 is the newest (save_every 2), and resume the run to its
    end (exit 0, log: tmp_path/resume.log)."""
    log = tmp_path / "first.log"
    first = start_train(args, log=log)
    try:
        if first_waits_for is not None:
            first_waits_for()
        _wait_for(run_dir, kill_at, first, log)
    finally:
        kill_group(first)
    assert (run_dir / "checkpoints" / "iter_000002").exists() and not (run_dir / "checkpoints" / "iter_000004").exists()
    resumed = start_train(["--resume", str(run_dir)], log=tmp_path / "resume.log")
    try:
        assert resumed.wait(timeout=900) == 0, (tmp_path / "resume.log").read_text()[-3000:]
    finally:
        kill_group(resumed)


def test_killed_rollout_worker_and_driver_resume_to_the_same_weights(reference, arith_files, varied_reward, tmp_path):
    import ray

    from tests.integration.test_reliability_runs import ActorKiller

    args = _async(tmp_path, arith_files, "async-killed", varied_reward,
                  **{"placement.ray_address": ray.get_runtime_context().gcs_address,
                     "trainer.plugins": "[tests.integration.hold_plugins]"})
    run_dir = tmp_path / "runs" / "async-killed"
    # iteration 3's rollout generates with weights v1 while iteration 2 trains: its actor is killed
    # inside that call (the hold plugin keeps the call until the kill lands)
    killer = ActorKiller(run_dir, ["rollout_generate-v1"])
    killer.start()

    def actor_killed() -> None:
        killer.join(timeout=600)
        assert killer.error is None and len(killer.kills) == 1, killer.error

    # then kill the driver while iteration 4 trains and iteration 5's rollout is in flight
    killed_then_resumed(args, run_dir, tmp_path, (4, "old_log_probs"), first_waits_for=actor_killed)
    assert executions(run_dir).count((3, "rollout")) >= 2  # the killed generation ran again (a task retry)
    from workers.pool import read_pool_events

    starts = read_pool_events(str(run_dir), "gen")
    assert killer.kills[0]["pid"] in [s["pid"] for s in starts] and len(starts) >= 3  # killed, restarted, resumed
    assert _rollouts(run_dir, ITERATIONS) == _rollouts(Path(reference["run_dir"]), ITERATIONS)
    assert_same_weights(_weights(run_dir / "checkpoints" / "iter_000005"), _weights(Path(reference["checkpoint"])))


def test_a_hung_weight_sync_restarts_the_rollout_rank_and_the_retried_publish_delivers(reference, arith_files,
                                                                                     varied_reward, tmp_path):
    """The rollout rank hangs while it files the weights of v2 (the hold plugin keeps the call for
    minutes): the publish times out after trainer.weight_sync_timeout_s, the rank is restarted, the
    retried publish_weights node delivers v2, and the run ends with the uninterrupted run's rollouts
    and weights (the TRL #7103 / #6796 class: a weight sync that hangs)."""
    from flows.train import train
    from tests.integration.hold_plugins import holds_dir
    from workers.pool import read_pool_events

    run_dir = tmp_path / "runs" / "async-hung-sync"
    holds = holds_dir(run_dir)
    holds.mkdir(parents=True)
    (holds / "receive_weights-v2").touch()
    start = time.monotonic()
    summary = train(overrides=_async(tmp_path, arith_files, "async-hung-sync", varied_reward, **{
        "trainer.plugins": "[tests.integration.hold_plugins]", "trainer.weight_sync_timeout_s": "20"}))
    assert summary["iterations"] == ITERATIONS and time.monotonic() - start < 280  # not waited out (300 s hold)
    assert (holds / "receive_weights-v2.held").exists()  # the receive of v2 did hang
    assert executions(run_dir).count((2, "publish_weights")) >= 2  # timed out, then retried
    assert len(read_pool_events(str(run_dir), "gen")) >= 2  # the rollout rank started again
    assert _rollouts(run_dir, ITERATIONS) == _rollouts(Path(reference["run_dir"]), ITERATIONS)
    assert_same_weights(_weights(run_dir / "checkpoints" / "iter_000005"), _weights(Path(reference["checkpoint"])))


def test_a_slow_update_does_not_let_the_rollout_pool_run_past_the_bound(prefect_api, ray_cluster, arith_files,
                                                                        varied_reward, tmp_path):
    from flows.train import train

    summary = train(overrides=_async(tmp_path, arith_files, "async-slow", varied_reward, **{
        "trainer.total_iterations": "4", "trainer.plugins": "[tests.integration.slow_plugins]",
        "actor.policy_loss": "slow_ppo"}))
    run_dir = Path(summary["run_dir"])
    assert _rollouts(run_dir, 4) == {1: [0] * 4, 2: [0] * 4, 3: [1] * 4, 4: [2] * 4}
    log = [json.loads(x) for x in (run_dir / "execution_log.jsonl").read_text().splitlines()]
    hist = {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    start = {(e["iteration"], e["node"]): e["t"] for e in log}
    for j in (3, 4):  # rollout j waited for iteration j-2's (slow) update to end, however long it took
        update_end = start[(j - 2, "update_policy")] + hist[j - 2]["timing_s/update_actor"]
        assert start[(j, "rollout")] >= update_end - 0.05
        assert hist[j]["rollout/staleness/max"] == 1
        assert hist[j - 2]["timing_s/update_actor"] > max(1.5, hist[j]["timing_s/gen"])  # slower than a rollout


def test_lora_adapters_alone_go_to_the_rollout_pool(prefect_api, ray_cluster, arith_files, varied_reward, tmp_path):
    from flows.train import train

    lora = {"reward.function": varied_reward, "model.lora_rank": "4", "actor.lr": "1e-2"}
    colocated = train(overrides=_overrides(tmp_path, arith_files, "lora-colocated", **lora))
    separate = train(overrides=_overrides(tmp_path, arith_files, "lora-separate", **ROLLOUT_POOL, **lora))
    full = train(overrides=_overrides(tmp_path, arith_files, "full-separate", **ROLLOUT_POOL,
                                      **{"reward.function": varied_reward}))
    assert_same_weights(_weights(Path(colocated["checkpoint"])), _weights(Path(separate["checkpoint"])))
    def synced(summary: dict) -> list[float]:
        lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
        return [json.loads(x)["metrics"]["perf/weight_sync_bytes"] for x in lines]

    assert 0 < max(synced(separate)) < min(synced(full)) / 5  # adapters only, not the model


@pytest.mark.parametrize("weight_sync", ["object_store", "collective"])
def test_max_staleness_0_on_a_rollout_pool_equals_the_colocated_run(prefect_api, ray_cluster, arith_files,
                                                                     varied_reward, tmp_path, weight_sync):
    from flows.train import train

    reward = {"reward.function": varied_reward}
    colocated = train(overrides=_overrides(tmp_path, arith_files, "sync-colocated", **reward))
    separate = train(overrides=_overrides(tmp_path, arith_files, "sync-separate", **ROLLOUT_POOL, **reward,
                                          **{"trainer.weight_sync": weight_sync}))
    hist = [json.loads(x)["metrics"] for x in (Path(separate["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    assert [m["perf/weight_sync_collective"] for m in hist] == [float(weight_sync == "collective")] * 2
    a, b = _weights(Path(colocated["checkpoint"])), _weights(Path(separate["checkpoint"]))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert _rollouts(Path(separate["run_dir"]), 2) == {1: [0] * 4, 2: [1] * 4}


def test_updates_per_sync_publishes_every_second_update_and_keeps_the_bound(prefect_api, ray_cluster, arith_files,
                                                                             varied_reward, tmp_path):
    """trainer.updates_per_sync=2 (verl's trigger_parameter_sync_step), max_staleness=1, a checkpoint
    after iteration 4 of 5: weights reach the rollout pool after iterations 2, 4 and 5 only; each
    rollout generates with the newest published version and is never older than the bound."""
    from flows.train import train

    summary = train(overrides=_async(tmp_path, arith_files, "async-sync2", varied_reward, **{
        "trainer.updates_per_sync": "2", "trainer.save_every": "4"}))
    run_dir = Path(summary["run_dir"])
    assert _rollouts(run_dir, ITERATIONS) == {1: [0] * 4, 2: [0] * 4, 3: [2] * 4, 4: [2] * 4, 5: [4] * 4}
    hist = {h["iteration"]: h["metrics"] for h in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert [it for it in sorted(hist) if hist[it].get("perf/weight_sync_bytes", 0) > 0] == [2, 4, 5]
    assert [hist[it]["rollout/staleness/max"] for it in sorted(hist)] == [0, 1, 0, 1, 0]
    assert all(hist[it]["rollout/regenerated_stale" if "rollout/regenerated_stale" in hist[it] else
                        "rollout/dropped_stale"] == 0 for it in hist)
