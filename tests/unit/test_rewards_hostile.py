"""Hostile answers (pathological LaTeX, huge numbers, code that never ends) neither hang a scorer
past ``reward.timeout_s`` nor crash the run: scored through the real RewardExecutor path (worker
processes, where math-verify's SIGALRM timeouts work), they come back as ordinary wrong answers.

Inputs in the spirit of verl's prime_math grader security tests, plus big-integer bombs that run in
C and would ignore SIGALRM (power towers, huge factorials)."""

from __future__ import annotations

import json
import time

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import RewardExecutor, RewardItem, default_compute_score
from hybridflow.rewards.code import row_budget_s
from hybridflow.rewards.grading import math_equal, symbolic_equal, too_costly

HOSTILE = {
    "big integer": "\\boxed{" + "9" * 100_000 + "}",
    "5000 digits": "\\boxed{" + "9" * 5000 + "}",
    "power tower": "\\boxed{10^{10^{10^{10^{10}}}}}",
    "flat tower": "\\boxed{9^9^9^9}",
    "python tower": "\\boxed{9**9**9**9}",
    "huge exponent": "\\boxed{2^{99999999}}",
    "huge factorial": "\\boxed{100000!}",
    "deep braces": "\\boxed{" + "{" * 20_000 + "1" + "}" * 20_000 + "}",
    "deep fractions": "\\boxed{" + "\\frac{1}{" * 2000 + "2" + "}" * 2000 + "}",
    "deep parens": "\\boxed{" + "(" * 5000 + "1" + ")" * 5000 + "}",
    "deep sqrt": "\\boxed{" + "\\sqrt{" * 3000 + "2" + "}" * 3000 + "}",
    "unclosed boxes": "\\boxed{" * 50_000,
    "long answer line": "Answer: " + "x" * 1_000_000,
    "many boxes": "\\boxed{1}" * 20_000 + "\\boxed{3}",
    "python payload": "\\boxed{__import__('os').system('true')}",
    "hash bomb": "#### " + "9" * 100_000,
    "think tags": "<think>" + "</think>" * 100_000,
}
SOURCES = ["lighteval/MATH", "math_dapo", "numina_olympiads", "hiyouga/geometry3k", "gsm8k", "arith"]
TRUTH = "3"


def test_hostile_answers_are_wrong_answers_within_the_timeout():
    cfg = RewardConfig(num_workers=2, timeout_s=10.0)
    items = [RewardItem(src, text, TRUTH, uid=f"{src}/{name}") for src in SOURCES for name, text in HOSTILE.items()]
    start = time.monotonic()
    with RewardExecutor(cfg) as ex:
        results = ex.score(items)
    elapsed = time.monotonic() - start
    assert results.failures == [None] * len(items), results.logs  # no timeout, crash or error
    assert ex.worker_restarts == 0
    for item, score in zip(items, results.scores, strict=True):
        if item.uid.endswith("many boxes"):  # the last of the boxes is right (geometry3k: no <think>, 0.9)
            want = 0.9 if item.data_source == "hiyouga/geometry3k" else 1.0
        else:  # a wrong answer: DAPO's -1, everyone else's 0
            want = -1.0 if item.data_source == "math_dapo" else 0.0
        assert score == want, item.uid
    # 102 rows on 2 workers, worker start included; one row near the timeout would already cost 10 s
    assert elapsed < 40, elapsed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["power tower", "flat tower", "python tower", "huge exponent", "huge factorial",
                                  "deep braces", "deep parens", "5000 digits"])  # fmt: skip
def test_too_costly_answers_never_reach_the_symbolic_engine(name):
    answer = HOSTILE[name][len("\\boxed{") : -1]
    assert too_costly(answer)
    start = time.monotonic()
    assert not symbolic_equal(answer, "x^2")
    assert not math_equal(answer, "x^2")
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize("answer", ["x^{2}", "2^{10}", "\\frac{\\sqrt{3}}{2}", "10!", "(1, 2)", "e^{i\\pi}", "e^{-x^2}"])
def test_ordinary_answers_are_not_too_costly(answer):
    assert not too_costly(answer)


def test_too_costly_length_limit_is_off_for_whole_responses():
    text = "a long derivation. " * 100 + "\\boxed{3}"
    assert too_costly(text) and not too_costly(text, max_chars=None)


