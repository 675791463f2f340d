"""Checks that run before anything heavy (Prefect server, Ray, model weights, pools) starts.

Each failure is a :class:`PreflightError` (a :class:`~hybridflow.config.ConfigError`, so
``hybridflow train`` prints it as one readable message and exits 2) that names the config
key, the value and what is wrong:

- ``trainer.run_dir`` cannot be created or written;
- ``model.path`` / ``model.tokenizer_path`` / ``critic.model_path`` does not exist;
- the tokenizer has no chat template while ``data.apply_chat_template`` is on;
- a file of ``data.train_files`` / ``data.val_files`` is missing, not parquet/jsonl, has a bad
  row (unless ``data.on_bad_row=skip``: then the rows are skipped and counted) or a prompt
  longer than ``data.max_prompt_tokens`` (policy ``error``);
- fewer usable prompts than ``data.prompts_per_iteration``;
- ``data.max_prompt_tokens`` (alone, or plus ``rollout.max_response_tokens``) longer than the
  model's context (``max_position_embeddings``);
- ``reward.judge.path`` does not exist, or the judge's rubric (with an empty prompt and response) plus
  ``reward.judge.max_new_tokens`` is longer than the judge's context;
- a group-baseline advantage estimator (GRPO, RLOO, ...: registered with
  ``min_samples_per_prompt=2``) with ``rollout.samples_per_prompt=1``;
- ``rollout.tools`` / ``rollout.environment`` do not import or do not fit the multi-turn settings
  (:func:`hybridflow.agents.checks.check_user_code`; not part of config validation);
- the model's config, weights or tokenizer, the data's encoding or the run folder's free space
  (:mod:`flows.preflight_inputs`);
- ``reward.function`` does not import (loaded in a throw-away reward process, as the reward
  pool will load it, so an import that crashes cannot take the caller down).

The CLI runs :func:`preflight` before it starts servers; the train flow runs the same
checks (:func:`load_datasets`, :func:`check_run_dir`, :func:`check_reward_function`,
``check_user_code``) before
it brings up the pools, so a run started from a Prefect deployment fails as early.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flows.preflight_base import PreflightError, check_engine, check_run_dir  # noqa: F401 (re-exported)
from hybridflow.config import ExperimentConfig
from hybridflow.layout import CHECKPOINTS, CONFIG


@dataclass
class Datasets:
    """What :func:`load_datasets` built, and what it skipped (``report``: counts by name)."""

    tokenizer: Any
    train_set: Any
    val_set: Any | None
    report: dict[str, float] = field(default_factory=dict)
    skip_reasons: list[str] = field(default_factory=list)


def check_models(cfg: ExperimentConfig) -> None:
    """Resolve every model location the run will load (offline; nothing is read yet)."""
    from hybridflow.models.resolve import resolve_model_path

    keys = [("model.path", cfg.model.path), ("model.tokenizer_path", cfg.model.tokenizer_path),
            ("reward.model.path", cfg.reward.model.path)]
    if cfg.reward.judge.enable:
        keys.append(("reward.judge.path", cfg.reward.judge.path))  # None: model.path, checked above
    if cfg.needs_critic:
        keys.append(("critic.model_path", cfg.critic.model_path))
    for key, value in keys:
        if value is None:
            continue
        try:
            resolve_model_path(value)
        except (FileNotFoundError, ValueError) as e:
            raise PreflightError(f"{key}={value!r}: {e}") from None


def check_context_length(cfg: ExperimentConfig) -> None:
    """Prompt and response budgets fit the policy's context (its config's
    ``max_position_embeddings``): a longer prompt would be cut or run past the position table.
    Models whose config names no context length are not checked."""
    from hybridflow.models.loading import context_length

    context = context_length(cfg.model)
    if context is None:
        return
    prompt, response = cfg.data.max_prompt_tokens, cfg.rollout.max_response_tokens
    if prompt > context:
        raise PreflightError(f"data.max_prompt_tokens={prompt} is longer than the model's context "
                             f"({context} positions, model.path={cfg.model.path!r}); use at most {context}")
    if prompt + response > context:
        raise PreflightError(
            f"data.max_prompt_tokens={prompt} + rollout.max_response_tokens={response} = {prompt + response} "
            f"tokens exceed the model's context ({context} positions, model.path={cfg.model.path!r}); "
            "lower one of them"
        )


def check_judge(cfg: ExperimentConfig) -> None:
    """``reward.judge``: its tokenizer loads, and the rubric rendered with an empty prompt, response
    and ground truth (in the judge's chat template) plus ``max_new_tokens`` fits the judge's context.
    A row longer than that is counted during the run (reward/judge_overlong), not refused here."""
    judge = cfg.reward.judge
    if not judge.enable:
        return
    from hybridflow.models import load_tokenizer
    from hybridflow.models.loading import context_length
    from hybridflow.rewards.judge import judge_prompt_ids, render_rubric

    model_cfg = cfg.judge_model
    where = f"{'reward.judge.path' if judge.path else 'model.path'}={model_cfg.path!r}"
    try:
        tokenizer, context = load_tokenizer(model_cfg), context_length(model_cfg)
    except (OSError, ValueError) as e:
        raise PreflightError(f"{where}: cannot load the judge's tokenizer or config: {e}") from None
    if context is None:
        return
    least = len(judge_prompt_ids(tokenizer, render_rubric(judge.rubric, "", "", None),
                                 apply_chat_template=judge.apply_chat_template, prefix=judge.verdict_prefix))
    if least + judge.max_new_tokens > context:
        raise PreflightError(
            f"reward.judge.rubric is {least} judge tokens with an empty prompt and response; + "
            f"reward.judge.max_new_tokens={judge.max_new_tokens} = {least + judge.max_new_tokens} exceed the judge's "
            f"context ({context} positions, {where}): shorten the rubric or lower max_new_tokens"
        )


def check_group_size(cfg: ExperimentConfig) -> None:
    """A group-baseline estimator needs more than one sample per prompt (verl refuses GRPO with
    rollout.n=1): with one sample the group baseline is the sample itself."""
    from hybridflow.algorithms.registry import advantage_estimator_min_samples

    name, n = cfg.algorithm.adv_estimator, cfg.rollout.samples_per_prompt
    needed = advantage_estimator_min_samples(name)
    if n < needed:
        raise PreflightError(
            f"rollout.samples_per_prompt={n} but algorithm.adv_estimator={name!r} compares each response "
            f"with the other responses to its prompt: sample at least {needed} per prompt "
            "(or use an estimator without a group baseline, e.g. gae with a critic, or reinforce_plus_plus)"
        )


def _load_split(key: str, files: list[str], cfg: ExperimentConfig, tokenizer: Any) -> tuple[Any, Any]:
    from hybridflow.data import PromptDataset, load_rows
    from hybridflow.data.io import read_records

    for path in files:  # attribute an unreadable file (e.g. a .parquet that is not parquet) to its path
        try:
            read_records(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises its own types
            raise PreflightError(f"{key}: cannot read {path!r}: {type(e).__name__}: {e}") from None
    try:
        # rule rewards need a ground truth per row; a custom reward.function may not
        rows = load_rows(files, cfg.data, require_ground_truth=cfg.reward.function is None)
        return rows, PromptDataset(rows, tokenizer, cfg.data)
    except ValueError as e:  # BadRowError, OverlongPromptError, DataFileError
        raise PreflightError(f"{key}: {e}") from None


def _check_chat_template(cfg: ExperimentConfig, tokenizer: Any) -> None:
    if cfg.data.apply_chat_template and not getattr(tokenizer, "chat_template", None):
        key = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
        value = cfg.model.tokenizer_path or cfg.model.path
        raise PreflightError(
            f"{key}={value!r}: the tokenizer has no chat template, but data.apply_chat_template=true "
            "renders chat messages with it; use a tokenizer with a chat template, or set "
            "data.apply_chat_template=false with plain-string prompts"
        )


def load_datasets(cfg: ExperimentConfig) -> Datasets:
    """The tokenizer and the tokenised train (and validation) prompts, every input error a
    PreflightError. ``report``: data/train_prompts, data/train_skipped_rows,
    data/train_filtered_overlong, data/train_truncated (and data/val_* when there is a
    validation set)."""
    from hybridflow.models import load_tokenizer

    if not cfg.data.train_files:
        raise PreflightError("data.train_files is empty: give at least one parquet/jsonl file")
    check_group_size(cfg)
    check_models(cfg)
    check_context_length(cfg)
    check_judge(cfg)
    try:
        tokenizer = load_tokenizer(cfg.model)
    except (OSError, ValueError) as e:
        raise PreflightError(f"model.path={cfg.model.path!r}: cannot load the tokenizer: {e}") from None
    _check_chat_template(cfg, tokenizer)
    out = Datasets(tokenizer, None, None)
    for split, key, files in (("train", "data.train_files", cfg.data.train_files),
                              ("val", "data.val_files", cfg.data.val_files)):  # fmt: skip
        if not files:
            continue
        rows, dataset = _load_split(key, files, cfg, tokenizer)
        out.report.update({f"data/{split}_prompts": float(len(dataset)),
                           f"data/{split}_skipped_rows": float(rows.skipped),
                           f"data/{split}_filtered_overlong": float(dataset.filtered),
                           f"data/{split}_truncated": float(dataset.truncated)})  # fmt: skip
        out.skip_reasons += rows.skip_reasons
        if split == "train":
            out.train_set = dataset
        else:
            out.val_set = dataset
    n, per_iteration = len(out.train_set), cfg.data.prompts_per_iteration
    if n < per_iteration:
        raise PreflightError(
            f"data.prompts_per_iteration={per_iteration} but data.train_files hold {n} usable prompts "
            f"({int(out.report['data/train_skipped_rows'])} bad rows skipped, "
            f"{int(out.report['data/train_filtered_overlong'])} overlong filtered)"
        )
    return out


def check_reward_function(cfg: ExperimentConfig) -> None:
    """Load ``reward.function`` in one throw-away reward process (as the reward pool will).
    Rule rewards (no function) need nothing. Raises PreflightError with the loader's message."""
    if cfg.reward.function is None:
        return
    from hybridflow.rewards import RewardExecutor

    executor = RewardExecutor(cfg.reward.model_copy(update={"num_workers": 1}), plugins=cfg.trainer.plugins)
    try:
        executor.start()
    except ImportError as e:  # RewardLoadError: its message names reward.function and the cause
        raise PreflightError(str(e)) from None
    finally:
        executor.close()


def check_resume_folder(run_dir: str | Path, cfg: ExperimentConfig, warn: Any = print) -> str | None:
    """What a resume of ``run_dir`` loads, checked before any server starts: every Prefect result
    record under ``prefect-results/`` is JSON of the node-result shape (never unpickled), and the
    checkpoint to resume from matches its manifest — else the newest intact one
    (``trainer.resume_fallback``; ``warn`` gets one line) or a PreflightError. Returns the
    checkpoint the run resumes from (None: there is none)."""
    from tasks.results import ResultRecordError, check_result_records
    from workers.checkpoint import CheckpointError
    from workers.checkpoint_integrity import choose_resume_checkpoint

    try:
        check_result_records(run_dir)
        return choose_resume_checkpoint(Path(run_dir) / CHECKPOINTS, fallback=cfg.trainer.resume_fallback,
                                        warn=warn)
    except (ResultRecordError, CheckpointError) as e:
        raise PreflightError(f"--resume {run_dir}: {e}") from None


def check_placement(cfg: ExperimentConfig) -> None:
    """Every pool can ever be placed on the Ray cluster (Ray must be up): a request no node set can
    hold is one line (PoolResourceError, a ConfigError: exit 2) before the flow starts, not a wait."""
    from workers.placement import check_pool_fits_cluster

    for name, pool_cfg in cfg.placement.pools.items():
        check_pool_fits_cluster(name, pool_cfg)


def preflight_run(cfg: ExperimentConfig, resume: str | None, warn: Any = print) -> int:
    """The checks of ``hybridflow train`` before any server starts: what a resume loads from its
    folder first (:func:`check_resume_folder`; ``warn`` gets its one-line fallback notices), then
    :func:`preflight` on the config the run continues with (a resumed run's saved config.yaml).
    Returns the number of bad dataset rows skipped (``data.on_bad_row=skip``); raises PreflightError."""
    from hybridflow.config import load_config

    if resume:
        from flows.preflight_inputs import check_resume_files

        check_resume_files(resume)
        check_resume_folder(resume, cfg, warn=warn)
        from flows.resume import where_it_started
        from flows.run_dir import RunDir

        # trainer.run_dir: the folder's parent (a saved relative one would be created in the cwd)
        cfg = where_it_started(load_config(Path(resume) / CONFIG), RunDir(resume), {})
    report = preflight(cfg)
    return int(report.get("data/train_skipped_rows", 0) + report.get("data/val_skipped_rows", 0))


def preflight(cfg: ExperimentConfig) -> dict[str, float]:
    """Every check above, cheapest first. Returns the data report (counts of skipped rows...)."""
    from flows.preflight_inputs import check_inputs
    from hybridflow.agents.checks import check_user_code

    check_run_dir(cfg)
    check_engine(cfg)
    check_user_code(cfg)  # imports the user's tools / environment (a ConfigError, one line)
    check_inputs(cfg)  # model files, data encoding, free space (flows/preflight_inputs.py)
    data = load_datasets(cfg)
    check_reward_function(cfg)
    check_harness_tasks(cfg)
    return data.report


def check_harness_tasks(cfg: ExperimentConfig) -> None:
    """``trainer.eval``'s harness is installed at its version and its tasks resolve and load offline
    (:func:`hybridflow.evals.harness.check_tasks`), so an evaluation scheduled for iteration 50 does not
    fail there. Raises PreflightError naming trainer.eval."""
    if not cfg.trainer.eval.enabled:
        return
    from hybridflow.evals.harness import HarnessError, check_tasks

    try:
        check_tasks(cfg.trainer.eval.tasks, cfg.trainer.eval.include_path)
    except HarnessError as e:
        raise PreflightError(f"trainer.eval: {e}") from None


__all__ = ["PreflightError", "Datasets", "preflight", "check_run_dir", "check_engine", "check_models",
           "check_context_length", "check_judge", "check_group_size", "load_datasets", "check_reward_function",
           "check_resume_folder", "check_placement", "preflight_run", "check_harness_tasks"]
