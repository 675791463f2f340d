"""Answer extraction from model responses: ``\\boxed{}``, ``Answer:`` lines, ``<answer>`` tags,
``#### N``, numbers — always the LAST one, so a response that revises its answer is judged on the revision.

Pure string functions (no sympy, no regex over nested braces): they run inside reward
worker processes on every response, so they stay cheap. Every extractor returns ``None``
when there is nothing to extract, so callers can tell "unparsed" from "wrong".
"""

from __future__ import annotations

import re
from fractions import Fraction

# A number as people write it: optional sign, digits with proper thousands groups
# ("1,000", not "1,2"), optional decimals; or a bare decimal (".5").
_NUMBER = r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
_HASH_RE = re.compile(r"####\s*\$?\s*(" + _NUMBER + ")")
_BOX_RE = re.compile(r"\\(?:boxed|fbox)")
_ANSWER_LINE_RE = re.compile(r"(?i)answer\s*:")
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})


def extract_boxed(text: str) -> str | None:
    """Content of the LAST closed ``\\boxed{...}`` or ``\\fbox{...}`` in ``text``, nested braces intact.

    ``extract_boxed(r"so \\boxed{\\frac{1}{3}}")`` → ``"\\frac{1}{3}"``; ``r"\\boxed{2}, wait, actually
    \\fbox{3}"`` → ``"3"`` (whichever command comes last). The brace-less form ``\\boxed 5`` gives
    ``"5"``. A later box that never closes, or a bare ``\\boxed`` mention, is skipped in favour of the
    last well-formed one. Returns None when no box is well formed. One pass over ``text`` however
    many boxes it holds, so hostile input stays linear.
    """
    starts = [m.start() for m in _BOX_RE.finditer(text)]
    if not starts:
        return None
    closing = _closing_braces(text)
    for start in reversed(starts):
        cmd_end = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
        if text.startswith(" ", cmd_end):  # "\boxed 5": up to the next whitespace or "$"
            token = re.match(r"\s+([^\s$]+)", text[cmd_end : cmd_end + 200])
            if token:
                return token.group(1)
        elif cmd_end in closing:
            return text[cmd_end + 1 : closing[cmd_end]]
    return None


def _closing_braces(text: str) -> dict[int, int]:
    """{index of "{": index of its matching "}"} for every brace pair that closes (one pass)."""
    stack: list[int] = []
    pairs: dict[int, int] = {}
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            pairs[stack.pop()] = i
    return pairs


def extract_answer_line(text: str) -> str | None:
    """What follows the LAST ``Answer:`` (any case, whitespace allowed around the colon, even a line
    break after it) up to the end of that line — the Minerva format (Lewkowycz et al. 2022) that
    DAPO's scorer reads. ``"Answer: 2. No wait, Answer: 3"`` → ``"3"``. An ``Answer:`` with nothing
    after it is skipped for the one before. Returns the stripped text, or None when there is none.
    """
    for m in reversed(list(_ANSWER_LINE_RE.finditer(text))):
        line = text[m.end() :].lstrip().split("\n", 1)[0].strip()
        if line:
            return line
    return None


def extract_answer_tags(text: str) -> str | None:
    """Stripped content of the LAST ``<answer>...</answer>`` pair (TinyZero's format), else None:
    the last ``<answer>`` that a ``</answer>`` follows, up to the first ``</answer>`` after it
    (``"<answer>a<answer>b</answer>"`` → ``"b"``). Linear: ``str.rfind``/``find``, no regex."""
    last_close = text.rfind("</answer>")
    start = text.rfind("<answer>", 0, last_close) if last_close >= 0 else -1
    if start < 0:
        return None
    end = text.find("</answer>", start)
    return text[start + len("<answer>") : end].strip()


def extract_hash_answer(text: str) -> str | None:
    """The number after the LAST ``#### `` marker (GSM8K's answer format), e.g. ``"1,000"``; else None."""
    found = _HASH_RE.findall(text.translate(_MINUS_SIGNS))
    return found[-1] if found else None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``"1,000"``, ``"-3.5"``, ``".5"``), else None."""
    found = _NUMBER_RE.findall(text.translate(_MINUS_SIGNS))
    return found[-1] if found else None


def parse_number(text: str) -> Fraction | None:
    """Exact value of one written number, or None if ``text`` is not a single number.

    Normalisation: surrounding whitespace, a leading ``$``, a trailing ``.``, thousands
    commas and a unicode minus are removed; a simple fraction ``a/b`` is allowed. Values are
    exact ``Fraction``s, so ``"72.0" == "72"`` and ``"0.1" + "0.2" == "0.3"`` hold.
    """
    s = text.strip().translate(_MINUS_SIGNS).removeprefix("$").strip().rstrip(".")
    if re.fullmatch(r"-?(?:\d{1,3}(?:,\d{3})+)(?:\.\d+)?", s):
        s = s.replace(",", "")
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


__all__ = [
    "extract_boxed",
    "extract_answer_line",
    "extract_answer_tags",
    "extract_hash_answer",
    "last_number",
    "parse_number",
]
