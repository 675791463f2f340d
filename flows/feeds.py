"""The driver's one input seam: what gives each iteration its first input.

A :class:`Feed` answers :meth:`~Feed.take` ``(iteration)`` with the iteration's first flow input
(:func:`flows.iteration.flow_inputs`) and metrics about it, or None when the data is exhausted.
Three feeds exist:

- :class:`PromptFeed` (synchronous training): the sampler's next prompts, saved as
  ``iter_<k>/prompts``; the iteration's ``rollout`` node generates from them.
- :class:`flows.rollout_ahead.RolloutsAhead` (a separate rollout pool, ``trainer.max_staleness``):
  the iteration's rollout, generated ahead by the train flow's ``generate_ahead`` task from the
  prompts a PromptFeed gives it, checked against the staleness bound.

- :class:`flows.stream_feed.GroupStream` (``trainer.async_mode: stream``): groups generated
  continuously on the rollout pool; its ``take`` returns a rollout assembled from finished groups,
  its ``settle`` adds what it measured, its ``in_flight`` what a checkpoint must keep.

The train flow does not change with the feed: :func:`open_feed` is the one place that picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from flows.feed_protocol import Feed, Taken
from flows.rollout_ahead import RolloutsAhead, _logger
from tasks.common import RunContext
from tasks.types import NodeResult

if TYPE_CHECKING:
    from flows.iteration import IterationResult
    from flows.trainer_state import TrainerState
    from hybridflow.config import ExperimentConfig
    from hybridflow.data import PromptSampler


def save_prompts(run: RunContext, node: str, indices: list[int], dataset: Any) -> NodeResult:
    """``dataset.collate(indices)`` saved as ``iter_<run.iteration>/<node>``; its NodeResult."""
    batch = dataset.collate(indices)
    ref = batch.save(run.batch_uri(node), run_id=run.run_id, iteration=run.iteration, node=node)
    return NodeResult(node=node, ref=ref)


class PromptFeed:
    """Sampler → prompts: each iteration's ``prompts_per_iteration`` training prompts, drawn by
    ``sampler`` from ``dataset`` and saved as ``iter_<k>/prompts``; None after ``total_epochs``
    epochs. ``context(k)``: the run's RunContext at iteration k (where the prompts are saved).
    The sampler's position is what a checkpoint keeps (``TrainerState.sampler``)."""

    def __init__(self, sampler: PromptSampler, dataset: Any, total_epochs: int,
                 context: Callable[[int], RunContext]) -> None:
        self.sampler, self.dataset, self.total_epochs, self.context = sampler, dataset, total_epochs, context

    def next_prompts(self, iteration: int, node: str = "prompts") -> NodeResult | None:
        """Draw and save iteration ``iteration``'s prompts as ``iter_<k>/<node>`` (None:
        ``total_epochs`` are done)."""
        if self.sampler.epoch >= self.total_epochs:
            return None
        return save_prompts(self.context(iteration), node, list(self.sampler.next_indices()), self.dataset)

    def take(self, iteration: int) -> Taken | None:
        prompts = self.next_prompts(iteration)
        return None if prompts is None else Taken(prompts)

    def settle(self, taken: Taken, out: IterationResult, phase: tuple[float, float], wall_s: float) -> None:
        """Nothing to add: the iteration's own rollout node generated from the prompts."""

    def in_flight(self) -> dict[str, dict[str, Any]]:
        return {}


def open_feed(cfg: ExperimentConfig, prompts: PromptFeed, trainer: TrainerState,
              submit: Callable[..., Any], take: Callable[..., Any] | None = None) -> Feed:
    """The feed for ``cfg`` (``ExperimentConfig.async_mode``): 'stream' = the group stream
    (``take``: the ``take_groups`` submitter, :class:`~flows.stream_feed.GroupStream`); 'ahead'
    = rollouts ahead (``submit``: the ``generate_ahead`` submitter,
    :class:`~flows.rollout_ahead.RolloutsAhead`); else ``prompts``. A checkpoint's work in flight
    (``trainer.rollouts``) of another mode than the resumed run's is not trained on (warned) and
    cleared: its prompts are skipped."""
    from flows.stream_feed import STATE_KEY, GroupStream

    mode = cfg.async_mode
    streamed = STATE_KEY in trainer.rollouts
    if trainer.rollouts and streamed != (mode == "stream"):
        _logger().warning(
            "the checkpoint recorded %s in flight; trainer.async_mode=%s does not take them over (their prompts are "
            "skipped)", "stream groups" if streamed else "the rollouts of iterations "
            + ", ".join(sorted(trainer.rollouts, key=int)), mode)
        trainer.rollouts = {}
    if mode == "stream":
        if take is None:
            raise ValueError("trainer.async_mode=stream needs the take_groups submitter")
        return GroupStream(prompts, trainer, cfg, take)
    if cfg.uses_rollout_pool:
        return RolloutsAhead(prompts, trainer, cfg.trainer, submit)
    if trainer.rollouts:  # resumed synchronously from an asynchronous run's checkpoint
        _logger().warning(
            "the checkpoint recorded the rollouts of iterations %s in flight; without a rollout pool they are not "
            "trained on (their prompts are skipped)", ", ".join(sorted(trainer.rollouts, key=int)))
        trainer.rollouts = {}
    return prompts


__all__ = ["Feed", "PromptFeed", "Taken", "open_feed", "save_prompts"]
