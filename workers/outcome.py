"""What an update of a trained role's weights decided (:class:`UpdateOutcome`) and the exactly-once
bookkeeping that decides whether it runs (:class:`VersionedUpdates`; the driver side is
:mod:`tasks.versions`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any


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




class VersionMismatchError(RuntimeError):
    """An update was requested at a weights_version the worker is not at."""


# ---- exactly-once ------------------------------------------------------------------------------


@dataclass
class VersionedUpdates:
    """Exactly-once bookkeeping of one trained role.

    ``run(expected_version, batch_id, fn)``: at ``weights_version == expected_version`` calls
    ``fn()`` (the update, an :class:`UpdateOutcome`) and, when it was applied, bumps the version
    and records (batch_id, metrics). At ``expected_version + 1`` with the recorded batch_id,
    returns the recorded metrics (applied) without applying anything. Anything else raises
    :class:`VersionMismatchError` naming both versions. Every outcome's metrics carry
    ``<prefix>/weights_version`` (after it).
    """

    role: str
    prefix: str
    weights_version: int = 0
    last_batch_id: str | None = None
    last_metrics: dict[str, float] | None = None

    def run(self, expected_version: int, batch_id: str, fn: Callable[[], UpdateOutcome]) -> UpdateOutcome:
        if expected_version == self.weights_version:
            outcome = fn()
            if outcome.applied:
                self.weights_version += 1
                self.last_batch_id, self.last_metrics = batch_id, dict(outcome.metrics)
            return outcome.with_metrics({f"{self.prefix}/weights_version": float(self.weights_version)})
        if expected_version + 1 == self.weights_version and batch_id == self.last_batch_id:
            assert self.last_metrics is not None
            return UpdateOutcome(applied=True, metrics=dict(self.last_metrics)
                                 | {f"{self.prefix}/weights_version": float(self.weights_version)})
        detail = (
            f"a different batch ({batch_id!r}) than the last applied one ({self.last_batch_id!r})"
            if expected_version + 1 == self.weights_version
            else "no update to apply or replay"
        )
        raise VersionMismatchError(
            f"{self.role} update expected weights_version {expected_version} but the worker is at "
            f"{self.weights_version}: {detail}"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"weights_version": self.weights_version, "last_batch_id": self.last_batch_id,
                "last_metrics": self.last_metrics}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.weights_version = int(sd["weights_version"])
        self.last_batch_id = sd["last_batch_id"]
        self.last_metrics = sd["last_metrics"]


__all__ = ["UpdateOutcome", "VersionMismatchError", "VersionedUpdates"]
