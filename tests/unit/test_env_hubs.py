"""The hub adapters (hybridflow/agents/hubs.py): TextArena single-player games and Gymnasium-API
environments behind the one reset/step contract; `hybridflow data textarena` rows; the rule reward
of environment-scored rows; the game metrics of a multi-turn rollout."""

import pickle
import re

import pytest

from hybridflow.agents import AgentLoadError, load_environment, normalise_step
from hybridflow.agents.hubs import GymnasiumEnvironment, TextArenaEnvironment


def _play_guess(env, pickled: bool) -> list:
    """Binary search on GuessTheNumber's hints; every step's result. ``pickled``: the instance
    travels through a pickle before every step, as between environment workers."""
    lo, hi, out = 1, 20, []
    for _ in range(10):
        guess = (lo + hi) // 2
        if pickled:
            env = pickle.loads(pickle.dumps(env))
        res = normalise_step(env.step(f"My guess is [{guess}]."))
        out.append((guess, res.observation, res.reward, res.done, res.info))
        if res.done:
            return out
        if "higher" in res.observation:
            lo = guess + 1
        else:
            assert "lower" in res.observation
            hi = guess - 1
    raise AssertionError(f"binary search did not finish: {out}")


def test_a_textarena_game_is_won_by_binary_search_through_new_messages_only():
    env = TextArenaEnvironment(env_id="GuessTheNumber-v0", seed=7)
    opening = env.reset({})
    assert opening[-1]["role"] == "user" and "Guess The Number" in opening[-1]["content"]
    steps = _play_guess(env, pickled=False)
    *middle, last = steps
    for _, observation, reward, done, info in middle:  # each observation is the new hint alone
        assert re.fullmatch(r"The target number is (higher|lower)\.", observation) and reward is None and not done
        assert info["invalid_moves"] == 0
    assert last[2] == 1.0 and last[3] and last[4]["won"] == 1.0 and last[4]["turns"] == len(steps)


def test_the_same_seed_is_the_same_game_and_a_pickle_between_steps_changes_nothing():
    plain = _play_guess(_reset(TextArenaEnvironment("GuessTheNumber-v0", seed=3)), pickled=False)
    travelled = _play_guess(_reset(TextArenaEnvironment("GuessTheNumber-v0", seed=3)), pickled=True)
    assert plain == travelled
    secrets = {_play_guess(_reset(TextArenaEnvironment("GuessTheNumber-v0", seed=s)), False)[-1][0] for s in range(8)}
    assert len(secrets) > 1  # seeds pick different secret numbers


def _reset(env):
    env.reset({})
    return env


def test_an_invalid_move_is_counted_and_the_second_ends_the_game():
    env = _reset(TextArenaEnvironment("GuessTheNumber-v0", seed=1))
    first = normalise_step(env.step("I do not know"))
    assert not first.done and first.info["invalid_moves"] == 1 and "invalid move" in first.observation.lower()
    second = normalise_step(env.step("still no number"))
    assert second.done and second.info["invalid_moves"] == 1 and second.info["won"] == 0.0
    assert second.reward == 0.0  # no guess was made: TextArena's completion share is 0


def test_a_valid_move_between_two_invalid_ones_keeps_the_game_going_and_each_is_counted():
    env = _reset(TextArenaEnvironment("GuessTheNumber-v0", seed=1))
    moves = [normalise_step(env.step(t)) for t in ("no number", "[1]", "none again", "[2]")]
    assert [m.info["invalid_moves"] for m in moves] == [1, 0, 1, 0] and not any(m.done for m in moves)


def test_a_system_prompt_leads_the_opening():
    opening = TextArenaEnvironment("TowerOfHanoi-v0", seed=0, system_prompt="Be brief.").reset({})
    assert opening[0] == {"role": "system", "content": "Be brief."}
    assert "Tower of Hanoi" in opening[1]["content"] and "A: [3, 2, 1]" in opening[1]["content"]  # prompt and board


@pytest.mark.parametrize(("env_id", "needle"), [
    ("Wordle", "ids of that game: Wordle-v0"),
    ("NoSuchGame-v0", "not a TextArena environment"),
    ("ConnectFour-v0", "only single-player games"),
])
def test_a_game_that_cannot_be_played_is_one_line_naming_the_key(env_id, needle):
    with pytest.raises(AgentLoadError, match="env_kwargs.env_id") as e:
        TextArenaEnvironment(env_id).reset({})
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_registry_finds_the_hub_adapters_by_name():
    assert load_environment("textarena") is TextArenaEnvironment
    assert load_environment("gymnasium") is GymnasiumEnvironment