def test_huge_numbers_compare_exactly_without_float_overflow():
    assert not math_equal("9" * 500, "3")  # 1e500 is past the largest float
    assert math_equal("9" * 500, "9" * 500 + ".0")
    assert math_equal("3.00001", "3") and not math_equal("3.001", "3")  # PRIME's relative tolerance 1e-4
    assert math_equal("50", "0.5")  # PRIME accepts a percentage either way


CODE_TESTS = json.dumps({"inputs": ["1\n", "2\n", "3\n"], "outputs": ["1\n", "2\n", "3\n"]})


def test_code_that_never_ends_is_cut_per_case_and_per_row():
    loop = "```python\nwhile True:\n    pass\n```"
    echo_or_loop = "```python\nn = int(input())\nwhile n == 2:\n    pass\nprint(n)\n```"
    # per case: 0.5 s each, three cases
    cfg = RewardConfig(code_case_timeout_s=0.5, timeout_s=30.0)
    out = default_compute_score("codecontests", loop, CODE_TESTS, reward_cfg=cfg)
    assert (out["score"], out["timeouts"], out["parsed"]) == (0.0, 3, True)
    out = default_compute_score("codecontests", echo_or_loop, CODE_TESTS, reward_cfg=cfg)
    assert (out["score"], out["passed"], out["timeouts"], out["pred"]) == (pytest.approx(2 / 3), 2, 1, "2/3")
    # per row: cases of 5 s would overrun timeout_s=3; the row stops at 3 - max(1, 0.6) = 2 s, and the
    # cases left fail unrun
    assert row_budget_s(3.0) == 2.0 and row_budget_s(10.0) == 8.0 and row_budget_s(0.5) == 0.0
    cfg = RewardConfig(code_case_timeout_s=5.0, timeout_s=3.0)
    start = time.monotonic()
    out = default_compute_score("taco", loop, CODE_TESTS, reward_cfg=cfg)
    assert time.monotonic() - start < 3.0
    assert (out["score"], out["timeouts"]) == (0.0, 1)


def test_code_that_never_ends_does_not_trip_the_executor_timeout():
    # two workers: the good row does not queue behind the looping one, whose row budget (2 s of its
    # 3 s) is what is tested; on one worker the good row had the last second, too little on a busy machine
    cfg = RewardConfig(num_workers=2, code_case_timeout_s=5.0, timeout_s=3.0)
    loop = "```python\nwhile True:\n    pass\n```"
    good = "```python\nprint(input())\n```"
    with RewardExecutor(cfg) as ex:
        results = ex.score([RewardItem("apps", loop, CODE_TESTS), RewardItem("apps", good, CODE_TESTS)])
    assert results.failures == [None, None], results.logs
    assert results.scores == [0.0, 1.0]
    assert results.metrics["reward/apps/timeouts/mean"] == 0.5  # one case of the looping row was killed


@pytest.mark.parametrize("code", ["import os\nos._exit(3)", "raise SystemExit(1)", "x = [0] * (10**10)",
                                  "print('y' * 10**8)", "import ctypes\nctypes.string_at(0)"])  # fmt: skip
def test_code_that_crashes_scores_zero(code):
    cfg = RewardConfig(code_case_timeout_s=5.0, timeout_s=30.0, sandbox_memory_mb=256)
    out = default_compute_score("codeforces", f"```python\n{code}\n```", CODE_TESTS, reward_cfg=cfg)
    assert out["score"] == 0.0 and out["parsed"] is True


@pytest.mark.timeout(60)
def test_tag_scanners_stay_linear():
    # a regex scan for <answer>(.*?)</answer> or verl's <think>.*</think>.*\boxed{.*}.* backtracks
    # quadratically here (measured: 60 s for 20k unclosed tags before the fix)
    start = time.monotonic()
    gt = {"target": 16, "numbers": [3, 5, 2]}
    assert default_compute_score("countdown", "<answer>" * 100_000, gt)["parsed"] is False
    assert default_compute_score("searchR1_nq", "<answer>" * 100_000, {"target": ["x"]})["score"] == 0.0
    assert default_compute_score("hiyouga/geometry3k", "<think>" + "</think>" * 100_000 + "\\boxed{3", "3")[
        "score"] == 0.0  # fmt: skip
    assert time.monotonic() - start < 5.0
