"""The train flow's observers in one place: the console (``flows/console.py``), Prefect artifacts
and events (``flows/artifacts.py``) and MLflow models of checkpoints (``flows/tracking.py``).

``flows/train.py`` calls one method per moment of the run (started, iteration done, validation
done, checkpoint saved, stopped, finished); each observer decides what to show or record.
"""

from __future__ import annotations

import sys
from typing import Any

from flows import signals
from flows.artifacts import PrefectReporter
from flows.console import RunConsole
from flows.run_state import RunSession
from flows.tracking import Tracker

STOP_REASONS = {"TrainingStopped": "nan_guard", "KeyboardInterrupt": "interrupted", "SystemExit": "terminated"}


def stop_reason(error: BaseException) -> tuple[str, str]:
    """(reason, message) for the error that stopped a run: a stop signal's reason (``interrupted``,
    ``terminated``, ``hangup``: :func:`flows.signals.stop_reason`, whatever the signal's exception
    became on its way up) with the signal's name, else by the error's type, with its text."""
    stop = signals.stop_reason(error)
    if stop is not None:
        return stop.reason, stop.name
    return STOP_REASONS.get(type(error).__name__, "error"), str(error) or type(error).__name__


class RunObserver:
    def __init__(self, state: RunSession, tracker: Tracker, flow_run_id: str):
        cfg = state.cfg
        self.state, self.tracker = state, tracker
        self.log_model = cfg.tracking.log_model
        self.total = cfg.trainer.total_iterations
        self.console = RunConsole(state.run_id, state.run_dir, self.total, state.start_iteration)
        self.prefect = PrefectReporter(state.run_id, flow_run_id, self.total,
                                       alert_val_drop=cfg.tracking.alert_val_drop)
        for metrics in (state.validations[k] for k in sorted(state.validations)):
            self.prefect.note_validation(metrics)  # a resumed run compares with its earlier best
        self.model_uris: dict[int, str] = {}

    def started(self) -> None:
        if self.state.info.get("stop_reason"):  # a resumed run: the last stop is history now
            self.state.bind(stop_reason=None)
        self.prefect.start(self.state.start_iteration)
        self.console.start()

    def iteration_done(self, it: int, metrics: dict[str, float]) -> None:
        self.console.iteration_done(it, metrics)
        self.prefect.iteration_done(it, metrics)

    def validation_done(self, it: int, metrics: dict[str, float]) -> None:
        self.console.validation_done(it, metrics)
        self.prefect.validation_done(it, metrics)

    def checkpoint_saved(self, it: int, final: bool) -> None:
        """Log the checkpoint as an MLflow model when ``tracking.log_model`` asks for it."""
        if self.log_model == "none" or (self.log_model == "final" and not final):
            return
        tag = f"hybridflow.model_uri.step_{it:06d}"  # the tag name stays (a resumed run finds its old tags)
        logged = self.tracker.client.get_run(self.tracker.run_id).data.tags.get(tag)  # e.g. before a resume
        policy_dir = f"{self.state.dir.checkpoint_dir(it)}/policy"
        if logged:
            self.model_uris[it] = logged
        elif self.state.dir.fs.isdir(policy_dir):
            self.model_uris[it] = self.tracker.log_checkpoint_model(policy_dir, it)
            self.tracker.set_tag(tag, self.model_uris[it])

    def stopped(self, error: BaseException) -> None:
        """Record the stop reason in run.json (``stop_reason``), on the console and as a Prefect event."""
        reason, message = stop_reason(error)
        try:
            self.state.bind(stop_reason=reason)
        except OSError as e:  # a full or read-only disk: the error that stopped the run is what must surface
            print(f"warning: could not record the stop reason in run.json: {e}", file=sys.stderr)
        by_signal = reason in signals.REASONS.values()
        self.console.stopped(f"{reason} ({message})" if by_signal else f"{reason}: {message}")
        self.prefect.stopped(reason, message[:2000])

    def finished(self, summary: dict[str, Any]) -> None:
        """Add the MLflow model and reward curve to ``summary``; publish the summary artifact."""
        self.console.close()
        last = self.state.last_checkpoint_iteration  # data ran out on a save_every checkpoint: still the final one
        if last and self.log_model != "none" and last not in self.model_uris:
            self.checkpoint_saved(last, final=True)
        if self.model_uris:
            summary["mlflow_model_uri"] = self.model_uris[max(self.model_uris)]
        hist = self.state.dir.metrics_history()
        summary["reward_curve"] = [hist[i]["critic/score/mean"] for i in sorted(hist) if "critic/score/mean" in hist[i]]
        self.prefect.summary(summary, self.tracker.run_link())

    def close(self) -> None:
        self.console.close()
