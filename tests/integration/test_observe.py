"""Where users look (issue 18), on ONE tiny run of the README's train command:

- ``hybridflow train -c examples/grpo_arith.yaml ...`` in a subprocess with a non-terminal stdout
  (the console a CI log gets), against the session's real Prefect server, MLflow in SQLite;
- the Prefect API then holds the iteration table artifacts (one version per iteration, the
  values of metrics.jsonl), the progress artifact at 100 %, the validation tables, the summary
  artifact and the hybridflow.* events of that flow run;
- MLflow holds a training run (experiment kind, model outputs), the dataset inputs, the
  generations table and system metrics; ``export --register`` makes a model version;
- the automation of deployments/automations.yaml pauses a deployment when a run of it stops on
  the NaN guard (the event emitted by the flow's own reporter code, for a real flow run);
- the rest of the README quick reference runs on that run: eval, export (resume: test_reliability_runs.py).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

import pytest

from flows.cli import main
from tests.integration.conftest import tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = "observed"
ITERATIONS = 2


@pytest.fixture(scope="module")
def cli_run(prefect_api, arith_files, tmp_path_factory):
    """The README's `hybridflow train -c examples/grpo_arith.yaml trainer.total_iterations=...` with
    the tiny model, stdout/stderr to files (not a terminal)."""
    tmp = tmp_path_factory.mktemp("observe")
    ov = tiny_overrides(str(tmp / "runs"), *arith_files, **{
        "trainer.run_id": RUN_ID, "trainer.total_iterations": str(ITERATIONS), "trainer.save_every": "1",
        "trainer.val_every": "2", "trainer.val_before_train": "true", "tracking.system_metrics": "true",
        "tracking.log_samples_every": "1", "tracking.log_model": "final",
    })
    env = {**os.environ, "PREFECT_API_URL": prefect_api, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    out, err = tmp / "stdout.txt", tmp / "stderr.txt"
    started = datetime.now(UTC)  # the Prefect server is the session's: earlier tests' runs log there too
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.run([sys.executable, "-m", "flows.cli", "train", "-c", "examples/grpo_arith.yaml", *ov],
                              cwd=ROOT, env=env, stdout=o, stderr=e, timeout=600)
    assert proc.returncode == 0, (out.read_text()[-3000:], err.read_text()[-3000:])
    run_dir = tmp / "runs" / RUN_ID
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"tmp": tmp, "run_dir": run_dir, "summary": summary, "stdout": out.read_text(),
            "stderr": err.read_text(), "overrides": ov, "api": prefect_api, "started": started}


def _metrics(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["iteration"]: r["metrics"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


# ---- the console -------------------------------------------------------------------------------


def test_console_is_a_few_plain_lines_per_iteration(cli_run):
    out, err = cli_run["stdout"], cli_run["stderr"]
    lines = out.splitlines()
    per_iteration = [ln for ln in lines if re.match(rf"iteration \d/{ITERATIONS} ", ln)]
    assert len(per_iteration) == ITERATIONS, out
    assert "score " in per_iteration[0] and "ETA" in per_iteration[0], per_iteration
    assert sum(ln.startswith(("validation before training", "validation after iteration")) for ln in lines) == 2, out
    for text in (out, err):
        assert "Finished in state" not in text, text[-2000:]
        assert not re.search(r"\((\w+ )?pid=\d+", text), text[-2000:]  # Ray's worker prefixes
        assert "Task run" not in text and "Flow run" not in text, text[-2000:]
        assert "workers.generation" not in text and "workers.training" not in text, text[-2000:]  # worker lines: Prefect only
    # the summary table and the UI commands follow; the whole console stays short
    assert "hybridflow run summary" in out
    assert len(lines) <= 4 * ITERATIONS + 30, out
    assert len(err.splitlines()) <= 3, err  # e.g. Ray's one-line token-auth notice


def test_workers_reported_progress_to_the_run_folder(cli_run):
    """The pool ranks (Ray actors) wrote their last counts where the live display reads them."""
    from workers.progress import read_progress

    phases = {p.phase: p for p in read_progress(str(cli_run["run_dir"]))}
    assert {"generating", "validating", "updating policy"} <= set(phases), phases
    for p in phases.values():
        assert p.total > 0 and p.done == p.total, p
    # the last iteration: 2 prompts × 2 samples (tiny_overrides); the last validation: one per test prompt
    assert phases["generating"].total == 4, phases


def _task_logs(client, since: datetime) -> list[str]:
    """Messages of task-run logs written since ``since`` (this module's run: the tests run one by one)."""
    out, offset = [], 0
    while batch := client.read_logs(limit=200, offset=offset):
        out += [log.message for log in batch if log.task_run_id is not None and log.timestamp >= since]
        offset += len(batch)
    return out


def test_worker_lines_reach_the_prefect_task_logs(cli_run):
    """What a pool rank logs during a call is in the Prefect task run's logs (quiet console)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        deadline = time.monotonic() + 60
        while True:  # task logs are shipped to the API in batches
            logs = _task_logs(client, cli_run["started"])
            gen = [m for m in logs if re.search(r"\[\w+ rank 0 policy\.generate_sequences\] INFO workers\.generation: "
                                                r"rank 0 generated 4 trajectories", m)]
            upd = [m for m in logs if re.search(r"\[\w+ rank 0 policy\.update_policy\] INFO workers\.training: "
                                                r"actor update: 1 optimizer steps", m)]
            if (len(gen) >= ITERATIONS and len(upd) >= ITERATIONS) or time.monotonic() > deadline:
                break
            time.sleep(2)
    assert len(gen) == ITERATIONS and len(upd) == ITERATIONS, [m for m in logs if "rank 0" in m][:20]


# ---- Prefect: artifacts and events ---------------------------------------------------------------


def _artifacts(client, key: str) -> list:
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    return client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])),
                                 sort=ArtifactSort.CREATED_DESC)[::-1]


def _data(artifact) -> object:
    return json.loads(artifact.data) if isinstance(artifact.data, str) else artifact.data


def test_prefect_artifacts_of_the_run(cli_run):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterType

    flow_run_id = cli_run["summary"]["prefect_flow_run_id"]
    metrics = _metrics(cli_run["run_dir"])
    with get_client(sync_client=True) as client:
        iterations = _artifacts(client, f"{RUN_ID}-iteration")
        assert len(iterations) == ITERATIONS, iterations
        for it, art in enumerate(iterations, start=1):
            assert str(art.flow_run_id) == flow_run_id and art.type == "table"
            rows = {r["metric"]: r["value"] for r in _data(art)}
            assert {r["iteration"] for r in _data(art)} == {it}
            for key in ("critic/score/mean", "response_length/mean", "actor/pg_clipfrac", "timing_s/step"):
                assert rows[key] == metrics[it][key], (it, key)
        validations = _artifacts(client, f"{RUN_ID}-validation")
        assert len(validations) == 2  # before training and after iteration 2
        val_rows = _data(validations[-1])
        assert {r["data_source"] for r in val_rows} == {"arith"}
        after = cli_run["summary"]["val_after"]
        assert {f"val-core/{r['data_source']}/{r['metric']}": r["value"] for r in val_rows} == after
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), type=ArtifactFilterType(any_=["progress"])))
        assert len(progress) == 1 and float(_data(progress[0])) == 100.0, progress
        (summary,) = _artifacts(client, f"{RUN_ID}-summary")
        assert summary.type == "markdown"
        assert cli_run["summary"]["mlflow_run_id"] in summary.data
        assert cli_run["summary"]["checkpoint"] in summary.data


def _events(api: str, flow_run_id: str, expect: int, timeout_s: float = 60.0) -> list[dict]:
    """The hybridflow.* events about the flow run (events are persisted asynchronously: poll)."""
    body = json.dumps({"filter": {"event": {"prefix": ["hybridflow."]},
                                  "any_resource": {"id": [f"prefect.flow-run.{flow_run_id}"]}},
                       "limit": 50}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        req = urllib.request.Request(f"{api}/events/filter", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            events = json.loads(r.read())["events"]
        if len(events) >= expect or time.monotonic() > deadline:
            return events
        time.sleep(1)


def test_prefect_events_of_the_run(cli_run):
    flow_run_id = cli_run["summary"]["prefect_flow_run_id"]
    events = _events(cli_run["api"], flow_run_id, expect=ITERATIONS + 2)
    names = sorted(e["event"] for e in events)
    assert names == ["hybridflow.iteration.completed"] * ITERATIONS + ["hybridflow.validation.completed"] * 2, names
    metrics = _metrics(cli_run["run_dir"])
    for e in events:
        assert e["resource"]["prefect.resource.id"] == f"prefect.flow-run.{flow_run_id}"
        assert e["resource"]["hybridflow.run-id"] == RUN_ID
        if e["event"] == "hybridflow.iteration.completed":
            it = e["payload"]["iteration"]
            assert e["payload"]["metrics"]["critic/score/mean"] == metrics[it]["critic/score/mean"]
        else:
            assert e["resource"]["hybridflow.val-regressed"] in ("true", "false")


def test_automation_pauses_the_deployment_when_a_run_stops_on_nan(cli_run, monkeypatch):
    """deployments/automations.yaml as `hybridflow deploy` creates it; a flow run of a deployment;
    the flow's reporter emits hybridflow.run.stopped (nan_guard) for that run: the deployment pauses."""
    from prefect.client.orchestration import get_client

    from flows.artifacts import PrefectReporter
    from flows.cli.deploy import deploy_automations

    deploy_automations(cli_run["api"], ROOT / "deployments" / "automations.yaml")
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow_from_name("train")
        deployment_id = client.create_deployment(flow_id=flow_id, name="observe-automation",
                                                 entrypoint="flows/train.py:train")
        other_id = client.create_deployment(flow_id=flow_id, name="observe-untouched", entrypoint="flows/train.py:train")
        flow_run = client.create_flow_run_from_deployment(deployment_id)
        other_run = client.create_flow_run_from_deployment(other_id)
    # prefect.runtime reads the flow run (and its deployment) from the API, as inside that run
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(other_run.id))
    PrefectReporter("other", str(other_run.id), 5, alert_val_drop=0.05).stopped("error", "a node failed")
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", str(flow_run.id))
    PrefectReporter("nan-run", str(flow_run.id), 5, alert_val_drop=0.05).stopped("nan_guard", "3 NaN updates in a row")
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=30)
    deadline = time.monotonic() + 90
    with get_client(sync_client=True) as client:
        while not client.read_deployment(deployment_id).paused and time.monotonic() < deadline:
            time.sleep(1)
        assert client.read_deployment(deployment_id).paused
        assert not client.read_deployment(other_id).paused  # a plain failure does not pause


