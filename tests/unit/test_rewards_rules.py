"""Rule rewards through default_compute_score: gsm8k, math (math-verify), countdown, arith, format."""

import json

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import (
    UnknownDataSourceError,
    default_compute_score,
    format_score,
    get_reward,
    register_reward,
    reward_names,
)

STRICT = RewardConfig(gsm8k_extraction="strict")
FLEX = RewardConfig(gsm8k_extraction="flexible")


# ---- gsm8k -----------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", [STRICT, FLEX])
@pytest.mark.parametrize(
    "response, truth",
    [
        ("#### 1,000", "1000"),  # thousands separator in the answer
        ("#### 72.0", "72"),  # same number, different spelling
        ("#### 72", "72.0"),
        ("First I add. #### 18\nSo Janet makes 18 dollars a day.", "18"),  # position does not matter
        ("#### $5", "5"),
    ],
)
def test_gsm8k_reference_cases_score_one(cfg, response, truth):
    out = default_compute_score("openai/gsm8k", response, truth, reward_cfg=cfg)
    assert out["score"] == 1.0 and out["acc"] == 1.0 and out["parsed"] is True


def test_gsm8k_strict_needs_the_marker_flexible_takes_last_number():
    response = "She has 3 apples and buys 15 more, so 18."
    assert default_compute_score("openai/gsm8k", response, "18", reward_cfg=STRICT) == {
        "score": 0.0, "acc": 0.0, "parsed": False, "pred": None}  # fmt: skip
    assert default_compute_score("openai/gsm8k", response, "18", reward_cfg=FLEX)["score"] == 1.0


def test_gsm8k_flexible_prefers_the_marker_over_a_later_number():
    # "#### 18" then a later "3": the marked answer wins wherever it is
    assert default_compute_score("gsm8k", "#### 18 (took 3 steps)", "18", reward_cfg=FLEX)["score"] == 1.0
    assert default_compute_score("gsm8k", r"so \boxed{18} after 3 steps", "18", reward_cfg=FLEX)["score"] == 1.0


def test_gsm8k_wrong_number_is_parsed_but_zero():
    out = default_compute_score("openai/gsm8k", "#### 17", "18", reward_cfg=STRICT)
    assert out == {"score": 0.0, "acc": 0.0, "parsed": True, "pred": "17"}


def test_gsm8k_non_numeric_truth_raises():
    with pytest.raises(ValueError, match="not a number"):
        default_compute_score("openai/gsm8k", "#### 1", "one")


# ---- math ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, truth, want",
    [
        (r"The answer is $\boxed{\frac{1}{3}}$.", "1/3", 1.0),
        (r"so \boxed{0.5}", r"\frac{1}{2}", 1.0),  # equivalent forms, decided by math-verify
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
        (r"\boxed{\frac{1}{4}}", r"\frac{1}{3}", 0.0),
    ],
)
def test_math_equivalence_by_math_verify(response, truth, want):
    out = default_compute_score("lighteval/MATH", response, truth)
    assert out["score"] == want and out["parsed"] is True


def test_math_unparsed_and_aliases():
    out = default_compute_score("lighteval/MATH", "I do not know", "3")
    assert out["parsed"] is False and out["score"] == 0.0
    assert get_reward("HuggingFaceH4/MATH-500") is get_reward("lighteval/MATH")
    assert get_reward("math") is get_reward("math_dapo")  # verl sends "math" to DAPO's scorer


# ---- countdown -------------------------------------------------------------------------------
GT = json.dumps({"target": 16, "numbers": [3, 5, 2]})


@pytest.mark.parametrize(
    "answer, want, parsed",
    [
        ("(3 + 5) * 2", 1.0, True),  # (3+5)*2 = 16, each number once
        ("2 * (5 + 3) = 16", 1.0, True),  # "= 16" tail ignored; order of numbers irrelevant
        ("(3 × 5) + 2 - 1", 0.0, True),  # 1 is not a given number
        ("3 * 5 + 2", 0.0, True),  # 17 ≠ 16
        ("(5 + 3) * 2 * 2", 0.0, True),  # 2 used twice (32 anyway)
        ("5 * 3", 0.0, True),  # 2 unused (15)
        ("16 / (5 - 5)", 0.0, True),  # division by zero: wrong, not a crash
        ("__import__('os').system('true')", 0.0, False),  # never evaluated
        ("2 ** 4", 0.0, False),  # powers are not allowed
        ("3.0 + 13", 0.0, False),  # floats are not allowed
    ],
)
def test_countdown(answer, want, parsed):
    out = default_compute_score("countdown", f"<think>...</think><answer>{answer}</answer>", GT)
    assert (out["score"], out["parsed"]) == (want, parsed)


