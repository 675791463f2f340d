"""Import direction: hybridflow <- workers <- tasks <- flows; hybridflow never imports prefect/ray/mlflow."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["hybridflow", "workers", "tasks", "flows"]
FORBIDDEN_IN_LIBRARY = {"prefect", "prefect_ray", "ray", "mlflow"}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_layers_import_one_way():
    problems = []
    for i, layer in enumerate(LAYERS):
        higher = set(LAYERS[i + 1 :])
        files = sorted((ROOT / layer).rglob("*.py"))
        assert files, f"layer {layer} has no python files"
        for f in files:
            bad = _imports(f) & (higher | (FORBIDDEN_IN_LIBRARY if layer == "hybridflow" else set()))
            if bad:
                problems.append(f"{f.relative_to(ROOT)} imports {sorted(bad)}")
    assert not problems, "\n".join(problems)


def test_checker_catches_a_violation(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("import ray\nfrom prefect import flow\n")
    assert _imports(bad) == {"ray", "prefect"}


# ---- no Ray above workers/ (issue 36) -------------------------------------------------------------
# In tasks/ and flows/ (bench/ and tests/ may use Ray to measure and to test): Ray is the workers'
# business, reached only through role handles and workers/ functions. AST patterns, not names of
# nodes (a node may be named like a worker method):
#   import-ray   `import ray` / `from ray... import` (prefect_ray, Prefect's task runner, stays allowed)
#   remote       any call `<x>.remote(...)` (an actor or task call past the handles)
#   ray-get      `ray.get(...)`
#   getattr      `getattr(<handle-like>, <anything>)`: a worker method picked by name. Handle-like: a name
#                (or the last attribute of a dotted one) in HANDLE_NAMES or ending in "handle" / "_pool",
#                or a call of `pool_of(...)` / `<x>.role(...)` (what returns a RoleHandle)
#   pool-call    `<x>.call(<role>, <method>, ...)` with a string literal among its first two arguments
#                (Pool.call by role and method name)
ABOVE_WORKERS = ["tasks", "flows"]
HANDLE_NAMES = {"handle", "policy", "rollout", "pool", "role", "critic", "reference", "reward", "tools", "actor",
                "engine", "worker"}


def _last_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _handle_like(node: ast.AST) -> bool:
    if isinstance(node, ast.Call):
        return _last_name(node.func) in ("pool_of", "role")
    name = _last_name(node)
    return name is not None and (name in HANDLE_NAMES or name.endswith(("handle", "_pool")))


def _ray_uses(path: Path) -> list[str]:
    """``<line>: <rule>`` for each use of Ray past the handles in ``path`` (rules above)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        rule = None
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "ray" for a in node.names):
            rule = "import-ray"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "ray":
            rule = "import-ray"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if f.attr == "remote":
                rule = "remote"
            elif f.attr == "get" and isinstance(f.value, ast.Name) and f.value.id == "ray":
                rule = "ray-get"
            elif f.attr == "call" and len(node.args) >= 2 and any(
                    isinstance(a, ast.Constant) and isinstance(a.value, str) for a in node.args[:2]):
                rule = "pool-call"
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
              and node.args and _handle_like(node.args[0])):
            rule = "getattr"
        if rule:
            found.append(f"{node.lineno}: {rule}")
    return found


def test_no_ray_above_workers():
    problems = [f"{f.relative_to(ROOT)}:{use}" for layer in ABOVE_WORKERS
                for f in sorted((ROOT / layer).rglob("*.py")) for use in _ray_uses(f)]
    assert not problems, "Ray past the role handles (see the rules above test_no_ray_above_workers):\n" + "\n".join(problems)


@pytest.mark.parametrize("source, rule", [
    ("import ray\n", "import-ray"),
    ("import ray.util\n", "import-ray"),
    ("from ray.exceptions import GetTimeoutError\n", "import-ray"),
    ("actor.call.remote('policy', 'x')\n", "remote"),
    ("f(h).remote()\n", "remote"),
    ("ray.get(refs, timeout=3)\n", "ray-get"),
    ("getattr(handle, name)(batch)\n", "getattr"),
    ("getattr(policy, 'update_policy')\n", "getattr"),
    ("getattr(self.rollout_handle, m)\n", "getattr"),
    ("getattr(pool_of(run, 'policy'), m)\n", "getattr"),
    ("getattr(pool.role('critic'), m)\n", "getattr"),
    ("pool.call('policy', 'generate_sequences', batch)\n", "pool-call"),
    ("get_pool(n).call(role, 'update_policy', b)\n", "pool-call"),
])
def test_each_ray_rule_catches_its_violation(tmp_path, source, rule):
    bad = tmp_path / "m.py"
    bad.write_text(source)
    assert _ray_uses(bad) == [f"1: {rule}"]


def test_the_ray_rules_leave_ordinary_code_alone(tmp_path):
    ok = tmp_path / "m.py"
    ok.write_text("from prefect_ray import RayTaskRunner\nimport prefect_ray.context\n"
                  "getattr(e, 'reason', None)\nd.get('k')\npolicy.generate_sequences(b, seed=1)\n"
                  "fn.call(x)\nsubprocess.call(['ls'])\n")
    assert _ray_uses(ok) == []
