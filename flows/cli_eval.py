"""``hybridflow eval --model PATH_OR_RUN_CHECKPOINT [-c CONFIG] [--data FILES...] [--samples N]
[--max-prompts N] [key=value ...]``: accuracy of a model or checkpoint, per data source.

``--model`` is a run directory (its latest checkpoint, or ``--step N``), a checkpoint folder
(``runs/<id>/checkpoints/step_000010``, or ``.../checkpoints/latest``), or any model
``model.path`` accepts (an exported HF folder, a .gguf file, ``smollm2-135m-instruct``). A
run's checkpoint is evaluated under the run's config.yaml unless ``-c CONFIG`` is given; a
model under ``-c CONFIG`` (the data, prompt format, reward and response length come from there).

The arguments are checked first (:func:`plan_evaluation`, shared with the ``evaluate`` flow; it
imports no Prefect, because Prefect reads PREFECT_API_URL once, when it is imported). Then, as
``hybridflow train`` does, a local Prefect server is started unless PREFECT_API_URL is set, Ray
is started, the ``evaluate`` flow runs, a table of accuracies is printed, and what was started
is stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flows.run_dir import CHECKPOINTS, CONFIG, RUN_INFO
from hybridflow.config import ExperimentConfig, config_from_dict, load_config

# a dotted override (actor.lr=1e-6) that `--data a.parquet b.parquet` swallowed
_OVERRIDE = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")


# ---- the plan: what is evaluated, under which config (no Prefect import) ----------------------


EVAL_ROLES = ("policy", "reward")


@dataclass(frozen=True)
class EvalTarget:
    """What is evaluated. ``model_path``: what the policy pool loads (a checkpoint's
    ``policy/`` folder, an HF folder, a .gguf file or an alias); ``run_dir``/``step``/
    ``checkpoint_dir`` are set for a checkpoint of a run."""

    label: str
    model_path: str
    run_dir: str | None = None
    step: int | None = None
    checkpoint_dir: str | None = None


def resolve_target(run_dir: str | None, checkpoint: str | int, model: str | None, default_model: str) -> EvalTarget:
    """A checkpoint of ``run_dir`` (``checkpoint`` = step or "latest"), else ``model``, else the
    config's model. Raises ValueError (both given), CheckpointNotFoundError (listing the steps),
    ModelNotFoundError (model path/alias not found)."""
    from flows.cli_export import CheckpointNotFoundError, resolve_checkpoint, step_of
    from hybridflow.models.resolve import resolve_model_path

    if run_dir and model:
        raise ValueError("evaluate a checkpoint of a run (run_dir) or a model (model), not both")
    if run_dir:
        step_dir = resolve_checkpoint(run_dir, checkpoint)
        policy = step_dir / "policy"
        if not (policy / "config.json").is_file():
            raise CheckpointNotFoundError(f"checkpoint {step_dir} has no policy/ HF folder")
        run = Path(run_dir).resolve()
        step = step_of(step_dir)
        return EvalTarget(f"{run.name}@step{step}", str(policy.resolve()), str(run), step, str(step_dir.resolve()))
    path = model or default_model
    resolved = resolve_model_path(path)
    if resolved.kind in ("hf_dir", "gguf"):  # absolute: the pool's processes may not share our cwd
        return EvalTarget(Path(path).resolve().name, str(resolved.path))
    return EvalTarget(path, path)


def _check_data_files(files: list[str]) -> None:
    import fsspec

    for f in files:
        fs, p = fsspec.core.url_to_fs(f)
        if not fs.exists(p):
            raise FileNotFoundError(f"evaluation data file {f!r} does not exist")


def eval_config(
    cfg: ExperimentConfig,
    target: EvalTarget,
    *,
    data_files: list[str] | None,
    samples_per_prompt: int,
    temperature: float,
    max_prompts: int | None,
) -> ExperimentConfig:
    """The config the evaluation runs under: ``cfg`` with the target model (LoRA off: checkpoints
    are merged), the data as ``data.val_files``, k = ``rollout.val_samples_per_prompt`` at
    ``rollout.val_temperature``, and pools holding only the policy and reward roles (KL and the
    critic switched off: evaluation needs neither). Raises ValueError for bad arguments or
    when there is no data; FileNotFoundError for a missing data file."""
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")
    d = cfg.model_dump(mode="json")
    d["model"].update(path=target.model_path, lora_rank=0)
    if target.checkpoint_dir:
        d["model"]["tokenizer_path"] = None  # the checkpoint holds its tokenizer
    files = list(data_files) if data_files else list(d["data"]["val_files"])
    if not files:
        raise ValueError("no evaluation data: pass data_files (hybridflow eval --data FILE) or set data.val_files")
    _check_data_files(files)
    d["data"]["val_files"] = files
    if max_prompts is not None:
        d["data"]["val_max_prompts"] = max_prompts
    d["rollout"].update(val_samples_per_prompt=samples_per_prompt, val_temperature=temperature)
    d["algorithm"]["use_kl_in_reward"] = False
    d["actor"]["use_kl_loss"] = False
    if cfg.needs_critic:
        d["algorithm"]["adv_estimator"] = "grpo"  # no critic to load; the estimator plays no part here
    pools = {}
    for name, pool in d["placement"]["pools"].items():
        roles = [r for r in pool["roles"] if r in EVAL_ROLES]
        if roles:
            pools[name] = {**pool, "roles": roles}
    d["placement"]["pools"] = pools
    return config_from_dict(d)


def plan_evaluation(
    run_dir: str | None = None,
    checkpoint: str | int = "latest",
    data_files: list[str] | None = None,
    model: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    samples_per_prompt: int = 1,
    temperature: float = 0.0,
    max_prompts: int | None = None,
) -> tuple[EvalTarget, ExperimentConfig]:
    """Check the arguments and build (target, eval config) without loading anything heavy.
    A run's checkpoint is evaluated under the run's config.yaml unless ``config_path`` is given."""
    if run_dir:
        target = resolve_target(run_dir, checkpoint, model, "")
        cfg = load_config(config_path or Path(run_dir) / CONFIG, overrides)
    else:
        cfg = load_config(config_path, overrides)
        target = resolve_target(None, checkpoint, model, cfg.model.path)
    return target, eval_config(cfg, target, data_files=data_files, samples_per_prompt=samples_per_prompt,
                               temperature=temperature, max_prompts=max_prompts)


# ---- the command line --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", "-m", required=True, metavar="PATH_OR_RUN_CHECKPOINT",
                   help="run dir, checkpoint folder, HF folder, .gguf file or smollm2-135m-instruct")
    p.add_argument("-c", "--config", help="YAML config (default for a run's checkpoint: the run's config.yaml)")
    p.add_argument("--data", nargs="+", metavar="FILE", help="evaluation data (default: the config's data.val_files)")
    p.add_argument("--samples", type=int, default=1, metavar="K", help="samples per prompt: mean@K / pass@K (default 1)")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: 0 = greedy for --samples 1, else rollout.temperature)")
    p.add_argument("--max-prompts", type=int, default=None, metavar="N", help="evaluate the first N prompts only")
    p.add_argument("--step", default=None, help="checkpoint step of a run dir: N or 'latest' (default: latest)")
    p.add_argument("--prefect-home", default=None, help="where a local Prefect server keeps its SQLite db")
    p.add_argument("--json", action="store_true", help="also print the full result as JSON")
    p.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. rollout.max_response_tokens=128")


def split_overrides(data: list[str] | None, overrides: list[str]) -> tuple[list[str] | None, list[str]]:
    """Move ``key.path=value`` items that ``--data`` swallowed back to the overrides."""
    if not data:
        return data, list(overrides)
    files = [d for d in data if not _OVERRIDE.match(d)]
    moved = [d for d in data if _OVERRIDE.match(d)]
    return files, moved + list(overrides)


def target_kwargs(model: str, step: str | None) -> dict[str, Any]:
    """{"run_dir", "checkpoint"} for a run dir (``--step`` or latest), its ``checkpoints/`` folder,
    its ``checkpoints/latest`` pointer or one ``checkpoints/step_<N>`` folder; else {"model"}.
    Raises ValueError when --step is given for something that is not a run dir."""
    p = Path(model)
    one_checkpoint = p.parent.name == CHECKPOINTS and (
        (p.is_dir() and (p / "trainer_state.json").is_file()) or (p.name == "latest" and p.is_file()))
    if one_checkpoint:
        if step is not None:
            raise ValueError(f"--step: {model} is already one checkpoint (pass its run dir to choose a step)")
        return {"run_dir": str(p.parent.parent), "checkpoint": p.name}
    if p.is_dir() and p.name == CHECKPOINTS and (p.parent / CONFIG).is_file():
        p = p.parent
    if p.is_dir() and (p / CONFIG).is_file() and ((p / RUN_INFO).is_file() or (p / CHECKPOINTS).is_dir()):
        return {"run_dir": str(p), "checkpoint": step or "latest"}
    if step is not None:
        raise ValueError(f"--step applies to a run directory; {model} is not one")
    return {"model": model}


def flow_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluate flow's parameters from the command line (no I/O beyond path checks)."""
    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    data, overrides = split_overrides(args.data, args.overrides)
    kwargs = target_kwargs(args.model, args.step)
    if args.config:
        kwargs["config_path"] = args.config
    return {**kwargs, "data_files": data, "overrides": overrides, "samples_per_prompt": args.samples,
            "max_prompts": args.max_prompts}


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    k = summary["samples_per_prompt"]
    table = Table(title=f"{summary['evaluated']}: {k} sample(s) per prompt, temperature {summary['temperature']:g}")
    cols = [f"mean@{k}"] + ([f"pass@{k}"] if k > 1 else [])
    for name in ("data source", "prompts", *cols):
        table.add_column(name, justify="left" if name == "data source" else "right")
    rows = summary["per_source"]
    for src, row in rows.items():
        table.add_row(src, str(int(row["prompts"])), *(f"{row[c]:.3f}" for c in cols))
    if len(rows) > 1:
        total = sum(r["prompts"] for r in rows.values())
        table.add_row("all (prompt-weighted)", str(int(total)),
                      *(f"{sum(r[c] * r['prompts'] for r in rows.values()) / total:.3f}" for c in cols))
    console = Console()
    console.print(table)
    console.print(f"generations: {summary['eval_dir']}")
    console.print(f"MLflow run:  {summary.get('mlflow_run_id')} at {summary.get('mlflow_uri')}")
    console.print(f"Prefect flow run: {summary.get('prefect_flow_run_id')}")


def run(args: argparse.Namespace) -> int:
    try:
        kwargs = flow_kwargs(args)
        _, cfg = plan_evaluation(**kwargs)  # fails here, before any service starts
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    kwargs["temperature"] = args.temperature if args.temperature is not None else (
        0.0 if args.samples == 1 else cfg.rollout.temperature)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import ray

    from flows.runtime import ensure_prefect_api

    ray_was_up = ray.is_initialized()
    server = ensure_prefect_api(args.prefect_home or str(Path(cfg.trainer.run_dir).resolve() / ".prefect"))
    try:
        from flows.evaluate import evaluate

        summary = evaluate(**kwargs)
        print_table(summary)
        if args.json:
            print(json.dumps(summary, indent=2))
        return 0
    finally:
        try:
            if not ray_was_up and ray.is_initialized():
                ray.shutdown()
        finally:
            from flows.cli_train import drain_prefect_services

            drain_prefect_services()
            server.stop()
            sys.stdout.flush()
