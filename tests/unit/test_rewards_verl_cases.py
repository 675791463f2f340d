"""verl's and OpenRLHF's reward test cases, as facts scored through hybridflow's registry.

Sources (inputs and expected scores only; the tests are written here):
- verl ``tests/utils/reward_score/``: test_default_compute_score_on_cpu, test_gsm8k_on_cpu,
  test_gsm8k_parser_on_cpu, test_math_dapo_on_cpu, test_numeric_canonicalization_on_cpu,
  test_prime_math_grader_on_cpu (verl-project/verl, 2025-2026).
- OpenRLHF ``tests/test_boxed_answer_extraction.py``, ``tests/test_math_utils.py``.

``CASES`` holds at least one scored case for every registered data source (and prefix);
:func:`test_every_registered_data_source_has_a_case` fails when one is added without a case.
"""

from __future__ import annotations

import json
import math

import pytest

from hybridflow.config import RewardConfig
from hybridflow.rewards import UnknownDataSourceError, default_compute_score, extract_boxed, reward_names
from hybridflow.rewards.grading import grade_answer, math_equal, symbolic_equal
from hybridflow.rewards.registry import get_reward, reward_prefixes

STRICT = RewardConfig(gsm8k_extraction="strict")
FLEX = RewardConfig(gsm8k_extraction="flexible")
CODE_CFG = RewardConfig(code_case_timeout_s=5.0, timeout_s=20.0)


