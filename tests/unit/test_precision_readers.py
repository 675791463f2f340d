"""One resolver (issue 41): no module reads the model section's dtype raw; every reader asks
``hybridflow.precision.resolved_precision`` / ``model_precision``.

AST rule: an attribute ``.dtype`` read off the model config — ``<x>.model.dtype`` (``cfg.model.dtype``)
or ``<name>.dtype`` where the name ends in ``model_cfg`` — anywhere in hybridflow/, workers/, tasks/,
flows/ and bench/, except the config section itself and the resolver.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["hybridflow", "workers", "tasks", "flows", "bench"]
ALLOWED = {"hybridflow/config/model.py", "hybridflow/precision.py"}


def _raw_dtype_reads(source: str) -> list[int]:
    """Line numbers of raw model-config dtype reads in ``source``."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Attribute) and node.attr == "dtype"):
            continue
        owner = node.value
        if isinstance(owner, ast.Attribute) and owner.attr == "model":
            lines.append(node.lineno)
        elif isinstance(owner, ast.Name | ast.Attribute):
            name = owner.id if isinstance(owner, ast.Name) else owner.attr
            if name.endswith("model_cfg"):
                lines.append(node.lineno)
    return lines


def test_no_module_reads_the_model_dtype_raw():
    problems = []
    for layer in SCANNED:
        for f in sorted((ROOT / layer).rglob("*.py")):
            rel = f.relative_to(ROOT).as_posix()
            if rel in ALLOWED:
                continue
            problems += [f"{rel}:{n}" for n in _raw_dtype_reads(f.read_text())]
    assert not problems, "read the precision through hybridflow.precision, not model.dtype:\n" + "\n".join(problems)


@pytest.mark.parametrize("source", [
    "x = cfg.model.dtype\n",
    "f(dtype=self.cfg.model.dtype)\n",
    "d = model_cfg.dtype\n",
    "d = self.policy_model_cfg.dtype\n",
])
def test_the_rule_catches_a_planted_violation(source):
    assert _raw_dtype_reads(source) == [1]


def test_the_rule_leaves_tensor_and_module_dtypes_alone():
    src = "a = x.dtype\nb = model.dtype\nc = next(model.parameters()).dtype\nd = resolved_precision(cfg).param_dtype\n"
    assert _raw_dtype_reads(src) == []
