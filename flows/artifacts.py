"""What a train flow run shows in Prefect besides its DAG: artifacts and events.

Artifacts (Prefect UI → the flow run's Artifacts tab, and Artifacts → key for the history):

- ``<run>-iteration``: a table of each iteration's headline metrics. One key for the whole run,
  so every iteration is a new version of the same artifact and the UI lists them as its history.
- a progress artifact for the flow run, updated as iterations complete (100 % at the end).
- ``<run>-validation``: a table per validation, one row per data source.
- ``<run>-summary``: markdown at the end (validation before/after, reward curve numbers,
  checkpoint, MLflow run id with a link when the tracking URI is a server).

Events (Prefect UI → Event feed; automations in ``deployments/automations.yaml`` act on them),
each with the train flow run as resource (``prefect.flow-run.<id>``) and its deployment/flow as
related resources, so an automation can infer the deployment:

- ``hybridflow.iteration.completed``  payload: the headline metrics;
- ``hybridflow.validation.completed`` payload: accuracies; label ``hybridflow.val-regressed``
  is "true" when an accuracy fell by more than ``tracking.alert_val_drop`` from the best so far;
- ``hybridflow.run.stopped``           label ``hybridflow.stop-reason`` (``nan_guard``, ...).

Everything here is best effort: a Prefect API hiccup is logged as a warning and never stops
training. Outside a flow run (no API) nothing is sent.
"""

from __future__ import annotations

import math
import re
from typing import Any
from uuid import UUID

HEADLINE_KEYS = (
    "critic/score/mean", "critic/score/max", "critic/score/min",
    "response_length/mean", "response_length/max", "response_length/clip_ratio",
    "actor/ppo_kl", "actor/pg_clipfrac", "actor/pg_loss", "actor/grad_norm", "actor/entropy",
    "timing_s/gen", "timing_s/reward", "timing_s/update_actor", "timing_s/step", "timing_s/iteration_wall",
)


