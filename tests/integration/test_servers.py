"""Real servers, started here on 127.0.0.1 and stopped after (issue 8).

One deployment run of the tiny-model train flow exercises both servers:

1. ``hybridflow deploy -n train`` registers the ``train`` deployment of a copy of
   ``deployments/prefect.yaml`` (tiny config, a test work pool) on the session's Prefect server
   (SQLite, the ``prefect_api`` fixture).
2. A flow run of that deployment is created through the API; ``prefect worker start --run-once``
   (a process worker, a subprocess of this test) runs it. The flow run starts its own local Ray
   (``ensure_ray``), as on one machine. The fault plugin fails it in iteration 2 after rollout
   and reward, past the node's retries, so the flow run ends Failed.
3. The flow run is retried through the API (state set to Scheduled) and a second ``--run-once``
   worker runs the *same* flow run again: it resumes its run directory from the iteration-1
   checkpoint, loads iteration 2's rollout and reward from node-level recovery, and completes.
4. The run logs to an ``mlflow server`` (SQLite backend, artifacts served over HTTP), and the
   metrics are read back through ``MlflowClient("http://...")``.

Cost: about 1.5 tiny training runs plus two Ray start-ups.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest

from tests.integration.conftest import tiny_overrides
from tests.train_process import stop_process_tree as _stop
from tests.train_process import write_train_deployment
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
POOL = "hybridflow-test-process"
RUN_ID = "deployed"
WORKER_TIMEOUT_S = 600  # one --run-once worker: start, one (partial) tiny training run, exit
SERVER_TIMEOUT_S = 120


# ---- processes this module starts ---------------------------------------------------------------


def _tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class MlflowServer:
    """``mlflow server`` with a SQLite backend store and served artifacts, started on 127.0.0.1.

    The process starts at once; ``wait_healthy`` blocks until ``GET /health`` answers, so the
    server can come up while the deployment is registered."""

    def __init__(self, home: Path):
        from flows.runtime import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = home / "server.log"
        cmd = [str(Path(sys.executable).with_name("mlflow")), "server",
               "--backend-store-uri", f"sqlite:///{home}/mlflow.db",
               "--artifacts-destination", str(home / "artifacts"), "--serve-artifacts",
               "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1], "--workers", "1"]
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, cwd=home, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True)

    def wait_healthy(self, timeout_s: float = SERVER_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while not _healthy(f"{self.url}/health"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer {self.url}/health:\n{_tail(self.log)}")
            time.sleep(0.5)

    def stop(self) -> None:
        _stop(self.proc)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    try:
        yield server
    finally:
        server.stop()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _run_worker(api: str, home: Path, log: Path) -> int:
    """``prefect worker start --pool POOL --run-once``: runs what is scheduled now, then exits."""
    env = {**os.environ, "PREFECT_API_URL": api, "PREFECT_HOME": str(home), "PYTHONPATH": str(ROOT),
           "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)  # the flow run starts its own local Ray (placement.ray_address unset)
    cmd = [sys.executable, "-m", "prefect", "worker", "start", "--pool", POOL, "--type", "process", "--run-once"]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return proc.wait(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"worker --run-once did not finish in {WORKER_TIMEOUT_S} s:\n{_tail(log)}")
    finally:
        _stop(proc)


# ---- the deployment run --------------------------------------------------------------------------


def _tiny_deployment_file(path: Path, run_root: Path, train: str, val: str, mlflow_uri: str) -> None:
    """deployments/prefect.yaml reduced to its ``train`` deployment, with the tiny config (with the
    test's fault plugin) as its ``config`` parameter and the test's work pool."""
    write_train_deployment(path, tiny_overrides(str(run_root), train, val, **{
        "trainer.run_id": RUN_ID,
        "trainer.dataflow": "tests.integration.fault_plugins:build_dataflow",
        "trainer.plugins": "[tests.integration.fault_plugins]",
        "tracking.mlflow_uri": mlflow_uri,
        "tracking.experiment": "servers-test",
    }), POOL)


@pytest.fixture(scope="module")
def deployed_run(prefect_api, mlflow_server, arith_files, tmp_path_factory):
    """Deploy, run (fails in iteration 2), retry through the API (completes). Returns what the
    tests read: the flow run id, the run directory, worker logs and both attempts' states."""
    from prefect.client.orchestration import get_client
    from prefect.states import Scheduled

    from flows.cli import build_parser
    from flows.cli.deploy import run as deploy

    tmp = tmp_path_factory.mktemp("deployed")
    run_dir = tmp / "runs" / RUN_ID
    prefect_file = tmp / "prefect.yaml"
    _tiny_deployment_file(prefect_file, tmp / "runs", *arith_files, mlflow_server.url)
    args = build_parser().parse_args(["deploy", "-n", "train", "--prefect-yaml", str(prefect_file),
                                      "--api-url", prefect_api, "--timeout-s", "30"])
    assert deploy(args) == 0
    mlflow_server.wait_healthy()

    # the gate node fails twice in iteration 2 (its one retry included): the flow run fails
    run_dir.mkdir(parents=True)
    (run_dir / "fail_plan.json").write_text(json.dumps({"iteration": 2, "failures": 2}))
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("train/train")
        flow_run = client.create_flow_run_from_deployment(deployment.id)
    _run_worker(prefect_api, tmp, tmp / "worker-1.log")  # the flow run fails: its exit code is not checked
    with get_client(sync_client=True) as client:
        first = client.read_flow_run(flow_run.id)
        execution_after_first = _execution_counts(run_dir)
        # retry from the API, as the UI's "Retry" does: the same flow run goes back to Scheduled
        client.set_flow_run_state(flow_run.id, Scheduled(), force=True)
    second_rc = _run_worker(prefect_api, tmp, tmp / "worker-2.log")
    with get_client(sync_client=True) as client:
        second = client.read_flow_run(flow_run.id)
    return {
        "flow_run_id": flow_run.id, "deployment": deployment, "run_dir": run_dir, "tmp": tmp,
        "first": first, "second": second, "second_rc": second_rc,
        "execution_after_first": execution_after_first,
    }


def _execution_counts(run_dir: Path) -> dict[int, Counter]:
    from tasks.common import read_execution_log

    out: dict[int, Counter] = {}
    for e in read_execution_log(str(run_dir)):
        out.setdefault(e["iteration"], Counter())[e["node"]] += 1
    return out


def _worker_logs(run: dict) -> str:
    return "\n--- worker 2 ---\n".join(_tail(run["tmp"] / f"worker-{i}.log", 60) for i in (1, 2))


# ---- tests ---------------------------------------------------------------------------------------


def test_deploy_registers_train_with_the_tiny_config(deployed_run, arith_files):
    dep = deployed_run["deployment"]
    assert dep.entrypoint == "flows/train.py:train"
    assert dep.work_pool_name == POOL
    cfg = dep.parameters["config"]
    assert cfg["model"]["path"] == "tiny"
    assert cfg["data"]["train_files"] == [arith_files[0]]
    assert cfg["trainer"]["run_id"] == RUN_ID


def test_worker_runs_the_deployment_run_then_the_retry_completes(deployed_run):
    first, second = deployed_run["first"], deployed_run["second"]
    assert first.state.is_failed(), (first.state, _worker_logs(deployed_run))
    assert "injected failure" in (first.state.message or ""), first.state.message
    assert second.state.is_completed(), (second.state, _worker_logs(deployed_run))
    assert second.run_count == 2  # the same flow run, run twice
    assert deployed_run["second_rc"] == 0, _worker_logs(deployed_run)
    summary = json.loads((deployed_run["run_dir"] / "summary.json").read_text())
    assert summary["iterations"] == 2
    assert Path(summary["checkpoint"]).name == checkpoint_name(2)
    assert summary["prefect_flow_run_id"] == str(deployed_run["flow_run_id"])


def test_task_runs_and_logs_are_readable_through_the_api(deployed_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId, LogFilter

    run_id = deployed_run["flow_run_id"]
    with get_client(sync_client=True) as client:
        subflows = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[run_id])))
        by_name: dict[str, list] = {}
        for r in subflows:
            by_name.setdefault(r.name, []).append(r)
        # iteration 1 ran once; iteration 2 failed in the first attempt and completed in the retry
        assert sorted(by_name) == ["iteration-000001", "iteration-000002"], sorted(by_name)
        assert [r.state.type.value for r in by_name["iteration-000001"]] == ["COMPLETED"]
        states2 = sorted(r.state.type.value for r in by_name["iteration-000002"])
        assert states2[-1] == "FAILED" and "COMPLETED" in states2, states2
        # each iteration's attempts hang under one parent task run of the train flow run, named
        # for the iteration (flows/train.py: _key_by_iteration), and all of those completed
        parents = {t.id: t for t in client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [run_id]}))}
        for name, runs in by_name.items():
            assert {parents[r.parent_task_run_id].name for r in runs} == {f"iteration-{int(name[-6:])}"}, name
        assert all(t.state.is_completed() for t in parents.values()), [(t.name, t.state) for t in parents.values()]
        checkpoints = sorted(t.name for t in parents.values() if t.name.startswith("checkpoint"))
        assert checkpoints == ["checkpoint-000001", "checkpoint-000002"], checkpoints
        done2 = next(r for r in by_name["iteration-000002"] if r.state.is_completed())
        tasks = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [done2.id]}))
        names = {t.name for t in tasks}
        assert {"rollout-000002", "reward-000002", "gate-000002", "advantage-000002",
                "update_policy-000002"} <= names, names
        assert all(t.state.is_completed() for t in tasks), [(t.name, t.state.type) for t in tasks]
        logs = client.read_logs(LogFilter(flow_run_id={"any_": [run_id]}))
        messages = [log.message for log in logs]
        assert any(m.startswith(f"run {RUN_ID} in ") for m in messages), messages[:20]
        assert any(m.startswith("summary: ") for m in messages), messages[-20:]
        sub_logs = [log.message for log in client.read_logs(LogFilter(flow_run_id={"any_": [done2.id]}))]
        assert any(m.startswith("iteration 2: score ") for m in sub_logs), sub_logs
        task_logs = [log.message for log in client.read_logs(
            LogFilter(task_run_id={"any_": [t.id for t in tasks if t.name == "update_policy-000002"]}))]
        assert any(m.startswith("policy update at version 1") for m in task_logs), task_logs


