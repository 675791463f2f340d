"""verifiers environments (PyPI ``verifiers``, used by prime-rl and SkyRL) behind hybridflow's ``reset`` / ``step``.

:class:`VerifiersEnvironment` (registered ``verifiers``) plays one rollout of a verifiers
``Environment`` (a ``SingleTurnEnv``: a dataset and a rubric; a ``MultiTurnEnv``: ``env_response``,
stop conditions and a rubric) with hybridflow's model producing the assistant turns.

verifiers' ``MultiTurnEnv.rollout`` owns its loop and asks a ``verifiers.Client`` for each model turn.
The adapter runs that loop unchanged, with a client of its own (:func:`_bridge_client`): when the
loop asks for a model turn, the client hands the prompt messages back to hybridflow (``reset`` returns
the first prompt, ``step`` the messages the environment added since the model's last turn) and waits
for the next ``step(text)``, whose text becomes the model's response. No OpenAI client, no network;
verifiers' own stop conditions, ``env_response``, ``final_env_response``, timeouts and cleanup run as
they would under ``vf-eval``. When the rollout ends, the rubric scores it (``Rubric.score_rollout``:
the weighted sum of its reward functions) and that score is the step's reward (the trajectory's
reward; earlier steps give None), with the rubric's per-function values in ``info["rubric"]``.

The rollout is a suspended coroutine between steps, which does not pickle: the class is **sticky**
(``picklable = False``), each instance kept in the environment worker that reset it (its one event
loop, :func:`hybridflow.agents.environments.call_maybe_async`); ``close`` cancels a rollout that the
rollout cut (max_turns, length), which runs verifiers' cleanup handlers.

Where the environment comes from (``env_kwargs``): ``env`` — a ``"pkg.mod:name"`` / ``"file.py:name"``
spec of a function returning a verifiers Environment (called with ``env_args``; a user's module, as
verifiers environments are written: ``def load_environment(**kwargs) -> vf.Environment``) or of an
Environment object; or ``env_id`` — ``verifiers.load_environment(env_id, **env_args)``, an environment
package already installed in this Python (``prime env install`` / the Environments Hub download it:
that needs the network, which this project does not have at run time). ``example`` is the row of the
environment's dataset (``split: train``, ``get_dataset()``) or eval dataset (``split: eval``) played.
Group reward functions (a rubric that scores a whole group at once) are refused at ``reset``.
"""

from __future__ import annotations

import asyncio
import json
import time
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from hybridflow.agents.environments import StepResult, register_environment
from hybridflow.agents.loading import AgentLoadError, load_object

VERIFIERS_VERSION = "0.3.1"  # pyproject's envs extra; 0.4.0 requires openai<3 (this venv: openai 3.x)
_ENVS: dict[str, Any] = {}  # (where, env_args) -> the loaded verifiers Environment, one per process


def require_verifiers() -> Any:
    """The ``verifiers`` module at :data:`VERIFIERS_VERSION`; AgentLoadError (one line) otherwise."""
    try:
        found = version("verifiers")
    except PackageNotFoundError:
        raise AgentLoadError(f"the verifiers environment needs the verifiers package; "
                             f"pip install -e '.[envs]' (verifiers=={VERIFIERS_VERSION})") from None  # fmt: skip
    if found != VERIFIERS_VERSION:
        raise AgentLoadError(f"verifiers {found} is installed; the verifiers environment needs {VERIFIERS_VERSION} "
                             f"(pip install verifiers=={VERIFIERS_VERSION})")  # fmt: skip
    import verifiers

    return verifiers


def as_dicts(messages: list[Any]) -> list[dict[str, Any]]:
    """verifiers' pydantic messages (or dicts) → plain chat dicts {"role", "content"[, "tool_calls"...]};
    fields that are None are dropped."""
    out = []
    for m in messages:
        d = m if isinstance(m, dict) else m.model_dump(exclude_none=True)
        out.append({k: v for k, v in d.items() if v is not None})
    return out


def _bridge_client(vf: Any) -> Any:
    """A ``verifiers.Client`` whose model is hybridflow: each ``get_response`` puts (prompt messages,
    future) on ``requests`` and returns the text the future is given, as an assistant Response."""

    class TurnBridge(vf.Client):
        def __init__(self) -> None:
            super().__init__(None)
            self.requests: asyncio.Queue[tuple[list[Any], asyncio.Future[str]]] = asyncio.Queue()

        def setup_client(self, config: Any) -> None:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            return tool

        async def to_native_prompt(self, messages: Any) -> tuple[Any, dict]:
            return messages, {}

        async def get_native_response(self, prompt: Any, model: str, sampling_args: Any, tools: Any = None,
                                      **kwargs: Any) -> str:  # fmt: skip
            answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            await self.requests.put((list(prompt), answer))
            return await answer

        async def raise_from_native_response(self, response: str) -> None:
            return None

        async def from_native_response(self, response: str) -> Any:
            message = vf.ResponseMessage(content=response, finish_reason="stop", is_truncated=False)
            return vf.Response(id=f"hybridflow-{time.time_ns()}", created=int(time.time()), model="hybridflow",
                               message=message)  # fmt: skip

        async def close(self) -> None:
            return None

    return TurnBridge()


