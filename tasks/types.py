"""What nodes return: small frozen types, in the manner of torchtune's ``rlhf/_types.py``.

Prefect carries these between tasks and stores them (``<run_dir>/prefect-results/<cache key>``)
with :class:`tasks.serializer.NodeResultSerializer`: plain JSON of one fixed shape, read back into one of the four
types below by a fixed table (never a class named by the file; ``tasks.results`` checks a record
before Prefect reads it). The batch a result names lives in the run directory
(``iter_000007/<node>.safetensors`` + ``.json``), never in the result.

- :class:`NodeResult` — every node: ``node`` (its name), ``ref`` (the saved batch, or None for a
  node that only reports), ``metrics`` (name → float, verl's metric names).
- :class:`AdvantageResult` — the advantage node adds ``kl_coef_next``: the adaptive KL
  controller's β for the next iteration (None: the fixed controller, nothing to carry).
- :class:`UpdateResult` — an update node adds ``applied`` (False: every optimizer step of the
  update was skipped for a NaN/inf loss or gradient) and ``version`` (the pool's weights_version
  after the update).
- :class:`RolloutResult` — a rollout of a separate rollout pool adds ``rollout_version`` (the
  weights that generated it) and when it ran (``started_at`` / ``finished_at``).
- :class:`RewardResult` — the reward node adds ``failed_rows`` (rows whose reward raised, was
  NaN/None, timed out or crashed) and ``last_error`` (the last failing row's one-line error): the
  run's stop-on-failure decision reads these, never the ``reward/*`` metric names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hybridflow.batch import Batch, BatchRef


def _floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The metrics that are numbers, as floats (anything else — strings, lists — is dropped)."""
    out = {}
    for k, v in metrics.items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            continue
    return out


@dataclass(frozen=True, kw_only=True)
class NodeResult:
    """One node's result: ``node`` name, ``ref`` to its saved batch (None: metrics only),
    ``metrics`` (name → float; treat as read-only, :meth:`with_metrics` makes a copy with more)."""

    kind: ClassVar[str] = "node"
    node: str
    ref: BatchRef | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", _floats(self.metrics))  # a plain dict: Ray pickles results

    def with_metrics(self, extra: Mapping[str, Any]) -> NodeResult:
        """A copy with ``extra`` metrics added (same type, same other fields)."""
        return dataclasses.replace(self, metrics={**self.metrics, **extra})

    def load(self) -> Batch | None:
        """The saved batch (checksum verified), or None for a metrics-only result."""
        return None if self.ref is None else self.ref.load()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if isinstance(value, BatchRef) else (
                dict(value) if isinstance(value, Mapping) else list(value) if isinstance(value, tuple) else value)
        return out

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> NodeResult:
        """Build the result a :meth:`to_json` dict describes. A dict without ``kind`` (a record
        written before these types existed) is a plain NodeResult. Raises ValueError naming an
        unknown kind or field."""
        kind = data.get("kind", "node")
        cls = RESULT_TYPES.get(kind)
        if cls is None:
            raise ValueError(f"unknown node result kind {kind!r}; known: {sorted(RESULT_TYPES)}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - names - {"kind"}
        if unknown:
            raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
        values = {k: v for k, v in data.items() if k != "kind"}
        if values.get("ref") is not None:
            values["ref"] = BatchRef.from_dict(values["ref"])
        for k, v in values.items():  # tuple fields travel as JSON lists
            if isinstance(v, list):
                values[k] = tuple(v)
        return cls(**values)

    @staticmethod
    def of(value: Any) -> NodeResult | None:
        """``value`` as a result: a NodeResult as it is, a JSON dict via :meth:`from_json`, None as None."""
        if value is None or isinstance(value, NodeResult):
            return value
        if isinstance(value, Mapping):
            return NodeResult.from_json(value)
        raise TypeError(f"not a node result: {type(value).__name__}")


@dataclass(frozen=True, kw_only=True)
class AdvantageResult(NodeResult):
    """The advantage node's result; ``kl_coef_next``: β for the next iteration (None: fixed)."""

    kind: ClassVar[str] = "advantage"
    kl_coef_next: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.kl_coef_next is not None and not math.isfinite(float(self.kl_coef_next)):
            raise ValueError(f"kl_coef_next must be finite, got {self.kl_coef_next}")


@dataclass(frozen=True, kw_only=True)
class UpdateResult(NodeResult):
    """An update node's result: ``applied`` (False: the whole update was skipped, NaN/inf) and
    ``version`` (the pool's weights_version after it)."""

    kind: ClassVar[str] = "update"
    applied: bool = True
    version: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutResult(NodeResult):
    """A rollout generated on a separate rollout pool (asynchronous training): ``rollout_version``
    (the policy weights_version that generated every trajectory of it), ``started_at`` /
    ``finished_at`` (Unix seconds: when the engine started and finished generating it, for the
    overlap metric). Streaming (``trainer.async_mode: stream``): ``rollout_version`` is the oldest
    token's version, ``groups`` the stream's group ids the rollout took (submission indices),
    ``dropped`` those it dropped as stale, ``started`` the spare groups it started instead."""

    kind: ClassVar[str] = "rollout"
    rollout_version: int = 0
    started_at: float = 0.0
    finished_at: float = 0.0
    groups: tuple[int, ...] = ()
    dropped: tuple[int, ...] = ()
    started: tuple[int, ...] = ()


@dataclass(frozen=True, kw_only=True)
class RewardResult(NodeResult):
    """The reward node's result: ``failed_rows`` (how many of ``ref.rows`` were scored
    ``reward.on_error`` because the reward failed on them) and ``last_error`` (the last failing
    row's one-line error, None when none failed)."""

    kind: ClassVar[str] = "reward"
    failed_rows: int = 0
    last_error: str | None = None


RESULT_TYPES: dict[str, type[NodeResult]] = {
    t.kind: t for t in (NodeResult, AdvantageResult, UpdateResult, RolloutResult, RewardResult)}


__all__ = ["NodeResult", "AdvantageResult", "UpdateResult", "RolloutResult", "RewardResult", "RESULT_TYPES"]
