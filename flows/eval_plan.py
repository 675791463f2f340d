"""What the ``evaluate`` flow evaluates, and under which config — decided without Prefect.

:func:`plan_evaluation` checks the arguments and builds (target, eval config) without loading
anything heavy and without importing Prefect: ``hybridflow eval`` calls it before it starts the
Prefect server (Prefect reads PREFECT_API_URL once, when it is imported), and the flow
(:mod:`flows.evaluate`) calls it again as its first step. :func:`target_of` reads what a
``--model`` argument names (a run, one of its checkpoints, or a model).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridflow.config import ExperimentConfig, config_from_dict, load_config
from hybridflow.layout import CHECKPOINTS, CONFIG, RUN_INFO

EVAL_ROLES = ("policy", "reward", "judge")  # the judge when reward.judge.enable: validation scores with it


@dataclass(frozen=True)
class EvalTarget:
    """What is evaluated. ``model_path``: what the policy pool loads (a checkpoint's
    ``policy/`` folder, an HF folder, a .gguf file or an alias); ``run_dir``/``step``/
    ``checkpoint_dir`` are set for a checkpoint of a run."""

    label: str
    model_path: str
    run_dir: str | None = None
    step: int | None = None
    checkpoint_dir: str | None = None


def target_of(model: str, step: str | None) -> dict[str, Any]:
    """The evaluate flow's target parameters for a ``--model`` argument: {"run_dir", "checkpoint"}
    for a run dir (``step`` or latest), its ``checkpoints/`` folder, its ``checkpoints/latest``
    pointer or one ``checkpoints/iter_<N>`` folder; else {"model"}. Raises ValueError when
    ``step`` is given for something that is not a run dir, ModelNotFoundError (a
    FileNotFoundError) when that something is no model either."""
    p = Path(model)
    one_checkpoint = p.parent.name == CHECKPOINTS and (
        (p.is_dir() and (p / "trainer_state.json").is_file()) or (p.name == "latest" and p.is_file()))
    if one_checkpoint:
        if step is not None:
            raise ValueError(f"--step: {model} is already one checkpoint (pass its run dir to choose a step)")
        return {"run_dir": str(p.parent.parent), "checkpoint": p.name}
    if p.is_dir() and p.name == CHECKPOINTS and (p.parent / CONFIG).is_file():
        p = p.parent
    if p.is_dir() and (p / CONFIG).is_file() and ((p / RUN_INFO).is_file() or (p / CHECKPOINTS).is_dir()):
        return {"run_dir": str(p), "checkpoint": step or "latest"}
    if step is not None:
        from hybridflow.models.resolve import resolve_model_path

        resolve_model_path(model)  # a missing path is named as such, not blamed on --step
        raise ValueError(f"--step applies to a run directory; {model} is not one")
    return {"model": model}


def resolve_target(run_dir: str | None, checkpoint: str | int, model: str | None, default_model: str) -> EvalTarget:
    """A checkpoint of ``run_dir`` (``checkpoint`` = step or "latest"), else ``model``, else the
    config's model. Raises ValueError (both given), CheckpointNotFoundError (listing the steps),
    ModelNotFoundError (model path/alias not found)."""
    from flows.checkpoints import CheckpointNotFoundError, resolve_checkpoint, step_of
    from hybridflow.models.resolve import resolve_model_path

    if run_dir and model:
        raise ValueError("evaluate a checkpoint of a run (run_dir) or a model (model), not both")
    if run_dir:
        step_dir = resolve_checkpoint(run_dir, checkpoint)
        policy = step_dir / "policy"
        if not (policy / "config.json").is_file():
            raise CheckpointNotFoundError(f"checkpoint {step_dir} has no policy/ HF folder")
        run = Path(run_dir).resolve()
        step = step_of(step_dir)
        return EvalTarget(f"{run.name}@step{step}", str(policy.resolve()), str(run), step, str(step_dir.resolve()))
    path = model or default_model
    resolved = resolve_model_path(path)
    if resolved.kind in ("hf_dir", "gguf"):  # absolute: the pool's processes may not share our cwd
        return EvalTarget(Path(path).resolve().name, str(resolved.path))
    return EvalTarget(path, path)


def _target_and_config(run_dir: str | None, checkpoint: str | int, model: str | None, config_path: str | None,
                       overrides: list[str] | None) -> tuple[EvalTarget, ExperimentConfig]:
    """What is evaluated and the config it is read with: a run's checkpoint under the run's config.yaml
    (or ``config_path``), else ``model`` (default: the config's) under ``config_path`` + ``overrides``."""
    if run_dir:
        return resolve_target(run_dir, checkpoint, model, ""), load_config(config_path or Path(run_dir) / CONFIG,
                                                                           overrides)
    cfg = load_config(config_path, overrides)
    return resolve_target(None, checkpoint, model, cfg.model.path), cfg


def _with_target_model(cfg: ExperimentConfig, target: EvalTarget) -> dict[str, Any]:
    """``cfg`` as a dict with the target as its model (LoRA off: checkpoints are merged; a checkpoint
    holds its tokenizer)."""
    d = cfg.model_dump(mode="json")
    d["model"].update(path=target.model_path, lora_rank=0)
    if target.checkpoint_dir:
        d["model"]["tokenizer_path"] = None
    return d


def _check_data_files(files: list[str]) -> None:
    import fsspec

    for f in files:
        fs, p = fsspec.core.url_to_fs(f)
        if not fs.exists(p):
            raise FileNotFoundError(f"evaluation data file {f!r} does not exist")


def _check_sampling(samples_per_prompt: int, temperature: float, max_prompts: int | None) -> None:
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if max_prompts is not None and max_prompts < 1:
        raise ValueError(f"max_prompts must be >= 1, got {max_prompts}")


def eval_config(
    cfg: ExperimentConfig,
    target: EvalTarget,
    *,
    data_files: list[str] | None,
    samples_per_prompt: int,
    temperature: float,
    max_prompts: int | None,
) -> ExperimentConfig:
    """The config the evaluation runs under: ``cfg`` with the target model (LoRA off: checkpoints
    are merged), the data as ``data.val_files``, k = ``rollout.val_samples_per_prompt`` at
    ``rollout.val_temperature``, and pools holding only the policy and reward roles (KL and the
    critic switched off: evaluation needs neither). Raises ValueError for bad arguments or
    when there is no data; FileNotFoundError for a missing data file."""
    _check_sampling(samples_per_prompt, temperature, max_prompts)
    d = _with_target_model(cfg, target)
    files = list(data_files) if data_files else list(d["data"]["val_files"])
    if not files:
        raise ValueError("no evaluation data: pass data_files (hybridflow eval --data FILE) or set data.val_files")
    _check_data_files(files)
    d["data"]["val_files"] = files
    if max_prompts is not None:
        d["data"]["val_max_prompts"] = max_prompts
    d["rollout"].update(val_samples_per_prompt=samples_per_prompt, val_temperature=temperature)
    d["algorithm"]["use_kl_in_reward"] = False
    d["actor"]["use_kl_loss"] = False
    if cfg.needs_critic:
        d["algorithm"]["adv_estimator"] = "grpo"  # no critic to load; the estimator plays no part here
    pools = {}
    for name, pool in d["placement"]["pools"].items():
        roles = [r for r in pool["roles"] if r in EVAL_ROLES]
        if roles:
            pools[name] = {**pool, "roles": roles}
    d["placement"]["pools"] = pools
    return config_from_dict(d)


def plan_evaluation(
    run_dir: str | None = None,
    checkpoint: str | int = "latest",
    data_files: list[str] | None = None,
    model: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    samples_per_prompt: int = 1,
    temperature: float = 0.0,
    max_prompts: int | None = None,
) -> tuple[EvalTarget, ExperimentConfig]:
    """Check the arguments and build (target, eval config) without loading anything heavy.
    A run's checkpoint is evaluated under the run's config.yaml unless ``config_path`` is given.
    Raises ValueError / ConfigError (bad arguments, tools / environment that do not load),
    FileNotFoundError (missing model, data, run)."""
    from hybridflow.agents.checks import check_user_code

    target, cfg = _target_and_config(run_dir, checkpoint, model, config_path, overrides)
    check_user_code(cfg)  # the tools / environment a multi-turn evaluation runs
    return target, eval_config(cfg, target, data_files=data_files, samples_per_prompt=samples_per_prompt,
                               temperature=temperature, max_prompts=max_prompts)


def harness_config(cfg: ExperimentConfig, target: EvalTarget, eval_overrides: dict[str, Any] | None = None) -> ExperimentConfig:
    """The config a harness evaluation (:mod:`flows.harness_eval`) runs under: ``cfg`` with the
    target model (LoRA off: checkpoints are merged), ``trainer.eval`` updated with
    ``eval_overrides`` (tasks, include_path, limit, ...), and an evaluator pool when the config
    places none (one worker, ``trainer.eval.cpus``). Raises ValueError / ConfigError for bad fields."""
    d = _with_target_model(cfg, target)
    d["trainer"]["eval"].update({k: v for k, v in (eval_overrides or {}).items() if v is not None})
    d["trainer"]["eval"]["every"] = 0  # one evaluation, not a schedule
    if not any("evaluator" in p["roles"] for p in d["placement"]["pools"].values()):
        d["placement"]["pools"]["evaluator"] = {"workers": 1, "cpus_per_worker": d["trainer"]["eval"]["cpus"],
                                                "roles": ["evaluator"]}
    return config_from_dict(d)


def plan_harness_evaluation(
    run_dir: str | None = None,
    checkpoint: str | int = "latest",
    model: str | None = None,
    config_path: str | None = None,
    overrides: list[str] | None = None,
    eval_overrides: dict[str, Any] | None = None,
) -> tuple[EvalTarget, ExperimentConfig]:
    """Check the arguments and build (target, harness config) without loading a model: the
    target as :func:`plan_evaluation` resolves it, the harness, its version and the tasks checked
    offline (:func:`hybridflow.evals.harness.check_tasks`: an unknown task, a hub dataset).
    Raises ValueError (HarnessError, ConfigError) or FileNotFoundError."""
    from hybridflow.evals.harness import check_tasks

    target, cfg = _target_and_config(run_dir, checkpoint, model, config_path, overrides)
    hcfg = harness_config(cfg, target, eval_overrides)
    check_tasks(hcfg.trainer.eval.tasks, hcfg.trainer.eval.include_path)
    return target, hcfg