@register_environment("verifiers")
class VerifiersEnvironment:
    """One rollout of a verifiers environment (see the module docstring).

    env_kwargs: ``env`` (spec of a loader function or Environment) or ``env_id`` (an installed verifiers
    environment) — exactly one; ``env_args`` (dict, the loader's kwargs); ``example`` (int, default 0: the
    dataset row played); ``split`` ("train" | "eval", default "train"). Info per step: ``turns``; at the
    end ``rubric`` ({reward function: value}) and ``stop_condition``.
    """

    picklable = False  # a suspended rollout coroutine: the instance stays in one worker (sticky)
    preload = ("verifiers",)  # imported by each environment worker at start, off the call clock

    def __init__(self, env: str | None = None, env_id: str | None = None, env_args: dict[str, Any] | None = None,
                 example: int = 0, split: str = "train") -> None:  # fmt: skip
        if (env is None) == (env_id is None):
            raise AgentLoadError(f"env_kwargs: give exactly one of env (a 'pkg.mod:load_environment' spec) or env_id "
                                 f"(an installed verifiers environment); got env={env!r}, env_id={env_id!r}")  # fmt: skip
        if split not in ("train", "eval"):
            raise AgentLoadError(f"env_kwargs.split={split!r}: 'train' (get_dataset) or 'eval' (get_eval_dataset)")
        self.env_spec, self.env_id, self.env_args = env, env_id, dict(env_args or {})
        self.example, self.split = int(example), split
        self.rollout: asyncio.Task | None = None
        self.pending: asyncio.Future[str] | None = None
        self.client: Any = None
        self.prompt_len = 0
        self.turns = 0

    def _environment(self, vf: Any) -> Any:
        where = self.env_spec or f"verifiers:{self.env_id}"
        key = f"{where}|{json.dumps(self.env_args, sort_keys=True, default=str)}"
        if key not in _ENVS:
            if self.env_spec is not None:
                obj = load_object(self.env_spec, "env_kwargs.env")
                built = obj if isinstance(obj, vf.Environment) else obj(**self.env_args)
            else:
                try:
                    built = vf.load_environment(self.env_id, **self.env_args)
                except (ImportError, ValueError) as e:
                    raise AgentLoadError(f"env_kwargs.env_id={self.env_id!r}: {str(e).splitlines()[0]} (verifiers "
                                         "environments install from the Environments Hub, which needs the network; "
                                         "define one in a module and pass env: 'file.py:load_environment')") from e  # fmt: skip
            if not isinstance(built, vf.Environment):
                raise AgentLoadError(f"env_kwargs: {where} gave a {type(built).__name__}, not a verifiers Environment")
            _ENVS[key] = built
        return _ENVS[key]

    def _input(self, environment: Any) -> dict[str, Any]:
        data = environment.get_dataset() if self.split == "train" else environment.get_eval_dataset()
        if not 0 <= self.example < len(data):
            raise AgentLoadError(f"env_kwargs.example={self.example}: the {self.split} dataset has {len(data)} rows")
        return dict(data[self.example])

    async def _play(self, environment: Any, row: dict[str, Any]) -> Any:
        state = await environment.rollout(row, self.client, "hybridflow", {})
        if environment.score_rollouts:
            await environment.rubric.score_rollout(state)
        else:
            await environment.rubric.dummy_score_rollout(state)
        await environment.rubric.cleanup(state)
        return state

    async def _next_turn(self) -> list[Any] | None:
        """The prompt of the rollout's next model turn, or None when the rollout has ended."""
        request = asyncio.ensure_future(self.client.requests.get())
        await asyncio.wait({request, self.rollout}, return_when=asyncio.FIRST_COMPLETED)
        if request.done():
            prompt, self.pending = request.result()
            return prompt
        request.cancel()
        self.rollout.result()  # re-raises what the rollout raised
        return None

    async def reset(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        vf = require_verifiers()
        environment = self._environment(vf)
        if environment.rubric.has_group_rewards:
            raise AgentLoadError(f"env_kwargs: {self.env_spec or self.env_id}'s rubric has group reward functions "
                                 "(scored over a whole group at once); only per-rollout rubrics are supported")  # fmt: skip
        await self.close()
        self.client, self.turns = _bridge_client(vf), 0
        self.rollout = asyncio.ensure_future(self._play(environment, self._input(environment)))
        prompt = await self._next_turn()
        if prompt is None:
            raise AgentLoadError(f"env_kwargs: the verifiers rollout of example {self.example} ended before the "
                                 f"model's first turn ({self.rollout.result().get('stop_condition')})")  # fmt: skip
        self.prompt_len = len(prompt)
        return as_dicts(prompt)

    async def step(self, text: str) -> StepResult:
        if self.pending is None or self.rollout is None:
            raise RuntimeError("step before reset")
        self.turns += 1
        pending, self.pending = self.pending, None
        pending.set_result(text)
        prompt = await self._next_turn()
        if prompt is not None:  # the conversation so far, the model's turn, then the environment's messages
            new, self.prompt_len = prompt[self.prompt_len + 1:], len(prompt)
            return StepResult(as_dicts(new) or None, None, False, {"turns": self.turns})
        state = self.rollout.result()
        final = state.get("final_env_response")
        rubric = {k: float(v) for k, v in (state.get("metrics") or {}).items() if isinstance(v, int | float)}
        info = {"turns": self.turns, "rubric": rubric, "stop_condition": state.get("stop_condition")}
        reward = state.get("reward")
        observation = final if isinstance(final, str) or not final else as_dicts(final)
        return StepResult(observation or None, None if reward is None else float(reward), True, info)

    async def close(self) -> None:
        """Cancel a rollout still waiting for a model turn (its cleanup handlers run)."""
        rollout, self.rollout, self.pending = self.rollout, None, None
        if rollout is not None and not rollout.done():
            rollout.cancel()
            try:
                await rollout
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - a cut trajectory's end is not reported
                pass
