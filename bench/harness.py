"""Running hybridflow iterations from a benchmark: the real train-flow machinery (local Prefect
server, Ray, persistent pools, the iteration subflow on a chosen task runner), one iteration
per call, so a benchmark can time each one and interleave other work between them.

Mirrors ``flows.train.train``'s loop (prompts from the sampler → iteration flow → version
bump) without validation, checkpoints or MLflow, which a timed iteration does not include.
"""

from __future__ import annotations

import os
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import common


@dataclass(frozen=True)
class Settings:
    """One GRPO iteration's shape, shared by hybridflow and TRL in the side-by-side runs."""

    model: str = common.DEMO_MODEL
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    max_response_tokens: int = 64
    mini_batch_trajectories: int = 16
    micro_batch_trajectories: int = 4
    lr: float = 1e-6
    threads: int = 2
    seed: int = 0
    precision: str = "fp32"  # model.precision (auto: the driver's probe decides, as in a run)
    rollout_dtype: str | None = None  # rollout.dtype (None: the config's default, the parameters' dtype)

    @property
    def trajectories(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def overrides(self, run_dir: str, train_file: str, **extra: Any) -> list[str]:
        """Dotted overrides: GRPO, no KL (so no reference), ``precision`` (float32 unless set), one
        policy pool with ``threads`` torch threads, a 0.5-CPU reward pool, prompts in file order."""
        ov: dict[str, Any] = {
            "model.path": self.model,
            "model.precision": self.precision,
            **({"rollout.dtype": self.rollout_dtype} if self.rollout_dtype else {}),
            "data.train_files": f"[{train_file}]",
            "data.prompts_per_iteration": self.prompts_per_step,
            "data.shuffle": "false",
            "rollout.samples_per_prompt": self.samples_per_prompt,
            "rollout.max_response_tokens": self.max_response_tokens,
            "rollout.temperature": 1.0,
            "algorithm.adv_estimator": "grpo",
            "actor.lr": self.lr,
            "actor.mini_batch_trajectories": self.mini_batch_trajectories,
            "actor.micro_batch_trajectories": self.micro_batch_trajectories,
            "critic.mini_batch_trajectories": self.mini_batch_trajectories,
            "critic.micro_batch_trajectories": self.micro_batch_trajectories,
            "placement.pools.main.roles": "[policy]",
            "placement.pools.main.cpus_per_worker": 1,
            "placement.pools.main.torch_threads": self.threads,
            "placement.pools.reward.cpus_per_worker": 0.5,
            "reward.num_workers": 1,
            "trainer.run_dir": run_dir,
            "trainer.total_iterations": 1000,
            "trainer.val_every": 0,
            "trainer.val_before_train": "false",
            "trainer.save_every": 0,
            "trainer.device": "cpu",
            "trainer.seed": self.seed,
            "tracking.mlflow_uri": f"sqlite:///{run_dir}/mlflow.db",
            **extra,
        }
        return [f"{k}={v}" for k, v in ov.items()]


@dataclass
class HybridflowRunner:
    """Brings up Prefect + Ray + pools once; :meth:`iteration` runs the next iteration."""

    settings: Settings
    workdir: str | None = None
    prompts: int = 256
    extra_overrides: dict[str, Any] = field(default_factory=dict)
    ray_system_config: dict[str, Any] | None = None  # e.g. keep idle Ray workers alive (see overhead.py)

    def start(self) -> HybridflowRunner:
        from flows.run_pools import open_pools
        from flows.run_state import open_run
        from flows.runtime import launch_prefect_api
        from hybridflow.config import load_config

        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("PYTHONPATH", str(common.ROOT))
        self._tmp = tempfile.TemporaryDirectory(prefix="hybridflow-bench-", dir=self.workdir)
        d = Path(self._tmp.name)
        train = common.write_arith_file(d / "train.jsonl", self.prompts, seed=self.settings.seed)
        self.cfg = load_config(None, self.settings.overrides(str(d / "runs"), train, **self.extra_overrides))
        import ray

        self._owns_ray = not ray.is_initialized()  # a test session's Ray stays up after stop()
        self.server = launch_prefect_api(d / "prefect").wait_healthy()
        self._client = ExitStack()  # closed by stop()
        try:
            from prefect.context import SyncClientContext

            # one Prefect client for all iterations, as in a training run, where each iteration is a
            # subflow of the train flow run and takes that run's client (here each iteration flow
            # would otherwise be a top-level run opening its own, ~40 ms)
            self._client.enter_context(SyncClientContext())
            self.state = open_run(self.cfg, resume=None)
            self.cfg = self.state.cfg  # with the run's precision decision (model.resolved_precision)
            if self.ray_system_config:
                if not self._owns_ray:
                    raise RuntimeError("Ray is already running: its _system_config cannot be changed")
                init_ray(self.cfg, self.ray_system_config)
            self._pools = ExitStack()  # closed by stop(): the pools go before Ray does
            self._pools.enter_context(open_pools(self.cfg, namespace=self.state.namespace,
                                                             ckpt_root=self.state.dir.checkpoints,
                                                             keep=self.cfg.placement.keep_pools))
            self.state.prepare_validation()
        except BaseException:
            self.stop()  # never leave a Prefect server or Ray behind
            raise
        self.base = self.state.context(0)
        self.it = 0
        return self

    def iteration(self, task_runner: str = "ray") -> dict[str, Any]:
        """Run the next iteration on ``task_runner`` ("ray" | "thread"). Returns {"wall_s",
        "t0", "t1" (epoch seconds), "metrics", "tokens"}: tokens = prompt + response tokens."""
        from flows.iteration import call_iteration, flow_input_values, iteration
        from flows.train import _check_update, _task_runner
        from tasks.common import load_node_output

        self.it += 1
        cfg = self.cfg.model_copy(update={"trainer": self.cfg.trainer.model_copy(update={"task_runner": task_runner})})
        flow = iteration.with_options(task_runner=_task_runner(cfg))
        prompts = self.state.prompts.next_prompts(self.it)
        t0 = time.time()
        inputs = flow_input_values(self.cfg, prompts, self.state.trainer)
        out = call_iteration(flow, self.base.with_iteration(self.it), inputs)
        t1 = time.time()
        _check_update(self.cfg, self.state.trainer, out, self.it)
        batch = load_node_output(out.results["rollout"])
        tokens = int(batch["prompt_mask"].sum() + batch["response_mask"].sum())
        return {"wall_s": t1 - t0, "t0": t0, "t1": t1, "metrics": out.metrics, "tokens": tokens,
                "response_tokens": int(batch["response_mask"].sum())}

    def stop(self) -> None:
        import ray

        try:
            if getattr(self, "_pools", None) is not None:
                self._pools.close()  # open_pools' exit: destroy the pools (unless placement.keep_pools)
            if getattr(self, "_client", None) is not None:
                self._client.close()
            if self._owns_ray and ray.is_initialized():
                ray.shutdown()
        finally:
            self.server.stop()
            self._tmp.cleanup()


def init_ray(cfg: Any, system_config: dict[str, Any]) -> None:
    """Start local Ray as ``flows.runtime.ensure_ray`` does, plus Ray ``_system_config`` knobs."""
    import ray

    env_vars = {k: os.environ[k] for k in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI", "HYBRIDFLOW_CACHE",
                                              "PYTHONPATH") if k in os.environ}
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    needed = sum(p.workers * p.cpus_per_worker for p in cfg.placement.pools.values())
    num_cpus = max(float(os.cpu_count() or 1), needed)
    ray.init(num_cpus=int(-(-num_cpus // 1)), _node_ip_address="127.0.0.1", include_dashboard=False,
             log_to_driver=True, namespace="hybridflow", runtime_env={"env_vars": env_vars},
             _system_config=system_config)


def hybridflow_phases(metrics: dict[str, float], wall: float) -> dict[str, float]:
    """Seconds per phase of one iteration from its node timings (each node's body, pool calls
    and batch load/save included); ``other`` = the rest of the wall time (Prefect dispatch)."""
    phases = {"rollout": metrics.get("timing_s/gen", 0.0), "reward": metrics.get("timing_s/reward", 0.0),
              "advantage": metrics.get("timing_s/adv", 0.0), "update": metrics.get("timing_s/update_actor", 0.0)}
    phases["other"] = max(0.0, wall - sum(phases.values()))
    return phases
