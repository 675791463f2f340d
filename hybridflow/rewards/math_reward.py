"""MATH-style rule reward: answer equivalence by ``math-verify`` (Hugging Face), as verl's
``math_verify.compute_score``, judged on the response's FINAL answer.

The ground truth is wrapped in ``\\boxed{}`` and parsed as LaTeX. The response's answer is the
content of its last ``\\boxed{}`` or ``\\fbox{}`` (:func:`~hybridflow.rewards.extract.extract_boxed`),
handed to math-verify as ``\\boxed{...}`` alone, so "``\\boxed{2}``, wait, actually ``\\boxed{3}``" is
judged on 3 (math-verify on the whole text takes its first match, 2). Only a response without any
box is parsed whole (LaTeX and plain-expression extraction), as verl does. No hand-written LaTeX
normaliser. Answers too costly for a symbolic engine (power towers, huge exponents, >400
characters: :func:`~hybridflow.rewards.grading.too_costly`) count as unparsed. math-verify's own
timeouts (3 s per step) use SIGALRM, which only works in a process's main thread (the reward
worker's); elsewhere they are switched off and the executor's ``reward.timeout_s`` still bounds the call.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed
from hybridflow.rewards.grading import alarm_timeout, too_costly
from hybridflow.rewards.registry import register_reward


def verify_latex(answer: str | None, ground_truth: str, *, whole_text: str | None = None) -> tuple[bool, bool]:
    """(parsed, equivalent): math-verify on ``\\boxed{answer}`` against ``\\boxed{ground_truth}``.

    answer None: parse ``whole_text`` instead (LaTeX + expressions), or report unparsed when that
    is None too. An answer (or whole text) that is :func:`~hybridflow.rewards.grading.too_costly`
    counts as unparsed. A ground truth that already holds ``\\boxed`` is used as it is. Raises ValueError
    when the ground truth is not a non-empty string or math-verify cannot parse it.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"math ground truth {ground_truth!r} is not a non-empty string")
    timeout = alarm_timeout()
    gold_text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    gold = parse(gold_text, extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {ground_truth!r}")
    if answer is not None:
        if too_costly(answer):
            return False, False
        pred = parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
    elif whole_text is not None:
        if too_costly(whole_text, max_chars=None):
            return False, False
        pred = parse(whole_text, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                     parsing_timeout=timeout)  # fmt: skip
    else:
        return False, False
    return bool(pred), bool(pred) and bool(verify(gold, pred, timeout_seconds=timeout))


@register_reward("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def math_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when math-verify finds the response's final answer equivalent to ``ground_truth``, else 0.0.

    Returns {score, acc, parsed, pred} (pred = the last box's content, None without a box).
    Raises ValueError when the ground truth is not a string or math-verify cannot parse it.
    """
    pred = extract_boxed(solution_str)
    parsed, acc = verify_latex(pred, ground_truth, whole_text=solution_str)
    return {"score": float(acc), "acc": float(acc), "parsed": parsed, "pred": pred}
