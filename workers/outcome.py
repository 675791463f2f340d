"""What an update of a trained role's weights decided: :class:`UpdateOutcome`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class UpdateOutcome(Mapping[str, float]):
    """An update's decision and its report.

    applied: True when at least one optimizer step was applied (the weights changed and
    ``weights_version`` went up by one), or when a retry of the last applied update returned its
    recorded metrics; False when every step was skipped (NaN/inf loss or gradient norm).
    metrics: for people (verl names, ``<prefix>/update_skipped`` among them); nothing decides on them.

    It reads as its metrics (a ``Mapping``: ``outcome["actor/pg_loss"]``), so callers that only
    report them stay as they are; a decision reads ``.applied``.
    """

    applied: bool
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __getitem__(self, key: str) -> float:
        return self.metrics[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.metrics)

    def __len__(self) -> int:
        return len(self.metrics)

    def with_metrics(self, extra: Mapping[str, float]) -> UpdateOutcome:
        """The same decision with ``extra`` metrics added (or replaced)."""
        return UpdateOutcome(self.applied, {**self.metrics, **extra})


__all__ = ["UpdateOutcome"]
