"""The declarative node API: ``@node`` and ``DataFlow(nodes=[...])``.

Each node parameter is wired to the output of the node of the same name, or to the flow input of
that name, unless the node is wired elsewhere where the dataflow is declared::

    flow = DataFlow([rollout, reward, filter_groups,
                     advantage.wire(rollout="filter_groups", reward="filter_groups"),
                     update_policy], inputs=("prompts", "kl_coef", "policy_version"))
    flow = flow.add(my_node).rewire("advantage", reward="my_node")   # a user's extension

The graph is checked before anything runs: a parameter that nothing provides, a duplicate node
name or a cycle is a :class:`DataFlowError` naming the node and the parameter. Independent nodes
are submitted together and run concurrently on the task runner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from hybridflow.deprecation import warn_deprecated
from tasks.common import RunContext, result_storage_path
from tasks.node import Node, node

__all__ = ["node", "Node", "DataFlow", "DataFlowError"]

INPUT = "input:"  # wiring prefix of a flow input


class DataFlowError(ValueError):
    """The node graph is not runnable (missing input, duplicate node, cycle, unknown node)."""


class DataFlow:
    """A validated DAG of nodes. ``inputs``: the names the flow provides at run time.

    ``wiring``: ``{node: {param: node name | "input:<name>" | None (optional, nothing provides it)}}``;
    ``order``: node names, each after the nodes it reads."""

    def __init__(self, nodes: Sequence[Node], inputs: Iterable[str] = ("prompts",)):
        self.nodes = _apply_deprecated_overrides(list(nodes))
        self.inputs = tuple(inputs)
        names = [n.name for n in self.nodes]
        dup = sorted({x for x in names if names.count(x) > 1})
        if dup:
            raise DataFlowError(f"duplicate node names: {dup}")
        clash = set(self.inputs) & set(names)
        if clash:
            raise DataFlowError(f"flow inputs {sorted(clash)} have the same name as nodes")
        self.wiring = {n.name: self._wire(n, set(names)) for n in self.nodes}
        self.order = self._topological_order()

    # ---- building ----
    def node(self, name: str) -> Node:
        """The node called ``name``; DataFlowError naming the nodes there are."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise DataFlowError(f"no node {name!r} in the dataflow (nodes: {', '.join(n.name for n in self.nodes)})")

    def add(self, new: Node, *, before: str | None = None) -> DataFlow:
        """A new DataFlow with ``new`` added (at the end, or listed before node ``before``;
        the order of the list is only the order they are shown in: wiring decides when a node runs)."""
        nodes = list(self.nodes)
        at = nodes.index(self.node(before)) if before else len(nodes)
        return DataFlow(nodes[:at] + [new] + nodes[at:], inputs=self.inputs)

    def rewire(self, consumer: str, **sources: str) -> DataFlow:
        """A new DataFlow where ``consumer``'s parameters read the given nodes or flow inputs
        (``rewire("advantage", rollout="my_filter")``)."""
        nodes = [n.wire(**sources) if n.name == consumer else n for n in self.nodes]
        self.node(consumer)
        return DataFlow(nodes, inputs=self.inputs)

    def without(self, name: str) -> DataFlow:
        """A new DataFlow without node ``name`` (its consumers must not need it: DataFlowError)."""
        self.node(name)
        return DataFlow([n for n in self.nodes if n.name != name], inputs=self.inputs)

    # ---- graph ----
    def _wire(self, n: Node, names: set[str]) -> dict[str, str | None]:
        wiring: dict[str, str | None] = {}
        for p in n.inputs:
            src = n.source(p)
            if src in names:
                wiring[p] = src
            elif src in self.inputs:
                wiring[p] = INPUT + src
            elif p in n.optional and src == p:
                wiring[p] = None
            else:
                where = f"wired to {src!r}, which" if src != p else "it"
                raise DataFlowError(
                    f"node {n.name!r}: parameter {p!r} is not provided: {where} is neither a node "
                    f"({', '.join(sorted(names))}) nor a flow input ({', '.join(self.inputs)})"
                )
        return wiring

    def deps(self, name: str) -> list[str]:
        """The nodes ``name`` reads, in parameter order."""
        return [s for s in self.wiring[name].values() if s and not s.startswith(INPUT)]

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
            for dep in self.deps(name):
                visit(dep, path + [name])
            state[name] = 2
            order.append(name)

        for n in self.nodes:
            visit(n.name, [])
        return order

    def describe(self, pool_of_role: dict[str, str] | None = None) -> str:
        """The nodes in run order, each with its inputs (``param <- source``) and the pools it calls."""
        lines = [f"flow inputs: {', '.join(self.inputs)}"]
        for name in self.order:
            n = self.node(name)
            wired = ", ".join(f"{p} <- {(src or '(default)').removeprefix(INPUT)}"
                              for p, src in self.wiring[name].items())
            pools = ", ".join(f"{r} @ pool {(pool_of_role or {}).get(r, '?')}" for r in n.roles)
            lines.append(f"{name}({wired})" + (f"  calls {pools}" if pools else ""))
        return "\n".join(lines)

    # ---- running (inside a Prefect flow) ----
    def submit(self, run: RunContext, **flow_inputs: Any) -> dict[str, Any]:
        """Submit every node (upstream futures as inputs, so independent nodes run concurrently).
        Returns {node name: PrefectFuture}. Raises DataFlowError for a missing flow input."""
        missing = set(self.inputs) - set(flow_inputs)
        if missing:
            raise DataFlowError(f"flow inputs not given: {sorted(missing)}")
        futures: dict[str, Any] = {}
        for name in self.order:
            kwargs = {p: (flow_inputs[src[len(INPUT):]] if src.startswith(INPUT) else futures[src])
                      for p, src in self.wiring[name].items() if src is not None}
            task = self.node(name).task.with_options(result_storage=result_storage_path(run.run_dir))
            futures[name] = task.submit(run=run, **kwargs)
        return futures


def _apply_deprecated_overrides(nodes: list[Node]) -> list[Node]:
    """``@node(overrides=("rollout",))`` (deprecated): the node's output stands in for ``rollout``
    for every node that does not feed it and reads ``rollout`` by name — translated to explicit
    wiring of those consumers."""
    overriders = [n for n in nodes if n.overrides]
    if not overriders:
        return nodes
    warn_deprecated(f"@node(overrides=...) (nodes {', '.join(n.name for n in overriders)})",
                    "DataFlow.rewire(consumer, param=node) (docs/extending.md)", stacklevel=3)
    by_name = {n.name: n for n in nodes}
    out = []
    for n in nodes:
        sources = {}
        for p in n.inputs:
            for o in overriders:
                if p in o.overrides and o.name != n.name and n.source(p) == p \
                        and n.name not in _ancestors(o.name, by_name):
                    sources[p] = o.name
        out.append(n.wire(**sources) if sources else n)
    return out


def _ancestors(name: str, by_name: dict[str, Node]) -> set[str]:
    """The nodes ``name`` reads, directly or not, by its declared wiring."""
    seen: set[str] = set()
    stack = [name]
    while stack:
        cur = by_name.get(stack.pop())
        for p in cur.inputs if cur else ():
            src = cur.source(p)
            if src in by_name and src not in seen:
                seen.add(src)
                stack.append(src)
    return seen
