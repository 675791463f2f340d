"""The driver's side of one training run: its folder, data, prompt feed and trainer state,
resume from the latest checkpoint, and the end-of-run summary.

The parts live apart: the folder's layout and files in :mod:`flows.run_dir` (``RunDir``), what a
checkpoint holds for the driver in :mod:`flows.trainer_state` (``TrainerState``), the prompts of
each iteration in :mod:`flows.feeds` (``PromptFeed``), the pools' lifetime in :mod:`flows.run_pools`. :func:`open_run` creates or reopens a run and returns the
:class:`RunSession` that ties them together for the train flow.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from flows.feeds import PromptFeed, save_prompts
from flows.resume import resolve_run_dir, where_it_started
from flows.run_dir import RunDir
from flows.trainer_state import TrainerState
from hybridflow import __version__
from hybridflow.agents.render import marked_conversation
from hybridflow.config import ExperimentConfig
from hybridflow.layout import RUN_FORMAT
from tasks.common import RunContext, load_node_output
from tasks.types import NodeResult
from workers.pool import namespace_for


class RunSession:
    """One open run (from :func:`open_run`): config, folder, data, prompt feed and trainer state.

    ``trainer`` is the live :class:`TrainerState` (versions, KL coefficient, NaN-update count,
    MLflow run); :meth:`trainer_state` snapshots it, with the sampler, for a checkpoint.
    ``prompts`` is the :class:`~flows.feeds.PromptFeed` (the sampler over the training set).
    ``start_iteration`` is the first iteration to run (after the restored checkpoint's);
    ``last_iteration`` / ``last_checkpoint_iteration`` / ``last_val_iteration`` the latest logged,
    checkpointed and validated ones.
    """

    def __init__(self, cfg: ExperimentConfig, run_dir: RunDir, *, resumed: bool):
        self.cfg = cfg
        self.dir = run_dir
        self.run_dir = run_dir.url
        self.run_id = run_dir.name
        self.resumed = resumed
        self.namespace = namespace_for(self.run_id)
        self.trainer = TrainerState(kl_coef=cfg.algorithm.kl_ctrl.kl_coef)
        self.start_iteration = 1
        self.last_iteration = 0
        self.last_checkpoint_iteration = 0
        self.last_val_iteration = -1
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
        """Record ``info`` (e.g. mlflow_run_id, prefect_flow_run_id) in run.json and in ``info``."""
        self.info = self.dir.bind(**{**self.info, **info})
        self.trainer.mlflow_run_id = info.get("mlflow_run_id", self.trainer.mlflow_run_id)

    def context(self, iteration: int) -> RunContext:
        return RunContext(self.run_id, self.run_dir, iteration, self.namespace, self.cfg.trainer.seed,
                          self.cfg.model_dump(mode="json"))

    def append_metrics(self, iteration: int, metrics: dict[str, float]) -> None:
        self.last_iteration = iteration
        self.dir.append_metrics(iteration, metrics)

    def record_validation(self, iteration: int, metrics: dict[str, float]) -> None:
        self.validations[iteration] = metrics
        self.last_val_iteration = iteration
        self.dir.append_validation(iteration, metrics)

    def trainer_state(self, iteration: int) -> TrainerState:
        """A snapshot of the trainer state at the end of ``iteration``, with the sampler's
        position: what the checkpoint of that iteration saves (``.to_dict()``)."""
        return dataclasses.replace(self.trainer, iteration=iteration, sampler=self.prompts.sampler.state_dict())

    def restore(self) -> None:
        """Driver state from the checkpoint a resume loads: the latest one that matches its manifest
        (``trainer.resume_fallback``: else the newest intact one, with a warning; the pools' workers
        then restore the same step, which ``latest`` names). Raises CheckpointError (a
        TrainerStateError for a trainer_state.json with missing or unknown keys), PreflightError."""
        from flows.preflight import check_resume_folder

        path = check_resume_folder(self.run_dir, self.cfg, warn=_warn)
        if path is None:
            return
        state = TrainerState.read(path)
        self.prompts.sampler.load_state_dict(state.sampler)
        self.trainer = state
        self.start_iteration = state.iteration + 1
        self.last_iteration = self.last_checkpoint_iteration = state.iteration
        self.validations.update(self.dir.validations())

    # ---- data ----
    def _load_data(self) -> None:
        from flows.preflight import load_datasets
        from flows.preflight_inputs import check_inputs
        from hybridflow.data import PromptSampler

        cfg = self.cfg
        check_inputs(cfg)  # a deployment's flow run (no CLI preflight) fails here, before any pool starts
        data = load_datasets(cfg)  # PreflightError naming key, file, row, value
        self.tokenizer, self.train_set, self.val_set = data.tokenizer, data.train_set, data.val_set
        self.data_report, self.data_skip_reasons = data.report, data.skip_reasons
        sampler = PromptSampler(len(self.train_set), cfg.data.prompts_per_iteration, shuffle=cfg.data.shuffle,
                                seed=cfg.trainer.seed, drop_last=cfg.data.drop_last)
        self.prompts = PromptFeed(sampler, self.train_set, cfg.trainer.total_epochs, self.context)

    def prepare_validation(self) -> None:
        """Save the validation prompts (``iter_000000/val_prompts``); called once the pools are up."""
        if self.val_set is None:
            return
        n = len(self.val_set)
        if self.cfg.data.val_max_prompts:
            n = min(n, self.cfg.data.val_max_prompts)
        self.val_prompts = save_prompts(self.context(0), "val_prompts", list(range(n)), self.val_set)

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
        hist = self.dir.metrics_history()
        scores = [hist[i].get("critic/score/mean") for i in sorted(hist)]
        scores = [s for s in scores if s is not None]
        val_keys = lambda m: {k: v for k, v in m.items() if k.startswith("val-core/")}  # noqa: E731
        vals = sorted(self.validations)
        from workers.checkpoint import load_latest

        return {
            "run_id": self.run_id,
            "run_dir": self.run_dir,
            "iterations": self.last_iteration,
            "checkpoint": load_latest(self.dir.checkpoints),
            "reward_first": scores[0] if scores else None,
            "reward_last": scores[-1] if scores else None,
            "val_before": val_keys(self.validations[0]) if 0 in self.validations else {},  # before training only
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


def open_run(cfg: ExperimentConfig, *, resume: str | None, flow_run_id: str | None = None) -> RunSession:
    """Create a new run directory, or reopen one to resume (``resume`` = its path, or "auto").

    The run takes the folder's lock (:mod:`flows.run_lock`; re-entrant, so the CLI that already
    holds it can run the flow); :meth:`RunSession.close` releases it.
    ``flow_run_id``: the Prefect flow run that opens the run (recorded in run.json as
    ``prefect_flow_run_id``). When ``trainer.run_id`` names a run directory whose run.json was
    written by this same flow run, the flow run is being retried (the Prefect UI's Retry, or its
    state set back to Scheduled through the API) and the directory is resumed like ``resume``.
    Raises FileExistsError when the directory holds another run (a fresh run needs a new
    ``trainer.run_id``; continuing it is ``resume``), FileNotFoundError when ``resume`` is not a
    run directory, RunLockedError when a live run holds the folder.
    """
    from flows.run_lock import acquire_run_lock, release_run_lock

    path, reopen = resolve_run_dir(cfg, resume)
    if not reopen:
        from flows.preflight import check_run_dir

        check_run_dir(cfg)
    acquire_run_lock(path)
    try:
        run_dir = RunDir(path)
        if reopen or (flow_run_id and _recorded_flow_run(run_dir) == flow_run_id):
            return _reopen(cfg, run_dir)  # resume, or a retry of the flow run that created it
        if run_dir.is_run():
            raise FileExistsError(f"run directory {path} exists; resume it with --resume {path}")
        return _create(cfg, run_dir)
    except BaseException:
        release_run_lock(path)
        raise


def _create(cfg: ExperimentConfig, run_dir: RunDir) -> RunSession:
    from hybridflow.precision_probe import decide_precision

    decided = decide_precision(cfg)  # before the folder exists: a failure leaves no half-made run
    run_dir.create(cfg)
    session = RunSession(cfg, run_dir, resumed=False)
    session.bind(precision=decided.model_dump(mode="json"), run_format=RUN_FORMAT, hybridflow_version=__version__)
    _settle_precision(session)
    return session


def _settle_precision(session: RunSession) -> None:
    """The run's precision, decided once, at its start: the one run.json records, on any machine
    (a resume never probes or switches); a run recorded before precisions were (no ``precision``
    in run.json) gets its configured one, decided now and recorded. ``session.cfg`` then carries it
    to every pool (``model.resolved_precision``)."""
    from hybridflow.precision import ResolvedPrecision, with_resolved_precision

    recorded = session.info.get("precision")
    if recorded is not None:
        resolved = ResolvedPrecision.model_validate(recorded)
        if resolved.requested != session.cfg.model.precision:
            _warn(f"model.precision={session.cfg.model.precision} but this run decided {resolved.name} "
                  f"(from {resolved.requested}) at its start: a run never switches precision; keeping {resolved.name}")
    else:
        from hybridflow.precision_probe import decide_precision

        resolved = decide_precision(session.cfg)
        session.bind(precision=resolved.model_dump(mode="json"))
    session.cfg = with_resolved_precision(session.cfg, resolved)


def _recorded_flow_run(run_dir: RunDir) -> str | None:
    """The Prefect flow run id that run.json records (None when absent or unreadable)."""
    try:
        return run_dir.run_info().get("prefect_flow_run_id") or None
    except (OSError, ValueError, AttributeError):
        return None


def _reopen(cfg: ExperimentConfig, run_dir: RunDir) -> RunSession:
    """Resume ``run_dir`` from its latest checkpoint with its saved config; ``cfg`` may only
    extend it (a larger trainer.total_iterations)."""
    saved = run_dir.read_config()
    # the saved run defines the experiment; the caller may extend it (e.g. more iterations)
    merged = saved.model_copy(update={"trainer": saved.trainer.model_copy(
        update={"total_iterations": max(cfg.trainer.total_iterations, saved.trainer.total_iterations)})})
    info = run_dir.run_info()
    from flows.preflight_inputs import check_run_format

    check_run_format(run_dir.url, info)  # a deployment's flow run (no CLI preflight) refuses here too
    session = RunSession(where_it_started(merged, run_dir, info), run_dir, resumed=True)  # whatever the cwd
    session.info = info
    if "run_format" not in info:  # a folder from before the format was recorded is format 1: say so
        session.bind(run_format=1)
    _settle_precision(session)
    session.trainer.mlflow_run_id = session.info.get("mlflow_run_id")
    session.restore()
    return session
