"""MATH-style rule reward: answer equivalence by ``math-verify`` (Hugging Face), as verl's
``math_verify.compute_score``.

The ground truth is wrapped in ``\\boxed{}`` and parsed as LaTeX; the response is parsed
with LaTeX and plain-expression extraction (math-verify prefers the last ``\\boxed{}``).
No hand-written LaTeX normaliser. math-verify's own timeouts use SIGALRM, which only works
in a process's main thread; elsewhere they are switched off (the reward executor's per-call
timeout still holds).
"""

from __future__ import annotations

import threading
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed
from hybridflow.rewards.registry import register_reward


@register_reward("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
def math_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when math-verify finds the response's answer equivalent to ``ground_truth``, else 0.0.

    Returns {score, acc, parsed, pred} (pred = the last ``\\boxed{}`` content, if any).
    Raises ValueError when the ground truth is not a string or math-verify cannot parse it.
    """
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"math ground truth {ground_truth!r} is not a non-empty string")
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold_text = ground_truth if "\\boxed" in ground_truth else f"\\boxed{{{ground_truth}}}"
    gold = parse(gold_text, extraction_config=[LatexExtractionConfig()], parsing_timeout=timeout)
    if not gold:
        raise ValueError(f"math-verify could not parse the ground truth {ground_truth!r}")
    pred = parse(
        solution_str,
        extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
        parsing_timeout=timeout,
    )
    acc = bool(pred) and verify(gold, pred, timeout_seconds=timeout)
    return {"score": float(acc), "acc": float(acc), "parsed": bool(pred), "pred": extract_boxed(solution_str)}
