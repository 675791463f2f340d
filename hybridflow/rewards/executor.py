"""Score responses in a process pool: rule rewards by data_source, or the user's function.

:class:`RewardExecutor` is what the reward worker calls. It turns every failure of reward
code into the configured ``reward.on_error`` score, counts it, and says once per failing row
what happened, so a bad reward function never stops a call (the train flow stops the run
after ``reward.max_failure_iterations`` iterations in a row in which every row failed):

=========  ==============================================  ===================
failure    what happened                                    metric
=========  ==============================================  ===================
error      raised, or returned something that is no number  ``reward/errors``
nan        returned None, NaN or ±inf                       ``reward/nan``
timeout    not scored within ``reward.timeout_s`` of the    ``reward/timeouts``
           call (one deadline per batch; hung workers
           killed)
crash      its process died (os._exit, segfault, OOM)       ``reward/crashes``
=========  ==============================================  ===================

Metrics per call: ``reward/<data_source>/mean`` (mean final score), ``reward/<data_source>/
<field>/mean`` for numeric/bool extra fields (``acc``, ``format``, ...), ``reward/score/mean``,
and ``reward/unparsed_frac`` — the fraction, among rows whose reward reports ``parsed``, with
no extractable answer (custom functions that do not report ``parsed`` are left out of it;
failed rows too).
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.procpool import CallKind, ProcessPool, Unit, WorkerStartError
from hybridflow.procpool.pool import _DEPTH
from hybridflow.rewards.loader import RewardLoadError
from hybridflow.rewards.registry import UnknownDataSourceError

logger = logging.getLogger("hybridflow.rewards")
FAILURE_METRICS = {"error": "reward/errors", "nan": "reward/nan", "timeout": "reward/timeouts", "crash": "reward/crashes"}
_ROWS_PER_CHUNK = 8  # small chunks: the rows queued behind a hung row in its chunk time out with it


class RewardWorkerError(WorkerStartError):
    """A reward worker could not be started (not a failure of one row)."""


@dataclass(frozen=True)
class RewardItem:
    """One response to score (the reward call kind's request). ``prompt`` is the rendered prompt
    text (TRL functions get it)."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: dict[str, Any] | None = None
    prompt: str = ""
    uid: str | None = None


@dataclass(frozen=True)
class RewardScore:
    """The reward call kind's response for a scored row: the finite score and the function's other
    returned fields (scalars: bool, int, float, str or None)."""

    score: float
    extra: dict[str, Any]


@dataclass(frozen=True)
class RewardSources:
    """What a reward worker reports once loaded: the registered data_source names and prefixes
    (rule rewards; a registered prefix matches every data_source that starts with it)."""

    names: tuple[str, ...]
    prefixes: tuple[str, ...]


REWARD_CALLS = CallKind("reward", "hybridflow.rewards._worker", "the reward", RewardLoadError, RewardWorkerError)


@dataclass
class RewardResults:
    """Per-row scores (failures replaced by ``reward.on_error``), per-row extra fields, metrics.

    scores: one float per item, in order. extra: field → list aligned with the items (None
    where a row has no such field). failures: None or "error" | "nan" | "timeout" | "crash"
    per row. messages: None or what went wrong (one line) per row. logs: one line per failing
    row (already sent to the ``hybridflow.rewards`` logger at WARNING), for the caller to
    forward (e.g. to Prefect).
    """

    scores: list[float]
    extra: dict[str, list[Any]] = field(default_factory=dict)
    failures: list[str | None] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    logs: list[str] = field(default_factory=list)
    messages: list[str | None] = field(default_factory=list)


class RewardExecutor:
    """Context manager owning a reward process pool for one :class:`RewardConfig`.

    ``reward_cfg.function`` None → rule rewards (:func:`default_compute_score`, with the
    config's extraction and format weights); else the user's function, loaded inside the
    workers (an import that crashes cannot take this process down). ``plugins``: modules
    the workers import first (they may call ``register_reward``). Workers start on enter
    (or on the first :meth:`score`) and are reused across calls.
    """

    def __init__(self, reward_cfg: RewardConfig, *, plugins: list[str] | tuple[str, ...] = ()) -> None:
        self.cfg = reward_cfg
        self.plugins = list(plugins)
        self._pool: ProcessPool | None = None

    def __enter__(self) -> RewardExecutor:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        """Start the workers and wait until they have loaded the reward; raises RewardLoadError."""
        if self._pool is None:
            setup = (self.cfg.function, self.cfg.model_dump())
            pool = ProcessPool(REWARD_CALLS, setup, self.plugins, self.cfg.num_workers)
            try:
                pool.wait_ready()
            except BaseException:
                pool.close()
                raise
            self._pool = pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    @property
    def worker_restarts(self) -> int:
        """Workers replaced after a timeout or crash since start."""
        return self._pool.restarts if self._pool else 0

    def score(self, items: list[RewardItem]) -> RewardResults:
        """Score ``items``; never raises for failures of reward code (see the module docstring).

        Raises UnknownDataSourceError (before any scoring) when rule rewards are used and an
        item's data_source has no registered reward.
        """
        self.start()
        assert self._pool is not None
        if not items:
            return RewardResults(scores=[])
        if self.cfg.function is None:
            sources: RewardSources = self._pool.info
            names, prefixes = set(sources.names), sources.prefixes
            unknown = sorted({it.data_source for it in items
                              if it.data_source not in names and not str(it.data_source).startswith(prefixes)})
            if unknown:
                known = [*sources.names, *(f"{p}*" for p in prefixes)]
                raise UnknownDataSourceError(
                    f"no reward registered for data_source {unknown}; registered: {', '.join(known)}"
                )
        outcomes = self._pool.run(self._units(items), self.cfg.timeout_s)
        return self._collect(items, [outcomes[i] for i in range(len(items))])

    def _units(self, items: list[RewardItem]) -> list[Unit]:
        rows = list(enumerate(items))
        batched = self._pool is not None and self._pool.batched
        if batched:  # one batched call per worker
            size = math.ceil(len(rows) / self.cfg.num_workers)
        else:  # several chunks per worker, so free workers take over the rows queued behind a hung one
            size = max(1, min(_ROWS_PER_CHUNK, len(rows) // (4 * _DEPTH * self.cfg.num_workers)))
        return [Unit("batch" if batched else "rows", rows[s : s + size]) for s in range(0, len(rows), size)]

    def _collect(self, items: list[RewardItem], outcomes: list[tuple[str, Any]]) -> RewardResults:
        scores: list[float] = []
        failures: list[str | None] = []
        extras: list[dict[str, Any]] = []
        logs: list[str] = []
        messages: list[str | None] = []
        for i, (status, value) in enumerate(outcomes):
            if status == "ok":
                scores.append(value.score)
                failures.append(None)
                extras.append(value.extra)
                messages.append(None)
                continue
            scores.append(self.cfg.on_error)
            failures.append(status)
            extras.append({})
            messages.append(f"{status}: {value}")
            uid = f", uid={items[i].uid}" if items[i].uid is not None else ""
            line = (f"reward {status} on row {i} (data_source={items[i].data_source}{uid}): {value}; "
                    f"scored {self.cfg.on_error:g}")  # fmt: skip
            logs.append(line)
            logger.warning(line)
        keys = sorted({k for e in extras for k in e})
        extra = {k: [e.get(k) for e in extras] for k in keys}
        metrics = reward_metrics(items, scores, failures, extras)
        return RewardResults(scores, extra, failures, metrics, logs, messages)


def reward_metrics(items: list[RewardItem], scores: list[float], failures: list[str | None],
                   extras: list[dict[str, Any]]) -> dict[str, float]:  # fmt: skip
    """The metrics of :class:`RewardResults` (module docstring) from per-row results; public so a
    data-parallel reward pool can compute them over the rows of all its ranks."""
    metrics = {name: float(sum(f == kind for f in failures)) for kind, name in FAILURE_METRICS.items()}
    metrics["reward/score/mean"] = sum(scores) / len(scores)
    by_source: dict[str, list[int]] = defaultdict(list)
    for i, it in enumerate(items):
        by_source[it.data_source].append(i)
    for source, rows in sorted(by_source.items()):
        metrics[f"reward/{source}/mean"] = sum(scores[i] for i in rows) / len(rows)
        numeric: dict[str, list[float]] = defaultdict(list)
        for i in rows:
            for k, v in extras[i].items():
                if isinstance(v, bool | int | float) and math.isfinite(v) and k != "parsed":
                    numeric[k].append(float(v))
        for k, vals in sorted(numeric.items()):
            metrics[f"reward/{source}/{k}/mean"] = sum(vals) / len(vals)
    parsed = [bool(e["parsed"]) for e in extras if isinstance(e.get("parsed"), bool)]
    if parsed:
        metrics["reward/unparsed_frac"] = parsed.count(False) / len(parsed)
    return metrics


_metrics = reward_metrics  # the name workers/reward.py imported first

__all__ = ["reward_metrics", "RewardExecutor", "RewardItem", "RewardResults", "RewardScore", "RewardSources",
           "RewardWorkerError", "REWARD_CALLS", "FAILURE_METRICS"]
