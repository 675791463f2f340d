"""Which folder and config a run (new or resumed) runs with.

The folder: :func:`resolve_run_dir` (a new run's name, ``--resume DIR`` or ``auto``) and
:func:`owned_run_dir` (the folder locked for a command's lifetime, :mod:`flows.run_lock`).

The config: a resumed run runs with its saved ``config.yaml``, changed only on request.

``hybridflow train --resume RUN key=value`` used to drop the overrides without a word. Now an
override (or a ``-c`` file) that changes the saved config is refused in one line naming the
keys, unless ``--override`` is given: then the new values apply, ``config.yaml`` is rewritten
(so a later resume continues with them) and ``run.json`` records each change under
``config_overrides`` (when, from which checkpoint, saved and new value).

Always allowed: a larger ``trainer.total_iterations`` (extending a run is what resume is
for); ``trainer.run_id`` / ``trainer.run_dir`` / ``trainer.resume`` name the run and
``trainer.resume_fallback`` governs the resume itself: they do not change the experiment.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from flows.preflight_base import PreflightError
from flows.run_dir import RunDir
from flows.run_lock import acquire_run_lock, release_run_lock
from hybridflow.config import ExperimentConfig, flatten_config, load_config
from hybridflow.layout import CONFIG, RUN_INFO, SUMMARY

IDENTITY_KEYS = ("trainer.run_id", "trainer.run_dir", "trainer.resume")
FREE_KEYS = (*IDENTITY_KEYS, "trainer.resume_fallback")
RUN_STATE_PREFIX = "model.resolved_precision"  # the run's decision (run.json), never a changed key


def config_changes(saved: ExperimentConfig, requested: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, requested value)}`` for every flattened key that differs, except the
    free keys (:data:`FREE_KEYS`) and a larger ``trainer.total_iterations``."""
    old, new = flatten_config(saved), flatten_config(requested)
    changes = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k not in FREE_KEYS and not k.startswith(RUN_STATE_PREFIX)}
    extend = changes.get("trainer.total_iterations")
    if extend is not None and extend[1] > extend[0]:
        del changes["trainer.total_iterations"]
    return changes


def _with_identity(cfg: ExperimentConfig, saved: ExperimentConfig) -> ExperimentConfig:
    keep = {k: getattr(saved.trainer, k) for k in ("run_id", "run_dir", "resume")}
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=keep)})


def where_it_started(cfg: ExperimentConfig, folder: RunDir, info: dict[str, Any]) -> ExperimentConfig:
    """``cfg`` for resuming ``folder`` from any working directory: ``trainer.run_dir`` = the
    folder's parent, absolute (so the default Prefect home is where the run started it,
    ``<parent>/.prefect``), and, when the config names no ``tracking.mlflow_uri``, the MLflow URI
    ``run.json`` recorded when the run started (absolute; a relative default would resolve against
    the new working directory, where the run's MLflow run does not exist). A recorded URI whose
    credentials were redacted is not used (the config or $MLFLOW_TRACKING_URI gives it again)."""
    trainer = {"run_dir": folder.url.rsplit("/", 1)[0]}
    recorded = info.get("mlflow_uri")
    tracking = {}
    if cfg.tracking.mlflow_uri is None and isinstance(recorded, str) and "***@" not in recorded:
        tracking["mlflow_uri"] = recorded
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=trainer),
                                  "tracking": cfg.tracking.model_copy(update=tracking)})


def reconcile_resume_config(cfg: ExperimentConfig, run_dir: str | Path, *, apply: bool) -> ExperimentConfig:
    """The config a resume of ``run_dir`` runs with, given the requested ``cfg``.

    Changes (see :func:`config_changes`) without ``apply``: PreflightError naming each key, the
    requested and the saved value. With ``apply``: writes the new config.yaml and appends the
    change record to run.json. Call it while holding the run's lock.
    """
    folder = RunDir(run_dir)
    saved = folder.read_config()
    changes = config_changes(saved, cfg)
    if not changes:
        return where_it_started(_with_identity(cfg, saved), folder, folder.run_info())
    if not apply:
        listed = ", ".join(f"{k}={new!r} (saved: {old!r})" for k, (old, new) in changes.items())
        raise PreflightError(
            f"--resume {run_dir}: {listed} would change the run's saved config; a resumed run continues "
            "with its saved config: drop the override, or pass --override to apply it (recorded in run.json)"
        )
    merged = _with_identity(cfg, saved)
    _record(folder, changes)
    folder.write_config(merged)
    return where_it_started(merged, folder, folder.run_info())


def _record(folder: RunDir, changes: dict[str, tuple[Any, Any]]) -> None:
    """Append the change record to run.json's ``config_overrides``."""
    from workers.checkpoint import load_latest

    latest = load_latest(folder.checkpoints)
    record = {
        "at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "from_checkpoint": Path(latest).name if latest else None,
        "changes": {k: {"saved": old, "now": new} for k, (old, new) in changes.items()},
    }
    folder.bind(config_overrides=[*folder.run_info().get("config_overrides", []), record])


