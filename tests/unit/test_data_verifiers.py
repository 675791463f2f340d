"""`hybridflow data verifiers` (hybridflow/data/tasks/verifiers_rows.py): one row per example of a verifiers
environment (tests/unit/verifiers_fixtures.py), its prompt the environment's own opening, played back by the
verifiers adapter to the rubric's score."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridflow.agents import load_environment, normalise_step
from hybridflow.agents.environments import call_maybe_async
from hybridflow.data.tasks.verifiers_rows import make_verifiers, verifiers_name

FIX = str(Path(__file__).with_name("verifiers_fixtures.py"))


def test_each_row_is_one_example_with_its_opening_and_plays_back_to_the_rubric_score():
    rows = make_verifiers(f"{FIX}:load_sums", n=2)
    assert [r["prompt"][-1]["content"] for r in rows] == ["What is 2+3?", "What is 4+4?"]
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Answer with a number."}
    assert {r["data_source"] for r in rows} == {"verifiers/verifiers_fixtures"}
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["verifiers_fixtures train example 0",
                                                                 "verifiers_fixtures train example 1"]
    kwargs = rows[1]["extra_info"]["env_kwargs"]
    assert kwargs == {"env": f"{Path(FIX).resolve()}:load_sums", "example": 1}
    assert rows[1]["extra_info"]["agent_name"] == "verifiers"
    env = load_environment("verifiers")(**kwargs)  # the row, as the environment workers play it
    assert call_maybe_async(env.reset, {}) == rows[1]["prompt"]
    assert normalise_step(call_maybe_async(env.step, "8")).reward == 1.0


def test_a_relative_file_spec_is_written_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(Path(FIX).parent)
    rows = make_verifiers("verifiers_fixtures.py:load_guess", env_args={"target": "3"}, n=1)
    assert rows[0]["extra_info"]["env_kwargs"] == {"env": f"{Path(FIX).resolve()}:load_guess",
                                                   "env_args": {"target": "3"}, "example": 0}


@pytest.mark.parametrize(("n", "start", "message"), [(0, 0, "at least one example"),
                                                      (2, 1, "examples 1..2 asked, the train dataset has 2 rows")])
def test_a_range_outside_the_dataset_is_refused(n, start, message):
    with pytest.raises(ValueError, match=message):
        make_verifiers(f"{FIX}:load_sums", n=n, start=start)


def test_names():
    assert verifiers_name(None, "wordle") == "wordle"
    assert verifiers_name("/a/b/my_env.py:load_environment", None) == "my_env"
    assert verifiers_name("pkg.envs.math:load", None) == "math"


def test_the_command_writes_train_and_held_out_rows_and_refuses_bad_env_args(tmp_path, capsys):
    from flows.cli import build_parser
    from hybridflow.data.cli import run
    from hybridflow.data.io import read_records

    def cli(*argv: str) -> int:
        return run(build_parser().parse_args(["data", "verifiers", *argv]))

    out, test = str(tmp_path / "train.jsonl"), str(tmp_path / "test.jsonl")
    assert cli("--env", f"{FIX}:load_sums", "--n", "1", "--out", out, "--test-out", test, "--test-n", "1") == 0
    # load_sums has no eval dataset: the held-out example is the train one after --out's
    assert [r["extra_info"]["env_kwargs"]["example"] for r in read_records(test)] == [1]
    assert [r["prompt"][-1]["content"] for r in read_records(out)] == ["What is 2+3?"]
    assert cli("--env", f"{FIX}:load_sums", "--env-args", "[1]", "--out", out) == 2
    assert "--env-args '[1]': a JSON object" in capsys.readouterr().err
    assert cli("--env", f"{FIX}:nowhere", "--out", out) == 2
    assert "has no attribute 'nowhere'" in capsys.readouterr().err