def _pad(n: int) -> str:
    """Filler without digits (verl's test_gsm8k_on_cpu uses the same idea)."""
    return ("the reasoning above confirms this result is consistent. " * (n // 55 + 1))[:n]


PMATRIX_56 = "\\begin{pmatrix} 5 \\ 6 \\end{pmatrix}"
ADD_PROGRAM = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
ADD_TESTS = json.dumps({"inputs": ["1 2\n", "10 20\n"], "outputs": ["3\n", "30\n"]})

# data_source -> [(response, ground_truth, expected score)]; score is the final one (format_weight 0).
CASES: dict[str, list[tuple[str, object, float]]] = {
    # verl test_default_compute_score_on_cpu
    "openai/gsm8k": [("reasoning #### 42", "42", 1.0), ("reasoning #### 41", "42", 0.0)],
    "gsm8k": [("2 + 40 = 42.\n#### 42\n" + _pad(4000), "42", 1.0)],
    # hybridflow's MATH family goes to math-verify (verl: math_reward's string normaliser)
    "lighteval/MATH": [(r"\boxed{\frac{1}{2}}", "0.5", 1.0), (r"\boxed{033}", "33", 1.0)],
    "DigitalLearningGmbH/MATH-lighteval": [(r"\boxed{-0}", "0", 1.0)],
    "HuggingFaceH4/MATH-500": [(r"\boxed{000}", "0", 1.0), (r"\boxed{2}", "3", 0.0)],
    # verl test_math_dapo_on_cpu: a 151-character boxed answer in fallback mode
    "math_dapo": [("\\boxed{" + "x" * 151 + "}", "x" * 151, 1.0), ("reasoning only", "42", -1.0)],
    "math_dapo_reasoning": [("so\nAnswer: 34", "34", 1.0)],
    "math": [("Answer: 7", "8", -1.0)],
    "aime": [(r"\boxed{99} more reasoning \boxed{42}", "42", 1.0)],
    "aime24": [("Answer: $204$", "204", 1.0)],
    "aime25": [("Answer: 70 degrees", "70", 1.0)],
    "aime2024": [("Answer: 1,000", "1000", 1.0)],
    "aime2025": [("Answer: 12", "21", -1.0)],
    "aime_1983_2024": [("Answer: 5", "5", 1.0)],  # any aime* name, through the prefix
    # verl test_prime_math_grader_on_cpu (through the scorer) and OpenRLHF's grade_answer cases
    "numina_aops_forum": [(r"so \boxed{[5, 6]}", PMATRIX_56, 1.0)],
    "numina_synthetic_math": [(r"\boxed{Matrix([[1, 2]])}", r"\begin{pmatrix} 1 & 2 \end{pmatrix}", 1.0)],
    "numina_amc_aime": [(r"\boxed{(1.0,2.0)}", "(1,2)", 1.0), (r"\boxed{[1,2]}", "(1,2)", 0.0)],
    "numina_synthetic_amc": [(r"\boxed{(1,2]}", "(1,2)", 0.0), (r"\boxed{[1,2)}", "[1,2]", 0.0)],
    "numina_cn_k12": [(r"\boxed{2\pi}", str(2 * math.pi), 1.0), (r"\boxed{3.5\pi}", str(3.5 * math.pi), 1.0)],
    "numina_olympiads": [(r"\boxed{033}", "33", 1.0), (r"\boxed{+033}", "33", 1.0)],
    # code: stdin/stdout programs in the sandbox
    "codecontests": [(ADD_PROGRAM, ADD_TESTS, 1.0)],
    "apps": [("```python\nprint(3)\n```", ADD_TESTS, 0.5)],  # passes 1 of 2
    "codeforces": [("no code, just words", ADD_TESTS, 0.0)],
    "taco": [("```python\ndef add(a, b):\n    return a + b\n```",
              json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [[3], [7]]}), 1.0)],  # fmt: skip
    # geometry3k: 0.9·acc + 0.1·format
    "hiyouga/geometry3k": [("<think>angles sum</think> so \\boxed{30}", "30", 1.0), ("\\boxed{30}", "30", 0.9),
                           ("<think>x</think> \\boxed{31}", "30", 0.1), ("31", "30", 0.0)],  # fmt: skip
    # Search-R1 exact match
    "searchR1_nq": [("<answer>The Beatles!</answer>", {"target": ["beatles"]}, 1.0)],
    "searchR1_triviaqa": [("<answer>Paris</answer>", {"target": ["London"]}, 0.0)],
    "searchR1_popqa": [("<answer>x</answer>" * 11 + "<answer>Paris</answer>", {"target": "paris"}, 0.25)],
    "searchR1_hotpotqa": [("Paris", {"target": ["Paris"]}, 0.0)],  # no <answer>: nothing to match
    "searchR1_2wikimultihopqa": [("<answer>an apple</answer>", {"target": ["Apple"]}, 1.0)],
    "searchR1_musique": [("<answer>first</answer> then <answer>second</answer>", {"target": ["second"]}, 1.0)],
    "searchR1_bamboogle": [("<answer>1969</answer>", ["1969", "69"], 1.0)],
    # hybridflow's own tasks
    "arith": [(r"\boxed{12}", "12", 1.0)],
    "countdown": [("<answer>(3 + 5) * 2</answer>", {"target": 16, "numbers": [3, 5, 2]}, 1.0)],
    # reasoning-gym rows: chain_sum's own verifier (compute_decimal_reward: "+07.0" equals "7"; an answer
    # holding the truth earns len(truth)/len(answer))
    "reasoning_gym": [("<answer>+07.0</answer>", "7", 1.0)],
    "reasoning_gym/chain_sum": [("<answer>17</answer>", "7", 0.5), ("7", "7", 0.0)],
    # scored by their environment (the game's reward replaces the score): the rule adds nothing
    "textarena": [("[5]", "GuessTheNumber-v0 seed 0", 0.0)],
    "textarena/GuessTheNumber-v0": [("[12]", "GuessTheNumber-v0 seed 3", 0.0)],
    "gymnasium": [("2", "FrozenLake-v1", 0.0)],
    "gymnasium/FrozenLake-v1": [("1", "FrozenLake-v1", 0.0)],
    "openenv": [("4", "", 0.0)],
    "openenv/CountUp": [("5", "", 0.0)],
    "verifiers": [("5", "sums train example 0", 0.0)],
    "verifiers/sums": [("8", "sums train example 1", 0.0)],
}

