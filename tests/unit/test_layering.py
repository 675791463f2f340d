"""Import direction: hybridflow <- workers <- tasks <- flows; hybridflow never imports prefect/ray/mlflow."""

import ast
from pathlib import Path

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
