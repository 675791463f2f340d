"""``@node``: turn a function into a dataflow node (a Prefect task with a deterministic cache key).

A node function takes ``run: RunContext`` first, then inputs wired by parameter name to the
outputs of nodes of the same name (or to flow inputs). Parameters annotated ``Batch`` receive
the loaded batch; any other annotation receives the upstream :data:`NodeResult` as it is.
A node returns a ``Batch`` (saved to the run directory as ``<node>``), a ``(Batch, metrics)``
pair, a metrics dict, or a NodeResult.

``overrides=("rollout",)`` makes the node's output stand in for ``rollout`` for every node
that does not feed it (e.g. a group filter between rollout and advantage).
"""

from __future__ import annotations

import functools
import inspect
import time
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from hybridflow.batch import Batch
from tasks.common import (
    NodeResult,
    RunContext,
    forward_logs,
    load_node_output,
    metrics_result,
    node_cache_key,
    record_execution,
    save_node_output,
)

# verl's timing metric names for the built-in nodes
TIMING_NAMES = {
    "rollout": "gen",
    "reward": "reward",
    "reference": "ref",
    "values": "values",
    "advantage": "adv",
    "update_policy": "update_actor",
    "update_critic": "update_critic",
    "validate": "testing",
    "checkpoint": "save_checkpoint",
}


@dataclass
class Node:
    name: str
    fn: Callable[..., Any]
    task: Any
    inputs: tuple[str, ...]
    optional: frozenset[str]
    overrides: tuple[str, ...] = ()
    retries: int = 0
    meta: dict[str, Any] = field(default_factory=dict)


def _annotations(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolved forward refs in user code: fall back to raw annotations
        return dict(getattr(fn, "__annotations__", {}))


def split_node_output(name: str, out: Any) -> tuple[Batch | None, Any]:
    """What a node returned, as ``(batch, metrics)`` for a Batch or (Batch, metrics) pair, or
    ``(None, NodeResult)`` for a metrics dict or a NodeResult. Raises TypeError otherwise."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Batch):
        return out[0], out[1]
    if isinstance(out, Batch):
        return out, {}
    if isinstance(out, dict) and "node" in out and "ref" in out:
        return None, out
    if isinstance(out, dict):
        return None, metrics_result(name, out)
    raise TypeError(f"node {name!r} returned {type(out).__name__}; expected Batch, (Batch, metrics) or metrics")


def _wrap_result(run: RunContext, name: str, out: Any) -> NodeResult:
    batch, rest = split_node_output(name, out)
    if batch is None:
        return rest
    logs = batch.meta.pop("logs", [])
    result = save_node_output(run, name, batch, rest)
    forward_logs(get_run_logger(), name, {"logs": logs}, result["metrics"])
    return result


def node(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    retries: int = 0,
    retry_delay_s: float = 1.0,
    cache: bool = True,
    overrides: Sequence[str] = (),
) -> Any:
    """Decorator making ``fn`` a dataflow node. See the module docstring for the contract.

    retries: Prefect task retries (use only for idempotent nodes).
    cache: cache by (run id, iteration, node, input refs) with results persisted to the run's
    result storage, so a re-run iteration skips completed nodes.
    """

    def build(f: Callable) -> Node:
        node_name = name or f.__name__
        sig = inspect.signature(f)
        params = list(sig.parameters.values())
        if not params or params[0].name != "run":
            raise TypeError(f"node {node_name!r}: the first parameter must be 'run: RunContext'")
        hints = _annotations(f)
        batch_params = {p.name for p in params[1:] if hints.get(p.name) in (Batch, Batch | None)}

        @functools.wraps(f)
        def body(*args: Any, **kwargs: Any) -> NodeResult:
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            run: RunContext = bound.arguments["run"]
            record_execution(run, node_name)
            start = time.perf_counter()
            for p in batch_params:
                bound.arguments[p] = load_node_output(bound.arguments[p])
            result = _wrap_result(run, node_name, f(*bound.args, **bound.kwargs))
            result["metrics"][f"timing_s/{TIMING_NAMES.get(node_name, node_name)}"] = time.perf_counter() - start
            return result

        body.__signature__ = sig.replace(return_annotation=dict)  # type: ignore[attr-defined]
        body.__annotations__ = {}  # Prefect must not validate inputs against user annotations
        options: dict[str, Any] = {
            "name": node_name,
            "task_run_name": node_name + "-{run.iteration:06d}",
            "retries": retries,
            "retry_delay_seconds": retry_delay_s,
            "persist_result": True,
            "result_serializer": "json",
        }
        if cache:
            options["cache_key_fn"] = node_cache_key
        else:
            from prefect.cache_policies import NO_CACHE

            options["cache_policy"] = NO_CACHE
        prefect_task = task(**options)(body)
        return Node(
            name=node_name,
            fn=f,
            task=prefect_task,
            inputs=tuple(p.name for p in params[1:]),
            optional=frozenset(p.name for p in params[1:] if p.default is not inspect.Parameter.empty),
            overrides=tuple(overrides),
            retries=retries,
        )

    return build(fn) if fn is not None else build
