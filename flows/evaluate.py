"""The evaluate flow: a checkpoint of a run, or a model, on a dataset — pass@k / mean@k per data source.

Runs with the training machinery, not beside it: the prompts go through the same
PromptDataset, the pools of the policy and reward roles are brought up on Ray
(:func:`flows.run_pools.open_pools`; no reference, critic or KL is needed to evaluate), and the ``validate`` node task generates
and scores (``val-core/<data_source>/acc/mean@k``, and ``pass@k`` when k > 1). Results go to
MLflow as a run of their own in the experiment, tagged with what was evaluated, and to
``<eval dir>/eval.json``:

    <run_dir>/evals/eval-<time>-<what>-<id>/        (a run's checkpoint)
    <trainer.run_dir>/evals/eval-<time>-<what>-<id>/ (a model)
        config.yaml  eval.json  execution_log.jsonl
        iter_<step>/val_prompts.*  iter_<step>/validate.*   (the scored generations)

What is evaluated and under which config is decided by :func:`flows.eval_plan.plan_evaluation`,
which imports no Prefect: the CLI checks its arguments with it before it starts the Prefect
server (Prefect reads PREFECT_API_URL once, when it is imported).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run as prefect_flow_run

from flows.eval_plan import EvalTarget, plan_evaluation
from hybridflow.config import ExperimentConfig, dump_config
from tasks.common import RunContext, load_node_output, result_storage_path
from tasks.types import NodeResult
from tasks.validate import validate


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:60] or "model"


def eval_context(target: EvalTarget, cfg: ExperimentConfig, kind: str = "eval") -> RunContext:
    """A fresh ``<kind>-<time>-<what>-<id>`` folder under the run's ``evals/`` (a model's: under
    ``trainer.run_dir``) holding ``config.yaml``, and its RunContext (a Ray namespace of its own)."""
    from workers.pool import namespace_for

    eval_id = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{_slug(target.label)}-{uuid.uuid4().hex[:6]}"
    parent = Path(target.run_dir) / "evals" if target.run_dir else Path(cfg.trainer.run_dir) / "evals"
    eval_dir = (parent / eval_id).resolve()
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "config.yaml").write_text(dump_config(cfg))
    return RunContext(eval_id, str(eval_dir), target.step or 0, namespace_for(eval_id), cfg.trainer.seed,
                      cfg.model_dump(mode="json"))


def _save_prompts(run: RunContext, cfg: ExperimentConfig) -> tuple[NodeResult, Any]:
    """The evaluation prompts (the first ``data.val_max_prompts``) saved as the run's ``val_prompts``."""
    from hybridflow.data import PromptDataset, load_rows
    from hybridflow.models import load_tokenizer

    tokenizer = load_tokenizer(cfg.model)
    dataset = PromptDataset(load_rows(cfg.data.val_files, cfg.data), tokenizer, cfg.data)
    n = min(len(dataset), cfg.data.val_max_prompts or len(dataset))
    if n == 0:
        raise ValueError(f"{cfg.data.val_files} hold no usable prompt")
    batch = dataset.collate(list(range(n)))
    ref = batch.save(run.batch_uri("val_prompts"), run_id=run.run_id, iteration=run.iteration, node="val_prompts")
    return NodeResult(node="val_prompts", ref=ref), tokenizer


def _run_validate(run: RunContext, cfg: ExperimentConfig, prompts: NodeResult) -> NodeResult:
    """Bring up the pools of the ``validate`` node's roles (no checkpoint restore: the model path
    is the weights), run the node task, and take the pools down again."""
    from flows.run_pools import open_pools

    with open_pools(cfg, validate.roles, namespace=run.namespace):
        task = validate.task.with_options(result_storage=result_storage_path(run.run_dir))
        return task(run=run, val_prompts=prompts)


def per_source_table(metrics: dict[str, float], scored: Any, k: int) -> dict[str, dict[str, float]]:
    """{data_source: {"prompts": n, "mean@k": ..., "pass@k": ... (k > 1)}} from the validate
    node's metrics and the scored batch (prompts = distinct uids of that source)."""
    uids: dict[str, set] = {}
    for uid, src in zip(scored["uid"], scored["data_source"], strict=True):
        uids.setdefault(src, set()).add(uid)
    table = {}
    for src in sorted(uids):
        row = {"prompts": float(len(uids[src])), f"mean@{k}": metrics[f"val-core/{src}/acc/mean@{k}"]}
        if k > 1:
            row[f"pass@{k}"] = metrics[f"val-core/{src}/acc/pass@{k}"]
        table[src] = row
    return table


def _sample_rows(scored: Any, tokenizer: Any, limit: int = 16) -> list[dict[str, Any]]:
    rows = []
    for i in range(min(limit, len(scored))):
        ids = scored["response_ids"][i][scored["response_mask"][i]].tolist()
        rows.append({
            "prompt": scored["raw_prompt"][i] if "raw_prompt" in scored else "",
            "response": tokenizer.decode(ids, skip_special_tokens=True),
            "ground_truth": str(scored["ground_truth"][i]),
            "score": float(scored["score"][i]),
        })
    return rows