# ---- MLflow ---------------------------------------------------------------------------------------


def test_mlflow_training_run_with_model_inputs_table_and_system_metrics(cli_run):
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{cli_run['tmp'] / 'runs'}/mlflow.db"
    ml = MlflowClient(uri)
    run = ml.get_run(cli_run["summary"]["mlflow_run_id"])
    assert ml.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    # the MLflow 3 UI counts a run with model outputs as a training run
    outputs = run.outputs.model_outputs
    assert [o.step for o in outputs] == [ITERATIONS], outputs
    model = ml.get_logged_model(outputs[0].model_id)
    assert model.source_run_id == run.info.run_id
    assert cli_run["summary"]["mlflow_model_uri"] == f"models:/{model.model_id}"
    contexts = sorted(next(t.value for t in d.tags if t.key == "mlflow.data.context") for d in run.inputs.dataset_inputs)
    assert contexts == ["training", "validation"], run.inputs
    mlflow.set_tracking_uri(uri)  # load_table searches runs through the fluent API
    table = ml.load_table(run.info.experiment_id, "samples/iter_000001.json", run_ids=[run.info.run_id])
    assert {"prompt", "response", "score"} <= set(table.columns) and len(table) > 0
    assert any(k.startswith("system/") for k in run.data.metrics), sorted(run.data.metrics)