# rewards that also read extra_info (the rows of `hybridflow data reasoning-gym` carry the entry)
_CHAIN_SUM = {"question": "State the final answer to the following arithmetic problem: 4 + 3 =", "answer": "7",
              "metadata": {"source_dataset": "chain_sum", "source_index": 0, "expression": "4 + 3"}}
EXTRA_INFO = {ds: {"dataset": "chain_sum", "config": "{}", "entry": json.dumps(_CHAIN_SUM)}
              for ds in ("reasoning_gym", "reasoning_gym/chain_sum")}


def _builtin(name: str) -> bool:
    """Registered by hybridflow's own modules (other tests register throwaway names)."""
    return get_reward(name).__module__.startswith("hybridflow.rewards.")


def test_every_registered_data_source_has_a_case():
    names = {n for n in reward_names() if _builtin(n)}
    prefixes = [p for p in reward_prefixes() if _builtin(p + "\x00")]
    assert prefixes == ["aime", "gymnasium/", "openenv/", "reasoning_gym/", "textarena/", "verifiers/"] and len(names) >= 36
    missing = sorted(names - set(CASES))
    assert not missing, f"registered data sources without a case in CASES: {missing}"
    for p in prefixes:
        assert any(ds.startswith(p) and ds not in names for ds in CASES), f"no case reaches prefix {p}* only"


@pytest.mark.parametrize(("data_source", "response", "truth", "want"),
                         [(ds, r, t, w) for ds, cases in CASES.items() for r, t, w in cases])  # fmt: skip
def test_case_scores_as_expected(data_source, response, truth, want):
    cfg = CODE_CFG if data_source in ("codecontests", "apps", "codeforces", "taco") else RewardConfig()
    out = default_compute_score(data_source, response, truth, EXTRA_INFO.get(data_source), reward_cfg=cfg)
    assert out["score"] == pytest.approx(want)
    if data_source.startswith(("textarena", "gymnasium", "openenv", "verifiers")):  # no answer to judge: no acc, no pred (a game's outcome is env/win_rate)
        assert set(out) == {"score"}
    else:
        assert {"score", "acc", "pred"} <= set(out)  # verl's shape


# ---- default_compute_score on unknown sources (verl test_default_compute_score_on_cpu) -----------
@pytest.mark.parametrize("data_source", ["", "   ", None, "/some/path/gsm8k"])
def test_unknown_data_source_is_a_not_implemented_error_naming_it(data_source):
    with pytest.raises(NotImplementedError) as info:
        default_compute_score(data_source, "reasoning #### 42", "42")
    assert isinstance(info.value, UnknownDataSourceError)
    assert repr(data_source) in str(info.value) and "openai/gsm8k" in str(info.value) and "aime*" in str(info.value)


# ---- gsm8k (verl test_gsm8k_on_cpu, test_gsm8k_parser_on_cpu) ------------------------------------
@pytest.mark.parametrize("trailing", [0, 1, 299, 300, 4000])
def test_gsm8k_answer_followed_by_any_amount_of_text(trailing):
    assert default_compute_score("openai/gsm8k", "2 + 40 = 42.\n#### 42\n" + _pad(trailing), "42",
                                 reward_cfg=STRICT)["score"] == 1.0  # fmt: skip


@pytest.mark.parametrize("lead", [0, 300, 4000])
def test_gsm8k_strict_takes_the_last_marker(lead):
    text = _pad(lead) + "#### 7\nwait, let me redo that.\n#### 42\n" + _pad(lead)
    assert default_compute_score("openai/gsm8k", text, "42", reward_cfg=STRICT)["pred"] == "42"


