"""MLflow tracking: one MLflow run per training run.

params = the flattened config; metrics per iteration with verl's names (sanitised for
MLflow); the Prefect flow run id as a tag (and the MLflow run id is written into the Prefect
run as an artifact by the train flow); artifacts: the resolved config, sample generation
tables, and a reward / response-length plot at the end.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from hybridflow.config import ExperimentConfig, dump_config, flatten_config

SECRET_MARKERS = ("password", "secret", "token", "api_key", "credential")
_URI_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)(?P<user>[^/@:\s]*)(?::[^/@\s]*)?@")


def redact(text: str) -> str:
    """Drop credentials embedded in URIs (``http://user:pass@host`` → ``http://***@host``), so a
    tracking URI or Ray address given with a password never lands in MLflow params/artifacts."""
    return _URI_USERINFO.sub(lambda m: f"{m['scheme']}***@", text)


def tracking_uri(cfg: ExperimentConfig) -> str:
    """Config, then $MLFLOW_TRACKING_URI, then a SQLite file in the working directory."""
    return cfg.tracking.mlflow_uri or os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def _sanitize(name: str) -> str:
    from hybridflow.metrics import sanitize_metric_name

    return sanitize_metric_name(name)


class Tracker:
    """Thin wrapper over MlflowClient (thread-safe, no global active-run state)."""

    def __init__(self, cfg: ExperimentConfig, *, run_name: str, mlflow_run_id: str | None = None,
                 tags: dict[str, str] | None = None):
        import mlflow
        from mlflow.tracking import MlflowClient

        self.uri = tracking_uri(cfg)
        mlflow.set_tracking_uri(self.uri)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(cfg.tracking.experiment)
        self.experiment_id = exp.experiment_id if exp else self.client.create_experiment(cfg.tracking.experiment)
        if mlflow_run_id:
            self.run_id = mlflow_run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id
            self._log_params(cfg)
            self._log_text(redact(dump_config(cfg)), "config.yaml")
        self.history: list[tuple[int, dict[str, float]]] = []

    def _log_params(self, cfg: ExperimentConfig) -> None:
        from mlflow.entities import Param

        params = []
        for k, v in flatten_config(cfg).items():
            if any(m in k.lower() for m in SECRET_MARKERS):
                continue  # secrets come from the environment and are never logged
            params.append(Param(k, redact(str(v))[:6000]))
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])

    def _log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        clean = {_sanitize(k): float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        items = [Metric(k, v, now, step) for k, v in sorted(clean.items())]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i : i + 500])
        self.history.append((step, clean))

    def log_samples(self, rows: list[dict[str, Any]], step: int) -> None:
        """A table of sample generations (prompt, response, score) as a JSON artifact."""
        self.client.log_table(self.run_id, data={k: [r[k] for r in rows] for k in rows[0]} if rows else {},
                              artifact_file=f"samples/iter_{step:06d}.json")

    def log_curves(self) -> str | None:
        """Plot reward and response length per iteration; returns the artifact path."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        steps = [s for s, m in self.history if "critic/score/mean" in m]
        if not steps:
            return None
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.5))
        for ax, key, title in ((axes[0], "critic/score/mean", "reward (score) mean"),
                               (axes[1], "response_length/mean", "response length mean")):
            pts = [(s, m[key]) for s, m in self.history if key in m]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o")
            ax.set_xlabel("iteration")
            ax.set_title(title)
        val = [(s, v) for s, m in self.history for k, v in m.items() if k.startswith("val-core/") and "mean@" in k]
        if val:
            axes[0].plot([p[0] for p in val], [p[1] for p in val], marker="s", label="val acc")
            axes[0].legend()
        fig.tight_layout()
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "reward_curve.png"
            fig.savefig(path, dpi=100)
            self.client.log_artifact(self.run_id, str(path), "plots")
        plt.close(fig)
        return "plots/reward_curve.png"

    def finish(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
