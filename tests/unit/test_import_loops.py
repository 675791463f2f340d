"""No import loops in hybridflow/, workers/, tasks/, flows/, except named registry patterns.

The graph: one node per module (a package is its ``__init__``). An edge A -> B when A imports B,
at module level or inside a function (a function-level import is still a dependency: it only
runs later). Imports under ``if TYPE_CHECKING:`` do not count: they never run, they only name
types for annotations. ``from pkg import name`` points at the module ``pkg.name`` when there is
one, else at ``pkg``. Importing ``pkg.mod`` from outside ``pkg`` also runs ``pkg/__init__``, so
it adds an edge to every enclosing package the importer is not itself inside (a module inside a
package is imported from its ``__init__`` or while it runs: that is not a loop).

A loop is a strongly connected component of more than one module. An allowed edge (below) is
taken out of the graph before looking for components: each is the back edge of a registry
pattern, where a registry imports its built-in implementations lazily (on first lookup) and
they import the registry to register themselves.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("hybridflow", "workers", "tasks", "flows")

# (importer, imported) -> why this edge may close a loop. The test fails when an entry no longer
# names an edge that exists, so a closed loop is removed from this list.
ALLOWED_EDGES: dict[tuple[str, str], str] = {
    **{("hybridflow.rewards.registry", f"hybridflow.rewards.{rule}"):
       "registry pattern: the rule-reward registry imports its built-in rules lazily on first "
       "lookup; each rule module imports the registry to register itself"
       for rule in ("arith", "code", "countdown", "geo3k", "gsm8k", "math_dapo", "math_reward",
                    "prime_math", "reasoning_gym", "search_qa", "environment")},
    ("hybridflow.agents.environments", "hybridflow.agents.hubs"):
        "registry pattern: the environment registry imports the hub adapters (textarena, gymnasium) "
        "lazily on first lookup; they import it to register themselves",
    ("hybridflow.agents.environments", "hybridflow.agents.hub_openenv"):
        "registry pattern: the environment registry imports the OpenEnv adapter lazily on first "
        "lookup; it imports the registry to register itself",
    ("hybridflow.agents.environments", "hybridflow.agents.hub_verifiers"):
        "registry pattern: the environment registry imports the verifiers adapter lazily on first "
        "lookup; it imports the registry to register itself",
    **{("workers.rollout.base", f"workers.rollout.{engine}"):
       "registry pattern: the rollout-engine registry imports the built-in engines lazily by "
       "name; each engine module imports the protocol and registry from base"
       for engine in ("hf", "vllm")},
}


def module_table(root: Path, packages: tuple[str, ...]) -> dict[str, tuple[Path, bool]]:
    """``{dotted module name: (file, is a package __init__)}`` for every .py under ``packages``."""
    table: dict[str, tuple[Path, bool]] = {}
    for package in packages:
        for f in sorted((root / package).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            table[".".join(parts[:-1] if is_package else parts)] = (f, is_package)
    return table


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_nodes(node: ast.AST):
    """Every node below ``node``, skipping the bodies of ``if TYPE_CHECKING:`` (not their else)."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and _is_type_checking(child):
            for stmt in child.orelse:
                yield stmt
                yield from _runtime_nodes(stmt)
            continue
        yield child
        yield from _runtime_nodes(child)


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """Dotted names an import statement may load (candidates: ``pkg.name`` before ``pkg``)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[: len(here) - (node.level - 1)]
        base = ".".join(here + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" for a in node.names]


def _resolve(name: str, table: dict) -> str | None:
    """The longest prefix of ``name`` that is a module of the table (None: outside it)."""
    while name and name not in table:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """``{module: modules it imports at run time}`` within ``packages`` (see the module docstring)."""
    table = module_table(root, packages)
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in table.items():
        direct: set[str] = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), filename=str(path))):
            for name in _imported_names(node, module, is_package):
                target = _resolve(name, table)
                if target:
                    direct.add(target)
        enclosing = {".".join(t.split(".")[:i]) for t in direct for i in range(1, t.count(".") + 1)}
        outside = {p for p in enclosing if p in table and not (module == p or module.startswith(p + "."))}
        graph[module] = (direct | outside) - {module}
    return graph


def import_loops(graph: dict[str, set[str]], allowed: set[tuple[str, str]] = frozenset()) -> list[list[str]]:
    """Strongly connected components of more than one module (sorted), without ``allowed`` edges
    (Tarjan's algorithm, iterative)."""
    edges = {a: sorted(b for b in bs if (a, b) not in allowed) for a, bs in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in edges:
                    continue
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(edges[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    loops.append(sorted(component))
    return sorted(loops)


def _describe(loop: list[str], graph: dict[str, set[str]]) -> str:
    inside = set(loop)
    edges = [f"{a} -> {b}" for a in loop for b in sorted(graph[a] & inside)]
    return "loop: " + ", ".join(loop) + "\n    " + "\n    ".join(edges)


def test_no_import_loops_beyond_the_allow_list():
    graph = import_graph(ROOT)
    loops = import_loops(graph, set(ALLOWED_EDGES))
    assert not loops, "\n".join(_describe(loop, graph) for loop in loops)


def test_every_allowed_edge_still_exists():
    graph = import_graph(ROOT)
    stale = [f"{a} -> {b}" for a, b in ALLOWED_EDGES if b not in graph.get(a, set())]
    assert not stale, f"ALLOWED_EDGES names edges that are gone (remove them): {stale}"


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return import_graph(tmp_path, ("pkg",))


def test_checker_catches_a_planted_loop(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": "def f():\n    from pkg import c\n",  # function-level imports count
        "pkg/c.py": "from . import a\n",  # relative imports resolve
        "pkg/d.py": "import pkg.a\n",  # imports into the loop, not part of it
    })
    assert import_loops(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert import_loops(graph, {("pkg.c", "pkg.a")}) == []  # an allowed edge breaks it


def test_type_checking_imports_do_not_count(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from pkg.b import f\n",
        "pkg/b.py": """\
            from typing import TYPE_CHECKING
            import typing
            if TYPE_CHECKING:
                from pkg.a import A
            if typing.TYPE_CHECKING:
                import pkg.a
            else:
                import pkg.c
            """,
        "pkg/c.py": "",
    })
    assert graph["pkg.b"] == {"pkg.c"}
    assert import_loops(graph) == []


def test_a_package_init_counts_for_importers_outside_it(tmp_path):
    graph = _plant(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/sub/__init__.py": "from pkg.sub import y\n",  # the package's __init__ imports y
        "pkg/sub/y.py": "def g():\n    from pkg.x import h\n",
        "pkg/sub/z.py": "from pkg.sub import y\n",  # inside pkg.sub: its __init__ is no edge
        "pkg/x.py": "from pkg.sub.z import k\n",  # runs pkg/sub/__init__, which imports y
    })
    assert graph["pkg.x"] == {"pkg.sub", "pkg.sub.z"} and graph["pkg.sub.z"] == {"pkg.sub.y"}
    assert import_loops(graph) == [["pkg.sub", "pkg.sub.y", "pkg.sub.z", "pkg.x"]]
