"""The driver's state of one training run: identity, data, sampler, versions, metrics log,
resume from the latest checkpoint, and the end-of-run summary.

Layout of a run directory (any fsspec-style local path here):
    <trainer.run_dir>/<run_id>/
        config.yaml  run.json  metrics.jsonl  execution_log.jsonl  summary.json
        iter_000007/{prompts,rollout,reward,reference,values,advantage}.{safetensors,json}
        updates_policy.jsonl  updates_critic.jsonl   (exactly-once ledgers)
        checkpoints/iter_000010/ ... checkpoints/latest
        prefect-results/   (Prefect result storage: node-level cache)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from flows.run_lock import resolve_run_dir
from hybridflow.agents.render import marked_conversation
from hybridflow.config import ExperimentConfig, dump_config, load_config
from tasks.common import RunContext, load_node_output, result_storage_path
from tasks.types import NodeResult
from workers.pool import namespace_for


class RunState:
    def __init__(self, cfg: ExperimentConfig, run_dir: Path, *, resumed: bool):
        self.cfg = cfg
        self.run_dir = str(run_dir.resolve())
        self.run_id = run_dir.name
        self.resumed = resumed
        self.namespace = namespace_for(self.run_id)
        self.policy_version = 0
        self.critic_version = 0
        self.kl_coef = cfg.algorithm.kl_ctrl.kl_coef
        self.bad_updates_in_a_row = 0
        self.start_iteration = 1
        self.last_iteration = 0
        self.last_checkpoint_iteration = 0
        self.last_val_iteration = -1
        self.mlflow_run_id: str | None = None
        self.info: dict[str, Any] = {}
        self.validations: dict[int, dict[str, float]] = {}
        self.val_prompts: NodeResult | None = None
        self._load_data()

    # ---- identity / persistence ----
    def close(self) -> None:
        """Release the run directory's lock (taken by :func:`open_run`); idempotent."""
        from flows.run_lock import release_run_lock

        if not getattr(self, "_closed", False):
            self._closed = True
            release_run_lock(self.run_dir)

    def bind(self, **info: Any) -> None:
        self.info.update(info)
        self.mlflow_run_id = info.get("mlflow_run_id", self.mlflow_run_id)
        (Path(self.run_dir) / "run.json").write_text(json.dumps({"run_id": self.run_id, **self.info}, indent=2))

    def context(self, iteration: int) -> RunContext:
        return RunContext(self.run_id, self.run_dir, iteration, self.namespace, self.cfg.trainer.seed,
                          self.cfg.model_dump(mode="json"))

    def append_metrics(self, iteration: int, metrics: dict[str, float]) -> None:
        self.last_iteration = iteration
        clean = {k: v for k, v in metrics.items() if isinstance(v, float) and math.isfinite(v)}
        with open(Path(self.run_dir) / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"iteration": iteration, "metrics": clean}) + "\n")

    def metrics_history(self) -> dict[int, dict[str, float]]:
        """Per-iteration metrics (the last record of each iteration wins, e.g. after a resume)."""
        path = Path(self.run_dir) / "metrics.jsonl"
        out: dict[int, dict[str, float]] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                rec = json.loads(line)
                out[rec["iteration"]] = rec["metrics"]
        return out

    def record_validation(self, iteration: int, metrics: dict[str, float]) -> None:
        self.validations[iteration] = metrics
        self.last_val_iteration = iteration
        with open(Path(self.run_dir) / "validation.jsonl", "a") as f:
            f.write(json.dumps({"iteration": iteration, "metrics": metrics}) + "\n")

    def trainer_state(self, iteration: int) -> dict[str, Any]:
        return {
            "iteration": iteration,
            "policy_version": self.policy_version,
            "critic_version": self.critic_version,
            "kl_coef": self.kl_coef,
            "bad_updates_in_a_row": self.bad_updates_in_a_row,
            "sampler": self.sampler.state_dict(),
            "mlflow_run_id": self.mlflow_run_id,
        }

    def restore(self, ckpt_root: str) -> None:
        """Driver state from the checkpoint a resume loads: the latest one that matches its manifest
        (``trainer.resume_fallback``: else the newest intact one, with a warning; the pools' workers
        then restore the same step, which ``latest`` names). Raises CheckpointError."""
        from flows.preflight import check_resume_folder
        from workers.checkpoint import read_trainer_state

        path = check_resume_folder(self.run_dir, self.cfg, warn=_warn)
        if path is None:
            return
        st = read_trainer_state(path)
        self.policy_version = st["policy_version"]
        self.critic_version = st["critic_version"]
        self.kl_coef = st["kl_coef"]
        self.bad_updates_in_a_row = st["bad_updates_in_a_row"]
        self.sampler.load_state_dict(st["sampler"])
        self.mlflow_run_id = st.get("mlflow_run_id")
        self.start_iteration = st["iteration"] + 1
        self.last_iteration = self.last_checkpoint_iteration = st["iteration"]
        for rec in (Path(self.run_dir) / "validation.jsonl").read_text().splitlines() if (
                Path(self.run_dir) / "validation.jsonl").exists() else []:
            r = json.loads(rec)
            self.validations[r["iteration"]] = r["metrics"]

    # ---- data ----
    def _load_data(self) -> None:
        from flows.preflight import load_datasets
        from hybridflow.data import PromptSampler

        cfg = self.cfg
        data = load_datasets(cfg)  # PreflightError naming key, file, row, value
        self.tokenizer, self.train_set, self.val_set = data.tokenizer, data.train_set, data.val_set
        self.data_report, self.data_skip_reasons = data.report, data.skip_reasons
        self.sampler = PromptSampler(len(self.train_set), cfg.data.prompts_per_step, shuffle=cfg.data.shuffle,
                                     seed=cfg.trainer.seed, drop_last=cfg.data.drop_last)

    def _save_prompts(self, iteration: int, node: str, indices: list[int], dataset: Any) -> NodeResult:
        batch = dataset.collate(indices)
        run = self.context(iteration)
        ref = batch.save(run.batch_uri(node), run_id=self.run_id, iteration=iteration, node=node)
        return NodeResult(node=node, ref=ref)

    def next_prompts(self, iteration: int) -> NodeResult | None:
        if self.sampler.epoch >= self.cfg.trainer.total_epochs:
            return None
        indices = self.sampler.next_indices()
        return self._save_prompts(iteration, "prompts", list(indices), self.train_set)

    def flow_inputs(self, prompts: NodeResult) -> dict[str, Any]:
        inputs: dict[str, Any] = {"prompts": prompts, "kl_coef": self.kl_coef, "policy_version": self.policy_version}
        if self.cfg.needs_critic:
            inputs["critic_version"] = self.critic_version
        return inputs

    def prepare_validation(self) -> None:
        if self.val_set is None:
            return
        n = len(self.val_set)
        if self.cfg.data.val_max_prompts:
            n = min(n, self.cfg.data.val_max_prompts)
        self.val_prompts = self._save_prompts(0, "val_prompts", list(range(n)), self.val_set)

    # ---- pools ----
    def bring_up_pools(self) -> None:
        from flows.preflight import check_reward_function
        from flows.runtime import ensure_ray
        from workers.pool import create_pools

        check_reward_function(self.cfg)  # before Ray and the pools: a clear error, not a dead actor
        ensure_ray(self.cfg)
        self.pools = create_pools(self.cfg, namespace=self.namespace, ckpt_root=f"{self.run_dir}/checkpoints")
        self.prepare_validation()

    def tear_down_pools(self) -> None:
        from workers.pool import destroy_pool

        if self.cfg.placement.keep_pools:
            return
        for pool in getattr(self, "pools", {}).values():
            destroy_pool(pool)
        self.pools = {}

    # ---- reporting ----
    def sample_rows(self, results: dict[str, NodeResult], limit: int = 8) -> list[dict[str, Any]]:
        batch = load_node_output(results.get("advantage"))
        if batch is None or "response_ids" not in batch:
            return []
        rows = []
        for i in range(min(limit, len(batch))):
            mask = batch["response_mask"][i]
            text = self.tokenizer.decode(batch["response_ids"][i][mask].tolist(), skip_special_tokens=True)
            if "observation_mask" in batch:  # multi-turn: the whole conversation, tool output marked
                text = marked_conversation(self.tokenizer, batch["response_ids"][i], mask, batch["observation_mask"][i])
            rows.append({
                "prompt": batch["raw_prompt"][i] if "raw_prompt" in batch else "",
                "response": text,
                "ground_truth": str(batch["ground_truth"][i]) if "ground_truth" in batch else "",
                "score": float(batch["token_level_scores"][i].sum()),
            })
        return rows

    def progress_line(self, it: int, m: dict[str, float]) -> str:
        return (f"[iter {it}/{self.cfg.trainer.total_iterations}] score={m.get('critic/score/mean', float('nan')):.3f} "
                f"len={m.get('response_length/mean', float('nan')):.1f} pg_loss={m.get('actor/pg_loss', float('nan')):.4f} "
                f"step={m.get('timing_s/step', float('nan')):.1f}s")

    def summary(self) -> dict[str, Any]:
        hist = self.metrics_history()
        scores = [hist[i].get("critic/score/mean") for i in sorted(hist)]
        scores = [s for s in scores if s is not None]
        val_keys = lambda m: {k: v for k, v in m.items() if k.startswith("val-core/")}  # noqa: E731
        vals = sorted(self.validations)
        from workers.checkpoint import load_latest

        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "iterations": self.last_iteration,
            "checkpoint": load_latest(f"{self.run_dir}/checkpoints"),
            "reward_first": scores[0] if scores else None,
            "reward_last": scores[-1] if scores else None,
            "val_before": val_keys(self.validations[vals[0]]) if vals else {},
            "val_after": val_keys(self.validations[vals[-1]]) if vals else {},
            **self.info,
            "finished_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        }


