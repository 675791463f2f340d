"""Code-contest rule reward (APPS, CodeContests, Codeforces, TACO): run the response's program on
the row's test cases in :func:`hybridflow.rewards.sandbox.run_code`, as verl's
``prime_code.compute_score(continuous=True)`` does in its own sandbox.

- **Program**: the LAST fenced ```` ```python ```` (or ```` ```py ````/```` ```python3 ````) block of
  the response; else its last fenced block of any language; else the whole response (verl: the
  text after the last ```` ```python ````).
- **Tests** (the ground truth, a dict or its JSON string): ``{"inputs": [...], "outputs": [...]}``
  for stdin/stdout programs — an output passes when it equals the expected text line by line after
  trailing whitespace is dropped, or token by token with numbers equal within 1e-6; with
  ``"fn_name"`` the program is call-based: ``inputs[i]`` is the argument list of ``fn_name`` (a
  top-level function or a method of ``class Solution``), and the JSON of its result must equal
  ``outputs[i]`` or ``[outputs[i]]``.
- **Limits**: the first ``reward.code_max_cases`` cases run (verl's continuous score reads the first
  10), each under ``reward.code_case_timeout_s`` of wall clock and ``reward.sandbox_memory_mb``. All
  cases of a row share a budget of ``reward.timeout_s`` minus a reserve of max(1 s, 20 %): a case
  is cut at the budget's end and cases left fail unrun, so a slow program scores what it passed
  instead of tripping the executor's row timeout.

Score = passed cases / cases run, in [0, 1] (1.0 when all pass). Returns {score, acc (1.0 when all
pass), parsed (a program was found), pred ("passed/run"), passed, timeouts}.
"""

from __future__ import annotations

import json
import math
import re
import time
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.registry import register_reward
from hybridflow.rewards.sandbox import run_code

CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
_FENCE_RE = re.compile(r"```([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_PYTHON_TAGS = {"python", "py", "python3"}
_CALL_HARNESS = """
import json as _hf_json, sys as _hf_sys
_hf_args = _hf_json.loads(_hf_sys.stdin.read())
_hf_fn = globals().get({fn!r}) or getattr(globals()["Solution"](), {fn!r})
print(_hf_json.dumps(_hf_fn(*_hf_args)))
"""


def extract_code(response: str) -> str | None:
    """The program in ``response`` (see the module docstring); None when it is blank."""
    blocks = _FENCE_RE.findall(response)
    python = [body for tag, body in blocks if tag.lower() in _PYTHON_TAGS]
    code = python[-1] if python else blocks[-1][1] if blocks else response
    return code if code.strip() else None


def parse_tests(ground_truth: Any) -> tuple[list[Any], list[Any], str | None]:
    """(inputs, outputs, fn_name) from a dict or its JSON; ValueError naming what is wrong."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(tests, dict) or "inputs" not in tests or "outputs" not in tests:
        raise ValueError(f"code ground truth must be a dict (or JSON) with 'inputs' and 'outputs', got {str(ground_truth)[:80]!r}")
    inputs, outputs = list(tests["inputs"]), list(tests["outputs"])
    if len(inputs) != len(outputs) or not inputs:
        raise ValueError(f"code ground truth has {len(inputs)} inputs and {len(outputs)} outputs; need as many, at least one")
    fn_name = tests.get("fn_name") or None
    return inputs, outputs, fn_name


def outputs_match(stdout: str, expected: str) -> bool:
    """Line-by-line equality ignoring trailing whitespace and blank trailing lines, else token by
    token with numeric tokens equal within 1e-6 (absolute or relative)."""
    got = [ln.rstrip() for ln in stdout.rstrip().splitlines()]
    want = [ln.rstrip() for ln in str(expected).rstrip().splitlines()]
    if got == want:
        return True
    a, b = stdout.split(), str(expected).split()
    return len(a) == len(b) and all(x == y or _close(x, y) for x, y in zip(a, b, strict=True))


def _close(x: str, y: str) -> bool:
    try:
        fx, fy = float(x), float(y)
    except ValueError:
        return False
    return math.isfinite(fx) and math.isfinite(fy) and math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-6)


def _call_match(stdout: str, expected: Any) -> bool:
    try:
        got = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    return got == expected or [got] == expected


def row_budget_s(timeout_s: float) -> float:
    """Seconds all test cases of one row may take: ``timeout_s`` less a reserve of max(1 s, 20 %)
    for starting processes and answering the executor."""
    return max(0.0, timeout_s - max(1.0, 0.2 * timeout_s))


@register_reward(*CODE_SOURCES)
def code_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """Fraction of the first ``reward.code_max_cases`` test cases the program passes (module docstring).

    Raises ValueError for a ground truth without matching inputs/outputs.
    """
    inputs, outputs, fn_name = parse_tests(ground_truth)
    cases = list(zip(inputs, outputs, strict=True))[: cfg.code_max_cases]
    code = extract_code(solution_str)
    if code is None:
        return {"score": 0.0, "acc": 0.0, "parsed": False, "pred": f"0/{len(cases)}", "passed": 0, "timeouts": 0}
    program = code + _CALL_HARNESS.format(fn=fn_name) if fn_name else code
    deadline = time.monotonic() + row_budget_s(cfg.timeout_s)
    passed = timeouts = 0
    for case_input, expected in cases:
        left = deadline - time.monotonic()
        if left <= 0.05:
            break  # the row's budget is spent: the remaining cases fail unrun
        stdin = json.dumps(case_input) if fn_name else str(case_input)
        res = run_code(program, timeout_s=min(cfg.code_case_timeout_s, left), memory_mb=cfg.sandbox_memory_mb,
                       stdin=stdin)  # fmt: skip
        timeouts += res.timed_out
        if res.ok and (_call_match(res.stdout, expected) if fn_name else outputs_match(res.stdout, expected)):
            passed += 1
    score = passed / len(cases)
    return {"score": score, "acc": float(passed == len(cases)), "parsed": True, "pred": f"{passed}/{len(cases)}",
            "passed": passed, "timeouts": timeouts}  # fmt: skip