def test_countdown_exact_division_and_tinyzero_dict_truth():
    # (6 / 4) * 8 = 12 exactly, via Fraction 3/2 * 8
    out = default_compute_score("countdown", "<answer>(6 / 4) * 8</answer>", {"target": 12, "numbers": [8, 6, 4]})
    assert out["score"] == 1.0


def test_countdown_without_answer_tag_is_unparsed():
    out = default_compute_score("countdown", "(3 + 5) * 2", GT)
    assert out["parsed"] is False and out["score"] == 0.0


# ---- arith -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "response, want, parsed, boxed",
    [
        (r"7 + 5 = \boxed{12}", 1.0, True, True),
        (r"\boxed{x = 12.0}", 1.0, True, True),  # last number inside the box
        (r"\boxed{12} is wrong, it is 13", 1.0, True, True),  # the box wins over later numbers
        ("7 + 5 = 12", 1.0, True, False),  # no box: the last number
        ("7 + 5 = 13", 0.0, True, False),
        ("I cannot say", 0.0, False, False),
    ],
)
def test_arith(response, want, parsed, boxed):
    out = default_compute_score("arith", response, "12")
    assert (out["score"], out["parsed"], out["boxed"]) == (want, parsed, boxed)


# ---- format and weights ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "style, text, want",
    [
        ("boxed", r"\boxed{3}", 1.0),
        ("boxed", r"\boxed{ }", 0.0),
        ("boxed", "3", 0.0),
        ("answer_tags", "<answer>1+2</answer>", 1.0),
        ("answer_tags", "<answer></answer>", 0.0),
        ("hash", "#### 3", 1.0),
        ("hash", "3", 0.0),
    ],
)
def test_format_styles(style, text, want):
    assert format_score(text, style) == want


def test_format_unknown_style():
    with pytest.raises(ValueError, match="known: answer_tags, boxed, hash"):
        format_score("x", "xml")


def test_correctness_and_format_weights():
    cfg = RewardConfig(correctness_weight=0.9, format_weight=0.1, format_style="boxed")
    # right and boxed: 0.9·1 + 0.1·1 = 1.0
    assert default_compute_score("arith", r"\boxed{12}", "12", reward_cfg=cfg)["score"] == pytest.approx(1.0)
    # right, no box: 0.9·1 + 0.1·0 = 0.9
    out = default_compute_score("arith", "12", "12", reward_cfg=cfg)
    assert out["score"] == pytest.approx(0.9) and out["format"] == 0.0 and out["acc"] == 1.0
    # wrong but boxed: 0.9·0 + 0.1·1 = 0.1
    assert default_compute_score("arith", r"\boxed{11}", "12", reward_cfg=cfg)["score"] == pytest.approx(0.1)


def test_no_format_field_when_format_weight_is_zero():
    assert "format" not in default_compute_score("arith", r"\boxed{12}", "12")


# ---- registry --------------------------------------------------------------------------------
def test_registry_unknown_lists_names_and_duplicates_raise():
    with pytest.raises(UnknownDataSourceError, match="registered: .*arith.*countdown"):
        default_compute_score("no/such", "x", "1")
    with pytest.raises(ValueError, match="already registered"):
        register_reward("arith")(lambda *a: {"score": 0.0})
    assert {"arith", "countdown", "openai/gsm8k", "math"} <= set(reward_names())


def test_register_reward_dispatches_by_data_source():
    @register_reward("test/length")
    def length_reward(solution_str, ground_truth, extra_info, cfg):
        return {"score": float(len(solution_str)), "parsed": True}

    assert default_compute_score("test/length", "abcd", "")["score"] == 4.0
