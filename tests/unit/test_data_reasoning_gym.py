"""reasoning-gym as data and reward (issue 39), on the real pinned package: `hybridflow data
reasoning-gym` rows, their parquet round trip, scoring parity with reasoning-gym's own verifiers,
and one-line errors for bad input."""

import functools
import subprocess
import sys

import pytest
import reasoning_gym

from flows.cli import main as cli_main
from hybridflow.config import DataConfig
from hybridflow.data import load_rows
from hybridflow.data.tasks.reasoning_gym import (
    INSTRUCTION,
    PINNED_VERSION,
    ReasoningGymError,
    decode,
    encode,
    make_reasoning_gym,
    parse_overrides,
    require_reasoning_gym,
    rg_seed,
)
from hybridflow.rewards import default_compute_score

# the families the parity test covers: the demo's arithmetic, counting, strings, partial credit
# (prime_factorization pays 0.5 for the right product in another form and raises on non-numbers),
# and ARC grids whose metadata holds tuples (rearc: plain JSON would turn them into lists).
FAMILIES = ["chain_sum", "basic_arithmetic", "leg_counting", "spell_backward", "prime_factorization", "rearc"]
PER_FAMILY = 50


@pytest.fixture(scope="module")
def parity_rows(tmp_path_factory):
    """50 rows of each family through the CLI into parquet and back through the training loader."""
    out = tmp_path_factory.mktemp("rg") / "mix.parquet"
    argv = ["data", "reasoning-gym", "--dataset", ",".join(FAMILIES), "--n", str(PER_FAMILY * len(FAMILIES)),
            "--seed", "7", "--out", str(out)]  # fmt: skip
    assert cli_main(argv) == 0
    return load_rows([str(out)], DataConfig())


def test_rows_interleave_the_datasets_and_carry_what_the_verifier_needs(parity_rows):
    assert len(parity_rows) == PER_FAMILY * len(FAMILIES)
    assert [r.data_source for r in parity_rows[: len(FAMILIES)]] == [f"reasoning_gym/{n}" for n in FAMILIES]
    for i, r in enumerate(parity_rows):
        name = FAMILIES[i % len(FAMILIES)]
        assert r.extra_info["dataset"] == name and r.extra_info["index"] == i // len(FAMILIES)
        assert r.extra_info["reasoning_gym_version"] == PINNED_VERSION
        entry = decode(r.extra_info["entry"])
        assert r.prompt == [{"role": "user", "content": f"{entry['question'].rstrip()}\n\n{INSTRUCTION}"}]
        assert r.ground_truth == entry["answer"]


@functools.cache
def _reference_dataset(name: str):
    return reasoning_gym.create_dataset(name, seed=rg_seed(7, name, "train"), size=PER_FAMILY)


def _reference(name: str, index: int):
    """reasoning-gym's own dataset and entry, generated directly by the package (not from the row)."""
    ds = _reference_dataset(name)
    return ds, ds[index]


def _package_score(ds, answer: str, entry) -> float | None:
    try:
        return ds.score_answer(answer, entry)
    except ValueError:
        return None  # the package's verifier raises on this text


def test_scores_equal_the_package_scorer_after_the_parquet_round_trip(parity_rows):
    partial = raised = 0
    for r in parity_rows:
        name, index = r.extra_info["dataset"], r.extra_info["index"]
        ds, entry = _reference(name, index)
        assert decode(r.extra_info["entry"]) == entry  # the row holds the package's entry, tuples and all
        truth = entry["answer"]
        for answer in (truth, truth + "1", truth[::-1] + " 0", "banana"):
            want = _package_score(ds, answer, entry)
            got = default_compute_score(r.data_source, f"I think <answer> {answer} </answer>", r.ground_truth,
                                        r.extra_info)  # fmt: skip
            if want is None:
                raised += 1
                assert (got["score"], got["verifier_error"]) == (0.0, True), (name, answer)
            else:
                assert got["score"] == want, (name, index, answer, got, want)
                assert got["acc"] == float(want == 1.0) and got["verifier_error"] is False
            partial += 0.0 < got["score"] < 1.0
        assert default_compute_score(r.data_source, f"<answer>{truth}</answer>", r.ground_truth, r.extra_info)["score"] == 1.0
    assert partial > 50 and raised > 0  # partial credit and verifier errors were both exercised


