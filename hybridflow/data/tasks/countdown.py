"""The Countdown task (TinyZero, Pan et al. 2025; data_source "countdown"): reach a target
from given numbers with + − × ÷, each number used exactly once.

Each problem is built backwards: draw ``k`` numbers (``min_numbers..max_numbers`` of them,
each in 1..``max_number``), combine them in a random order with random operations (exact
division only), and keep the result as the target when it is an integer in
1..``max_target``; so every problem has at least the recorded solution. The prompt is
TinyZero's instruct prompt (answer in ``<answer></answer>`` tags).
"""

from __future__ import annotations

import json
import random
from fractions import Fraction
from typing import Any

PROMPT = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use basic arithmetic "
    "operations (+, -, *, /) and each number can only be used once. Show your work in <think> </think> tags. "
    "And return the final answer in <answer> </answer> tags, for example <answer> (1 + 2) / 3 </answer>."
)


def _one_problem(rng: random.Random, k: int, max_number: int, max_target: int) -> tuple[list[int], int, str]:
    for _ in range(10_000):
        numbers = [rng.randint(1, max_number) for _ in range(k)]
        order = rng.sample(numbers, k)
        value, expr = Fraction(order[0]), str(order[0])
        for x in order[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (value / x).denominator != 1:
                op = rng.choice("+-*")
            value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
            expr = f"({expr} {op} {x})"
        if value.denominator == 1 and 1 <= value <= max_target:
            return numbers, int(value), expr[1:-1] if expr.startswith("(") else expr
    raise RuntimeError(f"no countdown problem with {k} numbers ≤ {max_number} reaches 1..{max_target}")


def make_countdown(n: int, *, seed: int, min_numbers: int = 3, max_numbers: int = 4, max_number: int = 99,
                   max_target: int = 100) -> list[dict[str, Any]]:  # fmt: skip
    """``n`` verl-format countdown rows, seeded; row ``i`` depends only on (seed, parameters, i).

    ``reward_model.ground_truth`` is the JSON string ``{"target": T, "numbers": [...]}``;
    ``extra_info`` records generator, seed, all parameters, index, target, numbers and one
    solution. Raises ValueError for inconsistent parameters.
    """
    if not 2 <= min_numbers <= max_numbers:
        raise ValueError(f"need 2 <= min_numbers ({min_numbers}) <= max_numbers ({max_numbers})")
    if max_number < 1 or max_target < 1 or n < 0:
        raise ValueError("max_number, max_target must be >= 1 and n >= 0")
    params = {"min_numbers": min_numbers, "max_numbers": max_numbers, "max_number": max_number, "max_target": max_target}
    rows = []
    for i in range(n):
        rng = random.Random(f"countdown/{seed}/{json.dumps(params, sort_keys=True)}/{i}")
        numbers, target, solution = _one_problem(rng, rng.randint(min_numbers, max_numbers), max_number, max_target)
        rows.append({
            "data_source": "countdown",
            "prompt": [{"role": "user", "content": PROMPT.format(numbers=numbers, target=target)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": json.dumps({"target": target, "numbers": numbers})},
            "extra_info": {"generator": "countdown", "seed": seed, **params, "index": i, "target": target,
                           "numbers": numbers, "solution": solution},
        })  # fmt: skip
    return rows
