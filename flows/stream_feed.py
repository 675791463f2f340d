"""The streaming feed (``trainer.async_mode: stream``): the driver's side of a group-level buffer
(docs/async.md "Streaming").

Every prompt the sampler draws becomes a *group* (the prompt × ``rollout.samples_per_prompt``
samples) with a group id, its submission index. The feed keeps up to ``rollout.max_inflight_groups``
groups started on the rollout pool, which generates them continuously
(:mod:`workers.group_stream`) while the trainer trains; iteration k's :meth:`GroupStream.take`
tops the groups in flight up and takes ``data.prompts_per_iteration`` finished groups through the
``take_groups`` task (:mod:`tasks.stream`), in completion or submission order
(``trainer.stream_order``).

What a checkpoint keeps (``TrainerState.rollouts["stream"]``): the next group id, the groups in
flight and the prompts drawn but not started (each: prompts batch uri and checksum, row, seed).
The sampler's position is the trainer state's own, after every drawn prompt. A resume starts the
groups in flight again from their prompts (what they had generated is lost, not trained), so a
kill at any point loses no group and trains none twice: a group is consumed only by the iteration
whose rollout took it, and an iteration that re-runs gets the same rollout from Prefect's cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flows.feed_protocol import Taken
from hybridflow.metric_names import METRIC_NAMES as M
from tasks.types import NodeResult, RolloutResult

if TYPE_CHECKING:
    from flows.feeds import PromptFeed
    from flows.iteration import IterationResult
    from flows.trainer_state import TrainerState
    from hybridflow.config import ExperimentConfig

STATE_KEY = "stream"  # TrainerState.rollouts[STATE_KEY]
GROUP_SEED_STRIDE = 1_000_003


def max_inflight_groups(cfg: ExperimentConfig) -> int:
    """``rollout.max_inflight_groups``, default (max_staleness + 1) × prompts_per_iteration; at least
    one iteration's groups."""
    per_iteration = cfg.data.prompts_per_iteration
    wanted = cfg.rollout.max_inflight_groups or (cfg.trainer.max_staleness + 1) * per_iteration
    return max(wanted, per_iteration)


class GroupStream:
    """See the module docstring. prompts: the PromptFeed (sampler, dataset, where prompts are
    saved); trainer: the live trainer state (``policy_version``; its ``rollouts["stream"]`` from a
    checkpoint is taken over); take: ``(iteration, wanted, spare, count, version) -> Prefect
    future`` of the ``take_groups`` task."""

    def __init__(self, prompts: PromptFeed, trainer: TrainerState, cfg: ExperimentConfig,
                 take: Callable[..., Any]) -> None:
        self.prompts, self.trainer, self.cfg, self._take = prompts, trainer, cfg, take
        self.per_iteration = cfg.data.prompts_per_iteration
        self.cap = max_inflight_groups(cfg)
        saved = trainer.rollouts.get(STATE_KEY) or {}
        self.next_gid = int(saved.get("next_gid", 0))
        self.inflight: list[dict[str, Any]] = list(saved.get("inflight", []))
        self.queue: list[dict[str, Any]] = list(saved.get("queue", []))
        trainer.rollouts = {}
        self.exhausted = False
        self._last: RolloutResult | None = None

    # ---- prompts → groups ----
    def _draw(self, iteration: int) -> bool:
        """Draw one iteration's worth of prompts into the queue (False: the epochs are done)."""
        saved = None if self.exhausted else self.prompts.next_prompts(iteration, f"prompts_g{self.next_gid:06d}")
        if saved is None:
            self.exhausted = True
            return False
        for row in range(saved.ref.rows):
            gid = self.next_gid
            self.queue.append({"gid": gid, "uri": saved.ref.uri, "checksum": saved.ref.checksum, "row": row,
                               "seed": (self.cfg.trainer.seed * GROUP_SEED_STRIDE + gid) % 2**31})
            self.next_gid += 1
        return True

    def _top_up(self, iteration: int) -> None:
        while len(self.inflight) < self.cap:
            if not self.queue and not self._draw(iteration):
                return
            self.inflight.append(self.queue.pop(0))

    def _spares(self, iteration: int) -> list[dict[str, Any]]:
        """Prompts a take may start in place of groups it drops: one iteration's worth under
        ``staleness_policy: drop``; with ``algorithm.filter_groups`` (zero-variance groups replaced)
        as many as may be in flight. Drawn prompts a take does not start stay queued for later takes."""
        want = self.cap if self.cfg.algorithm.filter_groups else (
            self.per_iteration if self.cfg.trainer.staleness_policy == "drop" else 0)
        while len(self.queue) < want and self._draw(iteration):
            pass
        return list(self.queue[:want])

    # ---- the Feed protocol ----
    def take(self, iteration: int) -> Taken | None:
        """Iteration ``iteration``'s rollout: ``prompts_per_iteration`` finished groups (None when
        fewer than that are left after the last epoch)."""
        self._top_up(iteration)
        if len(self.inflight) < self.per_iteration:
            return None
        version = self.trainer.policy_version
        spare = self._spares(iteration)
        result = NodeResult.of(self._take(iteration, list(self.inflight), spare, self.per_iteration, version,
                                          self.trainer.rollout_weights_version).result())
        if not isinstance(result, RolloutResult):
            raise TypeError(f"the take_groups task returned {type(result).__name__}, not a RolloutResult")
        started = set(result.started)
        for e in [e for e in self.queue if e["gid"] in started]:  # spares it started are in flight now
            self.queue.remove(e)
            self.inflight.append(e)
        gone = set(result.groups) | set(result.dropped)
        self.inflight = [e for e in self.inflight if e["gid"] not in gone]
        self._last = result
        return Taken(result, {M["staleness_mean"]: result.metrics.get(M["staleness_mean"], 0.0),
                              M["staleness_max"]: result.metrics.get(M["staleness_max"], 0.0)})

    def settle(self, taken: Taken, out: IterationResult, phase: tuple[float, float], wall_s: float) -> None:
        """The rollout joins the iteration's results, with its metrics and ``stream/inflight_groups``;
        the overlap metric is the streamer's busy share during the iteration's nodes."""
        out.results["rollout"] = taken.first
        out.metrics.update(taken.first.metrics)
        out.metrics["stream/inflight_groups"] = float(len(self.inflight))
        busy = taken.first.metrics.get("stream/busy_fraction", 0.0)
        out.metrics[M["overlap_fraction"]] = busy
        out.metrics[M["overlap_s"]] = busy * max(0.0, phase[1] - phase[0])

    def in_flight(self) -> dict[str, dict[str, Any]]:
        """The stream's state for the checkpoint (module docstring); nothing is waited for."""
        return {STATE_KEY: {"next_gid": self.next_gid, "inflight": list(self.inflight), "queue": list(self.queue),
                            "saved_at": time.time()}}


__all__ = ["GroupStream", "STATE_KEY", "max_inflight_groups"]
