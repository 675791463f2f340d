"""``hybridflow train`` against a real two-node Ray cluster (tests/cluster/ray_cluster.py), with
the Prefect server's database on PostgreSQL (tests/cluster/postgres.py): the
driver attaches through ``placement.ray_address`` and starts no Ray of its own; the Ray workers
run in each node's own working directory, not the driver's.

- STRICT_SPREAD puts the 2-rank DDP policy pool's ranks on different nodes (pool_events.jsonl
  records each rank's Ray node id beside its pid) and gloo DDP keeps their weights identical —
  with 1 prompt per step, so rank 1 gets no group of its own every iteration (uneven batches),
  and 3 validation prompts on 2 ranks;
- PACK keeps the pool on one node (with ``trainer.run_dir`` given as a ``file://`` URI: the lock,
  batches, checkpoints, Prefect results and ledger all land in that one folder);
- a pool the cluster can never hold fails at start in one line;
- node failure: node2's raylet is SIGKILLed (by PID) while the pool is inside iteration 2's
  update; the run stops with one line naming the pool and the lost node, a new node joins,
  ``hybridflow train --resume`` completes, the ledger holds every update once and the final
  weights equal the uninterrupted STRICT_SPREAD run's bit for bit.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

from tests.cluster.conftest import train_cli
from tests.cluster.shared_storage import assert_one_run_folder, wait_watching_lock
from tests.cluster.stall_plugin import stall_dir
from tests.integration.conftest import tiny_overrides
from tests.train_process import wait_train
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1500)]
ITERATIONS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("cluster-runs")


def overrides(cluster, runs: Path, data: Path, run_id: str, strategy: str, **extra: str) -> list[str]:
    return tiny_overrides(str(runs), str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": run_id,
        "trainer.seed": "5",
        "trainer.total_iterations": str(ITERATIONS),
        "trainer.save_every": "1",
        "trainer.val_before_train": "true",
        "trainer.plugins": "[tests.cluster.stall_plugin]",
        "data.prompts_per_iteration": "1",
        "actor.mini_batch_trajectories": "2",
        "rollout.max_response_tokens": "8",
        "reward.function": f"{data / 'varied_reward.py'}:compute_score",
        "placement.ray_address": cluster.address,
        "placement.pools.main.workers": "2",
        "placement.pools.main.roles": "[policy]",
        "placement.pools.main.placement_strategy": strategy,
        "placement.pools.reward.cpus_per_worker": "0.5",
        **extra,
    })


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []


def events(run_dir: Path, kind: str = "started") -> list[dict]:
    return [e for e in read_jsonl(run_dir / "pool_events.jsonl") if e["pool"] == "main" and e["event"] == kind]


def policy_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    from workers.checkpoint import read_safetensors_folder

    return read_safetensors_folder(step_dir / "policy")


def _run(cluster, runs, data, prefect_api, run_id: str, strategy: str, **extra: str) -> tuple[int, Path, str]:
    log = runs / f"{run_id}.log"
    proc = train_cli(overrides(cluster, runs, data, run_id, strategy, **extra), cwd=cluster.root / "driver",
                     log=log, prefect_api=prefect_api)
    rc = wait_train(proc, log)
    return rc, runs / run_id, log.read_text(errors="replace")


@pytest.fixture(scope="module")
def spread(cluster, runs, data, prefect_api):
    """The uninterrupted STRICT_SPREAD run (also the reference of the node-failure run)."""
    rc, run_dir, log = _run(cluster, runs, data, prefect_api, "spread", "STRICT_SPREAD")
    assert rc == 0, log[-4000:]
    return run_dir, log


def test_strict_spread_puts_ranks_on_different_nodes_in_step(cluster, spread, postgres):
    run_dir, log = spread
    # the Prefect server keeps its flow runs in PostgreSQL
    assert postgres.query("prefect", "select state_type from flow_run where name = 'train-spread'") == "COMPLETED"
    assert "Connected to Ray cluster" in log and "Started a local Ray instance" not in log
    ids = cluster.node_ids()
    started = events(run_dir)
    assert sorted(e["rank"] for e in started) == [0, 1]
    assert {e["node_id"] for e in started} == {ids["127.0.0.2"], ids["127.0.0.3"]}  # one rank per node
    assert len({e["pid"] for e in started}) == 2
    # the workers ran in their nodes' working directories, not the driver's
    assert {e["cwd"] for e in started} == {str(cluster.root / "head"), str(cluster.root / "node2")}
    stopped = events(run_dir, "stopped")
    assert len(stopped) == 2 and stopped[0]["weights_sha256"] == stopped[1]["weights_sha256"]
    assert stopped[0]["weights_sha256"]["policy"]
    ledger = read_jsonl(run_dir / "updates_policy.jsonl")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(0, 1), (1, 2), (2, 3)]
    validation = read_jsonl(run_dir / "validation.jsonl")
    assert validation, "validation of the 3 prompts on 2 ranks did not run"


def test_pack_keeps_the_pool_on_one_node(cluster, runs, data, prefect_api):
    # the run directory as a file:// URI (shared storage named by URI; every node sees this path):
    # every writer — the CLI's lock, the ranks' batches and checkpoints, Prefect's results, the
    # ledger — used that one folder
    ov = overrides(cluster, runs, data, "pack", "PACK", **{
        "trainer.total_iterations": "1", "trainer.val_before_train": "false", "trainer.run_dir": f"file://{runs}"})
    log = runs / "pack.log"
    proc = train_cli(ov, cwd=cluster.root / "driver", log=log, prefect_api=prefect_api)
    rc, holder = wait_watching_lock(proc, log, runs / "pack" / "run.lock")
    assert rc == 0, log.read_text(errors="replace")[-4000:]
    run_dir = runs / "pack"
    started = events(run_dir)
    assert len(started) == 2 and len({e["node_id"] for e in started}) == 1, started
    assert holder.get("pid") == proc.pid, holder
    assert_one_run_folder(run_dir, {str(n.cwd) for n in cluster.nodes}, iterations=1)


def test_a_pool_the_cluster_cannot_hold_fails_in_one_line(cluster, runs, data, prefect_api):
    rc, _, log = _run(cluster, runs, data, prefect_api, "too-big", "STRICT_SPREAD",
                      **{"placement.pools.main.workers": "3"})
    assert rc == 2, log[-4000:]
    last = log.strip().splitlines()[-1]
    assert last.startswith("error: pool 'main' asks for 3 × {CPU: 1.0, GPU: 0.0} (STRICT_SPREAD), which the cluster "
                           "cannot place (fewer than 3 nodes can hold a rank)"), log[-2000:]
    assert "Traceback" not in log


def _wait_for(cond, what: str, timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"{what}:\n{log.read_text(errors='replace')[-4000:]}"
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_node_failure_stops_the_run_and_resume_completes(cluster, runs, data, prefect_api, spread):
    run_dir, log = runs / "node-failure", runs / "node-failure.log"
    stall = stall_dir(run_dir)
    stall.mkdir(parents=True)
    (stall / "update_policy-v1").write_text("")  # iteration 2's update
    proc = train_cli(overrides(cluster, runs, data, "node-failure", "STRICT_SPREAD"), cwd=cluster.root / "driver",
                     log=log, prefect_api=prefect_api)
    try:
        _wait_for(lambda: (stall / "rank0.waiting").exists() and (stall / "rank1.waiting").exists(),
                  "the pool never reached iteration 2's update", 600, log)
        node2 = next(n for n in cluster.nodes if n.name == "node2")
        rank1 = next(e for e in events(run_dir) if e["rank"] == 1)
        cluster.kill_raylet(node2)
        _wait_for(lambda: _gone(rank1["pid"]), "rank 1 outlived its raylet", 120, log)
        (stall / "update_policy-v1").unlink()
        rc = wait_train(proc, log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
    text = log.read_text(errors="replace")
    assert rc != 0, text[-3000:]
    last = text.strip().splitlines()[-1]
    assert "pool 'main'" in last and "rank 1 ran on node" in last and "127.0.0.3" in last and "gone" in last, last
    ledger = read_jsonl(run_dir / "updates_policy.jsonl")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(0, 1)]  # iteration 2 never recorded

    cluster.stop_node(node2)
    cluster.add_node("node3", num_cpus=1)
    resume_log = runs / "node-failure-resume.log"
    resumed = train_cli(["--resume", str(run_dir)], cwd=cluster.root / "driver", log=resume_log,
                        prefect_api=prefect_api)
    assert wait_train(resumed, resume_log) == 0, resume_log.read_text(errors="replace")[-4000:]
    ledger = read_jsonl(run_dir / "updates_policy.jsonl")
    assert [(e["version_before"], e["iteration"]) for e in ledger] == [(0, 1), (1, 2), (2, 3)]
    ids = cluster.node_ids()
    assert {e["node_id"] for e in events(run_dir)[-2:]} == {ids["127.0.0.2"], ids["127.0.0.4"]}
    want = policy_weights(spread[0] / "checkpoints" / checkpoint_name(ITERATIONS))
    got = policy_weights(run_dir / "checkpoints" / checkpoint_name(ITERATIONS))
    assert want.keys() == got.keys()
    assert [k for k in want if not torch.equal(want[k], got[k])] == []
