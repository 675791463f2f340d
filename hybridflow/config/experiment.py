"""``ExperimentConfig``: all sections together, and the checks across sections."""

from __future__ import annotations

import importlib
from typing import Any

from pydantic import Field, model_validator

from hybridflow.config.actor import (
    ActorConfig,
)
from hybridflow.config.algorithm import (
    AlgorithmConfig,
)
from hybridflow.config.base import (
    BUILTIN_ADV_ESTIMATORS,
    BUILTIN_POLICY_LOSSES,
    ESTIMATORS_NEEDING_VALUES,
    RENAMED_KEYS,
    _rename_key,
    _Section,
)
from hybridflow.config.critic import (
    CriticConfig,
    ReferenceConfig,
)
from hybridflow.config.data import (
    DataConfig,
)
from hybridflow.config.model import (
    ModelConfig,
)
from hybridflow.config.placement import (
    PlacementConfig,
)
from hybridflow.config.reward import (
    RewardConfig,
)
from hybridflow.config.rollout import (
    RolloutConfig,
)
from hybridflow.config.tracking import (
    TrackingConfig,
)
from hybridflow.config.trainer import (
    TrainerConfig,
)
from hybridflow.precision import run_device_type


class ExperimentConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig, description="Policy model.")
    data: DataConfig = Field(default_factory=DataConfig, description="Datasets.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="Generation.")
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig, description="Advantage and KL.")
    actor: ActorConfig = Field(default_factory=ActorConfig, description="Policy update.")
    critic: CriticConfig = Field(default_factory=CriticConfig, description="Value model update.")
    reference: ReferenceConfig = Field(default_factory=ReferenceConfig, description="Reference model.")
    reward: RewardConfig = Field(default_factory=RewardConfig, description="Rewards.")
    placement: PlacementConfig = Field(default_factory=PlacementConfig, description="Ray pools.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="Loop, checkpoints, resume.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow.")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def trajectories_per_iteration(self) -> int:
        """Trajectories one RL iteration trains on: data.prompts_per_iteration × rollout.samples_per_prompt."""
        return self.data.prompts_per_iteration * self.rollout.samples_per_prompt

    @property
    def trajectories_per_step(self) -> int:
        """Deprecated name of :attr:`trajectories_per_iteration`."""
        return self.trajectories_per_iteration

    @property
    def needs_critic(self) -> bool:
        return self.algorithm.adv_estimator in ESTIMATORS_NEEDING_VALUES

    @property
    def needs_reference(self) -> bool:
        return self.algorithm.use_kl_in_reward or self.actor.use_kl_loss

    @property
    def old_log_probs_from_rollout(self) -> bool:
        """True when old_log_probs are the rollout engine's log-probs (no recompute forward)."""
        if self.actor.old_log_probs == "auto":
            # a correction, or a separate rollout pool (behaviour log-probs), needs the trainer's own;
            # so does bf16-mixed (the trainer's forward runs under autocast, the hf engine's does not),
            # and another engine or dtype (other numbers)
            needs_proximal = self.rollout_correction != "none" or self.uses_rollout_pool or self._mixed
            same_numbers = self.rollout.engine == "hf" and self.rollout_dtype == self._param_dtype
            return same_numbers and not needs_proximal
        return self.actor.old_log_probs == "rollout"

    @property
    def _mixed(self) -> bool:
        """The run trains under bf16-mixed (the driver's decision, else the configured name)."""
        decided = self.model.resolved_precision
        return (decided.name if decided is not None else self.model.precision) == "bf16-mixed"

    # ---- renamed keys --------------------------------------------------------------------------
    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        """Old key names (:data:`RENAMED_KEYS`) still load, with a warning naming the new key."""
        if not isinstance(data, dict):
            return data
        for old, new in RENAMED_KEYS.items():
            data = _rename_key(data, old, new)
        return data

    # ---- cross-field checks --------------------------------------------------------------------
    @model_validator(mode="after")
    def _check(self) -> ExperimentConfig:
        _check_registry_name("algorithm.adv_estimator", self.algorithm.adv_estimator, "advantage", self.trainer.plugins)
        _check_registry_name("actor.policy_loss", self.actor.policy_loss, "policy_loss", self.trainer.plugins)
        n = self.trajectories_per_iteration
        for sec in ("actor", "critic") if self.needs_critic else ("actor",):
            mini = getattr(self, sec).mini_batch_trajectories
            micro = getattr(self, sec).micro_batch_trajectories
            if n % mini:
                raise ValueError(
                    f"{sec}.mini_batch_trajectories={mini} must divide the iteration's trajectories "
                    f"data.prompts_per_iteration × rollout.samples_per_prompt = {n}"
                )
            if mini % micro:
                raise ValueError(f"{sec}.micro_batch_trajectories={micro} must divide {sec}.mini_batch_trajectories={mini}")
        buf = self.algorithm.overlong_buffer
        if buf.enable and buf.buffer_tokens > self.rollout.max_response_tokens:
            raise ValueError(
                f"algorithm.overlong_buffer.buffer_tokens={buf.buffer_tokens} must be <= "
                f"rollout.max_response_tokens={self.rollout.max_response_tokens} (the ramp ends at the maximum length)"
            )
        if self.algorithm.use_kl_in_reward and self.actor.use_kl_loss and not self.algorithm.allow_kl_in_reward_and_loss:
            raise ValueError(
                "algorithm.use_kl_in_reward and actor.use_kl_loss are both on (KL counted twice); "
                "turn one off or set algorithm.allow_kl_in_reward_and_loss=true"
            )
        roles = [r for p in self.placement.pools.values() for r in p.roles]
        for role in set(roles):
            if roles.count(role) > 1:
                raise ValueError(f"placement.pools: role '{role}' is in more than one pool")
        for name, pool in self.placement.pools.items():
            if "evaluator" in pool.roles and pool.roles != ["evaluator"]:
                raise ValueError(f"placement.pools.{name}: role 'evaluator' shares no process (it loads the checkpoint "
                                 f"under evaluation): give it a pool of its own, roles: [evaluator]")
        for role in ("policy", "reward"):
            if role not in roles:
                raise ValueError(f"placement.pools: no pool has role '{role}'")
        if self.needs_critic and "critic" not in roles:
            raise ValueError(
                f"algorithm.adv_estimator={self.algorithm.adv_estimator} needs a critic: add role 'critic' to a pool"
            )
        if self.needs_reference and "reference" not in roles:
            raise ValueError("KL is on (use_kl_in_reward or use_kl_loss): add role 'reference' to a pool")
        self._check_rollout_pool()
        self._check_tools_pool()
        self._check_judge_pool()
        corr = self.actor.rollout_correction
        if corr != "none" and self.actor.old_log_probs == "rollout":
            raise ValueError(
                f"actor.rollout_correction={corr} needs recomputed old_log_probs but actor.old_log_probs=rollout "
                "makes them the rollout log-probs (weight 1 everywhere): set actor.old_log_probs=auto or recompute"
                + (" (or actor.rollout_correction=none)" if corr == "auto" else "")
            )
        if self.actor.behav_weight_cap is not None and corr != "decoupled":
            raise ValueError(
                f"actor.behav_weight_cap is set but actor.rollout_correction={corr}: the cap applies to "
                "rollout_correction=decoupled only"
            )
        if self.model.precision == "fp16-true" and run_device_type(self) == "cpu":
            raise ValueError(f"model.precision=fp16-true (model.dtype: float16) is not supported on CPU "
                             f"(trainer.device={self.trainer.device}, no pool with GPUs): use model.precision: "
                             "fp32, bf16-mixed or auto")
        self.check_resolved()
        return self

    def check_resolved(self) -> None:
        """The checks that depend on the resolved precision (run again by
        :func:`hybridflow.precision.with_resolved_precision` once the driver has decided ``auto``).
        Raises ValueError."""
        self._check_rollout_engine()

    def _check_rollout_engine(self) -> None:
        """The hf engine generates on the trainer's own module, in its dtype or in bfloat16 against
        float32 weights (bfloat16 copies per generate call); what vLLM's CPU build cannot do
        (docs/engines.md): tensor parallelism, float16."""
        bf16_on_fp32 = (self.rollout_dtype, self._param_dtype) == ("bfloat16", "float32")
        if self.rollout.engine == "hf" and self.rollout_dtype != self._param_dtype and not bf16_on_fp32:
            raise ValueError(f"rollout.dtype={self.rollout.dtype} differs from the model's parameters "
                             f"({self._param_dtype}, model.precision={self.model.precision}): the hf engine generates "
                             "in the trainer's dtype, or in bfloat16 against float32 parameters; drop rollout.dtype "
                             "or use rollout.engine=vllm")
        if self.rollout.engine == "vllm" and self.trainer.device == "cpu":
            problem = self.vllm_cpu_problem()
            if problem:
                raise ValueError(problem)

    def vllm_cpu_problem(self) -> str | None:
        """What vLLM's CPU build cannot do with this config (one line), else None: tensor parallelism
        (one process per engine) and float16. Asked by config validation for ``trainer.device=cpu``
        and by the vLLM preflight (flows/preflight_vllm.py) when ``auto`` finds no GPU."""
        if self.rollout.tensor_parallel_size > 1:
            return (f"rollout.tensor_parallel_size={self.rollout.tensor_parallel_size}: vLLM on a CPU runs one "
                    "process per engine; use 1")
        if self.rollout_dtype == "float16":
            return ("rollout.dtype=float16 (or model.precision=fp16-true) with rollout.engine=vllm on a CPU: "
                    "vLLM's CPU build generates in float32 or bfloat16")
        return None

    @property
    def rollout_max_model_len(self) -> int | None:
        """``rollout.max_model_len``, else prompt + response budget (single-turn), else None (the model's
        context: a multi-turn conversation grows by turns and observations)."""
        if self.rollout.max_model_len is not None or self.rollout.is_multi_turn:
            return self.rollout.max_model_len
        return self.data.max_prompt_tokens + self.rollout.max_response_tokens

    @property
    def rollout_dtype(self) -> str:
        """The dtype the rollout engine generates in ("float32" | "bfloat16" | "float16"):
        ``rollout.dtype``; None = the model's parameter dtype; "auto" = "bfloat16" when the resolved
        precision is bf16-mixed or bf16-true, else the parameter dtype."""
        if self.rollout.dtype == "auto":
            from hybridflow.precision import model_precision

            bf16 = model_precision(self.model).name in ("bf16-mixed", "bf16-true")
            return "bfloat16" if bf16 else self._param_dtype
        return self.rollout.dtype or self._param_dtype

    @property
    def rollout_correction(self) -> str:
        """``actor.rollout_correction`` resolved ("none" | "tis" | "decoupled"): "auto" = "tis" when
        :attr:`rollout_dtype` differs from the trainer's parameter dtype, else "none". Every reader
        uses this, never the raw key."""
        corr = self.actor.rollout_correction
        if corr != "auto":
            return corr
        return "tis" if self.rollout_dtype != self._param_dtype else "none"

    @property
    def _param_dtype(self) -> str:
        """The trainer's parameter dtype name (the resolved precision's)."""
        from hybridflow.precision import model_precision

        return model_precision(self.model).param_dtype

    def _check_rollout_pool(self) -> None:
        """Asynchronous training needs the rollout role in a pool of its own (issue 20)."""
        pools = self.placement.pools
        where = next((n for n, p in pools.items() if "rollout" in p.roles), None)
        if where is not None and "policy" in pools[where].roles:
            raise ValueError(
                f"placement.pools.{where}: roles 'rollout' and 'policy' in one pool; the rollout role is a second "
                "copy of the policy for asynchronous training and needs a pool of its own (roles: [rollout]); "
                "drop it to keep the colocated hybrid engine"
            )
        if self.trainer.max_staleness > 0 and where is None:
            raise ValueError(
                f"trainer.max_staleness={self.trainer.max_staleness} needs a rollout pool apart from the policy's: "
                "add e.g. placement.pools.gen: {workers: 1, roles: [rollout]} (examples/grpo_arith_async.yaml)"
            )
        self._check_async_mode(where)

    def _check_async_mode(self, rollout_pool: str | None) -> None:
        """``trainer.async_mode`` against the placement and the rollout settings (issue 38)."""
        t, r = self.trainer, self.rollout
        if t.async_mode == "off" and t.max_staleness > 0:
            raise ValueError(f"trainer.async_mode=off but trainer.max_staleness={t.max_staleness}: the synchronous loop "
                             "trains on the current weights only; set max_staleness=0 or async_mode=ahead|stream")
        if t.async_mode in ("ahead", "stream") and rollout_pool is None:
            raise ValueError(f"trainer.async_mode={t.async_mode} needs a rollout pool apart from the policy's: add e.g. "
                             "placement.pools.gen: {workers: 1, roles: [rollout]} (examples/grpo_arith_stream.yaml)")
        if t.updates_per_sync > 1:
            if rollout_pool is None:
                raise ValueError(f"trainer.updates_per_sync={t.updates_per_sync} needs a rollout pool apart from the "
                                 "policy's (async_mode ahead|stream): the colocated engine always generates with the "
                                 "policy's current weights")
            if t.max_staleness < t.updates_per_sync - 1:
                raise ValueError(
                    f"trainer.updates_per_sync={t.updates_per_sync} lets the rollout pool's weights lag "
                    f"{t.updates_per_sync - 1} version(s) behind the trainer, past trainer.max_staleness={t.max_staleness}: "
                    f"set max_staleness >= {t.updates_per_sync - 1} or a smaller updates_per_sync")
            if self.async_mode == "stream" and t.stream_order == "submission":
                raise ValueError(
                    f"trainer.updates_per_sync={t.updates_per_sync} with trainer.stream_order=submission: the "
                    "submission order's fixed schedule loads every version; use stream_order=completion or "
                    "updates_per_sync=1")
        if self.async_mode != "stream":
            return
        if r.partial not in STREAM_PARTIAL_MODES[r.engine]:
            raise ValueError(
                f"rollout.partial={r.partial}: the {r.engine} engine offers {', '.join(STREAM_PARTIAL_MODES[r.engine])} "
                "(it cannot keep its requests and their KV cache while new weights load): use rollout.partial=abort")
        if r.partial == "pause" and r.engine == "hf" and not r.drop_finished_rows:
            raise ValueError("rollout.partial=pause with rollout.drop_finished_rows=false: the hf engine pauses only in "
                             "its own decode loop (transformers' generate has no place between steps to load weights); "
                             "set drop_finished_rows=true or use partial=abort")
        if r.partial == "pause" and t.stream_order == "submission":
            raise ValueError("rollout.partial=pause with trainer.stream_order=submission: the submission order's fixed "
                             "schedule changes weights only between chunks; use stream_order=completion or partial=abort")
        if r.partial == "pause" and r.engine == "vllm" and self.model.lora_rank > 0:
            raise ValueError(f"rollout.partial=pause with model.lora_rank={self.model.lora_rank}: a vLLM request keeps "
                             "the LoRA adapter it started with, so a paused request would go on with the old adapter; "
                             "use rollout.partial=abort")
        if r.is_multi_turn and r.partial == "pause":
            raise ValueError("rollout.partial=pause with rollout.tools / rollout.environment under "
                             "trainer.async_mode=stream: a multi-turn group takes new weights between turns, never "
                             "inside a model turn; use rollout.partial=abort (between turns) or off (whole group)")
        if r.is_multi_turn and t.stream_order == "submission":
            raise ValueError("trainer.stream_order=submission with rollout.tools / rollout.environment: the "
                             "submission schedule is in chunks of tokens, a multi-turn group is generated whole; "
                             "use trainer.stream_order=completion")

    def publishes_after(self, iteration: int) -> bool:
        """Whether ``iteration``'s policy update is published to the rollout pool: every
        ``trainer.updates_per_sync``-th iteration (verl's ``trigger_parameter_sync_step``), and every
        iteration that writes a checkpoint (``trainer.save_every``, the last), so a resumed run's
        rollout pool starts from weights it had. Always True with ``updates_per_sync`` 1."""
        t = self.trainer
        return (iteration % t.updates_per_sync == 0 or bool(t.save_every and iteration % t.save_every == 0)
                or iteration == t.total_iterations)

    @property
    def async_mode(self) -> str:
        """``trainer.async_mode`` resolved: 'auto' = 'off' with max_staleness 0 and no rollout pool,
        else 'ahead'."""
        if self.trainer.async_mode != "auto":
            return self.trainer.async_mode
        return "ahead" if self.trainer.max_staleness > 0 or self.uses_rollout_pool else "off"

    def _check_tools_pool(self) -> None:
        """The ``tools`` role (multi-turn tool / environment execution, workers/tools.py) runs alone in
        its pool, and only when the rollout is multi-turn."""
        where = next((n for n, p in self.placement.pools.items() if "tools" in p.roles), None)
        if where is None:
            return
        others = [r for r in self.placement.pools[where].roles if r != "tools"]
        if others:
            raise ValueError(
                f"placement.pools.{where}: role 'tools' shares a pool with {', '.join(others)}; "
                "it runs tool calls and environment steps in a pool of its own (roles: [tools]): drop it to run them "
                "in the rollout worker"
            )
        if not self.rollout.is_multi_turn:
            raise ValueError(
                f"placement.pools.{where}: role 'tools' but neither rollout.tools nor rollout.environment is set "
                "(nothing for the tools pool to run): set one, or drop the pool"
            )

    def _check_judge_pool(self) -> None:
        """``reward.judge.enable`` and a pool with role ``judge`` come together (the judge node calls that pool);
        a vLLM judge has that pool to itself."""
        where = next((n for n, p in self.placement.pools.items() if "judge" in p.roles), None)
        if self.reward.judge.enable and where is None:
            raise ValueError("reward.judge.enable=true needs a pool with role 'judge': add e.g. "
                             "placement.pools.judge: {workers: 1, cpus_per_worker: 0.5, roles: [judge]} "
                             "(examples/grpo_arith_judge.yaml)")
        if self.reward.judge.enable and self.async_mode == "stream" and self.algorithm.filter_groups:
            raise ValueError("reward.judge.enable with trainer.async_mode=stream and algorithm.filter_groups: the "
                             "stream drops zero-variance groups by the reward pool's scores alone, before the judge "
                             "scores them; use async_mode=ahead or drop one of them")
        if where is not None and not self.reward.judge.enable:
            raise ValueError(f"placement.pools.{where}: role 'judge' but reward.judge.enable is false (nothing for "
                             "the judge pool to do): set reward.judge.enable=true, or drop the role")
        others = sorted(set(self.placement.pools[where].roles) - {"judge"}) if where is not None else []
        if self.reward.judge.enable and self.reward.judge.engine == "vllm" and others:
            raise ValueError(f"reward.judge.engine=vllm: placement.pools.{where} also holds {others}; a vLLM judge "
                             "is an engine of its own (its KV cache, the vLLM interpreter): give role 'judge' a pool "
                             "of its own")

    @property
    def judge_model(self) -> ModelConfig:
        """The judge's model section: ``model`` with ``path`` = ``reward.judge.path`` (its own tokenizer)
        or, when that is None, the policy's path and tokenizer — the initial policy, loaded apart from
        the trained weights; no LoRA, no gradient checkpointing (the judge is frozen)."""
        judge = self.reward.judge
        own = judge.path is not None
        return self.model.model_copy(update={
            "path": judge.path if own else self.model.path,
            "tokenizer_path": None if own else self.model.tokenizer_path,
            "lora_rank": 0, "gradient_checkpointing": False})

    @property
    def weight_sync_mode(self) -> str:
        """``trainer.weight_sync`` with 'auto' resolved: 'collective' or 'object_store'."""
        if self.trainer.weight_sync != "auto":
            return self.trainer.weight_sync
        policy = next(p for p in self.placement.pools.values() if "policy" in p.roles)
        return "collective" if policy.gpus_per_worker > 0 else "object_store"

    @property
    def uses_rollout_pool(self) -> bool:
        """True when generation runs on a ``rollout`` pool apart from the trainer (asynchronous mode)."""
        return any("rollout" in p.roles for p in self.placement.pools.values())

    # ---- multi-turn rollouts (issue 16) ----
    @model_validator(mode="after")
    def _check_agents(self) -> ExperimentConfig:
        """The multi-turn limits. Importing the tools / environment is not validation: it is
        :func:`hybridflow.agents.checks.check_user_code`, which the CLI and the flows run before
        anything starts (a worker or a task re-validating the config imports no user code)."""
        mt = self.rollout.multi_turn
        if self.rollout.is_multi_turn and mt.max_tokens_per_turn is not None \
                and mt.max_tokens_per_turn > self.rollout.max_response_tokens:
            raise ValueError(
                f"rollout.multi_turn.max_tokens_per_turn={mt.max_tokens_per_turn} is larger than "
                f"rollout.max_response_tokens={self.rollout.max_response_tokens} (the whole trajectory's budget)"
            )
        return self


# rollout.partial modes each engine offers under trainer.async_mode=stream: abort and off on any engine
# (workers/group_stream.py re-prefills through generate); pause where the engine keeps its requests in
# place while weights load (vllm's step loop; hf's own decode loop, workers/rollout/hf_pause.py). Mirrors EngineCapabilities.partial_modes of each engine
# (workers/rollout/capabilities.py; tests/unit/test_rollout_capabilities.py checks they agree).
STREAM_PARTIAL_MODES: dict[str, tuple[str, ...]] = {"hf": ("abort", "pause", "off"), "vllm": ("abort", "pause", "off")}


def _check_registry_name(key: str, name: str, kind: str, plugins: list[str]) -> None:
    builtin = BUILTIN_ADV_ESTIMATORS if kind == "advantage" else BUILTIN_POLICY_LOSSES
    if name in builtin:
        return
    # Not a built-in: the user may have registered it. Import their plugins and the registry.
    for mod in plugins:
        importlib.import_module(mod)
    from hybridflow.algorithms import registry  # imports torch; only on this uncommon path

    known = registry.advantage_estimator_names() if kind == "advantage" else registry.policy_loss_names()
    if name not in known:
        raise ValueError(f"{key}={name!r} is not registered; allowed: {', '.join(sorted(known))}")