def _track(cfg: ExperimentConfig, target: EvalTarget, summary: dict[str, Any], samples: list[dict]) -> None:
    """One MLflow run in the experiment, tagged with what was evaluated; fills summary's MLflow ids."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from flows.tracking import Tracker, tracking_uri

    client = MlflowClient(tracking_uri(cfg))
    exp = client.get_experiment_by_name(cfg.tracking.experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(cfg.tracking.experiment)
    tags = {"hybridflow.kind": "evaluate", "hybridflow.evaluated": target.label,
            "hybridflow.model_path": target.model_path, "prefect.flow_run_id": summary["prefect_flow_run_id"]}
    if target.run_dir:
        tags |= {"hybridflow.run_dir": target.run_dir, "hybridflow.checkpoint_step": str(target.step)}
        from flows.run_dir import RunDir

        train_mlflow_run_id = RunDir(target.run_dir).run_info().get("mlflow_run_id")
        if train_mlflow_run_id:
            tags["hybridflow.train_mlflow_run_id"] = train_mlflow_run_id
    run = client.create_run(exp_id, run_name=f"eval-{target.label}", tags=tags)
    params = {"model.path": target.model_path, "data.val_files": cfg.data.val_files,
              "data.val_max_prompts": cfg.data.val_max_prompts, "samples_per_prompt": summary["samples_per_prompt"],
              "temperature": summary["temperature"], "rollout.max_response_tokens": cfg.rollout.max_response_tokens,
              "reward.function": cfg.reward.function, "prompts": summary["prompts"]}
    client.log_batch(run.info.run_id, params=[Param(k, str(v)[:6000]) for k, v in params.items()])
    tracker = Tracker(cfg, run_name=f"eval-{target.label}", mlflow_run_id=run.info.run_id)
    tracker.log_metrics(summary["metrics"], step=target.step or 0)
    if samples:
        tracker.log_samples(samples, step=target.step or 0)
    summary |= {"mlflow_run_id": run.info.run_id, "mlflow_uri": tracker.uri}
    client.log_dict(run.info.run_id, summary, "eval.json")
    tracker.finish("FINISHED")


def _eval_run_name() -> str:
    params = prefect_flow_run.parameters or {}
    if params.get("run_dir"):
        return f"evaluate-{Path(str(params['run_dir'])).name}-{params.get('checkpoint', 'latest')}"
    return f"evaluate-{_slug(Path(str(params.get('model') or 'model')).name)}"


@flow(name="evaluate", flow_run_name=_eval_run_name, log_prints=True, persist_result=False)
def evaluate(
    run_dir: str | None = None,
    checkpoint: str | int = "latest",
    data_files: list[str] | None = None,
    model: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    samples_per_prompt: int = 1,
    temperature: float = 0.0,
    max_prompts: int | None = None,
) -> dict[str, Any]:
    """Evaluate checkpoint ``checkpoint`` (a step or "latest") of ``run_dir`` under the run's
    config (or ``config_path``), or ``model`` (HF folder, .gguf, alias) under ``config_path`` + ``overrides``, on
    ``data_files`` (default: the config's data.val_files; the first ``max_prompts``), with
    ``samples_per_prompt`` = k samples at ``temperature`` (0 = greedy).

    Returns {"evaluated", "model_path", "run_dir", "step", "data_files", "samples_per_prompt",
    "temperature", "prompts", "metrics" (val-core/<source>/acc/mean@k, pass@k for k > 1,
    val-aux/...), "per_source" ({source: {prompts, mean@k, pass@k}}), "eval_dir",
    "mlflow_run_id", "mlflow_uri", "prefect_flow_run_id"}. Raises ValueError /
    FileNotFoundError for bad arguments before any pool starts; PoolError if a pool cannot start.
    """
    target, cfg = plan_evaluation(run_dir, checkpoint, data_files, model, config_path, overrides,
                                  samples_per_prompt, temperature, max_prompts)
    from flows.preflight_inputs import preflight_eval

    preflight_eval(target, cfg)  # a deployment's flow run (no CLI) fails here, before any pool starts
    logger = get_run_logger()
    if samples_per_prompt > 1 and temperature == 0:
        logger.warning("%d samples per prompt at temperature 0 are identical: pass@k = mean@k", samples_per_prompt)
    run = eval_context(target, cfg)
    result_storage_path(run.run_dir).mkdir(parents=True, exist_ok=True)
    prompts, tokenizer = _save_prompts(run, cfg)
    logger.info("evaluating %s on %d prompts of %s (k=%d, temperature %g) in %s", target.label,
                prompts.ref.rows, cfg.data.val_files, samples_per_prompt, temperature, run.run_dir)
    result = _run_validate(run, cfg, prompts)
    scored = load_node_output(result)
    metrics = {k: v for k, v in result.metrics.items() if k.startswith(("val-core/", "val-aux/", "timing_s/"))}
    summary: dict[str, Any] = {
        "evaluated": target.label, **{k: v for k, v in asdict(target).items() if k != "label"},
        "data_files": cfg.data.val_files, "samples_per_prompt": samples_per_prompt, "temperature": temperature,
        "prompts": prompts.ref.rows, "metrics": metrics,
        "per_source": per_source_table(metrics, scored, samples_per_prompt),
        "eval_dir": run.run_dir, "prefect_flow_run_id": str(prefect_flow_run.id or ""),
    }
    _track(cfg, target, summary, _sample_rows(scored, tokenizer))
    Path(run.run_dir, "eval.json").write_text(json.dumps(summary, indent=2))
    logger.info("evaluation of %s: %s", target.label, json.dumps(summary["per_source"]))
    return summary


if __name__ == "__main__":  # pragma: no cover
    import os
    import sys

    print(json.dumps(evaluate(run_dir=sys.argv[1], checkpoint=sys.argv[2] if len(sys.argv) > 2 else "latest"),
                     indent=2))
    os._exit(0)
