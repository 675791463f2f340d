"""Hand-made cases: every rule reward judges the FINAL answer (last box, last ####, last Answer:,
last <answer>), reads \\fbox like \\boxed, and survives thousands separators, units and trailing text."""

from __future__ import annotations

import json

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import default_compute_score

FLEX = RewardConfig(gsm8k_extraction="flexible")
# data source -> its full score for a right answer (geometry3k keeps 0.1 for the <think> format)
BOXED_SOURCES = {"lighteval/MATH": 1.0, "math_dapo": 1.0, "aime2024": 1.0, "numina_olympiads": 1.0,
                 "hiyouga/geometry3k": 0.9, "arith": 1.0, "gsm8k": 1.0}  # fmt: skip
WRONG = {"math_dapo": -1.0, "aime2024": -1.0}  # DAPO's ±1; the others give 0.0


@pytest.mark.parametrize("source", sorted(BOXED_SOURCES))
@pytest.mark.parametrize(("response", "truth"), [
    (r"so \boxed{2}, wait, actually \boxed{3}", "3"),  # a revised answer: the last box counts
    (r"\fbox{3}", "3"),
    (r"\boxed{2}, no: \fbox{3}", "3"),  # whichever command comes last
    (r"\fbox{2}, no: \boxed{3}", "3"),
    (r"\boxed{1,000}", "1000"),  # thousands separator
    (r"\boxed{5\text{ cm}}", "5"),  # unit
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{\$18}", "18"),
    (r"\boxed{3}. I hope this helps! 42 is my favourite number.", "3"),  # trailing text with a number
    (r"\boxed{3} and then a broken \boxed{", "3"),  # a later box that never closes
])  # fmt: skip
def test_boxed_final_answer_scores_full(source, response, truth):
    assert default_compute_score(source, response, truth, reward_cfg=FLEX)["score"] == BOXED_SOURCES[source]


@pytest.mark.parametrize("source", sorted(BOXED_SOURCES))
def test_the_first_of_two_boxes_is_not_the_answer(source):
    out = default_compute_score(source, r"so \boxed{2}, wait, actually \boxed{3}", "2", reward_cfg=FLEX)
    assert out["score"] == WRONG.get(source, 0.0)


def test_math_verify_on_the_whole_text_misses_both_cases():
    # why the MATH reward hands math-verify only the last box: on the whole text math-verify 0.9 reads
    # the two boxes as the set {2, 3} (equal to neither) and finds nothing in \fbox{}
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold = parse(r"\boxed{3}", extraction_config=[LatexExtractionConfig()])
    assert not verify(gold, parse(r"\boxed{2}, wait, actually \boxed{3}", extraction_config=configs))
    assert parse(r"\fbox{3}", extraction_config=configs) == []
    assert default_compute_score("lighteval/MATH", r"\boxed{2}, wait, actually \boxed{3}", "3")["score"] == 1.0
    assert default_compute_score("lighteval/MATH", r"\fbox{3}", "3")["score"] == 1.0


@pytest.mark.parametrize("cfg", [RewardConfig(gsm8k_extraction="strict"), FLEX])
def test_gsm8k_last_marker_wins(cfg):
    out = default_compute_score("openai/gsm8k", "#### 2\nWait, that is wrong.\n#### 3", "3", reward_cfg=cfg)
    assert (out["score"], out["pred"]) == (1.0, "3")


@pytest.mark.parametrize("response", ["Answer: 2\nHmm, actually\nAnswer: 3", "Answer: 2. No wait, Answer: 3",
                                      "answer : 3", "Answer:\n3", "Answer: 3\nThe answer:"])  # fmt: skip
def test_dapo_last_answer_line(response):
    assert default_compute_score("math_dapo", response, "3") == {"score": 1.0, "acc": 1.0, "parsed": True, "pred": "3"}


@pytest.mark.parametrize(("response", "truth"), [("Answer: 5 cm", "5"), ("Answer: 1,000 dollars", "1000"),
                                                 ("Answer: $\\frac12$", "\\frac{1}{2}"), ("Answer: x = 7", "7"),
                                                 ("Answer: \\boxed{3}", "3")])  # fmt: skip
def test_dapo_minerva_normalisation(response, truth):
    assert default_compute_score("math_dapo", response, truth)["score"] == 1.0


def test_dapo_answer_line_beats_a_box_as_in_verl():
    # verl prefers the Minerva line; the box is only a fallback
    assert default_compute_score("math_dapo", "\\boxed{4}\nAnswer: 3", "3")["score"] == 1.0
    assert default_compute_score("math_dapo", "Answer: 3\nso \\boxed{4}", "4")["score"] == -1.0


def test_countdown_and_search_take_the_last_answer_tag():
    gt = {"target": 16, "numbers": [3, 5, 2]}
    assert default_compute_score("countdown", "<answer>3 + 5 + 2</answer> no: <answer>(3 + 5) * 2</answer>", gt)[
        "score"] == 1.0  # fmt: skip
    assert default_compute_score("countdown", "<answer>(3 + 5) * 2</answer> no: <answer>3 + 5 + 2</answer>", gt)[
        "score"] == 0.0  # fmt: skip
    assert default_compute_score("searchR1_nq", "<answer>Rome</answer> <answer>Paris</answer>",
                                 {"target": ["Paris"]})["score"] == 1.0  # fmt: skip


def test_arith_box_wins_over_later_numbers_and_keeps_thousands():
    assert default_compute_score("arith", r"\boxed{1,234} (took 5 steps)", "1234")["pred"] == "1,234"
    assert default_compute_score("arith", r"\boxed{1,234} (took 5 steps)", "1234")["score"] == 1.0


def test_numina_marker_and_last_line_extraction():
    assert default_compute_score("numina_cn_k12", "So the answer is 12.", "12")["score"] == 1.0
    assert default_compute_score("numina_cn_k12", "first 3\nthen x = 12.", "12")["score"] == 1.0
    assert default_compute_score("numina_cn_k12", "no digits here", "12") == {
        "score": 0.0, "acc": 0.0, "parsed": True, "pred": "no digits here"}  # fmt: skip


def test_code_last_python_block_is_the_program():
    tests = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
    two_blocks = "```python\nprint(0)\n```\nBetter:\n```python\nprint(int(input()) * 2)\n```"
    cfg = RewardConfig(code_case_timeout_s=5.0, timeout_s=20.0)
    assert default_compute_score("apps", two_blocks, tests, reward_cfg=cfg)["score"] == 1.0
