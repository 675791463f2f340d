"""Geometry3K rule reward (Lu et al. 2021), as verl's ``geo3k.compute_score``.

``score = 0.9·acc + 0.1·format``: acc is 1.0 when the content of the LAST ``\\boxed{}``/``\\fbox{}``
is equivalent to the ground truth by PRM800K's grader
(:func:`~hybridflow.rewards.grading.grade_answer`, in place of verl's ``mathruler.grade_answer``,
a package hybridflow does not depend on); format is 1.0 when the response is ``<think>…</think>`` followed by a ``\\boxed{…}``
(verl's regex). Scores are 0.0, 0.1, 0.9 or 1.0. This 0.1 is verl's own shaping, separate from
hybridflow's ``reward.format_weight``.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed
from hybridflow.rewards.grading import grade_answer
from hybridflow.rewards.registry import register_reward

FORMAT_SHARE = 0.1


def has_think_box_format(text: str) -> bool:
    """verl's ``re.fullmatch(r"<think>.*</think>.*\\\\boxed\\{.*\\}.*", text, re.DOTALL)``, decided with
    ``str.find`` in linear time (the regex backtracks quadratically on many ``</think>`` tags)."""
    if not text.startswith("<think>"):
        return False
    close = text.find("</think>", len("<think>"))
    box = text.find("\\boxed{", close + len("</think>")) if close >= 0 else -1
    return box >= 0 and text.find("}", box + len("\\boxed{")) >= 0


@register_reward("hiyouga/geometry3k")
def geo3k_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """(1 - 0.1)·acc + 0.1·format; returns {score, acc, format_ok, parsed, pred}.

    Raises ValueError when ground_truth is not a non-empty string (a number is read as its string).
    """
    if isinstance(ground_truth, int | float) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"geometry3k ground truth {ground_truth!r} is not a non-empty string")
    pred = extract_boxed(solution_str)
    acc = float(grade_answer(pred, ground_truth.strip()))
    fmt = 1.0 if has_think_box_format(solution_str) else 0.0
    score = (1.0 - FORMAT_SHARE) * acc + FORMAT_SHARE * fmt
    return {"score": score, "acc": acc, "format_ok": fmt, "parsed": pred is not None, "pred": pred}