def test_retry_resumes_from_the_completed_nodes(deployed_run):
    before = deployed_run["execution_after_first"]
    assert before[2]["rollout"] == 1 and before[2]["reward"] == 1 and before[2]["gate"] == 2, before
    assert "advantage" not in before[2]
    after = _execution_counts(deployed_run["run_dir"])
    # iteration 1 was checkpointed: nothing of it ran again; in iteration 2 rollout and reward
    # were loaded from their persisted results, the gate ran a third time (and passed)
    assert after[1] == before[1], (before[1], after[1])
    c = after[2]
    assert (c["rollout"], c["reward"], c["gate"], c["advantage"], c["update_policy"]) == (1, 1, 3, 1, 1), c


def test_metrics_reach_the_mlflow_server_over_http(deployed_run, mlflow_server):
    from mlflow.tracking import MlflowClient

    summary = json.loads((deployed_run["run_dir"] / "summary.json").read_text())
    assert summary["mlflow_uri"] == mlflow_server.url
    ml = MlflowClient(mlflow_server.url)
    run = ml.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == str(deployed_run["flow_run_id"])
    assert run.data.params["model.path"] == "tiny"
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/step"):
        steps = sorted(m.step for m in ml.get_metric_history(run.info.run_id, key))
        assert steps == [1, 2], (key, steps)  # iteration 1 from the first attempt, 2 from the retry
    artifacts = {a.path for a in ml.list_artifacts(run.info.run_id)}
    assert "config.yaml" in artifacts, artifacts