def test_a_response_without_answer_tags_scores_zero_unparsed(parity_rows):
    r = parity_rows[0]
    got = default_compute_score(r.data_source, f"the answer is {r.ground_truth}", r.ground_truth, r.extra_info)
    assert (got["score"], got["parsed"], got["pred"]) == (0.0, False, None)
    # the last tag pair counts, as reasoning-gym's own extract_answer takes the last match
    got = default_compute_score(r.data_source, f"<answer>0</answer> no: <answer>{r.ground_truth}</answer>",
                                r.ground_truth, r.extra_info)  # fmt: skip
    assert got["score"] == 1.0 and got["pred"] == r.ground_truth


def test_boxed_rows_ask_for_a_box_and_their_reward_reads_the_last_box(tmp_path):
    from hybridflow.rewards.extract import parse_number

    out = tmp_path / "boxed.parquet"
    assert cli_main(["data", "reasoning-gym", "--dataset", "chain_sum,prime_factorization", "--n", "6", "--seed", "2",
                     "--answer-format", "boxed", "--out", str(out)]) == 0  # fmt: skip
    rows = load_rows([str(out)], DataConfig())
    assert rows and all(r.prompt[-1]["content"].endswith("\n\nPut the final answer in \\boxed{}.") for r in rows)
    assert {r.extra_info["answer_format"] for r in rows} == {"boxed"}
    for r in rows:
        truth = r.ground_truth
        score = functools.partial(default_compute_score, r.data_source, ground_truth=truth, extra_info=r.extra_info)
        got = score(solution_str=f"so \\boxed{{0}} no, \\boxed{{{truth}}}")
        assert (got["score"], got["boxed"]) == (1.0, True)
        got = score(solution_str=f"<answer>{truth}</answer>")  # tags are not what was asked
        if parse_number(truth) is not None:  # a number: the last number, as the arith reward reads it
            assert (got["score"], got["parsed"], got["boxed"], got["pred"]) == (1.0, True, False, truth)
            assert score(solution_str=f"{truth}, no: 12345.5")["score"] < 1.0  # the last number, not any
        else:  # not a number (a product of primes): no box, no answer
            assert (got["score"], got["parsed"], got["boxed"]) == (0.0, False, False)
    # rows of the default format (no answer_format in extra_info, as older files) still read tags
    tags = make_reasoning_gym(["chain_sum"], 1, seed=2)[0]
    assert tags["extra_info"]["answer_format"] == "tags" and tags["prompt"][-1]["content"].endswith(INSTRUCTION)
    old = {k: v for k, v in tags["extra_info"].items() if k != "answer_format"}
    truth = tags["reward_model"]["ground_truth"]
    assert default_compute_score(tags["data_source"], f"<answer>{truth}</answer>", truth, old)["score"] == 1.0
    with pytest.raises(ValueError, match="answer format 'latex': one of tags, boxed"):
        make_reasoning_gym(["chain_sum"], 1, seed=2, answer_format="latex")


def test_generation_is_seeded_prefix_stable_and_seeds_do_not_shift():
    a = make_reasoning_gym(["chain_sum", "leg_counting"], 40, seed=3)
    assert a == make_reasoning_gym(["chain_sum", "leg_counting"], 40, seed=3)
    assert make_reasoning_gym(["chain_sum", "leg_counting"], 15, seed=3) == a[:15]
    b = make_reasoning_gym(["chain_sum", "leg_counting"], 40, seed=4)
    qa, qb = ({r["prompt"][0]["content"] for r in rows} for rows in (a, b))
    # reasoning-gym draws item i from Random(seed + i): its seeds 3 and 4 share 39 of 40 items;
    # hybridflow's seeds hash apart, so at most a chance collision of small problems remains
    assert len(qa & qb) <= 2


