"""The preflight's base: its error type and the checks other preflight modules and the resume path
share (the run folder is writable, the rollout engine can run here). No other flows module is
imported here, so flows.preflight, flows.preflight_inputs, flows.resume and flows.run_lock can all
use it without an import loop."""

from __future__ import annotations

import uuid
from pathlib import Path

from hybridflow.config import ConfigError, ExperimentConfig


class PreflightError(ConfigError):
    """A run cannot start: names the config key, the value and the problem."""


def check_run_dir(cfg: ExperimentConfig) -> Path:
    """Create ``trainer.run_dir`` if needed and prove it is writable (a probe file is written and
    removed). Returns the folder. Raises PreflightError naming the folder and the OS error."""
    parent = Path(cfg.trainer.run_dir)
    probe = parent / f".hybridflow-write-probe-{uuid.uuid4().hex[:8]}"
    try:
        parent.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise PreflightError(
            f"trainer.run_dir={cfg.trainer.run_dir!r} is not writable ({e.strerror or e}); "
            "point trainer.run_dir at a folder this process can create and write"
        ) from None
    return parent


def check_engine(cfg: ExperimentConfig) -> None:
    """The engines can run here: for ``rollout.engine: vllm`` or ``reward.judge.engine: vllm`` the vLLM
    runtime (``make setup-vllm``) exists and matches, the CPU and the config suit vLLM's build, the KV
    caches fit (:func:`flows.preflight_vllm.check_vllm`); checked before any server starts, not when
    the pool builds the engine."""
    from flows.preflight_vllm import check_vllm

    check_vllm(cfg, PreflightError)


__all__ = ["PreflightError", "check_engine", "check_run_dir"]
