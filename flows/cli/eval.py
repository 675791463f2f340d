"""``hybridflow eval --model PATH_OR_RUN_CHECKPOINT [-c CONFIG] [--data FILES...] [--samples N]
[--max-prompts N] [key=value ...]``: accuracy of a model or checkpoint, per data source.
``hybridflow eval --harness lm-eval --tasks NAME[,...] [--include-path DIR] [--limit N] --model ...``:
the same target on lm-eval tasks (:mod:`flows.harness_eval`).

``--model`` is a run directory (its latest checkpoint, or ``--step N``), a checkpoint folder
(``runs/<id>/checkpoints/iter_000010``, or ``.../checkpoints/latest``), or any model
``model.path`` accepts (an exported HF folder, a .gguf file, ``smollm2-135m-instruct``). A
run's checkpoint is evaluated under the run's config.yaml unless ``-c CONFIG`` is given; a
model under ``-c CONFIG`` (the data, prompt format, reward and response length come from there).

The arguments are checked first (:func:`flows.eval_plan.plan_evaluation`, which the ``evaluate``
flow runs too; it imports no Prefect, because Prefect reads PREFECT_API_URL once, when it is
imported). Then, inside :func:`flows.services.services` (a local Prefect server unless
PREFECT_API_URL is set; Ray, stopped at exit if it was not running before), the ``evaluate``
flow runs and a table of accuracies is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from flows.cli.args import add_overrides


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
    h = p.add_argument_group("standard harness (docs/evaluation.md)")
    h.add_argument("--harness", choices=["lm-eval"], default=None,
                   help="evaluate with a standard harness instead of the config's validation data")
    h.add_argument("--tasks", default=None, metavar="NAME[,NAME...]",
                   help="harness tasks (default: the config's trainer.eval.tasks)")
    h.add_argument("--include-path", default=None, metavar="DIR",
                   help="a folder of lm-eval task YAMLs (hybridflow data lm-eval-task writes them)")
    h.add_argument("--limit", type=int, default=None, metavar="N", help="the first N documents of each task")
    h.add_argument("--no-chat-template", action="store_true",
                   help="prompt without the model's chat template (lm-eval's own default)")
    add_overrides(p, "rollout.max_response_tokens=128")


def flow_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The evaluate flow's parameters from the command line (no I/O beyond path checks).
    Raises ValueError (a bad count, --step for something that is not a run dir) or
    FileNotFoundError (a missing --model path)."""
    from flows.eval_plan import target_of

    if args.samples < 1:
        raise ValueError(f"--samples must be >= 1, got {args.samples}")
    if args.max_prompts is not None and args.max_prompts < 1:
        raise ValueError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    kwargs = target_of(args.model, args.step)
    if args.config:
        kwargs["config_path"] = args.config
    return {**kwargs, "data_files": args.data, "overrides": list(args.overrides), "samples_per_prompt": args.samples,
            "max_prompts": args.max_prompts}


def print_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    k = summary["samples_per_prompt"]
    title = f"{summary['evaluated']}: {k} sample(s) per prompt, temperature {summary['temperature']:g}"
    table = Table()  # the title goes on a line of its own: as the table's title it would wrap to the columns' width
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
    console.print(title, highlight=False)
    console.print(table)
    console.print(f"generations: {summary['eval_dir']}")
    console.print(f"MLflow run:  {summary.get('mlflow_run_id')} at {summary.get('mlflow_uri')}")
    console.print(f"Prefect flow run: {summary.get('prefect_flow_run_id')}")


def harness_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The harness-evaluate flow's parameters from the command line. Raises ValueError for
    arguments of the other mode (--data, --samples) or a bad --limit."""
    from flows.eval_plan import target_of

    if args.data or args.samples != 1 or args.max_prompts is not None or args.temperature is not None:
        raise ValueError("--data, --samples, --max-prompts and --temperature evaluate the config's validation data; "
                         "with --harness the tasks say what is generated (--tasks, --limit)")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1, got {args.limit}")
    kwargs = target_of(args.model, args.step)
    if args.config:
        kwargs["config_path"] = args.config
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    return {**kwargs, "overrides": list(args.overrides), "tasks": tasks, "include_path": args.include_path,
            "limit": args.limit, "apply_chat_template": False if args.no_chat_template else None}


def print_harness_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table()
    for name in ("task", "metric", "value", "documents"):
        table.add_column(name, justify="left" if name in ("task", "metric") else "right")
    for key in sorted(summary["metrics"]):
        _, task, metric = key.split("/", 2)
        table.add_row(task, metric, f"{summary['metrics'][key]:.4f}", str(summary["n_samples"].get(task, "")))
    console = Console()
    console.print(f"{summary['evaluated']}: lm-eval, chat template {'on' if summary['apply_chat_template'] else 'off'}, "
                  f"{summary['eval_s']:.1f} s", highlight=False)
    console.print(table)
    console.print(f"results and samples: {summary['eval_dir']}")
    console.print(f"MLflow run:  {summary.get('mlflow_run_id')}")
    console.print(f"Prefect flow run: {summary.get('prefect_flow_run_id')}")


def run_harness(args: argparse.Namespace) -> int:
    from flows.eval_plan import plan_harness_evaluation

    try:
        kwargs = harness_kwargs(args)
        plan = {k: kwargs.get(k) for k in ("run_dir", "checkpoint", "model", "config_path", "overrides")}
        _, cfg = plan_harness_evaluation(**{k: v for k, v in plan.items() if v is not None}, eval_overrides={
            k: kwargs[k] for k in ("tasks", "include_path", "limit", "apply_chat_template")})
    except (ValueError, FileNotFoundError) as e:  # HarnessError and ConfigError are ValueErrors
        print(e if str(e).startswith(("error:", "config error:")) else f"error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flows.services import services

    with services(cfg, prefect_home=args.prefect_home, ray=True, reaper=True):
        from flows.harness_eval import harness_evaluate

        summary = harness_evaluate(**kwargs)
        print_harness_table(summary)
        if args.json:
            print(json.dumps(summary, indent=2, default=str))
        return 0


def run(args: argparse.Namespace) -> int:
    if args.harness:
        return run_harness(args)
    from flows.eval_plan import plan_evaluation
    from flows.preflight_inputs import preflight_eval

    try:
        kwargs = flow_kwargs(args)
        if args.temperature is not None:
            kwargs["temperature"] = args.temperature  # checked with the plan (a negative one is refused)
        target, cfg = plan_evaluation(**kwargs)  # fails here, before any service starts
        preflight_eval(target, cfg)  # model files, data encoding, the eval folder's free space
    except (ValueError, FileNotFoundError) as e:  # ConfigError is a ValueError
        print(e if str(e).startswith(("error:", "config error:")) else f"error: {e}", file=sys.stderr)
        return 2
    kwargs["temperature"] = args.temperature if args.temperature is not None else (
        0.0 if args.samples == 1 else cfg.rollout.temperature)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from flows.services import services

    # Ray up front (the flow would start it with the same config): SIGTERM then unwinds through
    # the services' exit instead of meeting the handler ray.init installs, which aborts the driver
    with services(cfg, prefect_home=args.prefect_home, ray=True, reaper=True):
        from flows.evaluate import evaluate

        summary = evaluate(**kwargs)
        print_table(summary)
        if args.json:
            print(json.dumps(summary, indent=2))
        return 0
