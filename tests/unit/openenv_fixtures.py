"""OpenEnv fixtures (tests.unit.openenv_fixtures:...): an environment built on openenv-core's own
Environment / Action / Observation classes, and its ``create_app`` server factory. Apart from
agent_fixtures.py because importing openenv-core takes about a second (fastmcp), which every
environment worker loading agent_fixtures' tools would otherwise pay on its first call."""

from __future__ import annotations

from pydantic import Field


def _openenv():
    import openenv.core.env_server as openenv_server

    return openenv_server


class CountAction(_openenv().Action):
    """Say a number (an OpenEnv Action): the text must be digits."""

    message: str = Field(pattern=r"^\s*\d+\s*$", description="the number, as digits")


class CountObservation(_openenv().Observation):
    """What CountUpEnv says (an OpenEnv Observation; reward and done are the base class's fields)."""

    prompt: str = Field(default="", description="what the environment says")


class CountUpEnv(_openenv().Environment):
    """An OpenEnv environment: count up from a seeded start by saying the next number, ``target`` turns
    in a row. Each right number: reward 0.25 and the next prompt; the ``target``-th: reward 1, done; a
    wrong number: reward -0.5, done. The start is ``seed % 10`` (0 without a seed)."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self, target: int = 3) -> None:
        super().__init__()
        self.target, self.next, self.said = target, 0, 0
        self._state = _openenv().State(step_count=0)

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.next, self.said = (seed or 0) % 10, 0
        self._state = _openenv().State(episode_id=episode_id, step_count=0)
        return CountObservation(prompt=f"Count up from {self.next}.", reward=None, done=False)

    def step(self, action, timeout_s=None, **kwargs):
        self._state.step_count += 1
        if int(action.message) != self.next:
            return CountObservation(prompt=f"wrong: expected {self.next}", reward=-0.5, done=True)
        self.next, self.said = self.next + 1, self.said + 1
        if self.said == self.target:
            return CountObservation(prompt="done counting", reward=1.0, done=True)
        return CountObservation(prompt="next", reward=0.25, done=False)

    @property
    def state(self):
        return self._state


def count_up_app():
    """CountUpEnv served by openenv's own ``create_app`` (``uvicorn --factory``), two sessions at a time."""
    return _openenv().create_app(CountUpEnv, CountAction, CountObservation, max_concurrent_envs=2)
