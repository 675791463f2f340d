"""Answer extraction from model responses: ``\\boxed{}``, ``<answer>`` tags, ``#### N``, numbers.

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
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_MINUS_SIGNS = str.maketrans({"\u2212": "-", "\u2013": "-"})


def extract_boxed(text: str) -> str | None:
    """Content of the LAST ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces intact.

    ``extract_boxed(r"so \\boxed{\\frac{1}{3}}")`` → ``"\\frac{1}{3}"``. The brace-less form
    ``\\boxed 5`` gives ``"5"``. Returns None when there is no box or its braces never close.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed") :] if rest.startswith("\\boxed") else rest[len("\\fbox") :]
    if rest.startswith(" "):  # "\boxed 5": up to the next whitespace or "$"
        token = re.match(r"\s+([^\s$]+)", rest)
        return token.group(1) if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def extract_answer_tags(text: str) -> str | None:
    """Stripped content of the LAST ``<answer>...</answer>`` pair (TinyZero's format), else None."""
    found = _ANSWER_TAG_RE.findall(text)
    return found[-1].strip() if found else None


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


def numbers_equal(a: str, b: str) -> bool:
    """True when both strings parse as numbers (see :func:`parse_number`) of equal value."""
    x, y = parse_number(a), parse_number(b)
    return x is not None and y is not None and x == y


__all__ = [
    "extract_boxed",
    "extract_answer_tags",
    "extract_hash_answer",
    "last_number",
    "parse_number",
    "numbers_equal",
]
