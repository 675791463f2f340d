"""``hybridflow train -c CONFIG [key=value ...] [--resume RUN_DIR]``.

Validates the config first (fast, before anything heavy), starts a local Prefect server on
127.0.0.1 unless PREFECT_API_URL is set, starts Ray once, runs the train flow, prints the
summary, and stops what it started.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML config (examples/grpo_arith.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=2e-6 rollout.temperature=0.8")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint ('auto' = latest)")
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


def _load(args: argparse.Namespace):
    """(config to run, run directory to resume or None). ``--resume DIR`` without ``-c`` continues
    with DIR's saved config (overrides such as trainer.total_iterations may extend it), not with
    the defaults; ``--resume auto`` picks the latest run under trainer.run_dir (none: a new run)."""
    from flows.preflight import PreflightError
    from hybridflow.config import load_config

    cfg = load_config(args.config, args.overrides)  # fails fast with a readable ConfigError
    if not args.resume:
        return cfg, None
    if args.resume == "auto":
        from flows.run_state import _latest_run

        target = _latest_run(Path(cfg.trainer.run_dir))
        if target is None:
            return cfg, None
    else:
        target = Path(args.resume)
    if not (target / "run.json").is_file() or not (target / "config.yaml").is_file():
        raise PreflightError(f"--resume {args.resume}: {target} is not a run directory (no run.json / config.yaml)")
    if args.config is None:
        cfg = load_config(target / "config.yaml", args.overrides)
    return cfg, str(target)


def _preflight(cfg, resume: str | None) -> None:
    """Check inputs before starting servers (PreflightError, printed by the CLI, exit 2). A resumed
    run is checked against its saved config (the one it continues with)."""
    from flows.preflight import preflight
    from hybridflow.config import load_config

    report = preflight(load_config(Path(resume) / "config.yaml") if resume else cfg)
    skipped = int(report.get("data/train_skipped_rows", 0) + report.get("data/val_skipped_rows", 0))
    if skipped:
        print(f"skipping {skipped} bad dataset rows (data.on_bad_row=skip)", file=sys.stderr)


def drain_prefect_services(timeout_s: float = 20.0) -> None:
    """Send queued Prefect logs/events while the server is still up: once we stop the server, the
    interpreter's at-exit drain would otherwise wait on a server that is gone."""
    try:
        from prefect._internal.concurrency.services import QueueService

        QueueService.drain_all(timeout=timeout_s)
    except Exception:  # best effort: never turn a finished run into a failure
        pass


def stop_on_sigterm() -> None:
    """SIGTERM (``timeout``, ``kill``, a scheduler stopping the job) unwinds like Ctrl-C, so the
    ``finally`` below stops Ray and the Prefect server this command started instead of leaving
    them orphaned. Exit status 143 (128 + SIGTERM)."""
    import signal
    import threading

    def _terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)


def run(args: argparse.Namespace) -> int:
    stop_on_sigterm()
    cfg, resume = _load(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _preflight(cfg, resume)  # data, model, reward function, run dir: before any server starts
    from flows.runtime import ensure_prefect_api, start_reaper

    start_reaper()  # what this command starts from here on dies with it, even after a SIGKILL
    home = args.prefect_home or str(Path(cfg.trainer.run_dir).resolve() / ".prefect")
    server = ensure_prefect_api(home)
    try:
        from flows.train import train

        summary = train(config=cfg.model_dump(mode="json"), config_path=args.config, resume=resume)
        summary["prefect_home"] = server.home or None
        print_summary(summary, server.url)
        return 0
    finally:
        try:
            import ray

            if ray.is_initialized():
                ray.shutdown()
        finally:
            drain_prefect_services()
            server.stop()
            sys.stdout.flush()
