"""Environments from other hubs behind hybridflow's one ``reset`` / ``step`` contract.

- :class:`TextArenaEnvironment` (registered ``textarena``): a single-player game of TextArena
  (PyPI ``textarena``, e.g. ``GuessTheNumber-v0``, ``TowerOfHanoi-v0``, ``Mastermind-v0``).
  The game runs without TextArena's observation wrappers (they resend the whole history every
  turn); each turn's observation is only what the game said since the model's last move — the
  opening prompt and board first, then game messages, boards and invalid-move notices (the
  model's own move is already in the conversation). The reward is the game's: TextArena's
  ``close()`` reward of player 0, given once when the game ends (GuessTheNumber: 1 for a win,
  otherwise how close the last guess was; two invalid moves in a row end a game). Word games that
  fetch NLTK corpora at ``reset`` (Wordle, Hangman...) cannot run offline.
- :class:`GymnasiumEnvironment` (registered ``gymnasium``): any environment with Gymnasium's API
  (``reset(seed=) -> (obs, info)``, ``step(action) -> (obs, reward, terminated, truncated, info)``),
  made by id (``gymnasium.make``) or from a ``"pkg.mod:Class"`` / ``"file.py:Class"`` spec. The
  model's text is the action for a ``Text`` action space; for ``Discrete(n, start)`` the last
  integer in the text (a turn without one is an invalid move: observation says so, reward
  ``invalid_action_reward``, and the episode goes on). Observations are sent as ``str(obs)``
  unless they are already text.

Both are seeded per row (``env_kwargs["seed"]``; every sample of a GRPO group plays the same game),
and both pickle between steps as every hybridflow environment must (:mod:`hybridflow.agents.remote`).
The source packages are imported only when an environment is built, never at import time.
"""

from __future__ import annotations

import re
from typing import Any

from hybridflow.agents.environments import StepResult, register_environment
from hybridflow.agents.loading import AgentLoadError, is_spec, load_object

TEXTARENA_VERSION = "0.7.4"  # the version the adapter and its tests were written against (pyproject's envs extra)
_SHOWN_TYPES = ("PROMPT", "GAME_BOARD", "GAME_MESSAGE", "GAME_ACTION_DESCRIPTION", "GAME_ADMIN")


def _import_textarena() -> Any:
    try:
        import textarena
    except ImportError as e:
        raise AgentLoadError(f"the textarena environment needs the textarena package ({e}); "
                             f"pip install -e '.[envs]' (textarena=={TEXTARENA_VERSION})") from e  # fmt: skip
    return textarena