def test_cli_held_out_split_shares_no_question_and_has_the_asked_sizes(tmp_path):
    train, test = tmp_path / "train.parquet", tmp_path / "test.jsonl"
    argv = ["data", "reasoning-gym", "--dataset", "basic_arithmetic", "--config", "max_terms=2",
            "--config", "max_digits=1", "--n", "200", "--seed", "0", "--out", str(train),
            "--test-out", str(test), "--test-n", "60"]  # fmt: skip
    assert cli_main(argv) == 0
    tr, te = load_rows([str(train)], DataConfig()), load_rows([str(test)], DataConfig())
    assert (len(tr), len(te)) == (200, 60)
    # a small space (two one-digit terms): the train split repeats questions, the test split holds none of them
    questions = {r.prompt[0]["content"] for r in tr}
    assert len(questions) < 200 and not questions & {r.prompt[0]["content"] for r in te}
    assert {r.extra_info["split"] for r in te} == {"test"}
    assert all(decode(r.extra_info["config"]) == {"max_terms": 2, "max_digits": 1} for r in [*tr, *te])
    for r in te:  # the test rows score with the same overrides
        assert default_compute_score(r.data_source, f"<answer>{r.ground_truth}</answer>", r.ground_truth,
                                     r.extra_info)["score"] == 1.0  # fmt: skip


def test_config_values_take_the_type_of_the_default():
    got = parse_overrides(["basic_arithmetic", "chain_sum"],
                          ["max_terms=3", "basic_arithmetic.operators=+,-", "chain_sum.allow_negation=True"])
    assert got == {"basic_arithmetic": {"max_terms": 3, "operators": ("+", "-")},
                   "chain_sum": {"max_terms": 3, "allow_negation": True}}  # fmt: skip
    rows = make_reasoning_gym(["basic_arithmetic"], 30, seed=0, overrides={"basic_arithmetic": got["basic_arithmetic"]})
    assert all("*" not in r["extra_info"]["entry"] and "/" not in decode(r["extra_info"]["entry"])["metadata"]["expression"]
               for r in rows)  # fmt: skip


def test_encode_keeps_tuples_and_non_string_keys():
    value = {"grid": ((1, 2), (3, 4)), "by_int": {1: "a", 2: ("b",)}, "__tuple__": [1], "plain": [1.5, None, "x"]}
    assert decode(encode(value)) == value
    with pytest.raises(TypeError):
        encode({"s": {1, 2}})


@pytest.mark.parametrize(("argv", "message"), [
    (["--dataset", "chainsum"], "unknown reasoning-gym dataset 'chainsum' (did you mean 'chain_sum'?)"),
    (["--dataset", "chain_sum", "--config", "max_term=3"], "dataset 'chain_sum' has no config key 'max_term'"),
    (["--dataset", "chain_sum,leg_counting", "--config", "max_terms=3"],
     "dataset 'leg_counting' has no config key 'max_terms'"),
    (["--dataset", "chain_sum", "--config", "spell_backward.min_word_len=3"], "'spell_backward' is not among --dataset"),
    (["--dataset", "chain_sum", "--config", "size=3"], "size is set by --n"),
    (["--dataset", "chain_sum", "--config", "max_terms"], "expected key=value"),
    (["--dataset", "chain_sum", "--config", "min_terms=5", "--config", "max_terms=3"],
     "rejects config {'min_terms': 5, 'max_terms': 3}: max_terms must be >= min_terms"),
    (["--dataset", "rush_hour"], "'rush_hour' has no single oracle answer"),
])  # fmt: skip
def test_bad_input_is_one_line_exit_2_and_writes_nothing(tmp_path, capsys, argv, message):
    out = tmp_path / "x.parquet"
    assert cli_main(["data", "reasoning-gym", *argv, "--n", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not out.exists()


def test_a_missing_or_other_reasoning_gym_version_is_named(monkeypatch):
    import importlib.metadata

    require_reasoning_gym()  # the installed one is the pinned one
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.1.24")
    with pytest.raises(ReasoningGymError, match=r"reasoning-gym 0.1.24 is installed; hybridflow needs 0.1.25"):
        require_reasoning_gym()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ReasoningGymError, match="reasoning-gym is not installed"):
        require_reasoning_gym()


def test_a_row_without_the_entry_is_a_reward_error():
    with pytest.raises(ValueError, match="extra_info.entry"):
        default_compute_score("reasoning_gym/chain_sum", "<answer>3</answer>", "3", {"dataset": "chain_sum"})


def test_the_reward_modules_do_not_import_reasoning_gym():
    # reward workers import hybridflow.rewards on start; `hybridflow --help` the data CLI
    code = ("import sys, hybridflow.rewards, hybridflow.rewards.registry as r, hybridflow.data.cli; r._load_builtins(); "
            "assert 'reasoning_gym' not in sys.modules")  # fmt: skip
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
