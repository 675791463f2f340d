"""What every node task shares: the run context, deterministic cache keys, result storage,
the execution log, and forwarding worker logs/metrics to Prefect's logger.

Prefect carries references, not tensors: a node returns a :data:`NodeResult`, a JSON dict
``{"node": str, "ref": BatchRef dict | None, "metrics": {name: float}}``. The batch itself
lives in the run directory (``<run_dir>/iter_000007/<node>.safetensors`` + ``.json``).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import fsspec

from hybridflow.batch import Batch, BatchRef

NodeResult = dict[str, Any]


@dataclass(frozen=True)
class RunContext:
    """Everything a node needs to find its run: identifiers, where data lives, seeds.

    ``run_dir`` is this run's folder (``<trainer.run_dir>/<run_id>``); ``config`` is the
    resolved config as a JSON dict (tasks rebuild the frozen model from it)."""

    run_id: str
    run_dir: str
    iteration: int
    namespace: str
    seed: int
    config: dict

    def with_iteration(self, iteration: int) -> RunContext:
        return RunContext(self.run_id, self.run_dir, iteration, self.namespace, self.seed, self.config)

    def cfg(self):
        from hybridflow.config import config_from_dict

        return config_from_dict(self.config)

    @property
    def iter_dir(self) -> str:
        return f"{self.run_dir}/iter_{self.iteration:06d}"

    def batch_uri(self, node: str) -> str:
        return f"{self.iter_dir}/{node}"

    @property
    def ckpt_root(self) -> str:
        return f"{self.run_dir}/checkpoints"

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
    if isinstance(value, dict) and "ref" in value and "node" in value:
        ref = value["ref"]
        return {"node": value["node"], "checksum": ref["checksum"] if ref else None}
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_ref_fingerprint(v) for v in value]
    if isinstance(value, dict):
        return {k: _ref_fingerprint(v) for k, v in sorted(value.items())}
    raise TypeError(f"cannot make a cache key from {type(value).__name__}")


def node_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    """Cache key = (run id, iteration, node, input refs): never a hash of tensors (torch tensors
    pickle differently every time, so a default input hash would never hit). The record stored
    under that key is checked first (:func:`tasks.results.guard_cached_record`): Prefect would
    deserialize it with whatever serializer it names, pickle included."""
    run = parameters["run"]
    node = context.task.name
    inputs = {k: _ref_fingerprint(v) for k, v in sorted(parameters.items()) if k != "run"}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]
    key = f"{run.run_id}-iter{run.iteration:06d}-{node}-{digest}"
    from tasks.results import guard_cached_record

    guard_cached_record(result_storage_path(run.run_dir) / key)  # before Prefect reads (and unpickles) it
    return key


def result_storage_path(run_dir: str) -> Path:
    """Prefect result storage for a run: ``<run_dir>/prefect-results`` (shared storage on a cluster).
    Records there are read only as JSON node results (:mod:`tasks.results`)."""
    return Path(run_dir) / "prefect-results"


def record_execution(run: RunContext, node: str, **extra: Any) -> None:
    """Append one line to ``<run_dir>/execution_log.jsonl``: proof that a node's body ran
    (a cached node does not run its body, so it writes nothing)."""
    line = json.dumps({"iteration": run.iteration, "node": node, "pid": os.getpid(), "t": time.time(), **extra})
    fs, path = fsspec.core.url_to_fs(f"{run.run_dir}/execution_log.jsonl")
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "a") as f:
        f.write(line + "\n")


def read_execution_log(run_dir: str) -> list[dict[str, Any]]:
    fs, path = fsspec.core.url_to_fs(f"{run_dir}/execution_log.jsonl")
    if not fs.exists(path):
        return []
    with fs.open(path, "r") as f:
        return [json.loads(line) for line in f if line.strip()]


def save_node_output(run: RunContext, node: str, batch: Batch, metrics: dict[str, float] | None = None) -> NodeResult:
    ref = batch.save(run.batch_uri(node), run_id=run.run_id, iteration=run.iteration, node=node)
    all_metrics = {**batch.meta.pop("metrics", {}), **(metrics or {})}
    return {"node": node, "ref": ref.to_dict(), "metrics": _floats(all_metrics)}


def load_node_output(result: NodeResult | None) -> Batch | None:
    if result is None or result.get("ref") is None:
        return None
    return BatchRef.from_dict(result["ref"]).load()


def metrics_result(node: str, metrics: dict[str, Any]) -> NodeResult:
    return {"node": node, "ref": None, "metrics": _floats(metrics)}


def _floats(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            continue
    return out


def forward_logs(logger: Any, node: str, batch_or_meta: Any, metrics: dict[str, float]) -> None:
    """Log worker log lines (they come back in the return value: Prefect's logger does not work
    inside plain Ray actors) and a one-line metrics summary."""
    meta = batch_or_meta.meta if isinstance(batch_or_meta, Batch) else (batch_or_meta or {})
    for line in meta.pop("logs", []) if isinstance(meta, dict) else []:
        logger.info("[%s worker] %s", node, line)
    shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())[:12])
    logger.info("%s: %s", node, shown or "done")


def asdict_run(run: RunContext) -> dict[str, Any]:
    return asdict(run)
