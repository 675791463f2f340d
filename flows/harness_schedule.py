"""Harness evaluations of a training's checkpoints (``trainer.eval``), run beside training.

When a run starts, the initial model is evaluated at step 0 (``trainer.eval.before_train``). After
the checkpoint of iteration ``it`` is saved, when ``it`` is a multiple of
``trainer.eval.every`` (and after the final checkpoint), the ``harness-evaluate`` flow
(:mod:`flows.harness_eval`) is started on that checkpoint in a thread of the driver: a flow run
of its own in the Prefect UI, on an evaluator pool of its own, logging ``eval/<task>/<metric>``
into the training's MLflow run at step ``it``. Training does not wait for it: evaluations queue
one at a time, and the train flow waits for the queue only at its end (up to
``trainer.eval.timeout_s`` per evaluation left). An evaluation that fails is logged as a warning
and counted in the summary; it never stops the training.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import Any

from hybridflow.config import ExperimentConfig


class HarnessSchedule:
    """The evaluations one training run starts. ``run_dir``: the run's folder (the flow reads the
    run's config.yaml and its checkpoints there); ``mlflow_run_id``: the training's MLflow run."""

    def __init__(self, cfg: ExperimentConfig, run_dir: str, mlflow_run_id: str | None):
        from prefect.settings import PREFECT_API_URL

        self.cfg, self.run_dir, self.mlflow_run_id = cfg, run_dir, mlflow_run_id
        self._pool: cf.ThreadPoolExecutor | None = None
        self.futures: dict[int, cf.Future] = {}
        # the Prefect API the train flow talks to: a thread starts from Prefect's global settings, not from
        # the caller's settings context (temporary_settings), so the evaluations' flow runs get it explicitly
        self._api_url = PREFECT_API_URL.value()

    @property
    def enabled(self) -> bool:
        return self.cfg.trainer.eval.enabled

    def due(self, iteration: int, final: bool) -> bool:
        """Whether the checkpoint of ``iteration`` is evaluated: every ``trainer.eval.every``-th, and the final one."""
        every = self.cfg.trainer.eval.every
        return self.enabled and iteration not in self.futures and (final or bool(every and iteration % every == 0))

    def started(self, start_iteration: int) -> None:
        """At the start of a run (not a resume), evaluate the initial model (``model.path``) at step 0
        when ``trainer.eval.before_train``."""
        if self.enabled and self.cfg.trainer.eval.before_train and start_iteration == 1 and 0 not in self.futures:
            self._submit(0)

    def checkpoint_saved(self, iteration: int, final: bool) -> None:
        """Start the evaluation of the checkpoint just saved at ``iteration`` if it is due."""
        if self.due(iteration, final):
            self._submit(iteration)

    def _submit(self, iteration: int) -> None:
        if self._pool is None:
            self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="harness-eval")
        self.futures[iteration] = self._pool.submit(self._evaluate, iteration)

    def _evaluate(self, iteration: int) -> dict[str, Any]:
        from contextlib import nullcontext

        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.harness_eval import harness_evaluate
        from hybridflow.layout import CONFIG

        api = temporary_settings(updates={PREFECT_API_URL: self._api_url}) if self._api_url else nullcontext()
        with api:
            if iteration == 0:  # the initial model under the run's config, logged at step 0
                return harness_evaluate(model=self.cfg.model.path, config_path=f"{self.run_dir}/{CONFIG}",
                                        mlflow_run_id=self.mlflow_run_id)
            return harness_evaluate(run_dir=self.run_dir, checkpoint=iteration, mlflow_run_id=self.mlflow_run_id)

    def finish(self, *, wait: bool, logger: Any) -> dict[str, Any]:
        """Wait for the evaluations started (``wait``; up to trainer.eval.timeout_s each) or cancel
        those not begun. Returns {"evaluated": {iteration: metrics}, "failed": {iteration: reason}}."""
        out: dict[str, Any] = {"evaluated": {}, "failed": {}}
        if self._pool is None:
            return out
        if not wait:
            self._pool.shutdown(wait=False, cancel_futures=True)
            return out
        deadline = time.monotonic() + self.cfg.trainer.eval.timeout_s * max(1, sum(not f.done() for f in self.futures.values()))
        for it, fut in sorted(self.futures.items()):
            try:
                out["evaluated"][it] = fut.result(timeout=max(0.0, deadline - time.monotonic()))["metrics"]
            except cf.TimeoutError:
                out["failed"][it] = f"not finished within trainer.eval.timeout_s={self.cfg.trainer.eval.timeout_s:g}"
            except Exception as e:  # noqa: BLE001 - an evaluation never fails the training that started it
                out["failed"][it] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        for it, why in out["failed"].items():
            logger.warning("lm-eval of the checkpoint of iteration %d failed: %s", it, why)
        self._pool.shutdown(wait=False, cancel_futures=True)
        return out