def _warn(line: str) -> None:
    try:
        from prefect import get_run_logger

        get_run_logger().warning(line)
    except Exception:  # noqa: BLE001 - outside a flow run: stderr
        import sys

        print(line, file=sys.stderr)


def open_run(cfg: ExperimentConfig, *, resume: str | None, flow_run_id: str | None = None) -> RunState:
    """Create a new run directory, or reopen one to resume (``resume`` = its path, or "auto").

    The run takes the folder's lock (:mod:`flows.run_lock`; re-entrant, so the CLI that already
    holds it can run the flow); :meth:`RunState.close` releases it.
    ``flow_run_id``: the Prefect flow run that opens the run (recorded in run.json as
    ``prefect_flow_run_id``). When ``trainer.run_id`` names a run directory whose run.json was
    written by this same flow run, the flow run is being retried (the Prefect UI's Retry, or its
    state set back to Scheduled through the API) and the directory is resumed like ``resume``.
    Raises FileExistsError when the directory holds another run (a fresh run needs a new
    ``trainer.run_id``; continuing it is ``resume``), FileNotFoundError when ``resume`` is not a
    run directory, RunLockedError when a live run holds the folder.
    """
    from flows.run_lock import acquire_run_lock, release_run_lock

    run_dir, reopen = resolve_run_dir(cfg, resume)
    if not reopen:
        from flows.preflight import check_run_dir

        check_run_dir(cfg)
    acquire_run_lock(run_dir)
    try:
        if reopen or (flow_run_id and _recorded_flow_run(run_dir) == flow_run_id):
            return _reopen(cfg, run_dir)  # resume, or a retry of the flow run that created it
        if (run_dir / "run.json").exists():
            raise FileExistsError(f"run directory {run_dir} exists; resume it with --resume {run_dir}")
        return _create(cfg, run_dir)
    except BaseException:
        release_run_lock(run_dir)
        raise


