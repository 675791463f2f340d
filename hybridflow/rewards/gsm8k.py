"""GSM8K rule reward (Cobbe et al. 2021), as verl's ``gsm8k.compute_score`` but numeric.

Extraction (``reward.gsm8k_extraction``):

- ``strict``: only the number after the last ``#### `` marker counts (anywhere in the response).
- ``flexible``: the last ``#### N`` if there is one, else the last ``\\boxed{}`` number, else the
  last number in the response.

The extracted answer and the ground truth are compared as exact numbers after normalisation
(thousands commas, ``$``, trailing ``.``, ``72.0`` = ``72``), not as strings as verl does.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_boxed, extract_hash_answer, last_number, parse_number
from hybridflow.rewards.registry import register_reward


def extract_gsm8k_answer(solution_str: str, method: str) -> str | None:
    """The answer string per ``method`` ("strict" | "flexible"), or None when nothing is found."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"gsm8k extraction {method!r}; allowed: strict, flexible")
    answer = extract_hash_answer(solution_str)
    if answer is not None or method == "strict":
        return answer
    boxed = extract_boxed(solution_str)
    if boxed is not None and last_number(boxed) is not None:
        return last_number(boxed)
    return last_number(solution_str)


@register_reward("openai/gsm8k", "gsm8k")
def gsm8k_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when the extracted answer equals the ground truth number, else 0.0.

    Returns {score, acc, parsed, pred}. Raises ValueError when ground_truth is not a number.
    """
    truth = parse_number(ground_truth) if isinstance(ground_truth, str) else None
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number")
    pred = extract_gsm8k_answer(solution_str, cfg.gsm8k_extraction)
    value = parse_number(pred) if pred is not None else None
    acc = value is not None and value == truth
    return {"score": float(acc), "acc": float(acc), "parsed": pred is not None, "pred": pred}
