"""Answer extraction: boxed (nested braces), <answer> tags, #### N, last number, number parsing."""

from fractions import Fraction

import pytest

from hybridflow.rewards import (
    extract_answer_tags,
    extract_boxed,
    extract_hash_answer,
    last_number,
    parse_number,
)


def test_extract_boxed_keeps_nested_braces():
    assert extract_boxed(r"\boxed{\frac{1}{3}}") == r"\frac{1}{3}"
    assert extract_boxed(r"so $x = \boxed{\sqrt{\frac{a}{b}}}$ done") == r"\sqrt{\frac{a}{b}}"


def test_extract_boxed_takes_the_last_box():
    assert extract_boxed(r"first \boxed{1}, then \boxed{2}") == "2"


@pytest.mark.parametrize(
    "text, want",
    [
        (r"\boxed 5 is it", "5"),  # brace-less form
        (r"\fbox{7}", "7"),
        ("no box at all", None),
        (r"\boxed{unclosed \frac{1}{2}", None),
        (r"\boxed", None),
    ],
)
def test_extract_boxed_edge_cases(text, want):
    assert extract_boxed(text) == want


def test_answer_tags_last_pair_stripped():
    assert extract_answer_tags("<answer> 1 + 2 </answer> x <answer>(3+5)*2</answer>") == "(3+5)*2"
    assert extract_answer_tags("<answer>never closed") is None


def test_hash_answer_last_marker_with_commas_and_sign():
    assert extract_hash_answer("#### 3\nmore text\n#### 1,000 dollars") == "1,000"
    assert extract_hash_answer("####   −12") == "-12"  # unicode minus
    assert extract_hash_answer("#### none") is None


def test_last_number_respects_thousands_groups():
    assert last_number("it costs $1,234.50 in total") == "1,234.50"
    assert last_number("pick 3, 4") == "4"  # "3, 4" is two numbers, not 34
    assert last_number("no digits") is None


@pytest.mark.parametrize(
    "text, want",
    [
        ("1,000", Fraction(1000)),
        ("72.0", Fraction(72)),
        ("$18", Fraction(18)),
        ("5.", Fraction(5)),  # trailing sentence period
        ("3/4", Fraction(3, 4)),
        ("-0.5", Fraction(-1, 2)),
        ("1,2", None),  # not a thousands grouping
        ("abc", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, want):
    assert parse_number(text) == want