def _create(cfg: ExperimentConfig, run_dir: Path) -> RunState:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    result_storage_path(str(run_dir)).mkdir(parents=True, exist_ok=True)
    state = RunState(cfg, run_dir, resumed=False)
    state.bind()
    return state


def _recorded_flow_run(run_dir: Path) -> str | None:
    """The Prefect flow run id that run.json records (None when absent or unreadable)."""
    try:
        return json.loads((run_dir / "run.json").read_text()).get("prefect_flow_run_id") or None
    except (OSError, ValueError, AttributeError):
        return None


def _reopen(cfg: ExperimentConfig, target: Path) -> RunState:
    """Resume ``target`` from its latest checkpoint with its saved config; ``cfg`` may only
    extend it (a larger trainer.total_iterations)."""
    saved = load_config(target / "config.yaml")
    # the saved run defines the experiment; the caller may extend it (e.g. more iterations)
    merged = saved.model_copy(update={"trainer": saved.trainer.model_copy(
        update={"total_iterations": max(cfg.trainer.total_iterations, saved.trainer.total_iterations)})})
    state = RunState(merged, target, resumed=True)
    info = json.loads((target / "run.json").read_text())
    state.info = {k: v for k, v in info.items() if k != "run_id"}
    state.mlflow_run_id = info.get("mlflow_run_id")
    state.restore(f"{state.run_dir}/checkpoints")
    return state
