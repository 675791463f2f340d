"""DAPO's math reward (Yu et al. 2025, "DAPO"; verl ``math_dapo.compute_score``): ±1 on a
Minerva-normalised answer.

verl sends ``math_dapo``, ``math_dapo_reasoning``, ``math`` and every ``aime*`` data source here.

- **Default**: the answer is the text after the LAST ``Answer:`` up to the end of its line
  (:func:`~hybridflow.rewards.extract.extract_answer_line`); when the response has no such line,
  the content of its last ``\\boxed{}``/``\\fbox{}``. Answer and ground truth are both put through
  :func:`normalize_final_answer` (Minerva's normaliser, Lewkowycz et al. 2022, Appendix D.1) and
  compared as strings.
- **``reward.math_dapo_strict_box_verify``**: only the last box counts, its content compared with
  the ground truth exactly (no normalisation).

Score 1.0 when equal, -1.0 otherwise (also when no answer is found). Returns {score, acc, parsed,
pred}: acc 1.0/0.0, pred the normalised answer (None when nothing was found; verl says
"[INVALID]"). Deliberate differences from verl (docs/rewards.md): the whole response is searched
(verl looks at its last 300 characters, the strict box at its last 100); the boxed fallback is
normalised like the ``Answer:`` line (verl compares it raw, so ``\\boxed{1,000}`` ≠ ``1000`` there);
``\\fbox{}`` counts as a box; "Answer: 2, no, Answer: 3" on one line is read as 3.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_answer_line, extract_boxed
from hybridflow.rewards.registry import register_reward

# Minerva's normalisation tables (Lewkowycz et al. 2022, Appendix D.1), as DAPO/verl apply them.
_SUBSTITUTIONS = [("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}")]  # fmt: skip
_REMOVED = ["square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
            "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
            "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
            "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;",
            r",\!", "{,}", '"', "\\dots"]  # fmt: skip
_UNWRAP = [re.compile(r"(\\text\{)(.*?)(\})"), re.compile(r"(\\textbf\{)(.*?)(\})"),
           re.compile(r"(\\overline\{)(.*?)(\})"), re.compile(r"(\\boxed\{)(.*)(\})")]  # fmt: skip
_MAX_ANSWER_CHARS = 1000  # only an answer's last 1000 characters are normalised; keeps hostile input cheap


def normalize_final_answer(answer: str) -> str:
    """Minerva's normalisation of a final answer (string in, string out; never raises).

    Keeps what follows the last ``=``; drops spaces, articles, ``\\$``, units and filler words
    (``dollars``, ``cm``, ``degrees``, ...), ``^\\circ``; unwraps ``$…$``, ``\\text{}``, ``\\textbf{}``,
    ``\\overline{}``, ``\\boxed{}``; expands ``\\frac12`` → ``\\frac{1}{2}`` and ``\\sqrt2`` → ``\\sqrt{2}``;
    removes thousands commas from an integer (``1,000`` → ``1000``).
    """
    s = answer.split("=")[-1][-_MAX_ANSWER_CHARS:]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for expr in _REMOVED:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for pattern in _UNWRAP:
        s = pattern.sub("\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_verify(solution_str: str, ground_truth: str, strict_box_verify: bool = False) -> tuple[bool, str | None]:
    """(correct, pred) for one response; see the module docstring for the two modes."""
    if strict_box_verify:
        boxed = extract_boxed(solution_str)
        return boxed is not None and boxed == ground_truth, boxed
    answer = extract_answer_line(solution_str)
    if answer is None:
        answer = extract_boxed(solution_str)
    if answer is None:
        return False, None
    pred = normalize_final_answer(answer)
    return pred == normalize_final_answer(ground_truth), pred


@register_reward("math_dapo", "math_dapo_reasoning", "math", "aime", "aime24", "aime25", "aime2024", "aime2025",
                 prefixes=("aime",))  # fmt: skip
def math_dapo_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """+1.0 when the final answer matches ``ground_truth`` after normalisation, else -1.0.

    Returns {score, acc, parsed, pred}. An integer ground truth is read as its decimal string.
    Raises ValueError when ground_truth is not a non-empty string (or an integer).
    """
    if isinstance(ground_truth, int) and not isinstance(ground_truth, bool):
        ground_truth = str(ground_truth)
    if not isinstance(ground_truth, str) or not ground_truth.strip():
        raise ValueError(f"math_dapo ground truth {ground_truth!r} is not a non-empty string")
    correct, pred = dapo_verify(solution_str, ground_truth, cfg.math_dapo_strict_box_verify)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "parsed": pred is not None, "pred": pred}
