"""Generated arithmetic problems with a difficulty knob (data_source "arith").

Difficulty levels (integer answers, never negative):

=====  ==============================================  ===========================
level  problem                                         example
=====  ==============================================  ===========================
0      one step, single digits, + or −                  What is 7 + 5?
1      one step, two digits ± one digit                 What is 23 + 7?
2      one step, two digits ± two digits, or 1-digit ×  What is 47 - 18?
3      two steps, numbers up to 20                      What is 12 + 9 - 4?
4      two-step word problem                            Sam has 12 apples. He buys ...
5      three-step word problem with ×                   A box holds 6 pens. Ana ...
6      a 3-digit × 2-digit product (the tool task)      What is 347 * 28?
=====  ==============================================  ===========================

Every prompt asks for the answer in ``\\boxed{}`` and stays under ~60 tokens. Row ``i`` of
``make_arith(n, difficulty=d, seed=s)`` depends only on (s, d, i), so a longer dataset starts
with the rows of a shorter one. Measured on SmolLM2-135M-Instruct (greedy, small samples,
docs/data.md): level 0 ≈ 75%, level 1 ≈ 25%, level 3 ≈ 0% — level 1 sits in the 10–60%
band; re-measure before relying on a level. Level 6 is for tool use (``examples/grpo_arith_tool.yaml``):
products a 135M model gets wrong in its head and a calculator gets right.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

MAX_DIFFICULTY = 6
INSTRUCTION = "Put the final answer in \\boxed{}."
_NAMES = ["Sam", "Ana", "Tom", "Mia", "Leo", "Eva", "Ben", "Zoe"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "eggs", "stamps", "marbles"]


def _plus_minus(rng: random.Random, a: int, b: int) -> tuple[str, int]:
    if rng.random() < 0.5:
        return f"{a} + {b}", a + b
    a, b = max(a, b), min(a, b)
    return f"{a} - {b}", a - b


def _level0(rng: random.Random) -> tuple[str, str, int]:
    expr, ans = _plus_minus(rng, rng.randint(1, 9), rng.randint(1, 9))
    return f"What is {expr}?", expr, ans


def _level1(rng: random.Random) -> tuple[str, str, int]:
    expr, ans = _plus_minus(rng, rng.randint(10, 99), rng.randint(1, 9))
    return f"What is {expr}?", expr, ans


def _level2(rng: random.Random) -> tuple[str, str, int]:
    if rng.random() < 0.3:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        return f"What is {a} * {b}?", f"{a} * {b}", a * b
    expr, ans = _plus_minus(rng, rng.randint(10, 99), rng.randint(10, 99))
    return f"What is {expr}?", expr, ans


def _level3(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(2, 20), rng.randint(2, 20)
    c = rng.randint(1, a + b)
    expr = f"{a} + {b} - {c}"
    return f"What is {expr}?", expr, a + b - c


def _level4(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(5, 30), rng.randint(2, 15)
    c = rng.randint(1, a + b)
    q = f"{name} has {a} {item}. {name} buys {b} more and then gives away {c}. How many {item} does {name} have now?"
    return q, f"{a} + {b} - {c}", a + b - c


def _level5(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    per, boxes = rng.randint(3, 9), rng.randint(2, 6)
    give, find = rng.randint(1, per * boxes), rng.randint(1, 9)
    q = (f"A box holds {per} {item}. {name} buys {boxes} boxes, gives away {give} {item}, "
         f"then finds {find} more. How many {item} does {name} have?")  # fmt: skip
    return q, f"{per} * {boxes} - {give} + {find}", per * boxes - give + find


def _level6(rng: random.Random) -> tuple[str, str, int]:
    a, b = rng.randint(100, 999), rng.randint(11, 99)
    return f"What is {a} * {b}?", f"{a} * {b}", a * b


_LEVELS: list[Callable[[random.Random], tuple[str, str, int]]] = [
    _level0, _level1, _level2, _level3, _level4, _level5, _level6,
]  # fmt: skip


def make_arith(n: int, *, difficulty: int, seed: int) -> list[dict[str, Any]]:
    """``n`` verl-format rows of arithmetic problems at ``difficulty`` (0..6), seeded.

    ``reward_model.ground_truth`` is the integer answer as a string; ``extra_info`` records
    generator, seed, difficulty, index, the expression and the question. Raises ValueError
    for a difficulty outside 0..6 or n < 0.
    """
    if not 0 <= difficulty <= MAX_DIFFICULTY:
        raise ValueError(f"arith difficulty={difficulty}; allowed: 0..{MAX_DIFFICULTY}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    rows = []
    for i in range(n):
        rng = random.Random(f"arith/{seed}/{difficulty}/{i}")
        question, expr, answer = _LEVELS[difficulty](rng)
        rows.append({
            "data_source": "arith",
            "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"generator": "arith", "seed": seed, "difficulty": difficulty, "index": i,
                           "expression": expr, "question": question},
        })  # fmt: skip
    return rows
