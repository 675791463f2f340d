"""NuminaMath rule reward, graded as verl's ``prime_math.compute_score`` (PRIME, Cui et al. 2025).

verl sends the ``numina_*`` data sources here. The answer is the content of the response's LAST
``\\boxed{}``/``\\fbox{}``; without a box, the rest of the line after the last ``answer:`` /
``answer is`` marker (any case), else the whole response; either cut after its last ``=`` or
`` is `` and stripped of ``$`` and a trailing period. It is right when :func:`~hybridflow.rewards.grading.grade_answer` (PRM800K)
or :func:`~hybridflow.rewards.grading.math_equal` (PRIME; with ``\\pi`` read as π) accepts it.
Score 1.0 / 0.0 (verl returns the bool ``is_correct``, which its ``default_compute_score`` turns into
a float). Deliberate differences (docs/rewards.md): no ``eval``/``parse_expr`` of model text (math-verify
decides symbolic equality); a later ``\\fbox`` beats an earlier ``\\boxed`` (verl prefers any
``\\boxed``).
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed
from hybridflow.rewards.grading import grade_answer, math_equal
from hybridflow.rewards.registry import register_reward

NUMINA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                  "numina_cn_k12", "numina_olympiads")  # fmt: skip
_MARKER_RE = re.compile(r"(?i)answers? (?:is|are)|answer:")


def match_answer(response: str) -> str | None:
    """The final answer of ``response`` (see the module docstring), or None when nothing is left."""
    boxed = extract_boxed(response)
    if boxed is not None:
        return boxed.strip() or None
    markers = list(_MARKER_RE.finditer(response))
    if markers:
        lines = [ln for ln in response[markers[-1].end() :].splitlines() if ln.strip()]
        line = lines[0] if lines else ""
    else:
        line = response
    eq, is_ = line.rfind("="), line.rfind(" is ")
    start = max(eq + 1 if eq >= 0 else 0, is_ + len(" is ") if is_ >= 0 else 0)
    answer = line[start:]
    return answer.strip().strip("$").rstrip(".").strip() or None


def prime_equal(answer: str | None, ground_truth: str) -> bool:
    """PRM800K's grader, then PRIME's ``math_equal`` (with π as 3.14159… and 3.14 when ``\\pi`` shows)."""
    if answer is None:
        return False
    if grade_answer(answer, ground_truth):
        return True
    if math_equal(answer, ground_truth):
        return True
    if "\\pi" not in answer and "\\pi" not in ground_truth:
        return False
    for pi in (r"\cdot 3.141592653589793", r"\cdot 3.14"):  # PRIME also tries π = 3.14
        if math_equal(answer.replace("\\pi", pi), ground_truth.replace("\\pi", pi)):
            return True
    return False


@register_reward(*NUMINA_SOURCES)
def prime_math_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when the final answer is equivalent to ``ground_truth``, else 0.0.

    Returns {score, acc, parsed, pred}. A number ground truth is read as its decimal string;
    raises ValueError for any other non-string.
    """
    if isinstance(ground_truth, int | float) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"numina ground truth {ground_truth!r} is not a non-empty string")
    pred = match_answer(solution_str)
    acc = prime_equal(pred, ground_truth.strip())
    return {"score": float(acc), "acc": float(acc), "parsed": pred is not None, "pred": pred}