def resume_target(config_path: str | None, overrides: list[str] | None,
                  resume: str | None) -> tuple[ExperimentConfig, str | None]:
    """(config to run, run directory to resume or None) for ``hybridflow train [-c CONFIG]
    [overrides] [--resume RUN_DIR|auto]``. ``--resume DIR`` without ``-c`` continues with DIR's
    saved config (overrides such as trainer.total_iterations may extend it), not with the
    defaults; ``--resume auto`` picks the latest run under trainer.run_dir (none: a new run).
    Raises ConfigError (a bad config or override), PreflightError (DIR is not a run directory)."""
    cfg = load_config(config_path, overrides)  # fails fast with a readable ConfigError
    if not resume:
        return cfg, None
    if resume == "auto":
        target = latest_run(Path(cfg.trainer.run_dir))
        if target is None:
            return cfg, None
    else:
        target = Path(resume)
    if not RunDir(target).is_run() or not RunDir(target).exists(CONFIG):
        raise PreflightError(f"--resume {resume}: {target} is not a run directory (no run.json / config.yaml)")
    from flows.preflight_inputs import check_resume_files

    check_resume_files(target)  # a damaged run.json is one line here, before anything reads it
    if config_path is None:
        cfg = load_config(target / CONFIG, overrides)
    return cfg, str(target)


def latest_run(parent: Path) -> Path | None:
    runs = [p for p in parent.iterdir() if (p / RUN_INFO).exists()] if parent.exists() else []
    return max(runs, key=lambda p: (p / RUN_INFO).stat().st_mtime) if runs else None


def resolve_run_dir(cfg: ExperimentConfig, resume: str | None) -> tuple[Path, bool]:
    """(the run directory ``open_run`` will use, whether it reopens an existing run).

    ``resume`` = a run directory, or "auto" (the latest run under trainer.run_dir; none: a new
    run); ``trainer.resume: auto`` in the config does the same. A new run without
    ``trainer.run_id`` gets a name from the time (the CLI fixes it in the config first, so the
    flow opens the folder the CLI locked). Raises FileNotFoundError when ``resume`` is not a run
    directory.
    """
    parent = Path(cfg.trainer.run_dir)
    if resume == "auto" or (resume is None and cfg.trainer.resume == "auto"):
        target = latest_run(parent)
        if target is not None:
            return target, True
    elif resume:
        if not (Path(resume) / RUN_INFO).exists():
            raise FileNotFoundError(f"--resume {resume}: not a run directory (no run.json)")
        return Path(resume), True
    run_id = cfg.trainer.run_id or time.strftime("%Y%m%d-%H%M%S") + f"-{cfg.algorithm.adv_estimator}"
    return parent / run_id, False


def already_finished(cfg: ExperimentConfig, run_dir: str | Path) -> str | None:
    """One line when the run in ``run_dir`` has nothing left to do for ``cfg`` (its summary was
    written and its latest checkpoint is at ``trainer.total_iterations`` or beyond), naming how to
    extend it; None when a resume has work to do."""
    from workers.checkpoint import checkpoint_iteration, load_latest

    folder = RunDir(run_dir)
    latest = load_latest(folder.checkpoints) if folder.exists(SUMMARY) else None
    done = checkpoint_iteration(latest) if latest else None
    total = cfg.trainer.total_iterations
    if done is None or done < total:
        return None
    return (f"run {folder.url} already finished ({done} of {total} iterations); nothing to do. To train further: "
            f"hybridflow train --resume {folder.url} trainer.total_iterations={done + total}")


@contextmanager
def owned_run_dir(cfg: ExperimentConfig, resume: str | None, *,
                  apply_overrides: bool = False) -> Iterator[tuple[ExperimentConfig, str | None]]:
    """Lock the run directory for a command's lifetime before any server starts, and yield
    ``(config to run, run directory to resume or None)`` (``trainer.resume: auto`` without
    ``--resume`` resolves to the latest run here). A second start of the same ``trainer.run_id``, or a
    ``--resume`` of a folder a live run holds, is a RunLockedError (one line, exit 2); a new run
    whose folder already holds a run is a PreflightError. A new run without ``trainer.run_id``
    gets its generated name fixed in the config, so the flow opens the folder locked here. On
    resume, overrides that change the saved config are refused unless ``apply_overrides``
    (:func:`reconcile_resume_config`). A folder created here and left empty
    (the run was refused before it wrote anything) is removed at exit."""
    if apply_overrides and resume is None:
        raise PreflightError("--override applies only with --resume (a new run takes its overrides as they are)")
    run_dir, reopen = resolve_run_dir(cfg, resume)
    if not reopen:
        from flows.preflight_base import check_run_dir

        check_run_dir(cfg)  # an unwritable trainer.run_dir is named as such, not as a lock failure
        cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"run_id": run_dir.name})})
    acquire_run_lock(run_dir)
    try:
        if not reopen and (run_dir / RUN_INFO).exists():
            raise PreflightError(f"run directory {run_dir} already holds a run (trainer.run_id={run_dir.name!r}); "
                                 f"continue it with --resume {run_dir}, or choose another trainer.run_id")
        if reopen:
            cfg = reconcile_resume_config(cfg, run_dir, apply=apply_overrides)
        yield cfg, (str(run_dir) if reopen else None)
    finally:
        release_run_lock(run_dir, remove_empty_dir=not reopen)


__all__ = ["latest_run", "resolve_run_dir", "owned_run_dir", "config_changes", "reconcile_resume_config", "resume_target", "IDENTITY_KEYS", "FREE_KEYS",
           "where_it_started", "already_finished"]
