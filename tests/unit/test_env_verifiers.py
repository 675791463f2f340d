"""The verifiers adapter (hybridflow/agents/hub_verifiers.py) on the real verifiers package: small
environments defined in tests/unit/verifiers_fixtures.py (a SingleTurnEnv, a MultiTurnEnv), played
one step at a time with no OpenAI client, in-process and through the environment workers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridflow.agents import AgentLoadError, load_environment, normalise_step
from hybridflow.agents.environments import call_maybe_async
from hybridflow.agents.hub_verifiers import VerifiersEnvironment

FIX = str(Path(__file__).with_name("verifiers_fixtures.py"))


def _reset(**kwargs) -> tuple[VerifiersEnvironment, list[dict]]:
    env = load_environment("verifiers")(**kwargs)
    return env, call_maybe_async(env.reset, {})


def _step(env: VerifiersEnvironment, text: str):
    return normalise_step(call_maybe_async(env.step, text))


def test_a_single_turn_environment_gives_its_prompt_and_the_rubric_scores_the_one_turn():
    env, prompt = _reset(env=f"{FIX}:load_sums", example=1)
    assert prompt == [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 4+4?"}]
    res = _step(env, "It is 8.")
    assert (res.observation, res.reward, res.done) == (None, 1.0, True)
    # the rubric's values; num_turns is verifiers' own monitor metric (weight 0)
    assert res.info == {"turns": 1, "rubric": {"correct": 1.0, "num_turns": 1.0}, "stop_condition": "max_turns_reached"}
    wrong, _ = _reset(env=f"{FIX}:load_sums", example=0)
    assert _step(wrong, "It is 6.").reward == 0.0


def test_a_multi_turn_environment_sends_only_its_new_messages_and_scores_at_the_end():
    env, prompt = _reset(env=f"{FIX}:load_guess")
    assert prompt == [{"role": "user", "content": "Guess a number from 1 to 10."}]
    steps = [_step(env, guess) for guess in ("5", "9", "7")]
    assert [s.observation for s in steps] == [[{"role": "user", "content": "higher"}],
                                              [{"role": "user", "content": "lower"}],
                                              [{"role": "user", "content": "correct"}]]  # final_env_response
    assert [s.done for s in steps] == [False, False, True]
    assert [s.reward for s in steps[:2]] == [None, None]
    # rubric: won (weight 1) + fewer_turns (weight 0.5) = 1 + 0.5 * 1/3
    assert steps[-1].reward == pytest.approx(1.0 + 0.5 / 3)
    assert steps[-1].info["stop_condition"] == "has_final_env_response"
    assert steps[-1].info["rubric"]["won"] == 1.0 and steps[-1].info["turns"] == 3


def test_verifiers_own_stop_condition_ends_the_rollout_and_env_args_reach_the_loader():
    env, _ = _reset(env=f"{FIX}:load_guess", env_args={"max_turns": 2, "target": "3"})
    first, second = _step(env, "5"), _step(env, "6")
    assert first.observation == [{"role": "user", "content": "lower"}] and not first.done
    # max_turns reached: no env_response for the last turn; won 0, fewer_turns 1/2 → 0.5 * 0.5
    assert (second.observation, second.done, second.reward) == (None, True, 0.25)
    assert second.info["stop_condition"] == "max_turns_reached"


def test_close_cancels_a_rollout_cut_short_and_runs_its_cleanup():
    env, _ = _reset(env=f"{FIX}:load_guess")
    _step(env, "1")
    fixtures = sys.modules[type(env._environment(__import__("verifiers"))).__module__]  # the spec's module
    cleaned = len(fixtures.CLEANED)
    call_maybe_async(env.close)
    assert env.rollout is None and len(fixtures.CLEANED) == cleaned + 1


def test_an_installed_environment_module_loads_by_env_id(tmp_path, monkeypatch):
    (tmp_path / "vf_tiny_sums.py").write_text(
        f"import importlib.util\nspec = importlib.util.spec_from_file_location('fx', {FIX!r})\n"
        "fx = importlib.util.module_from_spec(spec); spec.loader.exec_module(fx)\n"
        "def load_environment(**kw):\n    return fx.load_sums(**kw)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env, prompt = _reset(env_id="vf-tiny-sums")  # verifiers maps the id to the module vf_tiny_sums
    assert prompt[-1]["content"] == "What is 2+3?" and _step(env, "5").reward == 1.0
    sys.modules.pop("vf_tiny_sums", None)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "give exactly one of env"),
    ({"env": f"{FIX}:load_sums", "env_id": "x"}, "give exactly one of env"),
    ({"env": f"{FIX}:load_sums", "split": "test"}, "env_kwargs.split='test'"),
])
def test_bad_kwargs_are_one_line_at_construction(kwargs, message):
    with pytest.raises(AgentLoadError, match=message):
        VerifiersEnvironment(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"env": f"{FIX}:load_sums", "example": 2}, "example=2: the train dataset has 2 rows"),
    ({"env": f"{FIX}:load_sums", "split": "eval", "example": 5}, "example=5: the eval dataset has 2 rows"),
    ({"env": f"{FIX}:not_an_environment"}, "gave a dict, not a verifiers Environment"),
    ({"env": f"{FIX}:load_grouped"}, "group reward functions"),
    ({"env_id": "no-such-verifiers-env"}, "needs the network"),
    ({"env": f"{FIX}:no_such_loader"}, "has no attribute 'no_such_loader'"),
])
def test_what_cannot_be_played_fails_its_reset_in_one_line(kwargs, message):
    env = VerifiersEnvironment(**kwargs)
    with pytest.raises((AgentLoadError, ValueError), match=message) as err:
        call_maybe_async(env.reset, {})
    assert "\n" not in str(err.value)


def test_a_missing_or_other_version_of_verifiers_is_one_line(monkeypatch):
    import hybridflow.agents.hub_verifiers as hub

    monkeypatch.setattr(hub, "version", lambda name: "0.4.0")
    with pytest.raises(AgentLoadError, match="verifiers 0.4.0 is installed; the verifiers environment needs 0.3.1"):
        hub.require_verifiers()


def test_the_environment_workers_keep_each_rollout_in_one_process():
    """Through EnvRunner (the crash-proof process pool): sticky, every call of a trajectory pinned."""
    from hybridflow.agents.remote import EnvCall, EnvRunner

    row = {"prompt": [{"role": "user", "content": "q"}], "uid": "u"}
    runner = EnvRunner(num_workers=2, timeout_s=60.0)
    try:
        resets = runner.run([EnvCall.reset("verifiers", {"env": f"{FIX}:load_guess"}, row, key=k) for k in (1, 2)])
        assert all(o.ok and o.result.sticky for o in resets), [o.message for o in resets]
        first = runner.run([EnvCall.step("verifiers", b"", "7", key=1), EnvCall.step("verifiers", b"", "2", key=2)])
        assert [o.result.done for o in first] == [True, False]
        assert first[0].result.reward == pytest.approx(1.5)  # won in one turn: 1 + 0.5 * 1
        (again,) = runner.run([EnvCall.step("verifiers", b"", "7", key=2)])
        assert again.ok and again.result.done and again.result.reward == pytest.approx(1.25)
    finally:
        runner.close()


def test_the_adapter_pins_what_the_envs_extra_installs():
    import tomllib

    from hybridflow.agents.hub_verifiers import VERIFIERS_VERSION

    extra = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert f"verifiers=={VERIFIERS_VERSION}" in extra["envs"]


def test_the_multi_turn_rollout_plays_a_verifiers_environment_to_its_rubric_score():
    """Through MultiTurnRollout (token ids, masks, the environment workers): the row's prompt is replaced by
    the environment's, the model's turns are scripted; won on the second guess: 1 + 0.5 * 1/2."""
    from hybridflow.agents.remote import EnvRunner
    from tests.unit.test_rollout_multi_turn import ScriptedEngine, rollout

    runner = EnvRunner(num_workers=1, timeout_s=60.0)
    try:
        cfg = {"environment": "verifiers", "max_response_tokens": 200, "multi_turn": {"max_turns": 4}}
        extra = [{"env_kwargs": {"env": f"{FIX}:load_guess"}}]
        out = rollout(runner, ScriptedEngine({"Guess a number": ["5", "7"]}), cfg, ["ignored"], extra=extra)
    finally:
        runner.close()
    assert out.non_tensors["env_reward"] == [pytest.approx(1.25)]
    assert out.non_tensors["num_turns"] == [2]