@pytest.mark.parametrize(("cfg", "prefix"), [(STRICT, "#### "), (FLEX, "the answer is ")])
def test_gsm8k_long_answer_is_not_cut(cfg, prefix):
    answer = "1234567890123456789"
    text = _pad(310 - len(answer) // 2) + prefix + answer
    assert default_compute_score("openai/gsm8k", text, answer, reward_cfg=cfg)["pred"] == answer


@pytest.mark.parametrize("cfg", [STRICT, FLEX])
def test_gsm8k_no_number_or_bare_punctuation_is_unparsed(cfg):
    for text in ("no number here at all", _pad(4000), "first sentence. second sentence. third sentence."):
        out = default_compute_score("openai/gsm8k", text, "42", reward_cfg=cfg)
        assert (out["score"], out["parsed"], out["pred"]) == (0.0, False, None)


def test_gsm8k_strict_needs_the_marker_and_strips_separators_and_periods():
    assert default_compute_score("openai/gsm8k", "the answer is 42", "42", reward_cfg=STRICT)["score"] == 0.0
    assert default_compute_score("openai/gsm8k", "#### 1,234\n" + _pad(4000), "1234", reward_cfg=STRICT)["score"] == 1.0
    assert default_compute_score("openai/gsm8k", "#### 308.", "308", reward_cfg=STRICT)["score"] == 1.0


@pytest.mark.parametrize(("text", "truth", "pred"), [
    ("The answer is 308.", "308", "308"),
    ("The answer is 3.14", "3.14", "3.14"),
    ("The answer is 15.00", "15", "15.00"),  # equal numbers, different spelling
    ("We compute everything carefully. Final result is \\boxed{10}. This took 50 minutes.", "10", "10"),
    ("First estimate 4, then revise. The answer is 12.", "12", "12"),
])  # fmt: skip
def test_gsm8k_flexible_parser(text, truth, pred):
    out = default_compute_score("openai/gsm8k", text, truth, reward_cfg=FLEX)
    assert (out["score"], out["pred"]) == (1.0, pred)


# ---- math_dapo (verl test_math_dapo_on_cpu) --------------------------------------------------------
BOX_CFG = RewardConfig(math_dapo_strict_box_verify=True)


def test_dapo_documented_length_boxed_answer_in_both_modes():
    answer = "x" * 151
    solution = "\\boxed{" + answer + "}"
    assert len(solution) == 159  # the longest answer in MATH-500, boxed
    for cfg in (BOX_CFG, RewardConfig()):
        assert default_compute_score("math_dapo", solution, answer, reward_cfg=cfg) == {
            "score": 1.0, "acc": 1.0, "parsed": True, "pred": answer}  # fmt: skip


def test_dapo_strict_box_uses_the_final_box_and_needs_one():
    out = default_compute_score("math_dapo", r"\boxed{99} more reasoning \boxed{42}", "42", reward_cfg=BOX_CFG)
    assert (out["score"], out["pred"]) == (1.0, "42")
    assert default_compute_score("math_dapo", "reasoning only", "42", reward_cfg=BOX_CFG) == {
        "score": -1.0, "acc": 0.0, "parsed": False, "pred": None}  # fmt: skip


def test_dapo_strict_box_compares_exactly():
    # strict mode does no normalisation: "1,000" is not "1000" there (the default mode accepts it)
    assert default_compute_score("math_dapo", r"\boxed{1,000}", "1000", reward_cfg=BOX_CFG)["score"] == -1.0
    assert default_compute_score("math_dapo", r"\boxed{1,000}", "1000")["score"] == 1.0


# ---- numeric canonicalisation (verl test_numeric_canonicalization_on_cpu) ---------------------------
@pytest.mark.parametrize(("gt", "pred"), [("033", "33"), ("+033", "33"), ("-0", "0"), ("000", "0")])
def test_canonical_integers_are_equal(gt, pred):
    assert grade_answer(pred, gt)


@pytest.mark.parametrize("illegal", ["3.3", "foo", "--33", "33a"])
def test_non_integers_are_not_canonicalised_to_33(illegal):
    assert not grade_answer(illegal, "33")


# ---- prime_math grader security (verl test_prime_math_grader_on_cpu) --------------------------------
def test_pi_multiples_are_numbers():
    for text, value in (("2\\pi", 2 * math.pi), ("\\pi", math.pi), ("3.5\\pi", 3.5 * math.pi)):
        assert default_compute_score("numina_olympiads", f"\\boxed{{{text}}}", f"{value:.6f}")["score"] == 1.0
    assert default_compute_score("numina_olympiads", r"\boxed{x\pi}", f"{math.pi:.6f}")["score"] == 0.0


def test_model_text_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    payloads = [
        (f"__import__('os').system('touch {marker}') and 1\\pi", "3.14"),
        ("[].__class__.__base__.__subclasses__()\\pi", "3.14"),
        (f"[open('{marker}','w').write('x')]", r"\begin{pmatrix} 5 \end{pmatrix}"),
        (f"Matrix(open('{marker}','w').write('x') and [[1,2]] or [[1,2]])", r"\begin{pmatrix} 1 & 2 \end{pmatrix}"),
        (f"__import__('os').system('touch {marker}')", "1"),
    ]
    for payload, truth in payloads:
        assert default_compute_score("numina_olympiads", payload, truth)["score"] == 0.0
        assert default_compute_score("numina_olympiads", f"\\boxed{{{payload}}}", truth)["score"] == 0.0
        assert not math_equal(payload, truth)
        assert not symbolic_equal(payload, truth)
    assert not marker.exists()


def test_matrix_literals_match_pmatrix():
    assert math_equal("[5, 6]", PMATRIX_56)
    assert math_equal("Matrix([[1, 2]])", r"\begin{pmatrix} 1 & 2 \end{pmatrix}")
    assert not math_equal("[5, 7]", PMATRIX_56)


# ---- OpenRLHF: boxed extraction and tuple grading ---------------------------------------------------
@pytest.mark.parametrize(("text", "want"), [(r"answer: \boxed{42}", "42"), (r"answer: \fbox{42}", "42"),
                                            (r"answer: \fbox{\frac{1}{2}}", r"\frac{1}{2}"),
                                            (r"answer: \fbox{42", None)])  # fmt: skip
def test_openrlhf_boxed_extraction(text, want):
    assert extract_boxed(text) == want


@pytest.mark.parametrize(("given", "truth"), [("[1,2]", "(1,2)"), ("(1,2)", "[1,2]"), ("(1,2]", "(1,2)"),
                                              ("[1,2)", "[1,2]")])  # fmt: skip
def test_openrlhf_tuples_need_matching_delimiters(given, truth):
    assert not grade_answer(given, truth)


def test_openrlhf_equivalent_tuple_with_matching_delimiters():
    assert grade_answer("(1.0,2.0)", "(1,2)")


def test_aime_prefix_resolves_and_exact_names_win():
    assert get_reward("aime_2026_ii") is get_reward("math_dapo")
    assert get_reward("aime2024") is get_reward("math_dapo")
    with pytest.raises(UnknownDataSourceError):
        get_reward("AIME2024")  # verl's startswith("aime") is case-sensitive too



# ---- verl test_sandbox_on_cpu: prime_math answers and a PRIME code sample ------------------------
def test_prime_math_answers_from_verls_sandbox_test():
    # verl prints these scores without asserting them; all three answers equal their ground truths
    bmatrix = "\\begin{bmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19 \n \\end{bmatrix}"
    pmatrix = "\\begin{pmatrix}\n -7 & 6 & -8 \\\\\n 11 & -9 & 12 \\\\\n 15 & -16 & 19\n \\end{pmatrix}"
    assert default_compute_score("numina_aops_forum", bmatrix, pmatrix)["score"] == 1.0
    assert default_compute_score("numina_aops_forum", bmatrix.replace("19", "18"), pmatrix)["score"] == 0.0
    assert default_compute_score("numina_aops_forum", "\\frac{\\sqrt{505}}{7}", "\\frac{\\sqrt{505}}{7}")["score"] == 1.0
    assert default_compute_score("numina_aops_forum", "x^2 + y^2 + 4x - 6y + 13", "(x + 2)^2 + (y - 3)^2 ")[
        "score"] == 1.0  # fmt: skip


# Codeforces 242C "King's Path": the 11 test cases of verl's sample (inputs, expected outputs)
KING_INPUTS = [
    "5 7 6 11\n3\n5 3 8\n6 7 11\n5 2 5\n", "3 4 3 10\n3\n3 1 4\n4 5 9\n3 10 10\n", "1 1 2 10\n2\n1 1 3\n2 6 10\n",
    "9 8 7 8\n9\n10 6 6\n10 6 6\n7 7 8\n9 5 6\n8 9 9\n9 5 5\n9 8 8\n8 5 6\n9 10 10\n",
    "6 15 7 15\n9\n6 15 15\n7 14 14\n6 15 15\n9 14 14\n7 14 16\n6 15 15\n6 15 15\n7 14 14\n8 15 15\n",
    "13 16 20 10\n18\n13 16 16\n20 10 10\n19 10 10\n12 15 15\n20 10 10\n18 11 11\n19 10 10\n19 10 10\n20 10 10\n"
    "19 10 10\n20 10 10\n20 10 10\n19 10 10\n18 11 11\n13 16 16\n12 15 15\n19 10 10\n19 10 10\n",
    "89 29 88 30\n16\n87 31 31\n14 95 95\n98 88 89\n96 88 88\n14 97 97\n13 97 98\n100 88 88\n88 32 32\n99 88 89\n"
    "90 29 29\n87 31 31\n15 94 96\n89 29 29\n88 32 32\n97 89 89\n88 29 30\n",
    "30 14 39 19\n31\n35 7 11\n37 11 12\n32 13 13\n37 5 6\n46 13 13\n37 14 14\n31 13 13\n43 13 19\n45 15 19\n"
    "46 13 13\n32 17 17\n41 14 19\n30 14 14\n43 13 17\n34 16 18\n44 11 19\n38 13 13\n40 12 20\n37 16 18\n"
    "46 16 18\n34 10 14\n36 9 10\n36 15 19\n38 15 19\n42 13 19\n33 14 15\n35 15 19\n33 17 18\n39 12 20\n"
    "36 5 7\n45 12 12\n",
    "2 1 1 1\n2\n1 1 2\n2 1 2\n",
    "1 1 1 2\n5\n1000000000 1 10000\n19920401 1188 5566\n1000000000 1 10000\n1 1 10000\n5 100 200\n",
    "1 1 1000000000 2\n5\n1000000000 1 10000\n19920401 1188 5566\n1000000000 1 10000\n1 1 10000\n5 100 200\n",
]  # fmt: skip
KING_OUTPUTS = ["4\n", "6\n", "-1\n", "2\n", "1\n", "-1\n", "1\n", "9\n", "1\n", "1\n", "-1\n"]
# a breadth-first search over the allowed cells (written for this test)
KING_SOLUTION = """import sys
from collections import deque
nums = list(map(int, sys.stdin.read().split()))
x0, y0, x1, y1, n = nums[:5]
free = set()
for k in range(n):
    r, a, b = nums[5 + 3 * k : 8 + 3 * k]
    free.update((r, c) for c in range(a, b + 1))
dist = {(x0, y0): 0}
todo = deque([(x0, y0)])
while todo:
    x, y = todo.popleft()
    for dx in (-1, 0, 1):
        for dy in (-1, 0, 1):
            nxt = (x + dx, y + dy)
            if nxt in free and nxt not in dist:
                dist[nxt] = dist[(x, y)] + 1
                todo.append(nxt)
print(dist.get((x1, y1), -1))
"""


def test_prime_code_sample_scores_as_in_verl():
    truth = {"inputs": KING_INPUTS, "outputs": KING_OUTPUTS}
    assert default_compute_score("codecontests", KING_SOLUTION, json.dumps(truth), reward_cfg=CODE_CFG)["score"] == 1.0
    # verl's failing sample: the 4th expected output changed to -1; 9 of the first 10 cases pass
    wrong = dict(truth, outputs=KING_OUTPUTS[:3] + ["-1\n"] + KING_OUTPUTS[4:])
    out = default_compute_score("codecontests", KING_SOLUTION, json.dumps(wrong), reward_cfg=CODE_CFG)
    assert (out["score"], out["pred"]) == (pytest.approx(0.9), "9/10")
