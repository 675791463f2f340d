"""``hybridflow train -c CONFIG [key=value ...] [--resume RUN_DIR]``.

Validates the config first (fast, before anything heavy), takes the run folder's lock
(:mod:`flows.run_lock`: one run per folder), checks what a resume loads from the folder, starts
a local Prefect server on 127.0.0.1 unless PREFECT_API_URL is set, starts Ray once, runs the
train flow, prints the summary, and stops what it started.
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import contextmanager
from pathlib import Path

from flows.run_dir import CONFIG, RunDir


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", help="YAML config (examples/grpo_arith.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=2e-6 rollout.temperature=0.8")
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
        from flows.run_lock import latest_run

        target = latest_run(Path(cfg.trainer.run_dir))
        if target is None:
            return cfg, None
    else:
        target = Path(args.resume)
    if not RunDir(target).is_run() or not RunDir(target).exists(CONFIG):
        raise PreflightError(f"--resume {args.resume}: {target} is not a run directory (no run.json / config.yaml)")
    if args.config is None:
        cfg = load_config(target / CONFIG, args.overrides)
    return cfg, str(target)


def _preflight(cfg, resume: str | None) -> None:
    """Check inputs before starting servers (PreflightError, printed by the CLI, exit 2). A resumed
    run is checked against its saved config (the one it continues with), and what it loads from
    its folder first (result records, the checkpoint: :func:`flows.preflight.check_resume_folder`)."""
    from flows.preflight import preflight
    from hybridflow.config import load_config

    if resume:
        from flows.preflight import check_resume_folder

        check_resume_folder(resume, cfg, warn=lambda line: print(line, file=sys.stderr))
    report = preflight(load_config(Path(resume) / CONFIG) if resume else cfg)
    skipped = int(report.get("data/train_skipped_rows", 0) + report.get("data/val_skipped_rows", 0))
    if skipped:
        print(f"skipping {skipped} bad dataset rows (data.on_bad_row=skip)", file=sys.stderr)


@contextmanager
def owned_run_dir(cfg, resume: str | None, *, apply_overrides: bool = False):
    """Lock the run directory for this command's lifetime (``flows.run_lock``) before any server
    starts, and yield ``(config to run, run directory to resume or None)`` (``trainer.resume: auto``
    without ``--resume`` resolves to the latest run here). A second start of the same ``trainer.run_id``, or a
    ``--resume`` of a folder a live run holds, is a RunLockedError (one line, exit 2); a new run
    whose folder already holds a run is a PreflightError. A new run without ``trainer.run_id``
    gets its generated name fixed in the config, so the flow opens the folder locked here. On
    resume, overrides that change the saved config are refused unless ``apply_overrides``
    (:func:`flows.resume_config.reconcile_resume_config`). A folder created here and left empty
    (the run was refused before it wrote anything) is removed at exit."""
    from flows.preflight import PreflightError
    from flows.run_lock import acquire_run_lock, release_run_lock, resolve_run_dir

    if apply_overrides and resume is None:
        raise PreflightError("--override applies only with --resume (a new run takes its overrides as they are)")
    run_dir, reopen = resolve_run_dir(cfg, resume)
    if not reopen:
        from flows.preflight import check_run_dir

        check_run_dir(cfg)  # an unwritable trainer.run_dir is named as such, not as a lock failure
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": run_dir.name})})
    acquire_run_lock(run_dir)
    try:
        if not reopen and RunDir(run_dir).is_run():
            raise PreflightError(f"run directory {run_dir} already holds a run (trainer.run_id={run_dir.name!r}); "
                                 f"continue it with --resume {run_dir}, or choose another trainer.run_id")
        if reopen:
            from flows.resume_config import reconcile_resume_config

            cfg = reconcile_resume_config(cfg, run_dir, apply=apply_overrides)
        yield cfg, (str(run_dir) if reopen else None)
    finally:
        release_run_lock(run_dir, remove_empty_dir=not reopen)


def storage_error_line(exc: BaseException) -> str | None:
    """``error: <message>`` for a CheckpointError anywhere in ``exc``'s chain (Ray wraps a worker's
    error as RayTaskError(CheckpointError), Prefect re-raises it from the task); None otherwise."""
    from workers.checkpoint import CheckpointError

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        cause = getattr(e, "cause", None)  # RayTaskError keeps the worker's exception as .cause
        if isinstance(cause, CheckpointError):
            e = cause
        if isinstance(e, CheckpointError):
            return "error: " + " ".join(str(e.args[0] if e.args else e).split("\n")[0].split())
        e = e.__cause__ or e.__context__
    return None


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


def check_placement(cfg) -> None:
    """Start (or join) Ray and check every pool can ever be placed on the cluster before the flow
    starts, so a request no node set can hold is one line (PoolResourceError, exit 2), not a wait."""
    from flows.runtime import ensure_ray
    from workers.placement import check_pool_fits_cluster

    ensure_ray(cfg)
    stop_on_sigterm()  # ray.init installs its own SIGTERM handler, which aborts the driver (exit -6)
    for name, pool_cfg in cfg.placement.pools.items():
        check_pool_fits_cluster(name, pool_cfg)


def run(args: argparse.Namespace) -> int:
    stop_on_sigterm()
    cfg, resume = _load(args)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    with owned_run_dir(cfg, resume, apply_overrides=args.override) as (cfg, resume):  # one run per folder
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
    from flows.runtime import ensure_prefect_api, start_reaper

    start_reaper()  # what this command starts from here on dies with it, even after a SIGKILL
    home = args.prefect_home or str(Path(cfg.trainer.run_dir).resolve() / ".prefect")
    server = ensure_prefect_api(home)
    try:
        check_placement(cfg)
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
