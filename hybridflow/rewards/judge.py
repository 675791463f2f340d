"""Judged rewards, the pure part: the rubric rendered per row, the judge's verdict parsed into a score,
and the judge's agreement with the rule reward (``reward.judge``, docs/rewards.md "Judged rewards").

The judge model and its generation live in :class:`workers.judge.JudgeWorker`; this module only
turns text into text (:func:`render_rubric`, :func:`judge_prompt_ids`) and text into numbers
(:func:`judge_score` over the verdict parsers registered by name, :func:`judge_rule_agreement`).
Nothing here imports torch.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from hybridflow.registry import Registry

VerdictParser = Callable[[str], float | None]
VERDICT_PARSERS: Registry[VerdictParser] = Registry("judge verdict parser")
register_verdict_parser = VERDICT_PARSERS.register

_NUMBER = r"([-+]?\d+(?:\.\d+)?)"
_SCORE_LINE = re.compile(r"score\s*[:=]\s*\**\s*" + _NUMBER + r"(?:\s*/\s*\d+(?:\.\d+)?)?", re.IGNORECASE)
_SCORE_TAG = re.compile(r"<score>\s*" + _NUMBER + r"\s*</score>", re.IGNORECASE)
_PLACEHOLDER = re.compile(r"\{(prompt|response|ground_truth)\}")


@register_verdict_parser("score_line")
def parse_score_line(verdict: str) -> float | None:
    """N of the last ``Score: N`` (case-insensitive; ``=`` for ``:``, markdown ``**`` and a ``/M``
    suffix allowed), else None. Examples: ``"ok. Score: 7"`` → 7.0; ``"score = 3/5"`` → 3.0;
    ``"**Score:** 8\\nScore: 9"`` → 9.0; ``"seven"`` → None."""
    found = _SCORE_LINE.findall(verdict)
    return float(found[-1]) if found else None


@register_verdict_parser("score_tag")
def parse_score_tag(verdict: str) -> float | None:
    """N of the last ``<score>N</score>`` (case-insensitive, spaces around N allowed), else None.
    Examples: ``"<score> 4 </score>"`` → 4.0; ``"<score>four</score>"`` → None."""
    found = _SCORE_TAG.findall(verdict)
    return float(found[-1]) if found else None


def judge_score(verdict: str, parser: str, max_score: float) -> float | None:
    """The judge score of one verdict in [0, 1]: N / ``max_score`` with N read by the parser
    registered as ``parser``; None (unparsed) when the parser finds nothing or N is outside
    [0, max_score]. Example: ``("Score: 7", "score_line", 10)`` → 0.7; ``("Score: 11", ..., 10)`` → None.
    Raises UnknownNameError for an unregistered parser."""
    n = VERDICT_PARSERS.get(parser)(verdict)
    if n is None or not 0 <= n <= max_score:
        return None
    return n / max_score


def render_rubric(rubric: str, prompt: str, response: str, ground_truth: str | None) -> str:
    """``rubric`` with ``{prompt}``, ``{response}`` and ``{ground_truth}`` ('' for None) replaced in
    one pass: text inside the substituted values is never substituted again (a response that writes
    ``{ground_truth}`` does not reveal it), and other braces (``\\boxed{}``) stay as they are.
    Example: ``("Q: {prompt} A: {response}", "1+1", "2", None)`` → ``"Q: 1+1 A: 2"``."""
    values = {
        "prompt": prompt,
        "response": response,
        "ground_truth": "" if ground_truth is None else str(ground_truth),
    }
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)


def judge_prompt_ids(tokenizer: Any, text: str, *, apply_chat_template: bool, prefix: str = "") -> list[int]:
    """The judge's input ids for a rendered rubric: one user turn of ``tokenizer``'s chat template with
    the generation prompt (when ``apply_chat_template`` and the tokenizer has a template), else the
    plain text with the tokenizer's usual special tokens; then ``prefix`` (the start of the judge's
    reply, ``reward.judge.verdict_prefix``)."""
    if apply_chat_template and getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(rendered + prefix, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text + prefix, add_special_tokens=True)["input_ids"])


def judge_rule_agreement(judge_scores: Sequence[float | None], rule_scores: Sequence[float]) -> float | None:
    """Share of the rows the judge scored (None = unparsed / overlong, left out) where the judge's pass
    (score ≥ 0.5, i.e. at least half of max_score) equals the rule reward's pass (rule score > 0).
    None when the judge scored no row. Example: judge [0.9, 0.2, None, 0.6], rule [1, 1, 0, 0] →
    rows 0, 1, 3: pass/pass, fail/pass, pass/fail → 1/3."""
    pairs = [(j >= 0.5, r > 0) for j, r in zip(judge_scores, rule_scores, strict=True) if j is not None]
    if not pairs:
        return None
    return sum(a == b for a, b in pairs) / len(pairs)


def verdict_parser_names() -> list[str]:
    """The registered verdict parsers, sorted."""
    return VERDICT_PARSERS.names()


__all__ = [
    "VERDICT_PARSERS",
    "register_verdict_parser",
    "parse_score_line",
    "parse_score_tag",
    "judge_score",
    "render_rubric",
    "judge_prompt_ids",
    "judge_rule_agreement",
    "verdict_parser_names",
]
