"""``hybridflow train -c CONFIG [key=value ...] [--resume RUN_DIR]``.

Validates the config first (fast, before anything heavy: :func:`flows.resume.resume_target`),
takes the run folder's lock (:func:`flows.resume.owned_run_dir`: one run per folder), checks
what a resume loads from the folder and the inputs (:func:`flows.preflight.preflight_run`), then,
inside :func:`flows.services.services` (the reaper, a local Prefect server on 127.0.0.1 unless
PREFECT_API_URL is set, Ray), checks the pools fit the cluster, runs the train flow, prints the
summary, and stops what it started.
"""

from __future__ import annotations

import argparse
import os
import sys

from flows.cli.args import add_overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML config (examples/grpo_arith.yaml)")
    add_overrides(p, "actor.lr=2e-6 rollout.temperature=0.8")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint ('auto' = latest)")
    p.add_argument("--override", action="store_true",
                   help="with --resume: apply overrides that change the saved config (recorded in run.json); "
                        "without it they are refused")
    p.add_argument("--prefect-home", default=None, help="where the local Prefect server keeps its SQLite db")


def print_summary(summary: dict, prefect_url: str | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hybridflow run summary", show_header=False)
    table.add_column(no_wrap=True)
    table.add_column(overflow="fold")  # paths are folded, never cut with an ellipsis
    rows = [
        ("run dir", summary.get("run_dir")),
        ("iterations", summary.get("iterations")),
        ("reward (first → last iteration)", f"{_num(summary.get('reward_first'))} → {_num(summary.get('reward_last'))}"),
        ("validation before", _vals(summary.get("val_before"))),
        ("validation after", _vals(summary.get("val_after"))),
        ("checkpoint", summary.get("checkpoint")),
        ("MLflow run", f"{summary.get('mlflow_run_id')} at {summary.get('mlflow_uri')}"),
        ("Prefect flow run", summary.get("prefect_flow_run_id")),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    console = Console()
    console.print(table)
    uri = summary.get("mlflow_uri", "sqlite:///mlflow.db")
    home = summary.get("prefect_home") or "<prefect home>"
    # plain print: the commands must stay on one line each to be copied
    print("Open the UIs on this run:")
    print(f"  MLflow:  .venv/bin/mlflow ui --backend-store-uri {uri} --host 127.0.0.1 --port 5000")
    print(f"  Prefect: PREFECT_HOME={home} .venv/bin/prefect server start --host 127.0.0.1")
    print(f"           then open http://127.0.0.1:4200/runs/flow-run/{summary.get('prefect_flow_run_id')}")
    if prefect_url:
        print(f"  (Prefect API used by this run: {prefect_url})")
    sys.stdout.flush()


def _num(x: object) -> str:
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def _vals(metrics: dict | None) -> str:
    return ", ".join(f"{k.removeprefix('val-core/')} = {_num(v)}" for k, v in (metrics or {}).items()) or "—"


def _preflight(cfg, resume: str | None) -> None:
    """Check inputs before starting servers (PreflightError, printed by the CLI, exit 2)."""
    from flows.preflight import preflight_run

    skipped = preflight_run(cfg, resume, warn=lambda line: print(line, file=sys.stderr))
    if skipped:
        print(f"skipping {skipped} bad dataset rows (data.on_bad_row=skip)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    from flows.console import storage_error_line
    from flows.resume import already_finished, owned_run_dir, resume_target
    from flows.services import stop_on_sigterm

    stop_on_sigterm()  # from here on, SIGTERM unwinds: the run folder's lock is released too
    cfg, resume = resume_target(args.config, args.overrides, args.resume)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with owned_run_dir(cfg, resume, apply_overrides=args.override) as (cfg, resume):  # one run per folder
        finished = already_finished(cfg, resume) if resume else None
        if finished:  # nothing to train: start nothing
            print(finished)
            return 0
        _preflight(cfg, resume)  # data, model, reward function, run dir: before any server starts
        try:
            return _train_with_servers(args, cfg, resume)
        except Exception as e:  # noqa: BLE001 - only storage errors are turned into one line
            line = storage_error_line(e)
            if line is None:
                raise
            print(line, file=sys.stderr)
            return 1


def _train_with_servers(args: argparse.Namespace, cfg, resume: str | None) -> int:
    from flows.preflight import check_placement
    from flows.services import resume_prefect_home, services

    home = resume_prefect_home(args.prefect_home, resume)  # a resume goes back to the server the run started
    with services(cfg, prefect_home=home, ray=True, reaper=True) as running:
        check_placement(cfg)
        from flows.train import train

        summary = train(config=cfg.model_dump(mode="json"), config_path=args.config, resume=resume)
        summary["prefect_home"] = running.prefect_home or None
        print_summary(summary, running.prefect_url)
        return 0
