"""One training run's folder: the paths of its files, and their persistence.

The names of its files are :mod:`hybridflow.layout`'s (the one module that spells them, and
lists the layout); this module builds their paths and reads and writes them.

Every path is ``<url>/<name>``; reads and writes use ``fsspec.core.url_to_fs``, so a local path
behaves as plain files do and a ``memory://`` or object-store URL works the same way.
Checkpoints and the lock need a local filesystem (atomic rename, ``O_EXCL``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import fsspec
import yaml
from fsspec.implementations.local import LocalFileSystem

from hybridflow.config import ConfigError, ExperimentConfig, config_from_dict, dump_config
from hybridflow.jsonl import append_line
from hybridflow.layout import (
    CHECKPOINTS,
    CONFIG,
    EXECUTION_LOG,
    METRICS,
    POOL_EVENTS,
    RESULTS,
    RUN_INFO,
    SUMMARY,
    VALIDATION,
    iteration_name,
    ledger_name,
)


class RunDir:
    """The folder of one run, at ``url`` (a local path or an fsspec URL).

    ``url``: a local path is made absolute (symlinks resolved), as the run directory always was;
    any other URL is kept as given, without a trailing ``/``. ``name`` (the last component) is
    the run id. Path methods only build strings; the others read or write the files.
    """

    def __init__(self, url: str | os.PathLike):
        self.fs, self._root = fsspec.core.url_to_fs(str(url))
        local = isinstance(self.fs, LocalFileSystem)
        self.url = str(Path(self._root).resolve()) if local else str(url).rstrip("/")
        if local:
            self._root = self.url

    def __repr__(self) -> str:
        return f"RunDir({self.url!r})"

    @property
    def name(self) -> str:
        """The run id: the folder's last component."""
        return self._root.rstrip("/").rsplit("/", 1)[-1]

    # ---- the layout ----
    def path(self, name: str) -> str:
        """``<url>/<name>`` for a file or folder of the run (one of this module's names)."""
        return f"{self.url}/{name}"

    @property
    def config_file(self) -> str:
        return self.path(CONFIG)

    @property
    def run_info_file(self) -> str:
        return self.path(RUN_INFO)

    @property
    def metrics_file(self) -> str:
        return self.path(METRICS)

    @property
    def validation_file(self) -> str:
        return self.path(VALIDATION)

    @property
    def summary_file(self) -> str:
        return self.path(SUMMARY)

    @property
    def execution_log(self) -> str:
        return self.path(EXECUTION_LOG)

    @property
    def pool_events(self) -> str:
        return self.path(POOL_EVENTS)

    @property
    def checkpoints(self) -> str:
        """The checkpoint root (``iter_000010/``, ``latest``)."""
        return self.path(CHECKPOINTS)

    @property
    def results(self) -> str:
        """Prefect result storage (the node-level cache)."""
        return self.path(RESULTS)

    def iter_dir(self, iteration: int) -> str:
        """``<url>/iter_000007``: the node outputs of iteration 7."""
        return self.path(iteration_name(iteration))

    def ledger(self, role: str) -> str:
        """``<url>/updates_<role>.jsonl``: the exactly-once ledger of a trained role."""
        return self.path(ledger_name(role))

    def checkpoint_dir(self, iteration: int) -> str:
        """The committed checkpoint of ``iteration``: ``<url>/checkpoints/iter_000007`` (or the
        legacy ``step_000007`` folder when that one exists on a local run directory)."""
        from workers.checkpoint import checkpoint_dir, checkpoint_name

        if isinstance(self.fs, LocalFileSystem):
            return checkpoint_dir(self.checkpoints, iteration)
        return f"{self.checkpoints}/{checkpoint_name(iteration)}"

    # ---- persistence ----
    def _fs_path(self, name: str) -> str:
        return f"{self._root.rstrip('/')}/{name}"

    def exists(self, name: str = "") -> bool:
        """Whether the folder (or its file ``name``) exists."""
        return self.fs.exists(self._fs_path(name) if name else self._root)

    def is_run(self) -> bool:
        """Whether the folder holds a run (its ``run.json``)."""
        return self.exists(RUN_INFO)

    def create(self, cfg: ExperimentConfig) -> None:
        """Make the folder and its result storage; write ``config.yaml`` (``dump_config(cfg)``)."""
        self.fs.makedirs(self._root, exist_ok=True)
        self.write_config(cfg)
        self.fs.makedirs(self._fs_path(RESULTS), exist_ok=True)

    def write_config(self, cfg: ExperimentConfig) -> None:
        self._write_text(CONFIG, dump_config(cfg))

    def read_config(self) -> ExperimentConfig:
        """The saved ``config.yaml``. Raises ConfigError (missing, not YAML, not a mapping, invalid)."""
        if not self.exists(CONFIG):
            raise ConfigError(f"config error: file {self.config_file!r} does not exist")
        try:
            loaded = yaml.safe_load(self._read_text(CONFIG))
        except yaml.YAMLError as e:
            raise ConfigError(f"config error: {self.config_file} is not valid YAML: {e}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config error: {self.config_file} must hold a mapping at the top level")
        return config_from_dict(loaded or {})

    def run_info(self) -> dict[str, Any]:
        """``run.json`` without its ``run_id`` ({} when there is none). Raises ValueError when it
        is not a JSON object."""
        if not self.exists(RUN_INFO):
            return {}
        info = json.loads(self._read_text(RUN_INFO))
        if not isinstance(info, dict):
            raise ValueError(f"{self.run_info_file} does not hold a JSON object")
        return {k: v for k, v in info.items() if k != "run_id"}

    def bind(self, **info: Any) -> dict[str, Any]:
        """Merge ``info`` into ``run.json`` (``{"run_id": name, ...}``, indented); returns the
        merged info without ``run_id``."""
        merged = {**self.run_info(), **info}
        self._write_text(RUN_INFO, json.dumps({"run_id": self.name, **merged}, indent=2))
        return merged

    def append_metrics(self, iteration: int, metrics: dict[str, float]) -> None:
        """Append ``{"iteration", "metrics"}`` to ``metrics.jsonl``; only finite floats are kept."""
        clean = {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
        self._append_line(METRICS, {"iteration": iteration, "metrics": clean})

    def metrics_history(self) -> dict[int, dict[str, float]]:
        """Per-iteration metrics (the last record of each iteration wins, e.g. after a resume)."""
        return self._read_records(METRICS)

    def append_validation(self, iteration: int, metrics: dict[str, float]) -> None:
        """Append ``{"iteration", "metrics"}`` to ``validation.jsonl``, values as given."""
        self._append_line(VALIDATION, {"iteration": iteration, "metrics": metrics})

    def validations(self) -> dict[int, dict[str, float]]:
        """Per-iteration validation metrics (the last record of each iteration wins)."""
        return self._read_records(VALIDATION)

    def write_summary(self, summary: dict[str, Any]) -> None:
        self._write_text(SUMMARY, json.dumps(summary, indent=2))

    def read_summary(self) -> dict[str, Any] | None:
        """``summary.json``, or None when the run has not finished."""
        return json.loads(self._read_text(SUMMARY)) if self.exists(SUMMARY) else None

    # ---- file access ----
    def _write_text(self, name: str, text: str) -> None:
        """Write ``<name>.tmp`` and move it over ``name``: a reader never sees half a file."""
        tmp = self._fs_path(f"{name}.tmp")
        with self.fs.open(tmp, "w") as f:
            f.write(text)
        self.fs.mv(tmp, self._fs_path(name))

    def _read_text(self, name: str) -> str:
        with self.fs.open(self._fs_path(name), "r") as f:
            return f.read()

    def _append_line(self, name: str, record: dict[str, Any]) -> None:
        append_line(self.fs, self._fs_path(name), json.dumps(record))  # no torn line on a full disk

    def _read_records(self, name: str) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        if self.exists(name):
            for line in self._read_text(name).splitlines():
                rec = json.loads(line)
                out[rec["iteration"]] = rec["metrics"]
        return out


__all__ = ["RunDir", "CONFIG", "RUN_INFO", "METRICS", "VALIDATION", "SUMMARY", "EXECUTION_LOG", "POOL_EVENTS",
           "CHECKPOINTS", "RESULTS"]
