"""The OpenEnv adapter (hybridflow/agents/hub_openenv.py) on openenv-core itself: an OpenEnv
Environment (tests/unit/openenv_fixtures.py CountUpEnv, built on openenv's Environment / Action /
Observation) played in-process and through openenv's own client against openenv's own server app on
127.0.0.1; the model's text as the Action's field; invalid moves; one-line errors."""

import os
import pickle
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hybridflow.agents import AgentLoadError, load_environment, normalise_step
from hybridflow.agents.hub_openenv import OPENENV_VERSION, OpenEnvEnvironment

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = "tests.unit.openenv_fixtures"
LOCAL = {"env": f"{FIXTURES}:CountUpEnv", "action": f"{FIXTURES}:CountAction"}


def _play(env, texts, pickled=True):
    """Every step's (observation, reward, done, invalid_moves); the instance travels through a
    pickle before each step when ``pickled``, as between environment workers."""
    out = []
    for text in texts:
        if pickled:
            env = pickle.loads(pickle.dumps(env))
        res = normalise_step(env.step(text))
        out.append((res.observation, res.reward, res.done, res.info["invalid_moves"]))
    return out


# CountUpEnv(target=3) from seed 14: start 14 % 10 = 4; 4, 5 → 0.25 each ("next"); 6 → 1.0, done
WON = [("next", 0.25, False, 0), ("next", 0.25, False, 0), ("done counting", 1.0, True, 0)]


def test_an_openenv_environment_is_played_in_process_with_the_text_as_the_actions_field():
    env = OpenEnvEnvironment(**LOCAL, seed=14, system_prompt="Digits only.")
    assert env.reset({}) == [{"role": "system", "content": "Digits only."},
                             {"role": "user", "content": "Count up from 4."}]  # the one field besides done/reward
    steps = _play(env, ["4", " 5 ", "6"])
    assert steps == WON and sum(r for _, r, _, _ in steps) == pytest.approx(0.25 + 0.25 + 1.0)


def test_a_text_the_action_does_not_validate_is_an_invalid_move_and_a_wrong_number_ends_the_episode():
    env = OpenEnvEnvironment(**LOCAL, seed=14, invalid_action_reward=-0.1)
    env.reset({})
    (bad_obs, bad_r, bad_done, bad_n), *rest = _play(env, ["four", "4", "9"])
    assert bad_obs.startswith("invalid action: ") and "CountAction" in bad_obs  # pydantic's first line
    assert (bad_r, bad_done, bad_n) == (-0.1, False, 1)
    assert rest == [("next", 0.25, False, 0), ("wrong: expected 5", -0.5, True, 0)]


def test_several_observation_fields_are_name_value_lines_and_observation_field_picks_one():
    from hybridflow.agents.hub_openenv import render_observation

    assert render_observation({"a": 1, "b": "x"}, None) == "a: 1\nb: x"
    assert render_observation({"a": 1, "b": "x"}, "b") == "x"
    with pytest.raises(AgentLoadError, match=r"observation_field='c'.*\['a', 'b'\]"):
        render_observation({"a": 1, "b": "x"}, "c")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def count_up_server():
    """openenv's create_app serving CountUpEnv under uvicorn on 127.0.0.1 (its own process, stopped
    by its handle); the base URL once /health answers (at most 60 s)."""
    import httpx

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "--factory", f"{FIXTURES}:count_up_app",
                             "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"],
                            cwd=ROOT, env=env)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, f"the OpenEnv server exited with {proc.returncode}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the OpenEnv server did not answer /health in 60 s"
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_server_episode_through_openenvs_client_equals_the_in_process_one(count_up_server):
    remote = OpenEnvEnvironment(base_url=count_up_server, action=f"{FIXTURES}:CountAction", seed=14)
    assert remote.picklable is False  # one live session per episode: a sticky instance
    assert remote.reset({}) == [{"role": "user", "content": "Count up from 4."}]
    assert _play(remote, ["4", "5", "6"], pickled=False) == WON
    remote.close()
    unchecked = OpenEnvEnvironment(base_url=count_up_server, seed=3)  # no action class: the dict is sent as is
    unchecked.reset({})
    assert _play(unchecked, ["3", "5"], pickled=False) == [("next", 0.25, False, 0), ("wrong: expected 4", -0.5, True, 0)]
    unchecked.close()


def test_server_episodes_run_sticky_in_the_environment_workers(count_up_server):
    """Through the crash-proof pool: each trajectory's session lives in the worker that reset it."""
    from hybridflow.agents.remote import EnvCall, EnvRunner

    runner = EnvRunner(num_workers=2, timeout_s=30.0)
    kwargs = {"base_url": count_up_server, "action": f"{FIXTURES}:CountAction", "seed": 14}
    try:
        resets = runner.run([EnvCall.reset("openenv", kwargs, {}, key=k) for k in (0, 1)])
        assert all(o.ok and o.result.sticky for o in resets), [o.message for o in resets]
        for text, want in zip(["4", "5", "6"], WON, strict=True):
            outs = runner.run([EnvCall.step("openenv", b"", text, key=k) for k in (0, 1)])
            assert [(o.result.observation, o.result.reward, o.result.done) for o in outs] == [want[:3]] * 2
    finally:
        runner.close()


def test_a_server_that_does_not_answer_is_one_line_naming_base_url():
    env = OpenEnvEnvironment(base_url=f"http://127.0.0.1:{_free_port()}", timeout_s=2)
    with pytest.raises(AgentLoadError, match=r"env_kwargs.base_url='http://127.0.0.1:\d+': Failed to connect") as e:
        env.reset({})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({}, "give exactly one of env"),
    ({**LOCAL, "base_url": "http://127.0.0.1:1"}, "give exactly one of env"),
    ({"env": f"{FIXTURES}:CountUpEnv"}, "env_kwargs.action"),
    ({**LOCAL, "env": f"{FIXTURES}:NoSuchEnv"}, "has no attribute 'NoSuchEnv'"),
    ({**LOCAL, "env": "no_such_pkg.envs:Env"}, "env_kwargs.env='no_such_pkg.envs:Env'"),
])
def test_an_environment_that_cannot_be_built_is_one_line(kwargs, needle):
    with pytest.raises(AgentLoadError) as e:
        OpenEnvEnvironment(**kwargs).reset({})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_another_openenv_core_version_is_refused_in_one_line(tmp_path, monkeypatch):
    """A distribution of openenv-core 9.9 first on sys.path is the one importlib.metadata reads."""
    dist = tmp_path / "openenv_core-9.9.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: openenv-core\nVersion: 9.9\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(AgentLoadError, match=f"openenv-core 9.9 is installed; .* needs {OPENENV_VERSION}"):
        OpenEnvEnvironment(**LOCAL).reset({})


def test_the_registry_finds_openenv_and_its_rows_have_a_zero_rule_reward():
    from hybridflow.rewards import default_compute_score

    assert load_environment("openenv") is OpenEnvEnvironment
    assert default_compute_score("openenv/CountUp", "4", "", {})["score"] == 0.0
