"""``@node``: turn a function into a dataflow node (a Prefect task with a deterministic cache key).

A node function takes ``run: RunContext`` first, then its inputs. Each input is wired to the
output of the node of the same name or to the flow input of that name, unless the dataflow wires
it elsewhere (:meth:`Node.wire`, e.g. ``advantage.wire(rollout="filter_groups")``). Parameters
annotated ``Batch`` receive the loaded batch; any other annotation receives the upstream
:class:`~tasks.types.NodeResult` as it is. A node returns a ``Batch`` (saved to the run directory
as ``iter_<k>/<node>``; a worker's report in its meta is taken into the metrics and logs), a
``(Batch, metrics)`` pair, a metrics dict, or a NodeResult.

``roles=("policy",)`` names the roles the node calls (``hybridflow dataflow show`` prints their pools).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import time
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prefect import get_run_logger, task

from hybridflow.batch import Batch
from hybridflow.deprecation import warn_deprecated
from hybridflow.metric_names import node_time_metric
from tasks.common import (
    RunContext,
    forward_logs,
    load_node_output,
    node_cache_key,
    record_execution,
    save_node_output,
    take_report,
    worker_logs_to,
)
from tasks.serializer import NodeResultSerializer
from tasks.types import NodeResult


@dataclass(frozen=True)
class Node:
    """A dataflow node: its function, its Prefect task and how its inputs are wired.

    inputs: parameter names after ``run``; optional: those with a default (absent → default);
    batch_inputs: those annotated ``Batch`` (loaded before the call); sources: ``{param: node or
    flow input}`` where the dataflow wires it elsewhere than the same-named node; roles: the pool
    roles it calls."""

    name: str
    fn: Callable[..., Any]
    task: Any
    inputs: tuple[str, ...]
    optional: frozenset[str]
    batch_inputs: frozenset[str] = frozenset()
    sources: Mapping[str, str] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    retries: int = 0
    overrides: tuple[str, ...] = ()  # deprecated: use Node.wire / DataFlow.rewire

    def source(self, param: str) -> str:
        """Where ``param`` comes from: a node name or a flow input name."""
        return self.sources.get(param, param)

    def wire(self, **sources: str) -> Node:
        """This node with ``param=<node or flow input>`` wiring (others stay by name). Raises
        ValueError naming a parameter the node does not have."""
        unknown = set(sources) - set(self.inputs)
        if unknown:
            raise ValueError(f"node {self.name!r} has no parameter(s) {sorted(unknown)}; "
                             f"parameters: {', '.join(self.inputs)}")
        return dataclasses.replace(self, sources={**self.sources, **sources})


def _annotations(fn: Callable) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolved forward refs in user code: fall back to raw annotations
        return dict(getattr(fn, "__annotations__", {}))


def split_node_output(name: str, out: Any) -> tuple[Batch | None, NodeResult]:
    """What a node returned, as ``(batch to save or None, result)``: a Batch, a ``(Batch, metrics)``
    pair, a ``(Batch, NodeResult)`` pair (a result type with more fields, e.g. AdvantageResult; its
    ``ref`` is filled in when the batch is saved), a NodeResult, or a metrics dict. Raises TypeError."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], Batch):
        rest = out[1]
        if isinstance(rest, NodeResult):
            return out[0], rest
        if isinstance(rest, Mapping):
            return out[0], NodeResult(node=name, metrics=rest)
    if isinstance(out, Batch):
        return out, NodeResult(node=name)
    if isinstance(out, NodeResult):
        return None, out
    if isinstance(out, Mapping):
        return None, NodeResult(node=name, metrics=out)
    raise TypeError(f"node {name!r} returned {type(out).__name__}; expected Batch, (Batch, metrics), "
                    "(Batch, NodeResult), a metrics dict or a NodeResult")


def save_output(run: RunContext, name: str, out: Any) -> tuple[NodeResult, list[str]]:
    """A node function's return value as its NodeResult, a batch saved as ``iter_<k>/<name>`` (its
    worker report taken into the metrics), and the worker's log lines."""
    batch, result = split_node_output(name, out)
    if batch is None:
        return result, []
    report, logs = take_report(batch)
    saved = save_node_output(run, name, batch)
    return dataclasses.replace(result, node=name, ref=saved.ref, metrics={**report, **result.metrics}), logs


def wrap_result(run: RunContext, name: str, out: Any) -> NodeResult:
    """:func:`save_output`, the worker's logs and a metrics line forwarded to Prefect's logger."""
    result, logs = save_output(run, name, out)
    if result.ref is not None:
        forward_logs(get_run_logger(), name, logs, result.metrics)
    return result


