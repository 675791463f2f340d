"""What a resumed run runs with: its saved ``config.yaml``, changed only on request.

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
from pathlib import Path
from typing import Any

from flows.preflight import PreflightError
from flows.run_dir import RunDir
from hybridflow.config import ExperimentConfig, flatten_config, load_config
from hybridflow.layout import CONFIG

IDENTITY_KEYS = ("trainer.run_id", "trainer.run_dir", "trainer.resume")
FREE_KEYS = (*IDENTITY_KEYS, "trainer.resume_fallback")


def config_changes(saved: ExperimentConfig, requested: ExperimentConfig) -> dict[str, tuple[Any, Any]]:
    """``{key: (saved value, requested value)}`` for every flattened key that differs, except the
    free keys (:data:`FREE_KEYS`) and a larger ``trainer.total_iterations``."""
    old, new = flatten_config(saved), flatten_config(requested)
    changes = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
               if old.get(k) != new.get(k) and k not in FREE_KEYS}
    extend = changes.get("trainer.total_iterations")
    if extend is not None and extend[1] > extend[0]:
        del changes["trainer.total_iterations"]
    return changes


def _with_identity(cfg: ExperimentConfig, saved: ExperimentConfig) -> ExperimentConfig:
    keep = {k: getattr(saved.trainer, k) for k in ("run_id", "run_dir", "resume")}
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update=keep)})


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
        return _with_identity(cfg, saved)
    if not apply:
        listed = ", ".join(f"{k}={new!r} (saved: {old!r})" for k, (old, new) in changes.items())
        raise PreflightError(
            f"--resume {run_dir}: {listed} would change the run's saved config; a resumed run continues "
            "with its saved config: drop the override, or pass --override to apply it (recorded in run.json)"
        )
    merged = _with_identity(cfg, saved)
    _record(folder, changes)
    folder.write_config(merged)
    return merged


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
    from flows.run_lock import latest_run

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
    if config_path is None:
        cfg = load_config(target / CONFIG, overrides)
    return cfg, str(target)


__all__ = ["config_changes", "reconcile_resume_config", "resume_target", "IDENTITY_KEYS", "FREE_KEYS"]
