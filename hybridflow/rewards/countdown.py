"""Countdown reward (TinyZero, Pan et al. 2025): reach the target with each given number once.

The equation is the content of the last ``<answer>...</answer>``. An optional ``= N`` tail is
ignored (only the left side is checked). It is parsed with :mod:`ast` — never ``eval`` — and
only integer literals, ``+ - * /``, unary ``-``/``+`` and parentheses are allowed; ``×`` and
``÷`` are read as ``*`` and ``/``. The value is computed exactly with ``Fraction`` (TinyZero
compares floats within 1e-5). Division by zero is a wrong answer.

Deviation from TinyZero: a well-formed but wrong equation scores 0.0 here, not 0.1; use the
format reward (``format_style=answer_tags``) to pay for the format.

The ground truth is ``{"target": int, "numbers": [int, ...]}`` as a dict (TinyZero parquet)
or as that JSON in a string (``hybridflow data countdown``).
"""

from __future__ import annotations

import ast
import json
import operator
from collections import Counter
from fractions import Fraction
from typing import Any

from hybridflow.config import RewardConfig
from hybridflow.rewards.extract import extract_answer_tags
from hybridflow.rewards.registry import register_reward

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_CHARS = 500
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class EquationError(ValueError):
    """The equation uses something other than integers, + - * /, and parentheses."""


def parse_equation(text: str) -> tuple[Fraction, list[int]]:
    """Exact value of an arithmetic expression and the integer literals it uses (in order).

    Raises EquationError on a syntax error or a forbidden construct (names, calls, floats,
    powers, ...); ZeroDivisionError on division by zero.
    """
    expr = text.replace("×", "*").replace("÷", "/").split("=")[0].strip()
    if len(expr) > _MAX_CHARS:
        raise EquationError(f"equation longer than {_MAX_CHARS} characters")
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        return _evaluate(tree.body, used), used
    except SyntaxError as e:
        raise EquationError(f"not an equation: {expr!r} ({e.msg})") from None
    except RecursionError:
        raise EquationError("equation nested too deeply") from None


def _evaluate(node: ast.AST, used: list[int]) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _evaluate(node.left, used), _evaluate(node.right, used)
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, used))
    raise EquationError(f"forbidden element in equation: {ast.dump(node)[:60]}")


def parse_countdown_truth(ground_truth: Any) -> tuple[int, list[int]]:
    """(target, numbers) from a dict or its JSON string; ValueError naming what is wrong."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(truth, dict) or "target" not in truth or "numbers" not in truth:
        raise ValueError(f"countdown ground truth must hold 'target' and 'numbers', got {ground_truth!r}")
    numbers = [int(n) for n in truth["numbers"]]
    return int(truth["target"]), numbers


@register_reward("countdown")
def countdown_reward(solution_str: str, ground_truth: Any, extra_info: Any, cfg: RewardConfig) -> dict[str, Any]:
    """1.0 when the <answer> equation uses each given number exactly once and equals the target.

    Returns {score, acc, parsed, pred}; parsed is False when there is no <answer> tag or its
    content is not an allowed equation.
    """
    target, numbers = parse_countdown_truth(ground_truth)
    pred = extract_answer_tags(solution_str)
    if pred is None:
        return {"score": 0.0, "acc": 0.0, "parsed": False, "pred": None}
    try:
        value, used = parse_equation(pred)
    except EquationError:
        return {"score": 0.0, "acc": 0.0, "parsed": False, "pred": pred}
    except ZeroDivisionError:
        return {"score": 0.0, "acc": 0.0, "parsed": True, "pred": pred}
    acc = Counter(used) == Counter(numbers) and value == target
    return {"score": float(acc), "acc": float(acc), "parsed": True, "pred": pred}
