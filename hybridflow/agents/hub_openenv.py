"""OpenEnv environments (PyPI ``openenv-core``) behind hybridflow's one ``reset`` / ``step`` contract.

:class:`OpenEnvEnvironment` (registered ``openenv``) plays one episode of an OpenEnv environment:

- **in-process** (``env_kwargs.env``: a ``"pkg.mod:Class"`` / ``"file.py:Class"`` spec of an
  ``openenv.core.env_server.Environment`` subclass, built with ``env_init_kwargs``): ``reset(seed=)``
  and ``step(action)`` are called on the instance, which travels between steps as a pickle like
  every hybridflow environment (:mod:`hybridflow.agents.remote`).
- **over the network** (``env_kwargs.base_url``, e.g. ``"http://127.0.0.1:8000"``): openenv's own
  ``GenericEnvClient`` talks to a server made by ``openenv.core.env_server.create_app`` through its
  WebSocket session endpoint (``/ws``; the server's plain HTTP ``/reset`` and ``/step`` build a fresh
  environment per request, so they cannot hold an episode). An OpenEnv session lives as long as its
  connection, so such an instance is sticky (``picklable = False``, :mod:`hybridflow.agents.remote`):
  it stays in the environment worker that reset it, holding one open session for the whole episode
  (one server step per turn), closed when the trajectory ends. The server needs one session per
  trajectory running at once.

The model's text becomes the action: ``Action(**{action_field: text})`` with the Action subclass
named by ``action`` (a spec; ``action_field`` defaults to ``"message"``, the text field of openenv's
echo template), or ``action_parser(text)`` (a ``"pkg.mod:fn"`` spec returning an Action or a dict; a ValueError
means an invalid move). A text the Action does not validate (pydantic ``ValidationError``) is an invalid
move: the observation says why, reward ``invalid_action_reward``, the episode goes on (info
``invalid_moves`` 1). The observation sent to the model is ``observation_field`` of OpenEnv's
observation, or — without it — its one field besides ``done`` / ``reward`` / ``metadata``, or
``name: value`` lines when it has several. The step's reward is the observation's ``reward`` (None
stays None); ``done`` ends the trajectory.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from hybridflow.agents.environments import StepResult, register_environment
from hybridflow.agents.hubs import _opening
from hybridflow.agents.loading import AgentLoadError, load_object

OPENENV_VERSION = "0.2.1"  # pyproject's envs extra: 0.2.2+ require gradio, which needs pillow<13 or huggingface-hub<2


def require_openenv() -> None:
    """Raise AgentLoadError (one line) unless openenv-core :data:`OPENENV_VERSION` is installed."""
    try:
        found = version("openenv-core")
    except PackageNotFoundError:
        raise AgentLoadError(f"the openenv environment needs the openenv-core package; "
                             f"pip install -e '.[envs]' (openenv-core=={OPENENV_VERSION})") from None  # fmt: skip
    if found != OPENENV_VERSION:
        raise AgentLoadError(f"openenv-core {found} is installed; the openenv environment needs {OPENENV_VERSION} "
                             f"(pip install openenv-core=={OPENENV_VERSION})")  # fmt: skip


def render_observation(fields: dict[str, Any], observation_field: str | None) -> str:
    """The text of an OpenEnv observation's fields (``done``, ``reward``, ``metadata`` already out):
    ``observation_field``'s value; else the one field's value; else ``name: value`` lines.
    Raises AgentLoadError when ``observation_field`` is not a field."""
    if observation_field is not None:
        if observation_field not in fields:
            raise AgentLoadError(f"env_kwargs.observation_field={observation_field!r}: the observation's fields "
                                 f"are {sorted(fields)}")  # fmt: skip
        return str(fields[observation_field])
    if len(fields) == 1:
        return str(next(iter(fields.values())))
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


@register_environment("openenv")
class OpenEnvEnvironment:
    preload = ("openenv.core",)  # imported by each environment worker at start, off the call clock (~1 s)
    """One episode of an OpenEnv environment (see the module docstring).

    env_kwargs: ``env`` (spec, in-process) or ``base_url`` (server) — exactly one; ``action`` (spec of
    the Action subclass; required in-process, optional with ``base_url``, where without it the dict
    ``{action_field: text}`` is sent unchecked); ``action_field`` (default ``"message"``);
    ``action_parser`` (spec, replaces ``action`` / ``action_field``); ``observation_field``;
    ``env_init_kwargs`` (dict); ``seed`` (int or None: passed to ``reset(seed=)`` when not None);
    ``invalid_action_reward`` (0.0); ``timeout_s`` (30: the WebSocket connect and message timeouts);
    ``system_prompt``, ``instructions`` (as for ``gymnasium``). Info per step: ``invalid_moves``, ``turns``.
    """

    def __init__(self, env: str | None = None, base_url: str | None = None, action: str | None = None,
                 action_field: str = "message", action_parser: str | None = None,
                 observation_field: str | None = None, env_init_kwargs: dict[str, Any] | None = None,
                 seed: int | None = None, invalid_action_reward: float = 0.0, timeout_s: float = 30.0,
                 system_prompt: str | None = None, instructions: str | None = None) -> None:  # fmt: skip
        if (env is None) == (base_url is None):
            raise AgentLoadError(f"env_kwargs: give exactly one of env (a 'pkg.mod:Class' OpenEnv Environment) "
                                 f"or base_url (an OpenEnv server); got env={env!r}, base_url={base_url!r}")  # fmt: skip
        if env is not None and action is None and action_parser is None:
            raise AgentLoadError(f"env_kwargs.action: the Action class of env={env!r} ('pkg.mod:Class'), "
                                 "or an action_parser")  # fmt: skip
        self.env_spec, self.base_url, self.action_spec = env, base_url, action
        self.action_field, self.action_parser, self.observation_field = action_field, action_parser, observation_field
        self.env_init_kwargs = dict(env_init_kwargs or {})
        self.seed = None if seed is None else int(seed)
        self.invalid_action_reward, self.timeout_s = float(invalid_action_reward), float(timeout_s)
        self.system_prompt, self.instructions = system_prompt, instructions
        self.env: Any = None  # the in-process OpenEnv Environment
        self.client: Any = None  # the open session with the server (base_url)
        self.last: dict[str, Any] | None = None  # the last serialised observation
        self.turns = 0
        if base_url is not None:
            self.picklable = False  # a live WebSocket session: the instance stays in one worker (sticky)

    # -- the two transports: each returns OpenEnv's wire form {"observation": {...}, "reward", "done"}

    def _reset_kwargs(self) -> dict[str, Any]:
        return {} if self.seed is None else {"seed": self.seed}

    def _local(self, action: Any | None) -> dict[str, Any]:
        from openenv.core.env_server import serialize_observation

        if action is None:
            self.env = load_object(self.env_spec, "env_kwargs.env")(**self.env_init_kwargs)
            return serialize_observation(self.env.reset(**self._reset_kwargs()))
        return serialize_observation(self.env.step(action))

    def _remote(self, action: dict[str, Any] | None) -> dict[str, Any]:
        """None: open a session and reset (closing a previous one); else one step in the session."""
        if action is None:
            from openenv.core import GenericEnvClient

            self.close()
            client = GenericEnvClient(self.base_url, connect_timeout_s=self.timeout_s, message_timeout_s=self.timeout_s)
            try:
                client.connect()
            except ConnectionError as e:
                raise AgentLoadError(f"env_kwargs.base_url={self.base_url!r}: {str(e).splitlines()[0]}") from e
            self.client = client
            res = client.reset(**self._reset_kwargs())
        else:
            res = self.client.step(action)
        return {"observation": res.observation, "reward": res.reward, "done": res.done}

    def close(self) -> None:
        """Close the server session (called by the environment worker when the trajectory ends)."""
        if self.client is not None:
            client, self.client = self.client, None
            client.close()

    def _action(self, text: str) -> tuple[Any, str | None]:
        """The action for the model's text (an Action in-process, a dict over the network), or
        (None, why it is invalid)."""
        from pydantic import ValidationError

        try:
            if self.action_parser is not None:
                action = load_object(self.action_parser, "env_kwargs.action_parser")(text)
            elif self.action_spec is not None:
                action = load_object(self.action_spec, "env_kwargs.action")(**{self.action_field: text})
            else:
                action = {self.action_field: text}
        except (ValidationError, ValueError) as e:  # ValidationError is a ValueError; named for the reader
            return None, f"invalid action: {str(e).splitlines()[0]}"
        if self.base_url is not None and not isinstance(action, dict):
            action = action.model_dump(exclude_defaults=True)
        return action, None

    def reset(self, row: dict[str, Any]) -> list[dict[str, str]]:
        require_openenv()
        self.turns = 0
        self.last = self._remote(None) if self.base_url is not None else self._local(None)
        text = render_observation(self.last["observation"], self.observation_field)
        return _opening(self.system_prompt, f"{self.instructions}\n{text}" if self.instructions else text)

    def step(self, text: str) -> StepResult:
        if self.last is None:
            raise RuntimeError("step before reset")
        self.turns += 1
        action, why = self._action(text)
        if why is not None:
            return StepResult(why, self.invalid_action_reward, False, {"invalid_moves": 1, "turns": self.turns})
        self.last = self._remote(action) if self.base_url is not None else self._local(action)
        reward = self.last["reward"]
        info = {"invalid_moves": 0, "turns": self.turns}
        observation = render_observation(self.last["observation"], self.observation_field)
        return StepResult(observation, None if reward is None else float(reward), bool(self.last["done"]), info)
