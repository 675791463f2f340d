"""The multi-turn rollout loop: tools and environments, token in, token out (docs/agents.md).

A trajectory is one batch row. ``response_ids`` holds everything after the conversation's start:
the model's turns *and* the observations between them; ``response_mask`` is True only on the
model's tokens (which keep the engine's log-probs), ``observation_mask`` on the inserted ones. Each round generates the next turn of every live trajectory in one engine call (rows at
different turns share it; finished ones leave), then steps their environments in the process
pool (:class:`hybridflow.agents.remote.EnvRunner`, or the ``tools`` pool: :mod:`workers.tools`) and
appends the rendered observations as ids.
Nothing already in a trajectory is decoded and re-tokenized.

Engines declaring ``continuing_kv`` (hf: ``generate_continuing``) keep each trajectory's KV cache
between turns and prefill only the new tokens (``rollout.multi_turn.kv_cache``); any other
engine (vllm) gets the whole sequence as a token-id prompt each turn through its own
``generate`` (vLLM's prefix cache then reuses what it can).

Limits (``rollout.multi_turn``): ``max_turns`` assistant turns; ``max_tokens_per_turn`` ends a
turn (the template's end-of-turn tokens are appended as non-model tokens) and the environment
still steps; ``max_observation_tokens`` (cut in the middle); the whole response within
``rollout.max_response_tokens``. Every tool / environment output is first cut to a byte budget
(:func:`hybridflow.agents.caps.observation_byte_budget`) in the process that made it, before it is
templated, tokenized, stored or logged; the stored conversation holds the text the model saw
(:func:`~hybridflow.agents.render.fit_observation`); cut observations count in ``tool/truncated``. Finish reasons: stop (the model answered without a tool call,
tools form), env_done (the environment said done), max_turns, length (the budget ran out),
env_error (the environment's reset/step raised, hung or crashed; a failing *tool* is only an
error observation).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from hybridflow.agents.caps import TRUNCATION_MARKER, observation_byte_budget
from hybridflow.agents.checks import TOOLS_ENVIRONMENT, environment_spec
from hybridflow.agents.remote import EnvCall, EnvOutcome
from hybridflow.agents.render import ChatRenderer, fit_observation
from hybridflow.batch import is_padding
from workers.progress import Tick
from workers.rollout.base import RolloutOutput, SamplingParams, left_pad, right_pad
from workers.rollout.capabilities import engine_capabilities
from workers.rollout.multi_turn_metrics import merge_prompt_metrics, multi_turn_metrics


@dataclass
class Trajectory:
    """One conversation in progress. ids/mask/logp: the response so far (mask True = model token)."""

    prompt: list[int]
    env: str
    messages: list[dict[str, Any]]
    extra_info: dict[str, Any] | None = None
    state: bytes | None = None  # the environment instance, pickled by an environment worker
    key: int | None = None  # the trajectory's id in the environment pool (a sticky instance's, EnvCall.key)
    sticky: bool = False  # the instance stays in one environment worker (picklable = False)
    env_open: bool = False  # a sticky instance the worker still holds (closed at the end of the rollout)
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per token: the weights version of the turn that made it
    turns: int = 0
    finish: str | None = None
    reward: float | None = None
    observation_tokens: int = 0
    turn_tail: list[int] = field(default_factory=list)  # end-of-turn ids the model did not write
    kv: Any = None  # the engine's KV cache of this trajectory's first tokens (hf engine, multi_turn.kv_cache)
    tool_calls: Counter[str] = field(default_factory=Counter)
    tool_errors: int = 0
    tool_timeouts: int = 0
    parse_errors: int = 0
    truncated: int = 0  # observations cut (bytes in the worker, or tokens here)
    invalid_moves: int | None = None  # a game's invalid moves (info "invalid_moves"), None when never reported
    won: float | None = None  # a game's outcome (info "won": 1 win, 0 not), None when never reported

    def append(self, ids: list[int], model: bool, logp: list[float] | None = None, version: int | None = None) -> None:
        """Add ``ids`` (model tokens or not); ``version``: the weights version that sampled them (None:
        the last turn's, for an observation; 0 before any)."""
        self.ids += ids
        self.mask += [model] * len(ids)
        self.logp += logp if logp is not None else [0.0] * len(ids)
        if version is None:
            version = self.versions[-1] if self.versions else 0
        self.versions += [version] * len(ids)


@dataclass
class MultiTurnOutput(RolloutOutput):
    """RolloutOutput plus what a multi-turn rollout adds: prompt_ids/prompt_mask (the conversation
    starts, which an environment's reset may change), observation_mask [B, R], per-row non-tensors
    (env_reward, num_turns, messages, and raw_prompt / extra_info with ``extra_info["messages"]``,
    the conversation the reward functions see), metrics, and token_versions (the weights version of
    each token's turn, as ``before_turn`` reported it; the streaming rollout's
    ``rollout_token_versions``)."""

    prompt_ids: Tensor | None = None
    prompt_mask: Tensor | None = None
    observation_mask: Tensor | None = None
    token_versions: Tensor | None = None  # [B, R] int64: each response token's turn's weights version (not in tensors())
    prompt_metrics: list[dict[str, float]] | None = None  # per prompt, generate(per_prompt_metrics=True)
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def tensors(self) -> dict[str, Tensor]:
        """The response tensors plus prompt_ids, prompt_mask (the conversation starts) and observation_mask."""
        extra = {"prompt_ids": self.prompt_ids, "prompt_mask": self.prompt_mask, "observation_mask": self.observation_mask}
        return {**super().tensors(), **{k: v for k, v in extra.items() if v is not None}}


class MultiTurnRollout:
    """Drives ``engine`` through multi-turn conversations.

    engine: a RolloutEngine; tokenizer: with a chat template; rollout_cfg: the RolloutConfig;
    runner: an EnvRunner (the process pool executing reset/step: ``run(list[EnvCall]) -> list[EnvOutcome]``).
    """

    def __init__(self, engine: Any, tokenizer: Any, rollout_cfg: Any, runner: Any) -> None:
        from hybridflow.agents.tools import load_tools

        self.engine, self.tokenizer, self.cfg, self.runner = engine, tokenizer, rollout_cfg, runner
        self.mt = rollout_cfg.multi_turn
        self.renderer = ChatRenderer(tokenizer)
        self.pad_id = int(tokenizer.pad_token_id)
        self.default_env = environment_spec(rollout_cfg)
        tools = load_tools(rollout_cfg.tools) if rollout_cfg.tools else {}
        self.tool_schemas = [t.schema for t in tools.values()]
        self.tool_names = list(tools)
        self.output_bytes = observation_byte_budget(self.mt.max_observation_tokens)
        self.per_turn = self.mt.max_tokens_per_turn or rollout_cfg.max_response_tokens
        self.continue_kv = self.mt.kv_cache and engine_capabilities(engine).continuing_kv
        # trajectory keys: consecutive (so key % ranks and the workers of a rank take turns), from a random
        # base (several rollout ranks share one tools pool)
        self._keys = itertools.count(random.SystemRandom().getrandbits(40) << 20)

    @classmethod
    def from_config(cls, engine: Any, tokenizer: Any, cfg: Any, namespace: str | None = None) -> MultiTurnRollout:
        """For an ExperimentConfig: the tools pool executes reset/step when a pool has the ``tools``
        role (:class:`workers.tools.PoolEnvRunner`, looked up in the Ray ``namespace``: the run's;
        None: the job's), else an in-process EnvRunner of ``rollout.multi_turn.num_workers`` processes."""
        from hybridflow.agents.remote import EnvRunner, worker_preload
        from workers.tools import PoolEnvRunner, tools_pool_name

        mt, pool = cfg.rollout.multi_turn, tools_pool_name(cfg)
        runner = PoolEnvRunner(pool, namespace) if pool else EnvRunner(mt.num_workers, mt.tool_timeout_s, worker_preload(cfg))
        return cls(engine, tokenizer, cfg.rollout, runner)

    # ---- the loop ------------------------------------------------------------------------------
    def generate(self, batch: Any, sampling: SamplingParams, progress: Tick | None = None,
                 before_turn: Callable[[int], int] | None = None, per_prompt_metrics: bool = False) -> MultiTurnOutput:
        """Batch of B prompts (prompt_ids/prompt_mask + raw_chat, extra_info, ... non-tensors) →
        B*n trajectories, prompt-major. ``sampling.max_new_tokens`` is the whole response budget.
        progress: called with (trajectories finished, B*n) after every round of turns.

        before_turn: called with the number of live trajectories before every round's engine call,
        between the environments' steps and the next model turn (the streaming rollout loads newer weights there,
        :mod:`workers.group_stream`); returns the weights version the turn is generated with, which
        its tokens record (``token_versions``; without it every token records 0). When the version
        changes, the trajectories' kept KV caches (``multi_turn.kv_cache``) are dropped, so the
        conversation so far is prefilled again under the new weights; the environments are not
        touched. A model turn is never interrupted. per_prompt_metrics: the metrics are computed per
        prompt (its n trajectories) into ``prompt_metrics``, without a collective (a thread that is
        not the rank's main one; :func:`merge_prompt_metrics` joins them), and ``metrics`` is empty."""
        trajs = self._start(batch, sampling.n)
        seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
        round_, version = 0, None
        while live := [t for t in trajs if t.finish is None]:
            now = before_turn(len(live)) if before_turn is not None else 0
            if version is not None and now != version:
                for t in live:
                    t.kv = None  # computed under the old weights
            version = now
            self._generate_turn(live, dataclasses.replace(sampling, n=1, seed=seed + 7919 * round_),
                                sampling.max_new_tokens, version)  # fmt: skip
            stepping = [t for t in live if t.finish is None]
            outcomes = self.runner.run([EnvCall.step(t.env, t.state, t.messages[-1]["content"], self.output_bytes,
                                                     key=t.key if t.sticky else None) for t in stepping])
            for t, outcome in zip(stepping, outcomes, strict=True):
                self._after_step(t, outcome, sampling.max_new_tokens)
            round_ += 1
            if progress is not None:
                progress(sum(t.finish is not None for t in trajs), len(trajs))
        self._close_sticky(trajs)
        if per_prompt_metrics:
            out = self._output(trajs, counted=False, reduce=False)
            out.metrics = {}
            out.prompt_metrics = [multi_turn_metrics(trajs[i:i + sampling.n], self.tool_names, reduce=False)
                                  for i in range(0, len(trajs), sampling.n)]
            return out
        return self._output(trajs, counted=not (hasattr(batch, "meta") and is_padding(batch)))

    def _close_sticky(self, trajs: list[Trajectory]) -> None:
        """Drop the sticky instances the workers still hold (trajectories the rollout ended: max_turns,
        length); a close that fails changes nothing of the trajectory."""
        open_ = [t for t in trajs if t.env_open]
        self.runner.run([EnvCall.close(t.env, t.key) for t in open_])
        for t in open_:
            t.env_open = False

    def _start(self, batch: Any, n: int) -> list[Trajectory]:
        """One Trajectory per (prompt, sample); the environments' reset runs here."""
        trajs, rows = [], []
        for i in range(len(batch)):
            row = {k: batch[k][i] for k in ("uid", "data_source", "ground_truth", "extra_info") if k in batch}
            row["prompt"] = batch["raw_chat"][i] if "raw_chat" in batch else None
            named = batch["agent_name"][i] if "agent_name" in batch else None  # verl's column, when a loader keeps it
            env = named or (row.get("extra_info") or {}).get("agent_name") or self.default_env
            prompt = batch["prompt_ids"][i][batch["prompt_mask"][i].bool()].tolist()
            for _ in range(n):
                trajs.append(Trajectory(prompt, env, list(row["prompt"] or []), row.get("extra_info"),
                                        key=next(self._keys)))
                rows.append(row)
        outcomes = self.runner.run([self._reset_request(t, r) for t, r in zip(trajs, rows, strict=True)])
        for t, outcome in zip(trajs, outcomes, strict=True):
            if outcome.result is None:
                t.finish = "env_error"
                continue
            t.state = outcome.result.state
            t.sticky = t.env_open = outcome.result.sticky
            t.truncated += outcome.result.truncated > 0
            if outcome.result.messages is not None:
                t.messages = list(outcome.result.messages)
                t.prompt = self.renderer.prompt_ids(t.messages)
            elif t.messages and (self.mt.system_prompt or self._schemas_for(t)):
                t.messages = _with_system(t.messages, self.mt.system_prompt)
                t.prompt = self._prompt_with_tools(t.messages, self._schemas_for(t))
        return trajs

    def _schemas_for(self, t: Trajectory) -> list[dict[str, Any]]:
        """The tool schemas the prompt shows: hermes-format tools only (python blocks need none)."""
        hermes = t.env == TOOLS_ENVIRONMENT and self.mt.tool_format == "hermes"
        return self.tool_schemas if hermes else []

    def _prompt_with_tools(self, messages: list[dict[str, Any]], schemas: list[dict[str, Any]]) -> list[int]:
        """The prompt with the tool schemas: through the template's ``tools=`` when it takes them,
        else as a system message written by the tool format."""
        if schemas and self.renderer.supports_tools:
            return self.renderer.prompt_ids(messages, tools=schemas)
        if schemas:
            from hybridflow.agents.formats import get_tool_format

            messages = _with_system(messages, get_tool_format(self.mt.tool_format).system_prompt(schemas))
        return self.renderer.prompt_ids(messages)

    def _generate_turn(self, live: list[Trajectory], sampling: SamplingParams, budget: int, version: int = 0) -> None:
        """One engine call for the next turn of every live trajectory; appends the model tokens
        (sampled under weights ``version``)."""
        caps = [min(self.per_turn, budget - len(t.ids)) for t in live]
        sampling = dataclasses.replace(sampling, max_new_tokens=max(caps))
        if self.continue_kv:
            out, kvs = self.engine.generate_continuing([t.prompt + t.ids for t in live], [t.kv for t in live], sampling)
        else:
            out, kvs = self.engine.generate(*self._left_padded(live), sampling), [None] * len(live)
        for r, (t, cap) in enumerate(zip(live, caps, strict=True)):
            m = out.response_mask[r]
            new = out.response_ids[r][m].tolist()[:cap]
            stopped = out.finish_reason[r] == "stop" and int(m.sum()) <= cap
            t.append(new, True, out.rollout_log_probs[r][m].tolist()[:cap], version)
            t.turns += 1
            t.kv = None if kvs[r] is None else kvs[r].truncated(len(t.prompt) + len(t.ids))
            t.messages.append({"role": "assistant", "content": self.tokenizer.decode(new, skip_special_tokens=True)})
            eot = self.renderer.end_of_turn_ids
            t.turn_tail = eot[1:] if stopped and new[-1:] == eot[:1] else eot  # closes the turn if it goes on
            if len(t.ids) >= budget:
                t.finish = "length"

    def _left_padded(self, live: list[Trajectory]) -> tuple[Tensor, Tensor]:
        return left_pad([t.prompt + t.ids for t in live], self.pad_id)

    def _after_step(self, t: Trajectory, outcome: EnvOutcome, budget: int) -> None:
        """Record the step's result; end the trajectory or append the observation's tokens."""
        observation: Any = None
        if (res := outcome.result) is not None:
            t.state = res.state
            t.env_open = t.sticky and not res.done  # a sticky instance is dropped by its worker at done
            if res.reward is not None:
                t.reward = (t.reward or 0.0) + res.reward
            self._count(t, res.info)
            if res.done:
                t.finish = "stop" if t.env == TOOLS_ENVIRONMENT else "env_done"
                return
            observation = res.observation
        elif t.env == TOOLS_ENVIRONMENT:  # a tool hung or killed its process: the model hears of it
            t.tool_timeouts += outcome.status == "timeout"
            t.tool_errors += outcome.status != "timeout"
            failed = f"error: the tool call failed ({outcome.message})"
            observation = [{"role": "tool", "name": "error", "content": failed}]
        else:
            t.finish = "env_error"
            return
        if t.turns >= self.mt.max_turns:
            t.finish = "max_turns"
            return
        messages = [{"role": "user", "content": observation}] if isinstance(observation, str) else observation or []
        messages, obs_ids, cut = fit_observation(self.renderer, messages, self.mt.max_observation_tokens,
                                                 TRUNCATION_MARKER)  # fmt: skip
        t.truncated += int(cut or (res is not None and res.truncated > 0))
        if len(t.ids) + len(t.turn_tail) + len(obs_ids) >= budget:  # no room left for another model token
            t.finish = "length"
            return
        t.messages += messages
        t.observation_tokens += len(obs_ids)
        t.append([*t.turn_tail, *obs_ids], False)

    @staticmethod
    def _count(t: Trajectory, info: dict[str, Any]) -> None:
        t.tool_calls.update(info.get("tool_calls", {}))
        t.tool_errors += int(info.get("tool_errors", 0))
        t.tool_timeouts += int(info.get("tool_timeouts", 0))  # a tool's own limit (the python sandbox's)
        t.parse_errors += int(info.get("parse_errors", 0))
        if "invalid_moves" in info:  # games (the textarena and gymnasium adapters; any environment may report them)
            t.invalid_moves = (t.invalid_moves or 0) + int(info["invalid_moves"])
        if "won" in info:
            t.won = float(info["won"])

    # ---- requests to the environment pool ------------------------------------------------------
    def _reset_request(self, t: Trajectory, row: dict[str, Any]) -> EnvCall:
        if t.env == TOOLS_ENVIRONMENT:
            kwargs = {"tools": list(self.cfg.tools), "tool_format": self.mt.tool_format,
                      "python_timeout_s": max(0.5, 0.75 * self.mt.tool_timeout_s),
                      "sandbox_walls": self.mt.sandbox_walls, "sandbox_disk_mb": self.mt.sandbox_disk_mb}  # fmt: skip
        else:
            kwargs = dict((row.get("extra_info") or {}).get("env_kwargs", {}))
        return EnvCall.reset(t.env, kwargs, row, self.output_bytes, key=t.key)

    # ---- output --------------------------------------------------------------------------------
    def _output(self, trajs: list[Trajectory], counted: bool = True, reduce: bool = True) -> MultiTurnOutput:
        """``counted`` False for a data-parallel padding stand-in: its trajectories join the
        metrics' all-reduce with nothing (workers/dispatch.py); ``reduce`` False: no all-reduce."""
        width = max(1, max(len(t.ids) for t in trajs))
        rows = [torch.tensor([t.ids], dtype=torch.int64).reshape(1, -1) for t in trajs]
        ids = right_pad(rows, self.pad_id, width)
        mask = right_pad([torch.tensor([t.mask], dtype=torch.bool).reshape(1, -1) for t in trajs], False, width)
        real = right_pad([torch.ones((1, len(t.ids)), dtype=torch.bool) for t in trajs], False, width)
        logp = right_pad([torch.tensor([t.logp], dtype=torch.float32).reshape(1, -1) for t in trajs], 0.0, width)
        vers = right_pad([torch.tensor([t.versions], dtype=torch.int64).reshape(1, -1) for t in trajs], 0, width)
        p_ids, p_mask = left_pad([t.prompt for t in trajs], self.pad_id)
        non_tensors = {
            "env_reward": [t.reward for t in trajs],
            "num_turns": [t.turns for t in trajs],
            "messages": [t.messages for t in trajs],
            "raw_prompt": [self.tokenizer.decode(t.prompt) for t in trajs],
            "extra_info": [{**(t.extra_info or {}), "messages": t.messages} for t in trajs],
        }
        return MultiTurnOutput(
            ids, mask, logp, [t.finish or "length" for t in trajs], prompt_ids=p_ids, prompt_mask=p_mask,
            observation_mask=real & ~mask, token_versions=vers, non_tensors=non_tensors,
            metrics=multi_turn_metrics(trajs if counted else [], self.tool_names, reduce=reduce),
        )  # fmt: skip


def _with_system(messages: list[dict[str, Any]], text: str | None) -> list[dict[str, Any]]:
    """``messages`` with ``text`` as (the end of) the leading system message."""
    if not text:
        return list(messages)
    if messages and messages[0].get("role") == "system":
        return [{"role": "system", "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


__all__ = ["MultiTurnRollout", "MultiTurnOutput", "Trajectory", "multi_turn_metrics", "merge_prompt_metrics",
           "TRUNCATION_MARKER"]
