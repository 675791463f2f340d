"""The environment call kind (hybridflow/agents/remote.py) without Ray: an EnvCall goes in, its
typed EnvResult comes out (reset, then steps on the returned state); an environment that raises,
hangs or kills its process gives an error / timeout / crash EnvOutcome, the worker is replaced and
counted, and the runner serves the next calls."""

from __future__ import annotations

import pickle

import pytest

from hybridflow.agents.remote import ENV_CALLS, EnvCall, EnvOutcome, EnvResult, EnvRunner, env_call

FIX = "tests.unit.agent_fixtures"
TOOLS_KW = {"tools": [f"{FIX}:add", f"{FIX}:hang", f"{FIX}:die"], "tool_format": "hermes"}
ROW = {"prompt": [{"role": "user", "content": "Q"}]}


def tool_call(name: str, **args) -> str:
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


@pytest.fixture(scope="module")
def runner():
    r = EnvRunner(num_workers=2, timeout_s=2.0)
    yield r
    r.close()


def test_the_kind_is_its_own_not_a_reward_row():
    assert ENV_CALLS.child_module == "hybridflow.agents._worker" and ENV_CALLS.name == "environment"


def test_env_call_in_this_process_reset_then_step():
    """The worker-side function on its own: reset builds and pickles the environment, step continues it."""
    reset = env_call(EnvCall.reset(f"{FIX}:GuessEnv", {"target": 3}, ROW))
    assert isinstance(reset, EnvResult) and reset.messages is None
    step = env_call(EnvCall.step(f"{FIX}:GuessEnv", reset.state, "5"))
    assert (step.observation, step.reward, step.done, step.info) == ("lower", -0.1, False, {"guesses": 1})
    assert pickle.loads(step.state).guesses == 1  # the state carries the instance on
    done = env_call(EnvCall.step(f"{FIX}:GuessEnv", step.state, "3"))
    assert (done.observation, done.reward, done.done) == ("correct", 1.0, True)


def test_requests_in_typed_results_out(runner):
    [guess, echo, tools] = runner.run([
        EnvCall.reset(f"{FIX}:GuessEnv", {"target": 2}, ROW),
        EnvCall.reset(f"{FIX}:AsyncEchoEnv", {}, ROW),
        EnvCall.reset("tools", TOOLS_KW, ROW),
    ])  # fmt: skip
    assert all(isinstance(o, EnvOutcome) and o.ok and isinstance(o.result, EnvResult) for o in (guess, echo, tools))
    assert echo.result.messages == [{"role": "user", "content": "echo"}] and tools.result.messages is None
    [g, e, t] = runner.run([
        EnvCall.step(f"{FIX}:GuessEnv", guess.result.state, "2"),
        EnvCall.step(f"{FIX}:AsyncEchoEnv", echo.result.state, "hello"),
        EnvCall.step("tools", tools.result.state, tool_call("add", a=2, b=3)),
    ])  # fmt: skip
    assert (g.result.observation, g.result.reward, g.result.done) == ("correct", 1.0, True)
    assert (e.result.observation, e.result.reward, e.result.done) == ("echo:hell", 0.5, False)
    assert t.result.observation == [{"role": "tool", "name": "add", "content": "5"}]
    assert t.result.info == {"tool_calls": {"add": 1}, "tool_errors": 0, "tool_timeouts": 0}
    assert runner.run([]) == []


def test_raise_hang_and_crash_are_outcomes_counted_and_the_runner_survives(runner):
    [tools] = runner.run([EnvCall.reset("tools", TOOLS_KW, ROW)])
    state = tools.result.state
    before = runner.restarts
    hang, die, bad = runner.run([
        EnvCall.step("tools", state, tool_call("hang", x=1)),
        EnvCall.step("tools", state, tool_call("die", x=1)),
        EnvCall.step("no_such_environment", state, "x"),
    ])  # fmt: skip
    assert (hang.status, hang.result) == ("timeout", None)
    assert hang.message == "still running at the deadline (2 s for the batch); worker killed"
    assert (die.status, die.message) == ("crash", "worker process died (exit code 3)")
    assert bad.status == "error" and bad.message.startswith("raised AgentLoadError: rollout.environment='no_such_environment'")
    assert runner.restarts == before + 2  # the hung and the dead worker; an error keeps its worker
    [again] = runner.run([EnvCall.step("tools", state, tool_call("add", a=1, b=1))])
    assert again.ok and again.result.observation[0]["content"] == "2"


def test_a_malformed_step_is_an_error_outcome(runner):
    [reset] = runner.run([EnvCall.reset(f"{FIX}:GuessEnv", {}, ROW)])
    bad_state = pickle.dumps(object())  # an "environment" without step
    [out] = runner.run([EnvCall.step(f"{FIX}:GuessEnv", bad_state, "1")])
    assert out.status == "error" and "AttributeError" in out.message and reset.ok
