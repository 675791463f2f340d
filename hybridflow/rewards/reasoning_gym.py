"""Reward for reasoning-gym rows (``hybridflow data reasoning-gym``, data_source ``reasoning_gym/<dataset>``).

The answer is the content of the last ``<answer>...</answer>`` pair (what the rows' prompt asks
for, :data:`hybridflow.data.tasks.reasoning_gym.INSTRUCTION`), or of the last ``\\boxed{}`` for rows
made with ``--answer-format boxed`` (``extra_info.answer_format``), stripped; it is judged by the
dataset's own verifier, ``dataset.score_answer(answer, entry)``, with the entry and the config
overrides the row carries in ``extra_info`` — so partial credit is exactly reasoning-gym's
(e.g. ``basic_arithmetic`` pays len(truth)/len(answer) when the answer contains the truth;
``prime_factorization`` 0.5 for the right product in the wrong form).

For ``boxed`` rows whose oracle answer is a number, a response without a box is read as its last
number, as hybridflow's arith reward does (``boxed`` False in the result): a 135M model often
writes ``69 + 37 = 106`` and forgets the box, and with no fallback no sample of a group would ever
score, leaving GRPO nothing to learn; pay for the box itself with ``reward.format_style: boxed``.

Two decisions of hybridflow's: a response without an ``<answer>`` pair (a box, apart from that
fallback) scores 0.0 without asking
the verifier (``parsed`` False); a verifier that raises on the model's text (``prime_factorization``
raises ValueError on ``"abc"``) scores 0.0 with ``verifier_error`` True — a malformed answer is a
wrong answer, not a failure of the reward. ``acc`` is 1.0 only for a full score.
"""

from __future__ import annotations

from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_answer_tags, extract_boxed, last_number, parse_number
from hybridflow.rewards.registry import register_reward


@register_reward("reasoning_gym", prefixes=("reasoning_gym/",))
def reasoning_gym_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """reasoning-gym's ``score_answer`` of the last ``<answer>`` content, in [0, 1].

    extra_info: a row of ``hybridflow data reasoning-gym`` (``dataset``, ``config``, ``entry``).
    Returns {score, acc, parsed, verifier_error, pred} (+ ``boxed`` for boxed rows: whether the answer
    came from a box or from the last-number fallback). Raises ValueError when extra_info lacks the
    entry (a row not made by that command) and ReasoningGymError when reasoning-gym is missing, at
    another version than the pinned one, or does not know the dataset.
    """
    from hybridflow.data.tasks.reasoning_gym import decode, scorer

    if not isinstance(extra_info, dict) or not isinstance(extra_info.get("entry"), str):
        raise ValueError("reasoning_gym rows need extra_info.entry (make them with `hybridflow data reasoning-gym`)")
    dataset = scorer(extra_info["dataset"], extra_info.get("config") or "{}")
    entry = decode(extra_info["entry"])
    boxed = extra_info.get("answer_format") == "boxed"
    pred = extract_boxed(solution_str) if boxed else extract_answer_tags(solution_str)
    pred = pred.strip() if isinstance(pred, str) else None
    extra: dict[str, Any] = {"boxed": pred is not None} if boxed else {}
    if pred is None and boxed and parse_number(str(ground_truth)) is not None:
        pred = last_number(solution_str)  # the arith reward's fallback (module docstring)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "parsed": False, "verifier_error": False, "pred": None, **extra}
    try:
        score = float(dataset.score_answer(pred, entry))
        error = False
    except Exception:  # the verifier choked on the model's text: a wrong answer
        score, error = 0.0, True
    return {"score": score, "acc": float(score == 1.0), "parsed": True, "verifier_error": error, "pred": pred, **extra}