def batch_parameters(fn: Callable) -> frozenset[str]:
    """The parameters of a node function annotated ``Batch`` (or ``Batch | None``)."""
    hints = _annotations(fn)
    params = list(inspect.signature(fn).parameters.values())[1:]
    return frozenset(p.name for p in params if hints.get(p.name) in (Batch, Batch | None))


def _as_results(arguments: dict[str, Any]) -> None:
    """Upstream results in JSON form (a record cached before the result types) as NodeResults."""
    for p, v in arguments.items():
        if isinstance(v, Mapping) and {"node", "ref", "metrics"} <= set(v):
            arguments[p] = NodeResult.of(v)


def _body(f: Callable, node_name: str, batch_params: frozenset[str]) -> Callable[..., NodeResult]:
    """The Prefect task's function: record the execution, load Batch inputs, call, wrap, time."""
    sig = inspect.signature(f)
    timing = node_time_metric(node_name)  # verl's names for the built-in nodes

    @functools.wraps(f)
    def body(*args: Any, **kwargs: Any) -> NodeResult:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        run: RunContext = bound.arguments["run"]
        _wait_if_retry(run, node_name)
        record_execution(run, node_name)
        start = time.perf_counter()
        _as_results(bound.arguments)
        for p in batch_params:
            bound.arguments[p] = load_node_output(bound.arguments[p])
        with worker_logs_to(get_run_logger()):
            result = wrap_result(run, node_name, f(*bound.args, **bound.kwargs))
        return result.with_metrics({timing: time.perf_counter() - start})

    body.__signature__ = sig.replace(return_annotation=NodeResult)  # type: ignore[attr-defined]
    body.__annotations__ = {}  # Prefect must not validate inputs against user annotations
    return body


def _wait_if_retry(run: RunContext, node_name: str) -> None:
    """On a Prefect retry of this node (run count > 1), wait for the run's pools to be whole again
    (:func:`tasks.pools.wait_for_run_pools`) before running it: a retry that came 1 s after an actor
    died met the rank still restarting and was spent (issue 40)."""
    from prefect.runtime import task_run

    if (task_run.run_count or 1) <= 1:
        return
    from tasks.pools import wait_for_run_pools

    waited = wait_for_run_pools(run)
    if waited >= 0.5:
        get_run_logger().info("retry of %s: waited %.1f s for the pools' ranks to be back", node_name, waited)


def _task_options(node_name: str, retries: int, retry_delay_s: float, cache: bool) -> dict[str, Any]:
    options: dict[str, Any] = {
        "name": node_name,
        "task_run_name": node_name + "-{run.iteration:06d}",
        "retries": retries,
        "retry_delay_seconds": retry_delay_s,
        "persist_result": True,
        "result_serializer": NodeResultSerializer(),
    }
    if cache:
        options["cache_key_fn"] = node_cache_key
    else:
        from prefect.cache_policies import NO_CACHE

        options["cache_policy"] = NO_CACHE
    return options


def node(
    fn: Callable | None = None,
    *,
    name: str | None = None,
    retries: int = 0,
    retry_delay_s: float = 1.0,
    cache: bool = True,
    roles: Sequence[str] = (),
    overrides: Sequence[str] = (),
) -> Any:
    """Decorator making ``fn`` a dataflow node. See the module docstring for the contract.

    retries: Prefect task retries (use only for idempotent nodes).
    cache: cache by (run id, iteration, node, input refs) with results persisted to the run's
    result storage, so a re-run iteration skips completed nodes.
    roles: the pool roles the node calls (documentation and ``hybridflow dataflow show``).
    overrides: deprecated (FutureWarning; removed in 0.3.0) — wire the consumers instead
    (``DataFlow.rewire``); still honoured.
    """

    def build(f: Callable) -> Node:
        node_name = name or f.__name__
        params = list(inspect.signature(f).parameters.values())
        if not params or params[0].name != "run":
            raise TypeError(f"node {node_name!r}: the first parameter must be 'run: RunContext'")
        if overrides:
            warn_deprecated(f"node {node_name!r}: @node(overrides=...)",
                            "DataFlow.rewire(consumer, param=node) (docs/extending.md)", stacklevel=2)
        batch_params = batch_parameters(f)
        prefect_task = task(**_task_options(node_name, retries, retry_delay_s, cache))(_body(f, node_name, batch_params))
        return Node(
            name=node_name,
            fn=f,
            task=prefect_task,
            inputs=tuple(p.name for p in params[1:]),
            optional=frozenset(p.name for p in params[1:] if p.default is not inspect.Parameter.empty),
            batch_inputs=batch_params,
            roles=tuple(roles),
            retries=retries,
            overrides=tuple(overrides),
        )

    return build(fn) if fn is not None else build
