"""``tracking``: MLflow, sample tables, alerts."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.config.base import (
    _Section,
)


class TrackingConfig(_Section):
    mlflow_uri: str | None = Field(
        None, description="MLflow tracking URI; None = $MLFLOW_TRACKING_URI or sqlite:///mlflow.db."
    )
    experiment: str = Field("hybridflow", description="MLflow experiment name.")
    peak_flops_per_device: float | None = Field(
        None, gt=0, description="Peak FLOP/s of one device, for perf/mfu/actor (measure: `hybridflow bench peak`)."
    )
    log_samples_every: int = Field(1, ge=0, description="Log a table of sample generations every N iterations.")
    # ---- issue 18: MLflow models, system metrics, alerts -----------------------------------------
    log_model: Literal["none", "final", "every_checkpoint"] = Field(
        "final",
        description="Log checkpoints' HF policy folders as MLflow models (mlflow.transformers) linked to the run: "
        "the final one, every saved one (trainer.save_every), or none.",
    )
    system_metrics: bool = Field(
        False, description="Log MLflow system metrics (CPU, memory, disk, network, GPU) for the run (needs psutil)."
    )
    alert_val_drop: float = Field(
        0.05, ge=0,
        description="A validation accuracy this far (absolute) below the run's best so far marks the "
        "hybridflow.validation.completed event as regressed (label hybridflow.val-regressed=true; "
        "deployments/automations.yaml pauses the deployment on it).",
    )
