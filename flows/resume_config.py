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
from hybridflow.config import ExperimentConfig, flatten_config

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


__all__ = ["config_changes", "reconcile_resume_config", "IDENTITY_KEYS", "FREE_KEYS"]
