"""Search-R1 style QA reward (Jin et al. 2025): exact match of the last ``<answer>`` with any gold
answer, as verl's ``search_r1_like_qa_em.compute_score``.

Both sides are normalised as in SQuAD's evaluation (lower case, punctuation and the articles
a/an/the removed, whitespace collapsed). The ground truth is ``{"target": str | [str, ...]}``
(verl's parquet; a numpy array of strings works too), or a bare string / list of strings.
Score 1.0 on a match, 0.25 on a match when the response holds more than 10 ``<answer>`` or
``</answer>`` tags (verl's guard against tag spamming), else 0.0.
"""

from __future__ import annotations

import re
import string
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_answer_tags
from hybridflow.rewards.registry import register_reward

SEARCH_R1_SOURCES = ("searchR1_nq", "searchR1_triviaqa", "searchR1_popqa", "searchR1_hotpotqa",
                     "searchR1_2wikimultihopqa", "searchR1_musique", "searchR1_bamboogle")  # fmt: skip
_PUNCT = str.maketrans("", "", string.punctuation)
_MAX_TAGS = 10


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = text.lower().translate(_PUNCT)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def _targets(ground_truth: Any) -> list[str]:
    target = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if isinstance(target, str):
        return [target]
    try:
        targets = [str(t) for t in target]
    except TypeError:
        targets = []
    if not targets:
        raise ValueError(f"searchR1 ground truth {ground_truth!r} holds no target answers")
    return targets


@register_reward(*SEARCH_R1_SOURCES)
def search_qa_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """Exact match of the last <answer> against the targets; returns {score, acc, parsed, pred}.

    Raises ValueError when the ground truth holds no target answers.
    """
    targets = {normalize_answer(t) for t in _targets(ground_truth)}
    pred = extract_answer_tags(solution_str)
    acc = pred is not None and normalize_answer(pred) in targets
    spam = solution_str.count("<answer>") > _MAX_TAGS or solution_str.count("</answer>") > _MAX_TAGS
    score = (0.25 if spam else 1.0) if acc else 0.0
    return {"score": score, "acc": float(acc), "parsed": pred is not None, "pred": pred}
