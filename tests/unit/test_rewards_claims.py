"""One test per docstring claim of the rule-reward modules in hybridflow/rewards/ that the other
reward test files do not already pin down (registry prefixes, extraction order, normalisers,
grader rules, code-test comparison, return shapes)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import default_compute_score, extract_boxed, register_reward
from hybridflow.rewards.code import extract_code, outputs_match, parse_tests
from hybridflow.rewards.extract import extract_answer_line
from hybridflow.rewards.grading import alarm_timeout, grade_answer, hendrycks_normalize, math_equal
from hybridflow.rewards.math_dapo import normalize_final_answer
from hybridflow.rewards.prime_math import match_answer
from hybridflow.rewards.registry import get_reward, reward_prefixes
from hybridflow.rewards.search_qa import normalize_answer

CODE_CFG = RewardConfig(code_case_timeout_s=5.0, timeout_s=30.0)


# ---- package ------------------------------------------------------------------------------------
def test_nothing_imports_torch():
    code = "import sys, hybridflow.rewards as r; r.reward_names(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


# ---- registry prefixes --------------------------------------------------------------------------
def test_exact_name_beats_prefix_and_longer_prefix_beats_shorter():
    def short(*a):
        return {"score": 1.0}

    def long_(*a):
        return {"score": 2.0}

    def exact(*a):
        return {"score": 3.0}

    register_reward("claims/pfx-placeholder", prefixes=("claims/p",))(short)
    register_reward("claims/pfx-placeholder-2", prefixes=("claims/pfx",))(long_)
    register_reward("claims/pfx-exact")(exact)
    assert get_reward("claims/pq") is short
    assert get_reward("claims/pfx-other") is long_
    assert get_reward("claims/pfx-exact") is exact
    assert {"claims/p", "claims/pfx"} <= set(reward_prefixes())
    with pytest.raises(ValueError, match="already registered"):
        register_reward("claims/another", prefixes=("claims/p",))(short)


# ---- extract ------------------------------------------------------------------------------------
def test_bare_box_mention_is_skipped_for_the_last_well_formed_box():
    assert extract_boxed(r"\boxed{3}. The \boxed. command was used") == "3"


def test_extract_boxed_is_linear_on_many_boxes():
    text = "\\boxed{" * 100_000 + "\\boxed{7}" + "\\boxed{" * 100_000
    start = time.monotonic()
    assert extract_boxed(text) == "7"
    assert time.monotonic() - start < 5.0  # a rescan per box would be 10^10 steps


def test_answer_tags_last_opening_tag_that_closes():
    from hybridflow.rewards import extract_answer_tags

    assert extract_answer_tags("<answer>a<answer>b</answer>") == "b"
    assert extract_answer_tags("<answer>a</answer> junk </answer>") == "a"
    assert extract_answer_tags("<answer>x</answer><answer>y") == "x"


def test_geo3k_format_check_is_verls_regex():
    from hybridflow.rewards.geo3k import has_think_box_format

    assert has_think_box_format("<think>a</think> so \\boxed{3}.")
    assert not has_think_box_format(" <think>a</think> \\boxed{3}")  # must start with <think>
    assert not has_think_box_format("<think>a</think> \\boxed{3")  # the box must close
    assert not has_think_box_format("<think>\\boxed{3}</think>")  # the box must follow </think>


def test_answer_line_none_when_absent_or_empty():
    assert extract_answer_line("no marker here") is None
    assert extract_answer_line("Answer:   \n") is None


# ---- MATH (math-verify) ---------------------------------------------------------------------------
def test_math_whole_text_only_without_a_box():
    assert default_compute_score("lighteval/MATH", "so it is 1/2", "0.5") == {
        "score": 1.0, "acc": 1.0, "parsed": True, "pred": None}  # fmt: skip


def test_math_costly_box_is_unparsed_and_boxed_truth_used_as_is():
    out = default_compute_score("lighteval/MATH", r"\boxed{10^{10^{10^{10}}}}", "3")
    assert (out["score"], out["parsed"]) == (0.0, False)
    assert default_compute_score("lighteval/MATH", r"\boxed{3}", r"\boxed{3}")["score"] == 1.0


@pytest.mark.parametrize("truth", [3, "", "   "])
def test_math_bad_truth_raises(truth):
    with pytest.raises(ValueError, match="not a non-empty string"):
        default_compute_score("lighteval/MATH", r"\boxed{3}", truth)


# ---- DAPO -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "want"), [
    ("x = 7", "7"),  # what follows the last "="
    ("5 dollars", "5"), ("12 cm", "12"), ("30^\\circ", "30"),  # units, degrees
    ("\\text{Monday}", "Monday"), ("\\textbf{4}", "4"), ("\\overline{12}", "12"), ("\\boxed{9}", "9"),
    ("$\\frac12$", "\\frac{1}{2}"), ("\\sqrt2", "\\sqrt{2}"),
    ("1,000", "1000"), ("1,000.5", "1,000.5"),  # commas only leave integers
    ("a square", ""),
])  # fmt: skip
def test_minerva_normalisation(raw, want):
    assert normalize_final_answer(raw) == want


@pytest.mark.parametrize("raw", ["", "=", "$", "\\boxed{", "}}}{{{", "\\frac", "\\sqrt", "$$$$"])
def test_minerva_normalisation_never_raises(raw):
    assert isinstance(normalize_final_answer(raw), str)


def test_dapo_searches_the_whole_response_and_reads_integer_truths():
    # verl cuts to the last 300 characters and would miss this answer
    text = "Answer: 34\n" + "I double-checked every step. " * 200
    assert default_compute_score("math_dapo", text, 34)["score"] == 1.0
    with pytest.raises(ValueError, match="not a non-empty string"):
        default_compute_score("math_dapo", text, " ")


# ---- numina (prime_math) ---------------------------------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [
    (r"junk \boxed{1} more \fbox{ 2 }", "2"),  # the last box, stripped
    ("so the answer is 12.\nDone, the end", "12"),  # after the last marker, to the end of its line
    ("Answer: y = 5", "5"),  # then after the last "="
    ("first line\nwhich is 42.", "42"),  # no marker: the last line, after " is "
    ("", None),
])  # fmt: skip
def test_prime_match_answer(text, want):
    assert match_answer(text) == want


def test_prime_number_truth_and_bad_truth():
    assert default_compute_score("numina_cn_k12", r"\boxed{12}", 12)["score"] == 1.0
    with pytest.raises(ValueError, match="not a non-empty string"):
        default_compute_score("numina_cn_k12", r"\boxed{12}", None)


# ---- grading ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(("raw", "want"), [
    ("\\left( 1, 2 \\right)", "(1,2)"), ("\\dfrac{1}{2}", "\\frac{1}{2}"), ("\\tfrac12", "\\frac{1}{2}"),
    ("90^\\circ", "90"), ("\\$5", "5"), ("50\\%", "50"), ("5 \\text{ cm}", "5"), ("x = 3", "3"),
    ("\\sqrt3", "\\sqrt{3}"), ("3/4", "\\frac{3}{4}"), ("0.5", "\\frac{1}{2}"), (".5", "\\frac{1}{2}"),
    ("\\text{yes}", "yes"), ("1\\!000", "1000"),
])  # fmt: skip
def test_hendrycks_normalize(raw, want):
    assert hendrycks_normalize(raw) == want


def test_grade_answer_fraction_and_integer_rules():
    assert not grade_answer("2/4", "1/2")  # an unreduced fraction must match as written
    assert not grade_answer("\\frac{6}{2}", "3")  # an integer truth needs an integer answer
    assert grade_answer("3.0", "3")
    assert not grade_answer(None, "3")


def test_math_equal_brackets_and_strings():
    assert math_equal("(1,2)", "(1.0, 2.0)")  # same brackets: element by element
    assert not math_equal("[1,2]", "(1,2)")
    assert math_equal("Yes", "yes") and math_equal("1 + x", "1+x")
    assert math_equal("$5", "5") and math_equal("50%", "50")


def test_alarm_timeout_only_in_the_main_thread():
    seen = []
    t = threading.Thread(target=lambda: seen.append(alarm_timeout()))
    t.start()
    t.join()
    assert (alarm_timeout(), seen) == (3, [None])


# ---- geometry3k and search ---------------------------------------------------------------------------
def test_geo3k_fields_and_number_truth():
    out = default_compute_score("hiyouga/geometry3k", "<think>a</think>\n\\boxed{30}", 30)
    assert out == {"score": 1.0, "acc": 1.0, "format_ok": 1.0, "parsed": True, "pred": "30"}
    with pytest.raises(ValueError):
        default_compute_score("hiyouga/geometry3k", "\\boxed{30}", "")


def test_search_normalisation_numpy_targets_and_empty_truth():
    import numpy as np

    assert normalize_answer("  The  Beatles, an Band!") == "beatles band"
    assert default_compute_score("searchR1_nq", "<answer>Paris</answer>", {"target": np.array(["paris"])})[
        "score"] == 1.0  # fmt: skip
    with pytest.raises(ValueError, match="no target answers"):
        default_compute_score("searchR1_nq", "<answer>Paris</answer>", {"target": []})


# ---- code --------------------------------------------------------------------------------------------
def test_extract_code_priority():
    assert extract_code("```js\nx\n```\n```python\nA\n```\n```c\ny\n```") == "A\n"  # a python block wins
    assert extract_code("```py\nB\n```") == "B\n" and extract_code("```python3\nC\n```") == "C\n"
    assert extract_code("```\nD\n```") == "D\n"  # else the last fenced block
    assert extract_code("print(1)") == "print(1)"  # else the whole response
    assert extract_code("   \n") is None


@pytest.mark.parametrize("truth", [{"inputs": ["1"]}, {"inputs": ["1"], "outputs": []}, "[1, 2]",
                                   {"inputs": [], "outputs": []}])  # fmt: skip
def test_parse_tests_rejects_bad_ground_truth(truth):
    with pytest.raises(ValueError, match="code ground truth"):
        parse_tests(truth)


def test_outputs_match_rules():
    assert outputs_match("1 2  \n3\n\n\n", "1 2\n3")  # trailing whitespace and blank lines
    assert outputs_match("0.3333333\n", "0.33333333")  # numbers within 1e-6
    assert not outputs_match("0.33\n", "0.3333")
    assert outputs_match("1 2 3", "1\n2\n3")  # token by token
    assert not outputs_match("1 2", "1 2 3") and not outputs_match("nan", "nan0")


def test_call_based_solution_class_and_unwrapped_outputs():
    program = "```python\nclass Solution:\n    def twice(self, x):\n        return [x, x]\n```"
    truth = json.dumps({"fn_name": "twice", "inputs": [[1], [2]], "outputs": [[1, 1], [[2, 2]]]})
    out = default_compute_score("taco", program, truth, reward_cfg=CODE_CFG)
    assert (out["score"], out["passed"], out["acc"]) == (1.0, 2, 1.0)


def test_only_the_first_code_max_cases_run():
    truth = {"inputs": ["1", "2", "3"], "outputs": ["1", "2", "wrong"]}
    cfg = RewardConfig(code_case_timeout_s=5.0, timeout_s=30.0, code_max_cases=2)
    out = default_compute_score("codecontests", "print(input())", truth, reward_cfg=cfg)
    assert (out["score"], out["pred"]) == (1.0, "2/2")
    out = default_compute_score("codecontests", "print(input())", truth, reward_cfg=CODE_CFG)
    assert (out["score"], out["acc"], out["pred"]) == (pytest.approx(2 / 3), 0.0, "2/3")
