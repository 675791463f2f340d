"""lm-eval during training (``trainer.eval``) and on a checkpoint (``hybridflow eval --harness``),
against the real Prefect server, Ray and MLflow, on the tiny model and a local lm-eval task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flows.cli import main
from tests.integration.conftest import tiny_overrides

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _flow_runs_named(prefix: str) -> list:
    import asyncio

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    async def read():
        async with get_client() as client:
            return await client.read_flow_runs(flow_filter=FlowFilter(name=FlowFilterName(any_=["harness-evaluate"])))

    return [r for r in asyncio.run(read()) if r.name.startswith(prefix)]


def test_training_evaluates_its_checkpoints_with_lm_eval_and_the_cli_agrees(prefect_api, ray_cluster, arith_files,
                                                                            tmp_path):
    """examples/grpo_arith_lmeval.yaml on the tiny model for 2 iterations, evaluating every checkpoint."""
    import mlflow

    from flows.train import train
    from hybridflow.data.io import read_records
    from hybridflow.evals.lm_eval_tasks import write_local_task

    train_file, val_file = arith_files
    tasks = tmp_path / "lm_eval"
    write_local_task(read_records(val_file), "arith_local", tasks, max_gen_toks=8)  # the example's task name
    ov = tiny_overrides(str(tmp_path / "runs"), train_file, val_file, **{
        "trainer.run_id": "tiny-lmeval", "trainer.total_iterations": "2", "trainer.save_every": "1",
        "trainer.val_every": "0", "trainer.val_before_train": "false",
        "trainer.eval.include_path": str(tasks), "trainer.eval.every": "1", "trainer.eval.cpus": "0.5",
        "placement.pools.main.cpus_per_worker": "1", "placement.pools.reward.cpus_per_worker": "0.25"})
    summary = train(config_path=str(EXAMPLES / "grpo_arith_lmeval.yaml"), overrides=ov)
    run_dir = Path(summary["run_dir"])
    key = "eval/arith_local/exact_match_boxed"
    assert summary["harness_eval"]["failed"] == {}
    assert sorted(summary["harness_eval"]["evaluated"]) == [0, 1, 2]  # the initial model, then each checkpoint
    assert all(set(m) == {key, "eval/arith_local/exact_match_flexible"} for m in summary["harness_eval"]["evaluated"].values())

    # one eval folder per checkpoint (the initial model's beside the run), each with every document's sample
    folders = {json.loads((d / "harness.json").read_text())["step"]: d for d in run_dir.glob("evals/harness-*")}
    assert sorted(folders) == [1, 2]
    (initial,) = (tmp_path / "runs" / "evals").glob("harness-*")
    assert json.loads((initial / "harness.json").read_text())["model_path"] == "tiny"
    samples = [json.loads(line) for line in (folders[1] / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and {s["task"] for s in samples} == {"arith_local"}

    # the training's MLflow run has the metric at steps 0, 1, 2, and the samples as artifacts
    client = mlflow.tracking.MlflowClient(f"sqlite:///{tmp_path / 'runs'}/mlflow.db")
    history = client.get_metric_history(summary["mlflow_run_id"], key)
    assert sorted(m.step for m in history) == [0, 1, 2]
    arts = {a.path for a in client.list_artifacts(summary["mlflow_run_id"], "lm_eval/iter_000001")}
    assert {"lm_eval/iter_000001/harness.json", "lm_eval/iter_000001/samples.jsonl"} <= arts

    # each evaluation was a flow run of its own
    assert len(_flow_runs_named("lm-eval-tiny-lmeval")) == 2

    # the CLI on checkpoint 1: same model, same greedy generations as the evaluation during training
    assert main(["eval", "--harness", "lm-eval", "--model", str(run_dir), "--step", "1", "--tasks", "arith_local",
                 "--include-path", str(tasks)]) == 0
    newest = max(run_dir.glob("evals/harness-*"), key=lambda d: d.stat().st_mtime)
    again = [json.loads(line) for line in (newest / "samples.jsonl").read_text().splitlines()]
    assert [s["response"] for s in again] == [s["response"] for s in samples]


def test_bad_harness_input_is_one_line_before_anything_starts(tmp_path, capsys, arith_files):
    from hybridflow.data.io import read_records
    from hybridflow.evals.lm_eval_tasks import write_local_task

    train_file, val_file = arith_files
    tasks = tmp_path / "lm_eval"
    write_local_task(read_records(val_file), "arith_tiny", tasks)
    cases = [
        (["eval", "--harness", "lm-eval", "--model", "tiny", "--tasks", "arith_tny", "--include-path", str(tasks)],
         "unknown lm-eval task 'arith_tny'"),
        (["eval", "--harness", "lm-eval", "--model", "tiny", "--tasks", "gsm8k"], "from the Hugging Face hub"),
        (["eval", "--harness", "lm-eval", "--model", "tiny", "--tasks", "arith_tiny", "--data", val_file],
         "with --harness the tasks say"),
        (["eval", "--harness", "lm-eval", "--model", "tiny"], "no lm-eval tasks"),
        (["train", *tiny_overrides(str(tmp_path / "runs"), train_file, val_file, **{
            "trainer.eval.tasks": "[arith_tny]", "trainer.eval.include_path": str(tasks)})],
         "trainer.eval: unknown lm-eval task 'arith_tny'"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert msg in err[-1], (argv, err)
    assert not list((tmp_path / "runs").glob("*/run.json"))  # no run was opened
