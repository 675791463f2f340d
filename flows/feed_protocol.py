"""The types of the driver's input seam (:mod:`flows.feeds`): what a feed gives an iteration
(:class:`Taken`) and the :class:`Feed` protocol every feed implements. Apart from the feeds so
that each feed module imports them without importing the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from tasks.types import NodeResult

if TYPE_CHECKING:
    from flows.iteration import IterationResult


@dataclass
class Taken:
    """What a feed gives iteration k: ``first``, its first flow input (the prompts' NodeResult, or
    a RolloutResult; None: nothing to train on this iteration, e.g. a rollout dropped as stale)
    and metrics about it (name → float, logged with the iteration's)."""

    first: NodeResult | None
    metrics: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Feed(Protocol):
    """The seam between the train flow's loop and where an iteration's input comes from."""

    def take(self, iteration: int) -> Taken | None:
        """Iteration ``iteration``'s input (waited for), or None when the data is exhausted."""
        ...

    def settle(self, taken: Taken, out: IterationResult, phase: tuple[float, float], wall_s: float) -> None:
        """After the iteration trained on ``taken``: add what the feed knows to ``out`` (results,
        metrics). ``phase``: the iteration subflow's start and end (Unix s); ``wall_s``: the
        iteration's wall time so far (s)."""
        ...

    def in_flight(self) -> dict[str, dict[str, Any]]:
        """What a checkpoint must record so a resume continues this feed (``TrainerState.rollouts``);
        waits for work in flight. {} when nothing is."""
        ...


__all__ = ["Feed", "Taken"]
