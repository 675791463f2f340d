"""Reward for the generated arithmetic task (``hybridflow data arith``, data_source "arith").

Decision: the answer is the last number inside the last ``\\boxed{}``; when the response has
no box, the last number in the whole response is used instead (a 135M model often gets the
number right but forgets the box; use the ``boxed`` format reward to pay for the box). The
extra field ``boxed`` says which path was taken; ``parsed`` is False only when the response
contains no number at all. Comparison is exact on numbers (``12.0`` = ``12``).
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed, last_number, parse_number
from hybridflow.rewards.registry import register_reward


@register_reward("arith")
def arith_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when the answer equals the ground truth number, else 0.0.

    Returns {score, acc, parsed, boxed, pred}. Raises ValueError when ground_truth is not a number.
    """
    truth = parse_number(ground_truth) if isinstance(ground_truth, str) else None
    if truth is None:
        raise ValueError(f"arith ground truth {ground_truth!r} is not a number")
    boxed = extract_boxed(solution_str)
    pred = last_number(boxed) if boxed is not None else None
    in_box = pred is not None
    if pred is None:
        pred = last_number(solution_str)
    value = parse_number(pred) if pred is not None else None
    acc = value is not None and value == truth
    return {"score": float(acc), "acc": float(acc), "parsed": pred is not None, "boxed": in_box, "pred": pred}
