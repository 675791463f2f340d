"""Prefect deployments on the Prefect server whose database is PostgreSQL (tests/cluster/postgres.py),
run by a ``prefect worker`` against the two-node Ray cluster (tests/cluster/ray_cluster.py).

``hybridflow deploy -n train`` registers the ``train`` deployment of a copy of
``deployments/prefect.yaml`` (the tiny model, one iteration, ``placement.ray_address`` at the
cluster, a work pool of this test) with the file's own ``concurrency_limit: 1``. Two flow runs of
it are created at once (each its own ``trainer.run_id`` through the ``overrides`` parameter), then
one process worker (``prefect worker start``, not ``--run-once``) runs them. Both complete (and
log to the MLflow server on PostgreSQL); the
server's state history shows the second refused into ``AwaitingConcurrencySlot`` while the first
ran, and their Running→Completed intervals do not overlap. The states are read over the API and
the AwaitingConcurrencySlot rows straight from PostgreSQL.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cluster.ray_cluster import cluster_env
from tests.integration.conftest import tiny_overrides
from tests.train_process import stop_process_tree, write_train_deployment

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]
POOL = "hybridflow-cluster-process"
RUN_IDS = ("deployed-a", "deployed-b")
RUNS_TIMEOUT_S = 900  # both flow runs, one after the other


def tiny_deployment_file(path: Path, cluster, data: Path, run_root: Path, mlflow_url: str) -> dict:
    """deployments/prefect.yaml reduced to its ``train`` deployment (its concurrency limit kept)
    with a tiny one-iteration config on the cluster and this test's work pool. Returns the
    deployment's mapping as written."""
    return write_train_deployment(path, tiny_overrides(str(run_root), str(data / "train.parquet"),
                                                       str(data / "val.parquet"), **{
        "trainer.total_iterations": "1",
        "trainer.run_id": "set-per-run",
        "placement.ray_address": cluster.address,
        "tracking.mlflow_uri": mlflow_url,
        "tracking.experiment": "cluster-deployments",
    }), POOL)


def start_worker(api: str, home: Path, log: Path) -> subprocess.Popen:
    """``prefect worker start --pool POOL --type process``: polls every 2 s; each flow run is a
    subprocess in the deployment's working directory (the repository root), a Ray driver of the
    cluster through ``placement.ray_address``."""
    env = {**cluster_env(), "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PREFECT_WORKER_QUERY_SECONDS": "2"}
    env.pop("RAY_ADDRESS", None)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process"]
    return subprocess.Popen(cmd, cwd=home, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_final(client, ids: list, worker: subprocess.Popen, log: Path) -> list:
    """The flow runs once all are in a final state; fails with the worker's log otherwise."""
    deadline = time.monotonic() + RUNS_TIMEOUT_S
    while True:
        runs = [client.read_flow_run(i) for i in ids]
        if all(r.state.is_final() for r in runs):
            return runs
        tail = log.read_text(errors="replace")[-4000:]
        assert worker.poll() is None, f"the worker exited ({worker.returncode}):\n{tail}"
        assert time.monotonic() < deadline, f"flow runs not final: {[r.state for r in runs]}\n{tail}"
        time.sleep(2)


@pytest.fixture(scope="module")
def deployed(mlflow_server, cluster, prefect_api, data, mlflow_url, tmp_path_factory):
    """Deploy, create two runs at once, run them with one worker; the runs and their state histories."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import build_parser
    from flows.cli.deploy import run as deploy

    tmp = tmp_path_factory.mktemp("deployments")
    dep_spec = tiny_deployment_file(tmp / "prefect.yaml", cluster, data, tmp / "runs", mlflow_url)
    args = build_parser().parse_args(["deploy", "-n", "train", "--prefect-yaml", str(tmp / "prefect.yaml"),
                                      "--api-url", prefect_api, "--timeout-s", "30"])
    assert deploy(args) == 0
    with temporary_settings({PREFECT_API_URL: prefect_api}), get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train/train")
        flow_runs = [client.create_flow_run_from_deployment(
            deployment.id, parameters={"overrides": [f"trainer.run_id={run_id}"]}) for run_id in RUN_IDS]
        ids = [r.id for r in flow_runs]
        worker = start_worker(prefect_api, tmp, tmp / "worker.log")
        try:
            runs = wait_final(client, ids, worker, tmp / "worker.log")
        finally:
            stop_process_tree(worker)
        history = {r.id: client.read_flow_run_states(r.id) for r in runs}
    return {"spec": dep_spec, "deployment": deployment, "runs": runs, "history": history, "tmp": tmp}


def _interval(states: list) -> tuple:
    """(the Running state's time, the Completed state's time) of one flow run's history."""
    running = [s.timestamp for s in states if s.type.value == "RUNNING"]
    done = [s.timestamp for s in states if s.type.value == "COMPLETED"]
    assert len(running) == 1 and len(done) == 1, [(s.type.value, s.name) for s in states]
    return running[0], done[0]


def test_deploy_and_a_worker_run_the_train_deployment_on_postgres(deployed, postgres, mlflow_url, cluster):
    from mlflow.tracking import MlflowClient

    node_cwds = {str(n.cwd) for n in cluster.nodes}
    assert deployed["spec"]["concurrency_limit"] == 1  # deployments/prefect.yaml's own limit
    assert deployed["deployment"].global_concurrency_limit.limit == 1  # as the server holds it
    tail = (deployed["tmp"] / "worker.log").read_text(errors="replace")[-4000:]
    for run, run_id in zip(deployed["runs"], RUN_IDS, strict=True):
        assert run.state.is_completed(), (run.state, tail)
        summary = json.loads((deployed["tmp"] / "runs" / run_id / "summary.json").read_text())
        assert summary["iterations"] == 1 and summary["prefect_flow_run_id"] == str(run.id)
        events = [json.loads(x) for x in (deployed["tmp"] / "runs" / run_id / "pool_events.jsonl").read_text()
                  .splitlines()]
        cwds = {e["cwd"] for e in events if e["event"] == "started"}
        assert cwds and cwds <= node_cwds, (cwds, node_cwds)  # the pools ran on the cluster's nodes
        row = postgres.query("prefect", f"select state_type from flow_run where id = '{run.id}'")
        assert row == "COMPLETED"  # the server's database is PostgreSQL
        ml = MlflowClient(mlflow_url).get_run(summary["mlflow_run_id"])
        assert ml.info.status == "FINISHED" and ml.data.tags["prefect.flow_run_id"] == str(run.id)


def test_two_runs_submitted_at_once_respect_the_concurrency_limit(deployed, postgres):
    runs = sorted(deployed["runs"], key=lambda r: _interval(deployed["history"][r.id])[0])
    first, second = (_interval(deployed["history"][r.id]) for r in runs)
    assert first[1] <= second[0], f"running intervals overlap: {first} and {second}"
    waited = [s.timestamp for s in deployed["history"][runs[1].id] if s.name == "AwaitingConcurrencySlot"]
    assert waited and any(first[0] <= t <= first[1] for t in waited), (first, waited)
    assert not any(s.name == "AwaitingConcurrencySlot" for s in deployed["history"][runs[0].id])
    rows = postgres.query("prefect", "select count(*) from flow_run_state where name = 'AwaitingConcurrencySlot' "
                          f"and flow_run_id = '{runs[1].id}'")
    assert int(rows) == len(waited)
