"""Task generators (arith, countdown, gsm8k) and the `hybridflow data` subcommands."""

import json
import subprocess
import sys

import pytest

from flows.cli import main as cli_main
from hybridflow.config import DataConfig, RewardConfig
from hybridflow.data import load_rows
from hybridflow.data.tasks import MAX_DIFFICULTY, gsm8k_rows, make_arith, make_countdown
from hybridflow.data.testing import char_tokenizer
from hybridflow.rewards import default_compute_score
from hybridflow.rewards.countdown import parse_equation

GSM8K_LINES = [
    {"question": "Janet has 3 apples and buys 2. How many?", "answer": "3 + 2 = <<3+2=5>>5\n#### 5"},
    {"question": "A house costs $1,000 more than ...", "answer": "work\n#### 1,000"},
    {"question": "Negative?", "answer": "#### -7"},
]


@pytest.mark.parametrize("difficulty", range(MAX_DIFFICULTY + 1))
def test_arith_rows_are_valid_and_answers_check_out(difficulty):
    rows = make_arith(20, difficulty=difficulty, seed=3)
    for r in rows:
        expr, truth = r["extra_info"]["expression"], r["reward_model"]["ground_truth"]
        value, _ = parse_equation(expr)
        assert str(value) == truth and int(truth) >= 0  # the stored answer is the expression's value
        assert r["data_source"] == "arith" and "\\boxed{}" in r["prompt"][0]["content"]
        assert r["extra_info"]["seed"] == 3 and r["extra_info"]["difficulty"] == difficulty
        # the reference answer in a box scores 1 with the arith reward
        assert default_compute_score("arith", f"\\boxed{{{truth}}}", truth)["score"] == 1.0
    assert len({r["prompt"][0]["content"] for r in rows}) > 10  # not one problem repeated


def test_arith_level_zero_is_single_step_small_operands():
    for r in make_arith(50, difficulty=0, seed=0):
        a, op, b = r["extra_info"]["expression"].split()
        assert op in "+-" and 1 <= int(a) <= 9 and 1 <= int(b) <= 9
        assert r["prompt"][0]["content"] == f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}."


def test_arith_prompts_are_short():
    tok = char_tokenizer()  # one token per character: an upper bound on any subword tokenizer's count
    longest = max(len(r["prompt"][0]["content"]) for d in range(MAX_DIFFICULTY + 1)
                  for r in make_arith(200, difficulty=d, seed=0))  # fmt: skip
    assert longest < 200  # < 200 characters, so well under 100 subword tokens
    assert len(tok("x" * longest)["input_ids"]) == longest


def test_arith_seeded_and_prefix_stable():
    assert make_arith(10, difficulty=2, seed=1) == make_arith(10, difficulty=2, seed=1)
    assert make_arith(5, difficulty=2, seed=1) == make_arith(10, difficulty=2, seed=1)[:5]
    assert make_arith(10, difficulty=2, seed=1) != make_arith(10, difficulty=2, seed=2)
    with pytest.raises(ValueError, match="allowed: 0..6"):
        make_arith(1, difficulty=7, seed=0)


def test_arith_level_six_is_a_three_digit_by_two_digit_product():
    rows = make_arith(50, difficulty=6, seed=0)
    for r in rows:
        a, op, b = r["extra_info"]["expression"].split()
        assert op == "*" and 100 <= int(a) <= 999 and 11 <= int(b) <= 99
        assert r["reward_model"]["ground_truth"] == str(int(a) * int(b))  # e.g. 347 * 28 = 9716
        assert r["prompt"][0]["content"] == f"What is {a} * {b}? Put the final answer in \\boxed{{}}."


def test_countdown_rows_have_a_recorded_solution():
    rows = make_countdown(100, seed=7, min_numbers=3, max_numbers=4)
    for r in rows:
        truth = json.loads(r["reward_model"]["ground_truth"])
        info = r["extra_info"]
        assert 3 <= len(truth["numbers"]) <= 4 and 1 <= truth["target"] <= 100
        assert all(1 <= x <= 99 for x in truth["numbers"])
        assert (info["seed"], info["max_number"], info["target"]) == (7, 99, truth["target"])
        answer = f"<answer>{info['solution']}</answer>"
        assert default_compute_score("countdown", answer, r["reward_model"]["ground_truth"])["score"] == 1.0
        assert "<answer>" in r["prompt"][0]["content"]
    assert make_countdown(5, seed=7) == make_countdown(5, seed=7) != make_countdown(5, seed=8)


def test_gsm8k_rows_from_jsonl(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in GSM8K_LINES))
    rows = gsm8k_rows(str(path), split="test")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["5", "1000", "-7"]  # separators removed
    assert rows[0]["data_source"] == "openai/gsm8k"
    assert rows[0]["prompt"][0]["content"].endswith('output the final answer after "####".')
    assert rows[1]["extra_info"] == {"split": "test", "index": 1, **GSM8K_LINES[1]}
    # the dataset's own answer text scores 1.0 with the strict gsm8k reward
    for r, line in zip(rows, GSM8K_LINES, strict=True):
        gt = r["reward_model"]["ground_truth"]
        assert default_compute_score("openai/gsm8k", line["answer"], gt, reward_cfg=RewardConfig(gsm8k_extraction="strict"))["score"] == 1.0


def test_gsm8k_line_without_final_answer(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(GSM8K_LINES[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl: line 2: answer has no '#### N' line"):
        gsm8k_rows(str(path))


def test_cli_writes_verl_parquet_that_load_rows_reads(tmp_path, capsys):
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in GSM8K_LINES))
    outs = {
        "gsm8k": ["data", "gsm8k", str(src), "--limit", "2", "--out", str(tmp_path / "g.parquet")],
        "arith": ["data", "arith", "--n", "4", "--difficulty", "0", "--seed", "2", "--out", str(tmp_path / "a.parquet")],
        "countdown": ["data", "countdown", "--n", "3", "--seed", "1", "--out", str(tmp_path / "c.jsonl")],
    }
    for argv in outs.values():
        assert cli_main(argv) == 0
    assert [r.ground_truth for r in load_rows([str(tmp_path / "g.parquet")], DataConfig())] == ["5", "1000"]
    arith = load_rows([str(tmp_path / "a.parquet")], DataConfig())
    assert [r.ground_truth for r in arith] == [r["reward_model"]["ground_truth"] for r in make_arith(4, difficulty=0, seed=2)]
    assert arith[0].extra_info["seed"] == 2 and arith[0].prompt[0]["role"] == "user"
    assert len(load_rows([str(tmp_path / "c.jsonl")], DataConfig())) == 3
    assert "wrote 4 arith rows" in capsys.readouterr().out


def test_cli_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert cli_main(["data", "arith", "--difficulty", "9", "--out", str(tmp_path / "a.parquet")]) == 2
    assert cli_main(["data", "arith", "--out", str(tmp_path / "a.csv")]) == 2
    assert cli_main(["data", "gsm8k", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "g.parquet")]) == 2
    err = capsys.readouterr().err
    assert "allowed: 0..6" in err and "must end in .parquet or .jsonl" in err and "missing.jsonl" in err


@pytest.mark.parametrize("module", ["hybridflow.data.cli", "hybridflow.data", "hybridflow.rewards"])
def test_light_imports_do_not_pull_in_torch(module):
    # `hybridflow --help` imports the data CLI; reward workers import hybridflow.rewards on start
    code = f"import sys, {module}; heavy = {{'torch', 'transformers'}} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
