"""The ``harness-evaluate`` flow: a checkpoint of a run, or a model, on standard-harness tasks (lm-eval).

    hybridflow eval --harness lm-eval --tasks arith_local --include-path evals/lm_eval --model runs/grpo-arith

Each evaluation is a flow run of its own: the target resolved and the tasks checked offline
(:func:`flows.eval_plan.plan_harness_evaluation`), an evaluator pool brought up with the model
under evaluation (:class:`workers.evaluator.HarnessEvaluator`, never the live policy), the
``lm_eval`` task run on it, the pool taken down. Results go to

- ``<eval dir>/harness.json`` (metrics, documents per task, versions) and ``samples.jsonl`` (lm-eval's
  ``--log_samples``: prompt document, response, extracted answer, score), in
  ``<run_dir>/evals/harness-<time>-<what>-<id>/`` (``<trainer.run_dir>/evals/...`` for a model);
- MLflow: with ``mlflow_run_id`` (a training's run, :mod:`flows.harness_schedule`) the metrics
  ``eval/<task>/<metric>`` at the checkpoint's iteration as step in that run, else a run of its own
  (tag ``hybridflow.kind=harness-evaluate``); ``harness.json`` and the samples as artifacts;
- a Prefect markdown artifact with the table (key ``lm-eval-<run>``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.eval_plan import EvalTarget, plan_harness_evaluation
from flows.evaluate import eval_context
from hybridflow.config import ExperimentConfig


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def markdown_table(label: str, step: int | None, metrics: dict[str, float], n_samples: dict[str, int]) -> str:
    """The result as a markdown table: task | metric | value | documents."""
    lines = [f"# lm-eval: {label}" + (f" (iteration {step})" if step is not None else ""), "",
             "| task | metric | value | documents |", "|---|---|---:|---:|"]
    for key in sorted(metrics):
        _, task, metric = key.split("/", 2)
        lines.append(f"| {task} | {metric} | {metrics[key]:.4f} | {n_samples.get(task, '')} |")
    return "\n".join(lines)


def _track(cfg: ExperimentConfig, target: EvalTarget, summary: dict[str, Any], samples_path: Path,
           mlflow_run_id: str | None) -> None:
    """Metrics at the checkpoint's iteration in ``mlflow_run_id`` (a training's run) or in a run
    of its own; harness.json and samples.jsonl as artifacts. Fills summary's MLflow ids."""
    from mlflow.tracking import MlflowClient

    from flows.tracking import Tracker, log_metrics, tracking_uri

    step = target.step or 0
    if mlflow_run_id:
        client, run_id = MlflowClient(tracking_uri(cfg)), mlflow_run_id
        log_metrics(client, run_id, summary["metrics"], step)
    else:
        tracker = Tracker(cfg, run_name=f"lm-eval-{target.label}",
                          tags={"hybridflow.kind": "harness-evaluate", "hybridflow.evaluated": target.label,
                                "hybridflow.model_path": target.model_path,
                                "prefect.flow_run_id": summary["prefect_flow_run_id"]})
        tracker.log_metrics(summary["metrics"], step=step)
        tracker.finish("FINISHED")
        client, run_id = tracker.client, tracker.run_id
    folder = f"lm_eval/iter_{step:06d}"
    client.log_dict(run_id, _jsonable(summary), f"{folder}/harness.json")
    if samples_path.is_file():
        client.log_artifact(run_id, str(samples_path), folder)
    summary["mlflow_run_id"] = run_id


def _artifact(table: str, eval_id: str, label: str) -> None:
    from prefect.artifacts import create_markdown_artifact

    from flows.artifacts import artifact_key

    try:
        create_markdown_artifact(table, key=artifact_key(eval_id, "lm-eval"), description=f"lm-eval of {label}")
    except Exception as e:  # noqa: BLE001 - reporting never fails an evaluation that has its results
        get_run_logger().warning("could not create the lm-eval artifact: %s", e)


def _run_name() -> str:
    params = prefect_flow_run.parameters or {}
    what = Path(str(params.get("run_dir") or params.get("model") or "model")).name
    return f"lm-eval-{what}-{params.get('checkpoint', 'latest')}" if params.get("run_dir") else f"lm-eval-{what}"


@flow(name="harness-evaluate", flow_run_name=_run_name, log_prints=True, persist_result=False)
def harness_evaluate(
    run_dir: str | None = None,
    checkpoint: str | int = "latest",
    model: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    tasks: list[str] | None = None,
    include_path: str | None = None,
    limit: int | None = None,
    apply_chat_template: bool | None = None,
    mlflow_run_id: str | None = None,
    log_to_training_run: bool = False,
) -> dict[str, Any]:
    """Evaluate checkpoint ``checkpoint`` of ``run_dir`` (under the run's config, or ``config_path``)
    or ``model`` on lm-eval ``tasks`` (default: the config's trainer.eval.tasks), reading task
    YAMLs from ``include_path`` too, the first ``limit`` documents of each. Metrics go to MLflow run
    ``mlflow_run_id``, or with ``log_to_training_run`` to the MLflow run of ``run_dir``'s training
    (what the scheduled ``lm-eval-latest`` deployment does), else to a run of their own.

    Returns {"evaluated", "model_path", "run_dir", "step", "tasks", "metrics" ({"eval/<task>/<metric>":
    value}), "n_samples", "versions", "eval_s", "eval_dir", "mlflow_run_id", "prefect_flow_run_id"}.
    Raises HarnessError / ValueError / FileNotFoundError before any pool starts; PoolError if the
    evaluator pool cannot start."""
    from flows.run_pools import open_pools
    from tasks.harness_eval import harness_eval

    target, cfg = plan_harness_evaluation(run_dir, checkpoint, model, config_path, overrides, {
        "tasks": tasks, "include_path": include_path, "limit": limit, "apply_chat_template": apply_chat_template})
    logger = get_run_logger()
    if log_to_training_run and not mlflow_run_id and target.run_dir:
        from flows.run_dir import RunDir

        mlflow_run_id = RunDir(target.run_dir).run_info().get("mlflow_run_id")
    run = eval_context(target, cfg, "harness")
    ev = cfg.trainer.eval
    logger.info("lm-eval %s on %s (limit %s) in %s", target.label, ",".join(ev.tasks), ev.limit, run.run_dir)
    with open_pools(cfg, ("evaluator",), namespace=run.namespace):
        result = harness_eval(run=run, tasks=list(ev.tasks))
    samples_path = Path(run.run_dir, "samples.jsonl")
    with samples_path.open("w") as f:
        for task_name, rows in result["samples"].items():
            for row in rows:
                f.write(json.dumps(_jsonable({"task": task_name, **row})) + "\n")
    summary: dict[str, Any] = {
        "evaluated": target.label, "model_path": target.model_path, "run_dir": target.run_dir, "step": target.step,
        "tasks": list(ev.tasks), "limit": ev.limit, "apply_chat_template": ev.apply_chat_template,
        "metrics": result["metrics"], "n_samples": result["n_samples"], "versions": _jsonable(result["versions"]),
        "eval_s": result["eval_s"], "eval_dir": run.run_dir, "prefect_flow_run_id": str(prefect_flow_run.id or ""),
    }
    _track(cfg, target, summary, samples_path, mlflow_run_id)
    Path(run.run_dir, "harness.json").write_text(json.dumps(_jsonable(summary), indent=2))
    table = markdown_table(target.label, target.step, result["metrics"], result["n_samples"])
    _artifact(table, run.run_id, target.label)
    logger.info("lm-eval of %s: %s (%.1f s)", target.label, json.dumps(result["metrics"]), result["eval_s"])
    return summary
