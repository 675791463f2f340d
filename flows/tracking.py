"""MLflow tracking: one MLflow run per training run.

params = the flattened config; metrics per iteration with verl's names (sanitised for
MLflow); the Prefect flow run id as a tag (and the MLflow run id is written into the Prefect
run as an artifact by the train flow); artifacts: the resolved config, sample generation
tables, and a reward / response-length plot at the end.

So that the MLflow 3 UI files the run as model training (not as a GenAI evaluation): the
experiment carries ``mlflow.experimentKind = custom_model_development`` (the tag the UI reads;
without it the UI infers a kind and stores it), and checkpoints are logged as MLflow models
linked to the run as outputs (a run with model outputs is a "training run" in the UI). The
training and validation files are the run's dataset inputs; ``tracking.system_metrics`` adds
MLflow's system metrics.
"""

from __future__ import annotations

import math
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hybridflow.config import ExperimentConfig, dump_config, flatten_config

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"  # the MLflow 3 UI's "Machine learning" kind
MODEL_FILE = Path(__file__).with_name("mlflow_model.py")
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


def log_metrics(client: Any, run_id: str, metrics: dict[str, float], step: int) -> dict[str, float]:
    """Log ``metrics`` at ``step`` into MLflow run ``run_id`` (names sanitized, None and non-finite values
    dropped, batches of 500); returns what was logged. Also for a run this process does not own (a
    harness evaluation logging into its training's run)."""
    import time

    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    clean = {_sanitize(k): float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    items = [Metric(k, v, now, step) for k, v in sorted(clean.items())]
    for i in range(0, len(items), 500):
        client.log_batch(run_id, metrics=items[i : i + 500])
    return clean


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
        if exp is None or EXPERIMENT_KIND_TAG not in exp.tags:
            self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
        if mlflow_run_id:
            self.run_id = mlflow_run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(self.experiment_id, run_name=run_name, tags=tags or {})
            self.run_id = run.info.run_id
            self._log_params(cfg)
            self._log_text(redact(dump_config(cfg)), "config.yaml")
            log_dataset_inputs(self.client, self.run_id, cfg)
        self.history: list[tuple[int, dict[str, float]]] = []
        self._system_metrics = start_system_metrics(self.run_id) if cfg.tracking.system_metrics else None

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
        self.history.append((step, log_metrics(self.client, self.run_id, metrics, step)))

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

    def log_checkpoint_model(self, policy_dir: str, step: int) -> str:
        """Log a checkpoint's HF policy folder as an MLflow model of this run (output at ``step``);
        returns its ``models:/<model_id>`` URI."""
        return log_hf_model(self.run_id, policy_dir, step)

    def run_link(self) -> str | None:
        """The MLflow UI page of the run when the tracking URI is a server, else None."""
        if not self.uri.startswith(("http://", "https://")):
            return None
        return f"{redact(self.uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def finish(self, status: str = "FINISHED") -> None:
        if self._system_metrics is not None:
            self._system_metrics.finish()
        self.client.set_terminated(self.run_id, status=status)


# MLflow colours these UserWarnings with raw ANSI codes (mlflow.utils.warnings_utils.color_warning), so a
# message filter must allow the escape before the text; shown, they put "\x1b[33m...color_warning(" in plain logs
_MLFLOW_MODEL_HINTS = r"(\x1b\[[0-9;]*m)?(Add type hints to the `predict` method|An input example was not provided)"


@contextmanager
def quiet_mlflow_model_hints() -> Iterator[None]:
    """Ignore MLflow's hints while logging our pyfunc model: it takes a DataFrame of prompts (no
    type-hint schema wanted) and is logged without an input example (loading it would load the model)."""
    hints = re.compile(_MLFLOW_MODEL_HINTS, re.I)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_MLFLOW_MODEL_HINTS, category=UserWarning)
        # MLflow checks ``predict`` under its own ``catch_warnings(); simplefilter("once", UserWarning)``
        # (mlflow.utils.annotations.filter_user_warnings_once), which puts "once" ahead of the filter
        # above; it keeps ``showwarning`` though, so the hints are dropped there as well
        shown = warnings.showwarning

        def show(message: Any, category: Any, *args: Any, **kwargs: Any) -> None:
            if not (issubclass(category, UserWarning) and hints.match(str(message))):
                shown(message, category, *args, **kwargs)

        warnings.showwarning = show
        yield


