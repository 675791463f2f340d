"""load_reward_function: module and file specs, verl / TRL / async detection, clear load errors."""

import textwrap

import pytest

from hybridflow.rewards import RewardLoadError, load_reward_function

USER_REWARDS = '''
import asyncio

def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)

def verl_no_extra(solution_str, ground_truth):
    return {"score": 2.0, "acc": True}

def trl_len(completions, **kwargs):
    return [float(len(c)) for c in completions]

def trl_explicit(prompts, completions, ground_truth):
    return [float(p + c == g) for p, c, g in zip(prompts, completions, ground_truth)]

async def trl_async(prompts, completions, **kwargs):
    await asyncio.sleep(0)
    return [1.0] * len(completions)

async def verl_async(data_source, solution_str, ground_truth, extra_info=None):
    return 0.5

def trl_wrong_length(prompts, completions, **kwargs):
    return [1.0]

def odd(x, y):
    return 0.0

NOT_CALLABLE = 3
'''


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("rewards") / "user_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.mark.parametrize(
    "name, kind",
    [
        ("verl_score", "verl"),
        ("verl_no_extra", "verl"),
        ("trl_len", "batched"),
        ("trl_explicit", "batched"),
        ("trl_async", "batched_async"),
        ("verl_async", "verl_async"),
    ],
)
def test_detects_signature(user_file, name, kind):
    assert load_reward_function(f"{user_file}:{name}").kind == kind


def test_calls_each_kind(user_file):
    f = load_reward_function(f"{user_file}:verl_score")
    assert f.score_row("x", "42", "42", None) == 1.0
    # verl_no_extra declares neither data_source nor extra_info: they are not passed
    assert load_reward_function(f"{user_file}:verl_no_extra").score_row("x", "a", "b", {"k": 1})["score"] == 2.0
    assert load_reward_function(f"{user_file}:verl_async").score_row("x", "a", "b", None) == 0.5
    trl = load_reward_function(f"{user_file}:trl_len")
    assert trl.score_batch(["p", "q"], ["ab", "abc"], ["s", "s"], ["", ""], [None, None]) == [2.0, 3.0]
    exp = load_reward_function(f"{user_file}:trl_explicit")
    assert exp.score_batch(["1"], ["2"], ["s"], ["12"], [None]) == [1.0]  # "1" + "2" == "12"
    assert load_reward_function(f"{user_file}:trl_async").score_batch(["p"], ["c"], ["s"], ["g"], [{}]) == [1.0]


def test_batched_wrong_length_raises(user_file):
    f = load_reward_function(f"{user_file}:trl_wrong_length")
    with pytest.raises(ValueError, match="returned 1 values for 2 completions"):
        f.score_batch(["p", "q"], ["a", "b"], ["s", "s"], ["", ""], [None, None])


def test_module_spec():
    f = load_reward_function("hybridflow.rewards.registry:default_compute_score")
    assert f.kind == "verl"
    assert f.score_row("arith", r"\boxed{4}", "4", None)["score"] == 1.0


@pytest.mark.parametrize(
    "spec, message",
    [
        ("no_colon_here", "expected 'package.module:function'"),
        ("/does/not/exist.py:fn", "does not exist"),
        ("no_such_pkg_xyz.mod:fn", "importing no_such_pkg_xyz.mod failed: ModuleNotFoundError"),
        ("hybridflow.rewards.registry:nope", "has no attribute 'nope'"),
    ],
)
def test_load_errors_name_spec_and_cause(spec, message):
    with pytest.raises(RewardLoadError, match=message) as err:
        load_reward_function(spec)
    assert repr(spec) in str(err.value)


def test_bad_signature_and_not_callable(user_file):
    with pytest.raises(RewardLoadError, match=r"unsupported signature \(x, y\)"):
        load_reward_function(f"{user_file}:odd")
    with pytest.raises(RewardLoadError, match="is a int, not a function"):
        load_reward_function(f"{user_file}:NOT_CALLABLE")


def test_file_that_raises_at_import(tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text(textwrap.dedent("""
        import json
        raise RuntimeError("config missing")
    """))
    with pytest.raises(RewardLoadError, match="RuntimeError: config missing"):
        load_reward_function(f"{bad}:fn")