def test_a_gymnasium_environment_from_a_spec_takes_the_last_integer_as_a_discrete_action():
    env = GymnasiumEnvironment("tests.unit.agent_fixtures:StairsGym", seed=0, make_kwargs={"top": 4},
                               instructions="Climb.")  # fmt: skip
    opening = env.reset({})
    assert opening[0]["content"].startswith("Climb.\nyou stand on step ")
    start = int(re.search(r"step (\d)", opening[0]["content"]).group(1))
    bad = normalise_step(env.step("no idea"))
    assert bad.info["invalid_moves"] == 1 and not bad.done and "from 1 to 3" in bad.observation and bad.reward == 0.0
    out_of_range = normalise_step(env.step("I climb 9"))
    assert out_of_range.info["invalid_moves"] == 1
    pos, results = start, []
    while pos < 4:
        n = min(3, 4 - pos)
        env = pickle.loads(pickle.dumps(env))
        results.append(normalise_step(env.step(f"steps 1 or 2... I climb {n}")))
        pos += n
    assert results[-1].done and results[-1].reward == 1.0 and results[-1].observation == "top reached"
    assert all(not r.done and r.reward == 0.0 for r in results[:-1])


def test_a_gymnasium_registered_id_is_made_with_gymnasium_make():
    env = GymnasiumEnvironment("FrozenLake-v1", seed=0, make_kwargs={"is_slippery": False})
    assert env.reset({})[0]["content"] == "0"  # the start cell
    rewards = [normalise_step(env.step(str(a))) for a in (2, 2, 1, 1, 1, 2)]  # right right down down down right
    assert rewards[-1].done and rewards[-1].reward == 1.0 and not any(r.done for r in rewards[:-1])
    with pytest.raises(AgentLoadError, match="env_kwargs.env_id='NoSuch-v0'"):
        GymnasiumEnvironment("NoSuch-v0").reset({})


def test_textarena_rows_survive_the_parquet_round_trip_and_hold_out_by_seed(tmp_path):
    from hybridflow.data import write_rows
    from hybridflow.data.io import read_records
    from hybridflow.data.tasks.textarena import make_textarena

    rows = make_textarena("GuessTheNumber-v0", 3, seed=2)
    test = make_textarena("GuessTheNumber-v0", 2, seed=2, seed_offset=3)
    write_rows(rows, str(tmp_path / "g.parquet"))
    back = read_records(str(tmp_path / "g.parquet"))
    assert [r["extra_info"]["env_kwargs"] for r in back] == [{"env_id": "GuessTheNumber-v0", "seed": 2_000_000 + i}
                                                              for i in range(3)]  # fmt: skip
    assert {r["extra_info"]["env_kwargs"]["seed"] for r in test}.isdisjoint(r["extra_info"]["env_kwargs"]["seed"] for r in rows)
    assert back[0]["extra_info"]["agent_name"] == "textarena" and back[0]["data_source"] == "textarena/GuessTheNumber-v0"
    env = TextArenaEnvironment(**back[0]["extra_info"]["env_kwargs"])
    assert env.reset({}) == list(back[0]["prompt"])  # the row's prompt is the game's opening


def test_environment_scored_rows_have_a_zero_rule_reward():
    from hybridflow.rewards import default_compute_score

    assert default_compute_score("textarena/GuessTheNumber-v0", "[5]", "", {})["score"] == 0.0
    assert default_compute_score("gymnasium/FrozenLake-v1", "2", "", None)["score"] == 0.0


def test_game_metrics_count_only_the_trajectories_that_report_them():
    from workers.rollout.multi_turn import Trajectory, multi_turn_metrics

    game = [Trajectory([1], "textarena", [], invalid_moves=k, won=w) for k, w in ((0, 1.0), (2, 0.0), (1, 0.0))]
    other = Trajectory([1], "guess", [])
    m = multi_turn_metrics([*game, other])
    assert m["env/invalid_moves/mean"] == pytest.approx(1.0) and m["env/win_rate"] == pytest.approx(1 / 3)
    assert "env/win_rate" not in multi_turn_metrics([other]) and "env/invalid_moves/mean" not in multi_turn_metrics([other])


@pytest.mark.parametrize(("environment", "plugins", "want"), [
    ("textarena", [], ["textarena"]),  # ~5 s of nltk + scipy imports, off the first reset's clock
    ("verifiers", ["my_plugins"], ["my_plugins", "verifiers"]),
    ("openenv", [], ["openenv.core"]),
    ("gymnasium", ["gymnasium"], ["gymnasium"]),  # named once
    ("tools", ["my_plugins"], ["my_plugins"]),  # the built-in tools environment declares nothing
    (None, [], []),
])
def test_environment_workers_import_the_adapters_package_before_the_first_call(environment, plugins, want):
    from hybridflow.agents.remote import worker_preload
    from hybridflow.config import ExperimentConfig

    cfg = ExperimentConfig.model_validate({"rollout": {"environment": environment}, "trainer": {"plugins": plugins}})
    assert worker_preload(cfg) == want


def test_a_preload_package_not_installed_is_left_to_the_adapters_own_error(monkeypatch):
    from hybridflow.agents.remote import worker_preload
    from hybridflow.config import ExperimentConfig

    monkeypatch.setattr(TextArenaEnvironment, "preload", ("textarena", "no_such_package_xyz", "no_such.sub"))
    cfg = ExperimentConfig.model_validate({"rollout": {"environment": "textarena"}})
    assert worker_preload(cfg) == ["textarena"]
