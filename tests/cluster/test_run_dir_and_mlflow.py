"""One ``hybridflow train`` on the two-node Ray cluster with a *relative* ``trainer.run_dir``,
logging to the MLflow server whose backend store is PostgreSQL (tests/cluster/postgres.py).

- Shared storage: the driver runs in ``<cluster>/driver-relative`` with ``trainer.run_dir=runs``;
  the 2-rank policy pool (STRICT_SPREAD) runs in the nodes' own working directories. Every writer
  — the CLI's lock, batches and checkpoints written by the ranks, Prefect's result storage, the
  ledger — used ``<driver cwd>/runs/<run id>``, and no node's working directory got a run folder.
- MLflow: the run's metrics, the table of sample generations, the reward plot and the final
  checkpoint logged as an MLflow model are read back over HTTP (``MlflowClient(server URL)``,
  artifacts through the server's ``mlflow-artifacts:`` proxy); the rows are in PostgreSQL.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cluster.conftest import train_cli
from tests.cluster.shared_storage import assert_one_run_folder, wait_watching_lock
from tests.integration.conftest import tiny_overrides
from workers.checkpoint import checkpoint_name

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(1200)]
RUN_ID = "relative"


@pytest.fixture(scope="module")
def relative_run(mlflow_server, cluster, prefect_api, data, mlflow_url):
    driver = cluster.root / "driver-relative"
    ov = tiny_overrides("runs", str(data / "train.parquet"), str(data / "val.parquet"), **{
        "trainer.run_id": RUN_ID,
        "trainer.total_iterations": "1",
        "reward.function": f"{data / 'varied_reward.py'}:compute_score",
        "placement.ray_address": cluster.address,
        "placement.pools.main.workers": "2",
        "placement.pools.main.roles": "[policy]",
        "placement.pools.main.placement_strategy": "STRICT_SPREAD",
        "tracking.mlflow_uri": mlflow_url,
        "tracking.experiment": "cluster-relative",
        "tracking.log_model": "final",
    })
    log = cluster.root / f"{RUN_ID}.log"
    proc = train_cli(ov, cwd=driver, log=log, prefect_api=prefect_api)
    rc, holder = wait_watching_lock(proc, log, driver / "runs" / RUN_ID / "run.lock")
    text = log.read_text(errors="replace")
    assert rc == 0, text[-4000:]
    return {"dir": driver / "runs" / RUN_ID, "holder": holder, "pid": proc.pid, "log": text}


def test_a_relative_run_dir_is_one_folder_for_every_node(cluster, relative_run):
    run_dir = relative_run["dir"]
    # the CLI (the driver) held the lock in that folder while it ran, and removed it at exit
    assert relative_run["holder"].get("pid") == relative_run["pid"], relative_run["holder"]
    assert not (run_dir / "run.lock").exists()
    started = [json.loads(x) for x in (run_dir / "pool_events.jsonl").read_text().splitlines()]
    main = {e["node_id"] for e in started if e["event"] == "started" and e["pool"] == "main"}
    assert len(main) == 2, started  # the two ranks (and so their writes) on two nodes
    assert_one_run_folder(run_dir, {str(n.cwd) for n in cluster.nodes}, iterations=1)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["run_dir"] == str(run_dir.resolve())


def test_mlflow_on_postgres_serves_metrics_samples_plot_and_model(relative_run, mlflow_url, postgres, tmp_path):
    from mlflow.tracking import MlflowClient

    summary = json.loads((relative_run["dir"] / "summary.json").read_text())
    assert summary["mlflow_uri"] == mlflow_url
    client = MlflowClient(mlflow_url)
    run = client.get_run(summary["mlflow_run_id"])
    run_id = run.info.run_id
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith("mlflow-artifacts:"), run.info.artifact_uri  # served over HTTP
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean", "timing_s/step"):
        assert [m.step for m in client.get_metric_history(run_id, key)] == [1], key
    score = client.get_metric_history(run_id, "critic/score/mean")[0].value

    table = json.loads(Path(client.download_artifacts(run_id, "samples/iter_000001.json", str(tmp_path))).read_text())
    assert {"prompt", "response", "ground_truth", "score"} <= set(table["columns"]), table["columns"]
    scores = [row[table["columns"].index("score")] for row in table["data"]]
    assert len(scores) == 4  # 2 prompts × 2 samples: the whole batch
    assert sum(scores) / len(scores) == pytest.approx(score)  # the rows are the ones the metric averaged

    png = Path(client.download_artifacts(run_id, "plots/reward_curve.png", str(tmp_path))).read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 1000

    import mlflow.artifacts

    model_id = summary["mlflow_model_uri"].removeprefix("models:/")
    model = client.get_logged_model(model_id)
    assert model.source_run_id == run_id
    # by the model's artifact location (mlflow-artifacts:/...): a models:/ URI would be resolved
    # against the default tracking URI (a SQLite file in the working directory), not mlflow_url
    assert model.artifact_location.startswith("mlflow-artifacts:"), model.artifact_location
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=model.artifact_location,
                                                      dst_path=str(tmp_path / "model"), tracking_uri=mlflow_url))
    weights = list(folder.rglob("model.safetensors"))  # the HF folder, the model's hf_model artifact
    ckpt = relative_run["dir"] / "checkpoints" / checkpoint_name(1) / "policy" / "model.safetensors"
    assert len(weights) == 1 and weights[0].read_bytes() == ckpt.read_bytes(), weights

    # the tracking server's backend store is the test's PostgreSQL
    assert int(postgres.query("mlflow", f"select count(*) from metrics where run_uuid = '{run_id}'")) > 0
    assert postgres.query("mlflow", f"select source_run_id from logged_models where model_id = '{model_id}'") == run_id
