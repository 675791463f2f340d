"""Answer equivalence for free-form math answers: PRM800K's ``grade_answer`` and PRIME's
``math_equal``, without evaluating model text as code.

Sources: Hendrycks et al. 2021 (MATH ``is_equiv`` normaliser), Lightman et al. 2023 (PRM800K
``grading/grader.py``), PRIME (Cui et al. 2025) ``math_equal`` as vendored in verl
``prime_math/grader.py``. Where those call ``sympy.parse_expr`` / ``eval`` on the model's text,
this module uses math-verify (its LaTeX parser builds sympy objects without ``eval``) and
``ast.literal_eval`` for list/matrix literals, so a response such as
``__import__('os').system(...)`` is only ever a wrong answer. Symbolic checks run under
math-verify's SIGALRM timeouts in the reward worker's main thread; everywhere the executor's
``reward.timeout_s`` bounds the whole call.
"""

from __future__ import annotations

import ast
import functools
import re
import threading
from fractions import Fraction

_MAX_CHARS = 1000  # longer "answers" are cut (PRIME does the same) so hostile text stays cheap
MAX_SYMBOLIC_CHARS = 400  # longer answers are not handed to math-verify
_UNITS = ["degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard", "liter"]  # fmt: skip
_UNIT_RE = re.compile("(?:" + "|".join(_UNITS) + r")(?:es)?(?:s)? *(?:\^[0-9]+)?")
_TUPLE_CHARS = "()[]"


