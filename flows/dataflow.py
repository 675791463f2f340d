"""The declarative node API: ``@node`` and ``DataFlow(nodes=[...])``.

Inputs are wired by parameter name to the outputs of the nodes of the same name, or to flow
inputs. The graph is checked before anything runs: a parameter that nothing provides, a
duplicate node name or a cycle is a :class:`DataFlowError` naming the node and parameter.
Independent nodes are submitted together and run concurrently on the task runner.

    @node(name="filter_groups", overrides=("rollout", "reward"))
    def filter_groups(run, rollout: Batch, reward: Batch) -> Batch: ...

    flow = DataFlow(nodes=[rollout, reward, filter_groups, advantage, update_policy])
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from tasks.common import NodeResult, RunContext, result_storage_path
from tasks.node import Node, node

__all__ = ["node", "Node", "DataFlow", "DataFlowError"]


class DataFlowError(ValueError):
    """The node graph is not runnable (missing input, duplicate node, cycle)."""


class DataFlow:
    """A validated DAG of nodes. ``inputs`` are the names the flow provides at run time."""

    def __init__(self, nodes: Sequence[Node], inputs: Iterable[str] = ("prompts",)):
        self.nodes = list(nodes)
        self.inputs = set(inputs)
        names = [n.name for n in self.nodes]
        dup = {x for x in names if names.count(x) > 1}
        if dup:
            raise DataFlowError(f"duplicate node names: {sorted(dup)}")
        clash = self.inputs & set(names)
        if clash:
            raise DataFlowError(f"flow inputs {sorted(clash)} have the same name as nodes")
        self.wiring = self._wire()
        self.order = self._topological_order()

    # ---- graph ----
    def _providers(self) -> dict[str, str]:
        return {n.name: n.name for n in self.nodes}

    def _wire(self) -> dict[str, dict[str, str | None]]:
        """{node: {param: provider node name | 'input:<name>' | None (optional, absent)}}."""
        base = self._providers()
        plain = {n.name: {p: base.get(p) for p in n.inputs} for n in self.nodes}
        overriders = [n for n in self.nodes if n.overrides]
        wiring: dict[str, dict[str, str | None]] = {}
        for n in self.nodes:
            wiring[n.name] = {}
            for p in n.inputs:
                src: str | None = base.get(p)
                for o in overriders:
                    if p in o.overrides and o.name != n.name and n.name not in _ancestors(o.name, plain):
                        src = o.name
                if src is None:
                    if p in self.inputs:
                        src = f"input:{p}"
                    elif p not in n.optional:
                        raise DataFlowError(
                            f"node {n.name!r}: parameter {p!r} is not the output of any node "
                            f"({', '.join(sorted(base))}) nor a flow input ({', '.join(sorted(self.inputs))})"
                        )
                wiring[n.name][p] = src
        return wiring

    def _deps(self, name: str) -> list[str]:
        return [s for s in self.wiring[name].values() if s and not s.startswith("input:")]

    def _topological_order(self) -> list[str]:
        order: list[str] = []
        state: dict[str, int] = {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == 2:
                return
            if state.get(name) == 1:
                cycle = path[path.index(name):] + [name]
                raise DataFlowError(f"cycle in the dataflow: {' -> '.join(cycle)}")
            state[name] = 1
            for dep in self._deps(name):
                visit(dep, path + [name])
            state[name] = 2
            order.append(name)

        for n in self.nodes:
            visit(n.name, [])
        return order

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    # ---- running (inside a Prefect flow) ----
    def submit(self, run: RunContext, skip: Iterable[str] = (), **flow_inputs: Any) -> dict[str, Any]:
        """Submit every node (upstream futures as inputs, so independent nodes run concurrently).
        Returns {node name: PrefectFuture}. ``skip``: nodes not to run (their consumers get None)."""
        missing = self.inputs - set(flow_inputs)
        if missing:
            raise DataFlowError(f"flow inputs not given: {sorted(missing)}")
        skip = set(skip)
        futures: dict[str, Any] = {}
        for name in self.order:
            if name in skip:
                continue
            kwargs: dict[str, Any] = {}
            for p, src in self.wiring[name].items():
                if src is None:
                    continue
                if src.startswith("input:"):
                    kwargs[p] = flow_inputs[src[len("input:"):]]
                elif src in futures:
                    kwargs[p] = futures[src]
                elif p in self.node(name).optional:
                    continue
                else:
                    raise DataFlowError(f"node {name!r} needs {p!r} from skipped node {src!r}")
            task = self.node(name).task.with_options(result_storage=result_storage_path(run.run_dir))
            futures[name] = task.submit(run=run, **kwargs)
        return futures

    def run(self, run: RunContext, **flow_inputs: Any) -> dict[str, NodeResult]:
        """Submit all nodes and wait. Raises the first node failure."""
        futures = self.submit(run, **flow_inputs)
        return {name: fut.result() for name, fut in futures.items()}


def _ancestors(name: str, plain: dict[str, dict[str, str | None]]) -> set[str]:
    seen: set[str] = set()
    stack = [name]
    while stack:
        cur = stack.pop()
        for src in plain.get(cur, {}).values():
            if src and src not in seen:
                seen.add(src)
                stack.append(src)
    return seen