def log_hf_model(run_id: str, policy_dir: str, step: int, name: str = "policy") -> str:
    """Log an HF model folder as an MLflow pyfunc model (``flows/mlflow_model.py``, the folder as
    its ``hf_model`` artifact) linked to run ``run_id`` as an output at ``step``. No active run
    is needed or left behind; requirements are given, not inferred (inference loads the model in
    a subprocess). Returns ``models:/<model_id>``."""
    import mlflow.pyfunc
    import torch
    import transformers
    from mlflow.models import Model

    with quiet_mlflow_model_hints():
        info = Model.log(artifact_path=None, name=name, flavor=mlflow.pyfunc, run_id=run_id, step=step,
                         python_model=str(MODEL_FILE), artifacts={"hf_model": str(policy_dir)},
                         pip_requirements=[f"torch=={torch.__version__.split('+')[0]}",
                                           f"transformers=={transformers.__version__}", f"mlflow=={mlflow.__version__}"],
                         tags={"hybridflow.step": str(step), "hybridflow.policy_dir": str(policy_dir)})
    return info.model_uri


def register_model(model_uri: str, name: str) -> Any:
    """Register ``model_uri`` as a new version of registered model ``name``; returns the ModelVersion."""
    import mlflow

    return mlflow.register_model(model_uri, name)


def log_dataset_inputs(client: Any, run_id: str, cfg: ExperimentConfig) -> None:
    """The training (context ``training``) and validation (``validation``) files as the run's
    dataset inputs, with their schema and row counts. A file that cannot be read is skipped:
    the data checks before the run already named any problem with it."""
    from mlflow.entities import DatasetInput, InputTag

    inputs = []
    for context, files in (("training", cfg.data.train_files), ("validation", cfg.data.val_files or [])):
        for path in files:
            dataset = _dataset(str(path))
            if dataset is not None:
                inputs.append(DatasetInput(dataset._to_mlflow_entity(), [InputTag("mlflow.data.context", context)]))
    if inputs:
        client.log_inputs(run_id, datasets=inputs)


def _dataset(path: str) -> Any:
    import mlflow.data
    import pandas as pd

    try:
        df = pd.read_parquet(path) if path.endswith(".parquet") else pd.read_json(path, lines=True)
    except Exception:  # noqa: BLE001 - HF dataset ids and odd formats: no input recorded
        return None
    import warnings

    df = df.map(lambda v: v if isinstance(v, (str, int, float, bool)) or v is None else str(v))
    with warnings.catch_warnings():  # "can be interpreted in multiple ways": both are local files
        warnings.simplefilter("ignore", UserWarning)
        return mlflow.data.from_pandas(df, source=redact(path), name=Path(path).name)


def start_system_metrics(run_id: str) -> Any:
    """MLflow's system-metrics monitor for ``run_id`` (every 10 s); stopped by Tracker.finish."""
    from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

    monitor = SystemMetricsMonitor(run_id, sampling_interval=10, samples_before_logging=1)
    monitor.start()
    return monitor


def register_checkpoint(run_dir: str | Path, step: int, model_dir: str | Path, name: str) -> Any:
    """Register step ``step`` of run ``run_dir`` as a new version of MLflow model ``name``.

    Uses the MLflow model the train flow logged for that checkpoint (run tag
    ``hybridflow.model_uri.step_<N>``); a checkpoint logged without one (``tracking.log_model``)
    is logged now from ``model_dir`` (an HF folder) as an output of the run's MLflow run. The
    tracking URI comes from the run's config (or $MLFLOW_TRACKING_URI). Returns the ModelVersion;
    ValueError when the run has no MLflow run recorded in run.json."""
    import mlflow
    from mlflow.tracking import MlflowClient

    from flows.run_dir import RunDir

    folder = RunDir(run_dir)
    cfg = folder.read_config()
    mlflow_run_id = folder.run_info().get("mlflow_run_id")
    if not mlflow_run_id:
        raise ValueError(f"{run_dir}/run.json records no MLflow run to register a model from")
    uri = tracking_uri(cfg)
    mlflow.set_tracking_uri(uri)
    tags = MlflowClient(uri).get_run(mlflow_run_id).data.tags
    model_uri = tags.get(f"hybridflow.model_uri.step_{step:06d}")
    if model_uri is None:
        model_uri = log_hf_model(mlflow_run_id, str(model_dir), step)
        MlflowClient(uri).set_tag(mlflow_run_id, f"hybridflow.model_uri.step_{step:06d}", model_uri)
    return register_model(model_uri, name)
