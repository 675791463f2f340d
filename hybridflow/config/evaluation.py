"""``trainer.eval``: standard-harness evaluations (lm-eval) of the run's checkpoints, scheduled
during training as flow runs of their own on a pool of their own (docs/evaluation.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from hybridflow.config.base import _Section


class HarnessEvalConfig(_Section):
    harness: Literal["lm-eval"] = Field(
        "lm-eval", description="The evaluation harness: EleutherAI's lm-evaluation-harness (lm-eval[hf]==0.4.13, the "
        "eval extra). Gao et al., 'A framework for few-shot language model evaluation' (2021-2024).",
    )
    tasks: list[str] = Field(
        default_factory=list, description="lm-eval task, group or tag names; empty = no harness evaluation. Tasks "
        "must read local files (no network at run time): write them with hybridflow data lm-eval-task.",
    )
    every: int = Field(
        0, ge=0, description="Evaluate the checkpoint of every N-th iteration (a multiple of trainer.save_every, "
        "so the checkpoint exists); 0 = never. The final checkpoint is evaluated too when tasks are set.",
    )
    before_train: bool = Field(
        True, description="Evaluate the initial model (model.path) too, at step 0, when a run starts (not on resume).",
    )
    include_path: str | None = Field(None, description="A folder of lm-eval task YAMLs (the local tasks).")
    limit: int | None = Field(None, gt=0, description="The first N documents of each task (None = all).")
    batch_size: int = Field(8, gt=0, description="Prompts per generate call in lm-eval's HFLM.")
    apply_chat_template: bool = Field(
        True, description="Render prompts with the model's chat template (lm-eval --apply_chat_template). lm-eval's "
        "default applies none, which scores an instruct model on text it was never trained to continue.",
    )
    system_instruction: str | None = Field(None, description="A system message before every prompt (lm-eval's).")
    log_samples: bool = Field(
        True, description="Keep each document's prompt, response, extracted answer and score (lm-eval "
        "--log_samples) as an MLflow artifact of the run.",
    )
    cpus: float = Field(
        1.0, gt=0, description="Logical CPUs of the evaluator pool when placement.pools places none (a pool with "
        "role 'evaluator' sets workers, CPUs, GPUs and threads like any pool). Local Ray starts with them added. On "
        "a 2-core machine it takes cores from training: docs/evaluation.md has the measured slowdown.",
    )
    timeout_s: float = Field(3600.0, gt=0, description="Longest one evaluation may take before it is reported failed.")

    @field_validator("tasks")
    @classmethod
    def _no_blank_tasks(cls, v: list[str]) -> list[str]:
        if any(not t.strip() or "," in t for t in v):
            raise ValueError(f"tasks {v}: one non-empty task name per list item")
        return v

    @model_validator(mode="after")
    def _tasks_when_scheduled(self) -> HarnessEvalConfig:
        if self.every and not self.tasks:
            raise ValueError(f"trainer.eval.every={self.every} with no trainer.eval.tasks: name the lm-eval tasks")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)