def hendrycks_normalize(answer: str) -> str:
    """The MATH dataset's ``is_equiv`` string normaliser: drops ``\\left``/``\\right``, ``\\!``,
    ``^\\circ``, ``\\$``, ``\\%``, spaces, a right-hand ``\\text{ unit}``, a short ``x =`` prefix;
    ``tfrac``/``dfrac`` → ``frac``, ``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt3`` → ``\\sqrt{3}``,
    ``a/b`` → ``\\frac{a}{b}`` for integers, ``0.5`` → ``\\frac{1}{2}``, leading ``.5`` → ``0.5``."""
    s = answer.strip()
    m = re.fullmatch(r"\\text\{(.+?)\}", s)
    s = m.group(1).strip() if m else s
    for before, after in [("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                          ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")]:  # fmt: skip
        s = s.replace(before, after)
    if s.count("\\text{ ") == 1:
        s = s.split("\\text{ ")[0]
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if s.startswith("."):
        s = "0" + s
    parts = s.split("=")
    if len(parts) == 2 and len(parts[0]) <= 2:
        s = parts[1]
    s = re.sub(r"\\sqrt([^{\\])", r"\\sqrt{\1}", s).replace(" ", "")
    s = re.sub(r"\\frac([^{\\])([^{\\])", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac([^{\\])\{", r"\\frac{\1}{", s)
    if s == "0.5":
        s = "\\frac{1}{2}"
    m = re.fullmatch(r"(\d+)/(\d+)", s)
    return f"\\frac{{{m.group(1)}}}{{{m.group(2)}}}" if m else s


def _prm_normalize(expr: str) -> str:
    """PRM800K's ``_normalize``; of its LaTeX-to-text step only ``\\frac{a}{b}`` → ``a/b`` for integers is
    kept (math-verify reads the rest of the LaTeX)."""
    m = re.fullmatch(r"\\text\{(.+?)\}", expr)
    s = m.group(1) if m else expr
    s = s.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
    s = s.replace(" or ", " , ").replace(" and ", " , ")
    s = s.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
    s = _UNIT_RE.sub("", s)
    s = re.sub(r"\^ *\\circ", "", s)
    if len(s) > 1 and s[0] == "{" and s[-1] == "}":
        s = s[1:-1]
    s = re.sub(r",\\! *", "", s)
    s = re.sub(r"\\[dt]?frac\{(-?\d+)\}\{(\d+)\}", r"\1/\2", s)  # what PRM800K's LaTeX-to-text step gives
    value = _number(s)
    if value is not None and value.denominator == 1:
        s = str(value.numerator)
    return re.sub("- *", "-", s).strip().lower()


def _number(s: str) -> Fraction | None:
    """Exact value of a plain decimal number (thousands commas allowed), else None."""
    t = s.strip()
    if re.fullmatch(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d{1,3})?|[-+]?\.\d+", t):
        return Fraction(t.replace(",", ""))
    return None


def _split_tuple(expr: str) -> list[str]:
    s = re.sub(r"(\d),(\d\d\d)($|\D)", r"\1\2\3", expr)
    if len(s) > 2 and s[0] in _TUPLE_CHARS and s[-1] in _TUPLE_CHARS and not any(c in s[1:-1] for c in _TUPLE_CHARS):
        return [e.strip() for e in s[1:-1].split(",")]
    return [s] if s else []


def grade_answer(given: str | None, truth: str) -> bool:
    """PRM800K's grader: True when the normalised strings match, or element by element (tuples and
    intervals need the same delimiters: ``[1,2]`` ≠ ``(1,2)``) the values are equal. An unreduced
    fraction must match as written; an integer truth needs an integer answer; the rest is decided
    by :func:`symbolic_equal`."""
    if given is None:
        return False
    given, truth = given[:_MAX_CHARS], truth[:_MAX_CHARS]
    if hendrycks_normalize(given) == hendrycks_normalize(truth):
        return True
    g, t = _prm_normalize(given), _prm_normalize(truth)
    if g == t:
        return True
    if not g:
        return False
    t_elems, g_elems = _split_tuple(t), _split_tuple(g)
    if len(t_elems) != len(g_elems) or (len(t_elems) > 1 and (t[0] != g[0] or t[-1] != g[-1])):
        return False
    for te, ge in zip(t_elems, g_elems, strict=True):
        if re.fullmatch(r"-?\d+/\d+", te) and re.fullmatch(r"-?\d+/\d+", ge):
            ok = te == ge
        elif _is_int(te) != _is_int(ge):
            ok = False
        else:
            ok = symbolic_equal(ge, te)
        if not ok:
            return False
    return True


def _is_int(s: str) -> bool:
    v = _number(s)
    return v is not None and v.denominator == 1


def math_equal(pred: str, ref: str, tolerance: float = 1e-4) -> bool:
    """PRIME's ``math_equal``: equal strings; numbers within ``tolerance`` (relative), also as a
    percentage (``ref``, ``ref/100``, ``ref·100``); tuples/intervals with the same brackets element by
    element; a list literal or ``Matrix([[...]])`` against a ``pmatrix``; else :func:`symbolic_equal`."""
    pred, ref = _strip_percent(pred.strip()[:_MAX_CHARS]), _strip_percent(ref.strip()[:_MAX_CHARS])
    if pred.lower() == ref.lower() or pred.replace(" ", "") == ref.replace(" ", ""):
        return True
    p, r = _number(pred), _number(ref)
    if p is not None and r is not None:
        return any(_close(p, x, tolerance) for x in (r, r / 100, r * 100))
    if not pred:
        return False
    if pred[0] in "([" and pred[-1] in ")]" and ref[:1] == pred[0] and ref[-1:] == pred[-1]:
        pp, rp = pred[1:-1].split(","), ref[1:-1].split(",")
        if len(pp) == len(rp) and all(math_equal(a, b, tolerance) for a, b in zip(pp, rp, strict=True)):
            return True
    if "\\begin{pmatrix}" in ref and (pred.startswith("[") or pred.startswith("Matrix(")):
        return _matrix_equal(pred, ref, tolerance)
    return symbolic_equal(pred, ref)


def _close(a: Fraction, b: Fraction, tolerance: float) -> bool:
    """|a - b| ≤ tolerance·max(|a|, |b|), exactly (no float overflow on huge numbers)."""
    return abs(a - b) <= Fraction(tolerance) * max(abs(a), abs(b))


def _strip_percent(s: str) -> str:
    if re.fullmatch(r"\$\d+(\.\d+)?", s):
        return s[1:]
    if re.fullmatch(r"\d+(\.\d+)?(\\%|%)", s):
        return s.replace("\\%", "").replace("%", "")
    return s


def _matrix_equal(pred: str, ref: str, tolerance: float) -> bool:
    """A Python list literal (``[5, 6]``, ``Matrix([[1, 2]])``) against ``\\begin{pmatrix}...``, read
    with ``ast.literal_eval`` only: anything that is not a literal is a wrong answer."""
    text = pred[len("Matrix(") : -1] if pred.startswith("Matrix(") and pred.endswith(")") else pred
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return False
    if not isinstance(value, list):
        return False
    body = ref.split("\\begin{pmatrix}", 1)[1].split("\\end{pmatrix}", 1)[0]
    rows = [[c.strip() for c in piece.split("&")] for piece in body.split("\\") if piece.strip()]
    flat_pred = [x for row in value for x in (row if isinstance(row, list) else [row])]
    flat_ref = [c for row in rows for c in row]
    return len(flat_pred) == len(flat_ref) and all(
        math_equal(str(a), b, tolerance) for a, b in zip(flat_pred, flat_ref, strict=True))


_COSTLY_RES = [  # possessive quantifiers and anchors keep every pattern linear on hostile text
    re.compile(r"\d\s*+\^\s*+\{\s*+[-+]?\d++\s*+\^"),  # an integer power inside an exponent: 10^{10^{10}}
    re.compile(r"\^\s*+\(?\s*+[-+]?\d++\s*+\)?\s*+\^"),  # 9^9^9
    re.compile(r"\*\*[^*]*+\*\*"),  # 9**9**9
    re.compile(r"\^\s*+\{?\s*+[-+]?\d{4}"),  # an exponent of 1000 or more
    re.compile(r"(?<!\d)\d{4,}+\s*+!"),  # 1000! and more
    re.compile(r"\d{500}"),  # a number of 500 digits or more
]
_MAX_DEPTH = 30
_LATEX_CMD_RE = re.compile(r"\\(?:begin|end)\{[A-Za-z*]*\}|\\[A-Za-z]+")  # commands and environment names


def too_costly(text: str, max_chars: int | None = MAX_SYMBOLIC_CHARS) -> bool:
    """True when ``text`` is too expensive to hand to a symbolic engine: longer than ``max_chars``
    (None = no limit, for whole responses), an integer power tower (``10^{10^{10}}``, ``9^9^9``,
    ``9**9**9``; ``e^{x^2}`` is fine),
    an exponent of 1000 or more, a factorial of 1000 or more, a number of 500 digits or more, or brackets nested deeper than 30. Big-integer arithmetic
    runs in C and ignores the SIGALRM timeouts, so such answers would hold a reward worker until the
    executor kills it; they are judged by string and number comparison only."""
    if max_chars is not None and len(text) > max_chars:
        return True
    if any(r.search(text) for r in _COSTLY_RES):
        return True
    depth = deepest = 0
    for ch in text:
        if ch in "{([":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "})]":
            depth = max(0, depth - 1)
    return deepest > _MAX_DEPTH


def symbolic_equal(a: str, b: str) -> bool:
    """math-verify's equivalence of two answers, each read as LaTeX in ``\\boxed{}`` (and as a plain
    expression); False when either does not parse, is :func:`too_costly`, or holds more than two
    distinct letters outside LaTeX commands and ``\\begin{…}``/``\\end{…}`` names (PRM800K's ``should_allow_eval``: words are not
    expressions). Never evaluates the text as Python. Results are cached per pair within a worker."""
    if any(too_costly(x) or len(set(re.findall(r"[A-Za-z]", _LATEX_CMD_RE.sub("", x)))) > 2 for x in (a, b)):
        return False
    return _symbolic_equal(a, b)


@functools.lru_cache(maxsize=1024)
def _symbolic_equal(a: str, b: str) -> bool:
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    timeout = alarm_timeout()
    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    try:
        pa = parse(f"\\boxed{{{a}}}", extraction_config=configs, parsing_timeout=timeout)
        pb = parse(f"\\boxed{{{b}}}", extraction_config=configs, parsing_timeout=timeout)
        return bool(pa) and bool(pb) and bool(verify(pb, pa, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - math-verify raising on odd input is a wrong answer
        return False


def alarm_timeout() -> int | None:
    """math-verify's per-step timeout in seconds: 3 in a main thread (SIGALRM works there, as in a
    reward worker), None elsewhere (the executor's ``reward.timeout_s`` still holds)."""
    return 3 if threading.current_thread() is threading.main_thread() else None


__all__ = ["grade_answer", "math_equal", "symbolic_equal", "hendrycks_normalize", "too_costly", "alarm_timeout"]
