"""What every node task shares: the run context, deterministic cache keys, result storage,
the execution log, and forwarding worker logs/metrics to Prefect's logger.

Prefect carries references, not tensors: a node returns a :class:`tasks.types.NodeResult`
(node, ref, metrics). The batch itself lives in the run directory
(``<run_dir>/iter_000007/<node>.safetensors`` + ``.json``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec

from hybridflow.batch import Batch, BatchRef
from hybridflow.jsonl import append_line
from hybridflow.layout import CHECKPOINTS, EXECUTION_LOG, RESULTS, iteration_name
from tasks.types import NodeResult

_CFG_CACHE = "_cfg_cache"  # RunContext.__dict__ key of the parsed config (not a dataclass field)


@dataclass(frozen=True)
class RunContext:
    """Everything a node needs to find its run: identifiers, where data lives, seeds.

    ``run_dir`` is this run's folder (``<trainer.run_dir>/<run_id>``); ``config`` is the
    resolved config as a JSON dict (tasks rebuild the frozen model from it: :meth:`cfg`).

    :meth:`cfg` caches the validated model in the instance ``__dict__`` under :data:`_CFG_CACHE`,
    outside the dataclass fields: equality, ``repr``, ``dataclasses.asdict`` (Prefect's parameter
    JSON) and the node cache key (run id and iteration only, :func:`node_cache_key`) never see it,
    and pickling (to Ray tasks, Prefect results) drops it (:meth:`__getstate__`)."""

    run_id: str
    run_dir: str
    iteration: int
    namespace: str
    seed: int
    config: dict

    def with_iteration(self, iteration: int) -> RunContext:
        """The same run at ``iteration`` (the parsed config, when cached, is shared: same dict)."""
        other = RunContext(self.run_id, self.run_dir, iteration, self.namespace, self.seed, self.config)
        if _CFG_CACHE in self.__dict__:
            object.__setattr__(other, _CFG_CACHE, self.__dict__[_CFG_CACHE])
        return other

    def cfg(self):
        """The frozen ``ExperimentConfig`` of :attr:`config`, validated on the first call and kept
        (the dict must not be mutated afterwards). Raises ConfigError as ``config_from_dict``."""
        cached = self.__dict__.get(_CFG_CACHE)
        if cached is None:
            from hybridflow.config import config_from_dict

            cached = config_from_dict(self.config)
            object.__setattr__(self, _CFG_CACHE, cached)  # frozen dataclass: not a field, not compared
        return cached

    def __getstate__(self) -> dict[str, Any]:
        """Pickle the fields only: the cached config is rebuilt on the other side when asked for."""
        return {k: v for k, v in self.__dict__.items() if k != _CFG_CACHE}

    @property
    def iter_dir(self) -> str:
        return f"{self.run_dir}/{iteration_name(self.iteration)}"

    def batch_uri(self, node: str) -> str:
        return f"{self.iter_dir}/{node}"

    @property
    def ckpt_root(self) -> str:
        return f"{self.run_dir}/{CHECKPOINTS}"

    def node_seed(self, node: str) -> int:
        """A seed for (run seed, iteration, node): the same on a retry, different across nodes."""
        h = hashlib.sha256(f"{self.seed}/{self.iteration}/{node}".encode()).digest()
        return int.from_bytes(h[:4], "little")


def _ref_fingerprint(value: Any) -> Any:
    """What identifies an input for caching: a NodeResult/BatchRef by checksum, a RunContext by
    (run id, iteration), plain JSON values as they are."""
    if isinstance(value, RunContext):
        return {"run": value.run_id, "iteration": value.iteration}
    if isinstance(value, BatchRef):
        return value.checksum
    if isinstance(value, NodeResult):
        return {"node": value.node, "checksum": value.ref.checksum if value.ref else None}
    if isinstance(value, dict) and "ref" in value and "node" in value:  # a result as JSON
        return _ref_fingerprint(NodeResult.from_json(value))
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_ref_fingerprint(v) for v in value]
    if isinstance(value, dict):
        return {k: _ref_fingerprint(v) for k, v in sorted(value.items())}
    raise TypeError(f"cannot make a cache key from {type(value).__name__}")


def node_cache_key(context: Any, parameters: dict[str, Any], node: str | None = None) -> str:
    """Cache key = (run id, iteration, node, input refs): never a hash of tensors (torch tensors
    pickle differently every time, so a default input hash would never hit). ``node``: the node
    whose output the task writes (default: the task's name). The record stored
    under that key is checked first (:func:`tasks.results.guard_cached_record`): Prefect would
    deserialize it with whatever serializer it names, pickle included."""
    run = parameters["run"]
    node = node or context.task.name
    inputs = {k: _ref_fingerprint(v) for k, v in sorted(parameters.items()) if k != "run"}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    key = f"{run.run_id}-iter{run.iteration:06d}-{node}-{digest}"
    from tasks.results import guard_cached_record

    guard_cached_record(result_storage_path(run.run_dir) / key)  # before Prefect reads (and unpickles) it
    return key


def result_storage_path(run_dir: str) -> Path:
    """Prefect result storage for a run: ``<run_dir>/prefect-results`` (shared storage on a cluster).
    Records there are read only as JSON node results (:mod:`tasks.results`)."""
    return Path(run_dir) / RESULTS


def record_execution(run: RunContext, node: str, **extra: Any) -> None:
    """Append one line to ``<run_dir>/execution_log.jsonl``: proof that a node's body ran
    (a cached node does not run its body, so it writes nothing)."""
    line = json.dumps({"iteration": run.iteration, "node": node, "pid": os.getpid(), "t": time.time(), **extra})
    fs, path = fsspec.core.url_to_fs(f"{run.run_dir}/{EXECUTION_LOG}")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    append_line(fs, path, line)


def read_execution_log(run_dir: str) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(f"{run_dir}/{EXECUTION_LOG}")
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def save_node_output(run: RunContext, node: str, batch: Batch, metrics: dict[str, float] | None = None) -> NodeResult:
    """Save ``batch`` as ``iter_<k>/<node>``; the result carries ``metrics`` (the batch's worker
    report must have been taken first: :func:`take_report`)."""
    ref = batch.save(run.batch_uri(node), run_id=run.run_id, iteration=run.iteration, node=node)
    return NodeResult(node=node, ref=ref, metrics=metrics or {})


def load_node_output(result: NodeResult | dict | None) -> Batch | None:
    """The batch a result names (checksum verified); None for None or a metrics-only result."""
    result = NodeResult.of(result)
    return None if result is None else result.load()


def take_report(batch: Batch) -> tuple[dict[str, float], list[str]]:
    """What a worker reported with a batch it returned — ``meta["metrics"]`` (name → number) and
    ``meta["logs"]`` (lines: Prefect's logger does not work inside plain Ray actors) — removed
    from the batch, so they are neither saved with it nor reported twice. The one place that
    reads these two keys on the task side."""
    return dict(batch.meta.pop("metrics", None) or {}), list(batch.meta.pop("logs", None) or [])


class _ToRunLogger(logging.Handler):
    def __init__(self, logger: Any, thread: int):
        super().__init__(logging.INFO)
        self.logger, self.thread = logger, thread

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread == self.thread:  # calls made by this task, not by another thread of the process
            self.logger.log(record.levelno, "%s", record.getMessage())


@contextmanager
def worker_logs_to(logger: Any) -> Iterator[None]:
    """Inside the block, what pool ranks print during calls made on this thread
    (:mod:`workers.worker_logs`: re-emitted on ``hybridflow.worker_logs`` when each call returns)
    goes to ``logger`` (a node's Prefect run logger: the task run's logs in the Prefect UI; on
    the console only with ``-v``, as Prefect's console handler level decides)."""
    from workers.worker_logs import WORKER_LOGGER

    handler = _ToRunLogger(logger, threading.get_ident())
    source = logging.getLogger(WORKER_LOGGER)
    source.addHandler(handler)
    try:
        yield
    finally:
        source.removeHandler(handler)


def forward_logs(logger: Any, node: str, logs: list[str], metrics: dict[str, float] | None = None) -> None:
    """Log a worker's log lines (and, given ``metrics``, a one-line summary) to the task's Prefect logger."""
    for line in logs:
        logger.info("[%s worker] %s", node, line)
    if metrics is None:
        return
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:12])
    logger.info("%s: %s", node, shown or "done")