def make_textarena_game(env_id: str) -> Any:
    """The unwrapped single-player TextArena game ``env_id`` (a registered id such as
    ``GuessTheNumber-v0``; a ``-train`` / ``-raw`` suffix is accepted). Raises AgentLoadError for
    an unknown id (naming close ids) or a missing package."""
    ta = _import_textarena()
    registry = ta.envs.registration.ENV_REGISTRY
    base = re.sub(r"-(train|raw)$", "", env_id)
    if base not in registry:
        close = sorted(k for k in registry if k.split("-")[0].lower() == base.split("-")[0].lower())[:6]
        raise AgentLoadError(f"env_kwargs.env_id={env_id!r}: not a TextArena environment"
                             + (f"; ids of that game: {', '.join(close)}" if close else ""))  # fmt: skip
    try:
        env = ta.make(f"{base}-raw" if f"{base}-raw" in registry else base)
    except Exception as e:  # noqa: BLE001 - e.g. a game module that needs a newer Python (Chess: 3.12 f-strings)
        raise AgentLoadError(f"env_kwargs.env_id={env_id!r}: TextArena could not build it: "
                             f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e  # fmt: skip
    while isinstance(env, ta.Wrapper):
        env = env.env
    return env


def _kind(kind: Any) -> str:
    return getattr(kind, "name", str(kind))


def _opening(system_prompt: str | None, text: str) -> list[dict[str, str]]:
    """The conversation an adapter's ``reset`` starts: an optional system message, then ``text`` as the user's."""
    return ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user", "content": text}]


def _render(messages: list[tuple[int, str, Any]]) -> str:
    """A TextArena player's new messages as one text: what the game said (not the player's own move)."""
    return "\n".join(m.strip() for _, m, kind in messages if _kind(kind) in _SHOWN_TYPES and m.strip())


@register_environment("textarena")
class TextArenaEnvironment:
    preload = ("textarena",)  # imported by each environment worker at start, off the call clock (~5 s: nltk, scipy)
    """A single-player TextArena game (see the module docstring).

    env_kwargs: ``env_id`` (required, e.g. ``"GuessTheNumber-v0"``), ``seed`` (int; the game's
    secret and layout; default 0), ``system_prompt`` (str, optional: a system message before the
    game's opening prompt). ``reset`` returns the conversation (the row's prompt is replaced by the
    game's opening); ``step`` returns the game's new messages, the reward at the end, and info
    ``invalid_moves`` (this turn's: 0 or 1), ``won`` (1.0 on the winning move, else 0.0: a game cut
    by ``max_turns`` counts as not won), ``turns``.
    """

    def __init__(self, env_id: str, seed: int = 0, system_prompt: str | None = None) -> None:
        if not isinstance(env_id, str) or not env_id:
            raise AgentLoadError(f"env_kwargs.env_id={env_id!r}: a TextArena id such as 'GuessTheNumber-v0'")
        self.env_id, self.seed, self.system_prompt = env_id, int(seed), system_prompt
        self.game: Any = None
        self.turns = 0

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.game = make_textarena_game(self.env_id)
        try:
            self.game.reset(num_players=1, seed=self.seed)
        except Exception as e:  # noqa: BLE001 - two-player games refuse one player (an assertion or ValueError)
            raise AgentLoadError(f"env_kwargs.env_id={self.env_id!r}: reset for one player failed ({type(e).__name__}: "
                                 f"{e}); only single-player games are played") from e  # fmt: skip
        self.turns = 0
        return _opening(self.system_prompt, _render(self.game.get_observation()[1]))

    def step(self, text: str) -> StepResult:
        if self.game is None:
            raise RuntimeError("step before reset")
        self.turns += 1
        state = self.game.state
        errors_before = getattr(state, "error_count", 0)
        done, _ = self.game.step(text)
        ended_invalid = done and bool((getattr(state, "game_info", None) or {}).get(0, {}).get("invalid_move"))
        invalid = int(getattr(state, "error_count", 0) > errors_before or ended_invalid)
        observation = _render(self.game.get_observation()[1])
        if not done:
            return StepResult(observation or None, None, False, {"invalid_moves": invalid, "turns": self.turns, "won": 0.0})
        rewards, game_info = self.game.close()
        reward = float(rewards[0]) if rewards else 0.0
        info = {"invalid_moves": invalid, "turns": self.turns, "won": float(reward >= 1.0)}
        reason = (game_info or {}).get(0, {}).get("reason")
        return StepResult(reason or observation or None, reward, True, info)


def _last_int(text: str) -> int | None:
    found = re.findall(r"-?\d+", text)
    return int(found[-1]) if found else None


@register_environment("gymnasium")
class GymnasiumEnvironment:
    preload = ("gymnasium",)  # imported by each environment worker at start, off the call clock
    """An environment with Gymnasium's API (see the module docstring).

    env_kwargs: ``env_id`` (a ``gymnasium.make`` id, or a ``"pkg.mod:Class"`` / ``"file.py:Class"``
    spec built with ``make_kwargs``), ``seed`` (int, default 0), ``make_kwargs`` (dict),
    ``invalid_action_reward`` (float, default 0.0), ``system_prompt`` (str, optional),
    ``instructions`` (str, optional: put before the first observation). A terminated or truncated
    episode is done; the step's reward is Gymnasium's.
    """

    def __init__(self, env_id: str, seed: int = 0, make_kwargs: dict[str, Any] | None = None,
                 invalid_action_reward: float = 0.0, system_prompt: str | None = None,
                 instructions: str | None = None) -> None:  # fmt: skip
        if not isinstance(env_id, str) or not env_id:
            raise AgentLoadError(f"env_kwargs.env_id={env_id!r}: a gymnasium id or a 'pkg.mod:Class' spec")
        self.env_id, self.seed, self.make_kwargs = env_id, int(seed), dict(make_kwargs or {})
        self.invalid_action_reward = float(invalid_action_reward)
        self.system_prompt, self.instructions = system_prompt, instructions
        self.env: Any = None

    def _make(self) -> Any:
        try:
            import gymnasium
        except ImportError as e:
            raise AgentLoadError(f"the gymnasium environment needs the gymnasium package ({e}); pip install -e '.[envs]'") from e
        if is_spec(self.env_id):
            return load_object(self.env_id, "env_kwargs.env_id")(**self.make_kwargs)
        try:
            return gymnasium.make(self.env_id, **self.make_kwargs)
        except gymnasium.error.Error as e:
            raise AgentLoadError(f"env_kwargs.env_id={self.env_id!r}: {e}") from e

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        self.env = self._make()
        obs, _ = self.env.reset(seed=self.seed)
        return _opening(self.system_prompt, f"{self.instructions}\n{obs}" if self.instructions else str(obs))

    def _action(self, text: str) -> tuple[Any, str | None]:
        """The Gymnasium action for the model's text, or (None, why it is invalid)."""
        from gymnasium import spaces

        space = self.env.action_space
        if isinstance(space, spaces.Discrete):
            value = _last_int(text)
            lo, hi = int(space.start), int(space.start + space.n - 1)
            if value is None or not lo <= value <= hi:
                return None, f"invalid action: answer with one integer from {lo} to {hi}"
            return value, None
        if isinstance(space, spaces.Text):
            return text, None if space.contains(text) else f"invalid action: the text is not in {space}"
        raise AgentLoadError(f"env_kwargs.env_id={self.env_id!r}: action space {space} is not Text or Discrete")

    def step(self, text: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("step before reset")
        action, why = self._action(text)
        if why is not None:
            return StepResult(why, self.invalid_action_reward, False, {"invalid_moves": 1})
        obs, reward, terminated, truncated, _ = self.env.step(action)
        done = bool(terminated or truncated)
        return StepResult(str(obs), float(reward), done, {"invalid_moves": 0, "truncated": int(bool(truncated))})