# ---- the rest of the README quick reference on this run -------------------------------------------


def test_export_registers_a_model_version(cli_run):
    from mlflow.tracking import MlflowClient

    out = cli_run["tmp"] / "out" / "model"
    assert main(["export", str(cli_run["run_dir"]), "--step", "1", str(out), "--register", "observed-policy"]) == 0
    assert (out / "config.json").is_file()
    ml = MlflowClient(f"sqlite:///{cli_run['tmp'] / 'runs'}/mlflow.db")
    (version,) = ml.search_model_versions("name='observed-policy'")
    assert int(version.version) == 1
    run = ml.get_run(cli_run["summary"]["mlflow_run_id"])
    # step 1 had no logged model (tracking.log_model=final): it is logged now, as an output of the run
    assert version.source == run.data.tags["hybridflow.model_uri.step_000001"]
    assert sorted(o.step for o in ml.get_run(run.info.run_id).outputs.model_outputs) == [1, ITERATIONS]
    # the README's `export runs/<run_id> out/latest --register NAME`: the final checkpoint's logged model
    assert main(["export", str(cli_run["run_dir"]), str(out.with_name("latest")), "--register", "observed-policy"]) == 0
    v2 = ml.get_model_version("observed-policy", "2")
    assert v2.source == cli_run["summary"]["mlflow_model_uri"]
    assert len(ml.get_run(run.info.run_id).outputs.model_outputs) == 2  # nothing logged twice


def test_quick_reference_eval_runs_on_the_tiny_run(cli_run, capsys):
    """(`hybridflow train --resume runs/<run_id>` is run by test_reliability_runs.py, in a subprocess.)"""
    run_dir, ov = cli_run["run_dir"], cli_run["overrides"]
    # `hybridflow eval --model runs/<run_id>/checkpoints/latest -c examples/grpo_arith.yaml` (+ tiny data/pools)
    keep = [o for o in ov if not o.startswith("model.path=")]
    assert main(["eval", "--model", str(run_dir / "checkpoints" / "latest"), "-c", "examples/grpo_arith.yaml",
                 *keep]) == 0
    assert "mean@1" in capsys.readouterr().out
