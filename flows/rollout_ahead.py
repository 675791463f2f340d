"""Rollouts ahead of the trainer: the driver's side of asynchronous training (docs/async.md).

With a separate rollout pool the train flow keeps up to ``trainer.max_staleness + 1`` rollouts
in flight as Prefect futures of its ``generate_ahead`` task (:data:`tasks.rollout.generate_ahead`). Before iteration k trains, the rollouts of iterations
k … k + s (s = max_staleness) are submitted; each new one is generated with the policy weights
the trainer has at that moment (``policy_version`` after iteration k−1's update), so the rollout
of iteration j always uses the weights after iteration j−1−s's update — a fixed schedule, which
a resumed run replays exactly::

    iteration k:   generate_ahead(k+s, weights v_{k-1})  ‖  old_log_probs ‖ reward … ─► update(k) ─► publish v_k

A rollout older than the bound when its iteration trains (``policy_version − rollout_version >
max_staleness``, e.g. the bound was lowered on a resume) is never trained on:
``trainer.staleness_policy`` ``wait`` generates it again with the current weights, ``drop`` skips
the iteration's update and counts its trajectories (``rollout/dropped_stale``).

A checkpoint after iteration c waits for the rollouts in flight (c+1 … c+s) and records them
(prompts and result refs) in ``trainer_state.json`` under ``rollouts``; a resume takes them from
there — they were generated with weights older than the checkpoint's — and goes on with the
same schedule.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from flows.feed_protocol import Taken
from hybridflow.metric_names import METRIC_NAMES as M
from tasks.types import NodeResult, RolloutResult

if TYPE_CHECKING:
    from flows.iteration import IterationResult
    from flows.trainer_state import TrainerState
    from hybridflow.config import TrainerConfig


def _logger() -> logging.Logger | logging.LoggerAdapter:
    """Prefect's run logger inside a flow run, else this module's."""
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger(__name__)


REGENERATE_KEY_OFFSET = 1_000_000  # Prefect dynamic key of a regenerated (stale) rollout: iteration + this


@dataclass
class _Ahead:
    prompts: NodeResult
    version: int
    submitted_at: float
    future: Any = None
    result: RolloutResult | None = None

    def wait(self) -> RolloutResult:
        if self.result is None:
            self.result = NodeResult.of(self.future.result())
            if not isinstance(self.result, RolloutResult):
                raise TypeError(f"the rollout node returned {type(self.result).__name__}, not a RolloutResult")
        return self.result


class PromptSource(Protocol):
    def next_prompts(self, iteration: int) -> NodeResult | None: ...


class RolloutsAhead:
    """The rollouts in flight (see the module docstring), a :class:`~flows.feeds.Feed`.

    prompts: where each rollout's prompts come from (a :class:`~flows.feeds.PromptFeed`);
    trainer: the live trainer state (its ``policy_version`` is read when a rollout is submitted
    and taken; its ``rollouts`` — a checkpoint's rollouts in flight — are taken over and cleared);
    trainer_cfg: ``max_staleness``, ``staleness_policy``, ``total_iterations``;
    ``submit(iteration, prompts, version, key, wait_for)`` submits the ``generate_ahead`` task
    (after the futures ``wait_for``, Prefect dynamic key ``key``) and returns its Prefect future."""

    def __init__(self, prompts: PromptSource, trainer: TrainerState, trainer_cfg: TrainerConfig,
                 submit: Callable[..., Any]):
        self.prompts, self.trainer, self.trainer_cfg, self.submit = prompts, trainer, trainer_cfg, submit
        self.bound = trainer_cfg.max_staleness
        self.ahead: dict[int, _Ahead] = {}
        self.exhausted = False
        for it, rec in sorted((int(k), v) for k, v in trainer.rollouts.items()):  # from the checkpoint
            result = NodeResult.of(rec["rollout"])
            self.ahead[it] = _Ahead(NodeResult.of(rec["prompts"]), result.rollout_version, 0.0, result=result)
        trainer.rollouts = {}

    # ---- the schedule ----
    def fill(self, iteration: int) -> None:
        """Submit the rollouts of ``iteration`` … ``iteration + max_staleness − lag`` not yet in
        flight, with the newest policy version published to the rollout pool (until the data or
        total_iterations runs out). ``lag``: how many versions that one is behind the trainer's
        (``trainer.updates_per_sync`` > 1; 0 otherwise), so no rollout can be older than the bound
        when its iteration trains."""
        version = self.trainer.rollout_weights_version
        lag = self.trainer.policy_version - version
        last = min(iteration + max(0, self.bound - lag), self.trainer_cfg.total_iterations)
        for j in range(iteration, last + 1):
            if j in self.ahead or self.exhausted:
                continue
            prompts = self.prompts.next_prompts(j)
            if prompts is None:
                self.exhausted = True
                return
            before = [e.future for _, e in sorted(self.ahead.items()) if e.future is not None and e.result is None]
            # in iteration order: the rollout pool serves one at a time, and the next needs this one first
            self.ahead[j] = _Ahead(prompts, version, time.time(), self.submit(j, prompts, version, j, before[-1:]))

    def take(self, iteration: int) -> Taken | None:
        """Iteration ``iteration``'s rollout, waited for and checked against the bound (None: the
        data ran out before it)."""
        self.fill(iteration)
        entry = self.ahead.pop(iteration, None)
        if entry is None:
            return None
        rollout = entry.wait()
        current = self.trainer.policy_version
        staleness = current - rollout.rollout_version
        metrics = {M["staleness_mean"]: float(staleness), M["staleness_max"]: float(staleness),
                   M["rollout_weights_version"]: float(rollout.rollout_version), M["dropped_stale"]: 0.0}
        if staleness <= self.bound:
            return Taken(rollout, metrics)
        log = _logger()
        if self.trainer_cfg.staleness_policy == "drop":
            rows = rollout.ref.rows if rollout.ref is not None else 0
            log.warning("iteration %d: rollout of weights v%d is %d versions behind the trainer (max_staleness=%d): "
                        "dropped %d trajectories", iteration, rollout.rollout_version, staleness, self.bound, rows)
            return Taken(None, {**metrics, M["dropped_stale"]: float(rows)})
        log.warning("iteration %d: rollout of weights v%d is %d versions behind the trainer (max_staleness=%d): "
                    "generating it again with v%d", iteration, rollout.rollout_version, staleness, self.bound, current)
        fresh = _Ahead(entry.prompts, current, time.time(),
                       self.submit(iteration, entry.prompts, current, iteration + REGENERATE_KEY_OFFSET, []))
        rollout = fresh.wait()
        return Taken(rollout, {**metrics, M["staleness_mean"]: 0.0, M["staleness_max"]: 0.0,
                               M["rollout_weights_version"]: float(rollout.rollout_version),
                               M["regenerated_stale"]: float(rollout.ref.rows if rollout.ref else 0)})

    def settle(self, taken: Taken, out: IterationResult, phase: tuple[float, float], wall_s: float) -> None:
        """The rollout joins the iteration's results (``rollout``), its metrics and the overlap
        metric (:meth:`overlap`) its metrics."""
        out.results["rollout"] = taken.first
        out.metrics.update(taken.first.metrics)
        out.metrics.update(self.overlap(phase, taken.first, wall_s))

    def in_flight(self) -> dict[str, dict[str, Any]]:
        """Wait for every rollout in flight and return them as the checkpoint records them:
        ``{iteration: {"prompts": NodeResult json, "rollout": RolloutResult json}}``."""
        return {str(j): {"prompts": e.prompts.to_json(), "rollout": e.wait().to_json()}
                for j, e in sorted(self.ahead.items())}

    # ---- the overlap metric ----
    def overlap(self, phase: tuple[float, float], taken: RolloutResult | None, wall_s: float) -> dict[str, float]:
        """``async/overlap_fraction``: the share of the iteration's wall time (``wall_s``) in which the
        rollout pool generated while the trainer's nodes of the iteration ran (``phase``: their start
        and end, Unix seconds). Generation intervals: finished rollouts' own (RolloutResult started_at … finished_at);
        one still running counts from when it could start (submitted, and the rollout before it done)."""
        busy = 0.0
        previous_end = taken.finished_at if taken is not None else 0.0
        for _, e in sorted(self.ahead.items()):
            if e.result is None and e.future is not None and e.future.state.is_completed():
                e.wait()
            if e.result is not None:
                start, end = e.result.started_at, e.result.finished_at
            else:
                start, end = max(e.submitted_at, previous_end), phase[1]
            busy += max(0.0, min(end, phase[1]) - max(start, phase[0]))
            previous_end = end
        return {M["overlap_s"]: busy, M["overlap_fraction"]: busy / wall_s if wall_s > 0 else 0.0}


__all__ = ["RolloutsAhead", "Taken", "REGENERATE_KEY_OFFSET"]