def artifact_key(run_id: str, what: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only."""
    slug = re.sub(r"[^a-z0-9-]+", "-", run_id.lower()).strip("-") or "run"
    return f"{slug}-{what}"


def headline_metrics(metrics: dict[str, float]) -> dict[str, float]:
    return {k: float(metrics[k]) for k in HEADLINE_KEYS if _finite(metrics.get(k))}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


class PrefectReporter:
    """Artifacts and events of one train flow run (call from the flow, not from tasks)."""

    def __init__(self, run_id: str, flow_run_id: str, total_iterations: int, *, alert_val_drop: float):
        self.run_id, self.flow_run_id, self.total = run_id, flow_run_id, total_iterations
        self.alert_val_drop = alert_val_drop
        self.enabled = bool(flow_run_id)
        self.progress_id: UUID | None = None
        self.best_val: dict[str, float] = {}

    def _safe(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # never fail training on reporting
            from prefect import get_run_logger

            get_run_logger().warning("could not %s: %s", what, e)
            return None

    # ---- artifacts ----
    def start(self, start_iteration: int) -> None:
        from prefect.artifacts import create_progress_artifact

        done = 100.0 * (start_iteration - 1) / max(self.total, 1)
        self.progress_id = self._safe("create the progress artifact", create_progress_artifact, done,
                                      key=artifact_key(self.run_id, "progress"),
                                      description=f"iterations of run {self.run_id} done")

    def iteration_done(self, it: int, metrics: dict[str, float]) -> None:
        from prefect.artifacts import create_table_artifact, update_progress_artifact

        head = headline_metrics(metrics)
        rows = [{"iteration": it, "metric": k, "value": v} for k, v in head.items()]
        self._safe("create the iteration table", create_table_artifact, rows,
                   key=artifact_key(self.run_id, "iteration"),
                   description=f"run {self.run_id}, iteration {it}/{self.total}: headline metrics")
        if self.progress_id is not None:
            self._safe("update the progress artifact", update_progress_artifact, self.progress_id,
                       100.0 * min(it, self.total) / max(self.total, 1))
        self._emit("hybridflow.iteration.completed", {"iteration": it, "metrics": head})

    def note_validation(self, metrics: dict[str, float]) -> bool:
        """Update the best accuracies so far; True when one fell more than ``alert_val_drop`` below its best."""
        regressed = False
        for key, value in metrics.items():
            if key.startswith("val-core/") and _finite(value):
                best = self.best_val.get(key)
                regressed |= best is not None and best - value > self.alert_val_drop
                self.best_val[key] = value if best is None else max(best, value)
        return regressed

    def validation_done(self, it: int, metrics: dict[str, float]) -> None:
        from prefect.artifacts import create_table_artifact

        rows = []
        for key, value in sorted(metrics.items()):
            if key.startswith("val-core/") and _finite(value):
                source, _, name = key.removeprefix("val-core/").partition("/")
                rows.append({"iteration": it, "data_source": source, "metric": name, "value": float(value)})
        regressed = self.note_validation(metrics)
        if rows:
            self._safe("create the validation table", create_table_artifact, rows,
                       key=artifact_key(self.run_id, "validation"),
                       description=f"run {self.run_id}: validation after iteration {it}")
        payload = {"iteration": it, "regressed": regressed,
                   "metrics": {f"{r['data_source']}/{r['metric']}": r["value"] for r in rows}}
        self._emit("hybridflow.validation.completed", payload,
                   labels={"hybridflow.val-regressed": str(regressed).lower()})

    def stopped(self, reason: str, message: str) -> None:
        self._emit("hybridflow.run.stopped", {"reason": reason, "message": message},
                   labels={"hybridflow.stop-reason": reason})

    def summary(self, summary: dict[str, Any], mlflow_link: str | None) -> None:
        from prefect.artifacts import create_markdown_artifact

        if self.progress_id is not None and summary.get("iterations") == self.total:
            from prefect.artifacts import update_progress_artifact

            self._safe("update the progress artifact", update_progress_artifact, self.progress_id, 100.0)
        self._safe("create the summary artifact", create_markdown_artifact, summary_markdown(summary, mlflow_link),
                   key=artifact_key(self.run_id, "summary"), description=f"run {self.run_id}: summary")

    # ---- events ----
    def _emit(self, event: str, payload: dict[str, Any], labels: dict[str, str] | None = None) -> None:
        from prefect.events import emit_event

        self._safe(f"emit {event}", emit_event, event=event, resource=self._resource(labels),
                   related=_related(), payload=payload)

    def _resource(self, labels: dict[str, str] | None) -> dict[str, str]:
        from prefect.runtime import flow_run

        return {"prefect.resource.id": f"prefect.flow-run.{self.flow_run_id}",
                "prefect.resource.name": str(flow_run.name or ""), "hybridflow.run-id": self.run_id, **(labels or {})}


def _related() -> list[dict[str, str]]:
    """The flow run's deployment and flow, as Prefect's own flow-run events relate them."""
    from prefect.runtime import deployment, flow_run

    out = []
    if deployment.id:
        out.append({"prefect.resource.id": f"prefect.deployment.{deployment.id}",
                    "prefect.resource.role": "deployment", "prefect.resource.name": str(deployment.name or "")})
    if flow_run.flow_name:
        out.append({"prefect.resource.id": f"prefect.flow.{flow_run.flow_name}", "prefect.resource.role": "flow",
                    "prefect.resource.name": str(flow_run.flow_name)})
    return out


def summary_markdown(summary: dict[str, Any], mlflow_link: str | None) -> str:
    """The end-of-run summary as markdown (what ``hybridflow train`` prints, for the Prefect UI)."""

    def num(x: Any) -> str:
        return f"{x:.3f}" if isinstance(x, float) else ("—" if x is None else str(x))

    def vals(m: dict[str, float] | None) -> str:
        return ", ".join(f"{k.removeprefix('val-core/')} = {num(v)}" for k, v in (m or {}).items()) or "—"

    mlflow = f"`{summary.get('mlflow_run_id')}` at `{summary.get('mlflow_uri')}`"
    if mlflow_link:
        mlflow = f"[{summary.get('mlflow_run_id')}]({mlflow_link})"
    curve = summary.get("reward_curve") or []
    lines = [
        f"# hybridflow run `{summary.get('run_id')}`", "",
        "| | |", "|---|---|",
        f"| iterations | {summary.get('iterations')} |",
        f"| reward (first → last iteration) | {num(summary.get('reward_first'))} → {num(summary.get('reward_last'))} |",
        f"| reward per iteration | {', '.join(num(x) for x in curve) or '—'} |",
        f"| validation before | {vals(summary.get('val_before'))} |",
        f"| validation after | {vals(summary.get('val_after'))} |",
        f"| checkpoint | `{summary.get('checkpoint')}` |",
        f"| run dir | `{summary.get('run_dir')}` |",
        f"| MLflow run | {mlflow} |",
    ]
    if summary.get("mlflow_model_uri"):
        lines.append(f"| MLflow model | `{summary['mlflow_model_uri']}` |")
    return "\n".join(lines) + "\n"
