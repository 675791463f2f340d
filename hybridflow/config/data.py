"""``data``: datasets, prompts per iteration, chat templates, bad rows."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from hybridflow.config.base import (
    _Section,
)
from hybridflow.deprecation import warn_deprecated


class DataConfig(_Section):
    train_files: list[str] = Field(
        default_factory=list, description="Training datasets (parquet, jsonl, or a saved HF dataset dir); fsspec URIs."
    )
    val_files: list[str] = Field(default_factory=list, description="Validation datasets, same formats.")
    prompt_key: str = Field("prompt", description="Column holding the chat messages (verl format).")
    data_source_key: str = Field("data_source", description="Column selecting the reward function per row.")
    reward_model_key: str = Field("reward_model", description="Column holding {style, ground_truth}.")
    extra_info_key: str = Field("extra_info", description="Column holding free-form per-row info.")
    prompts_per_iteration: int = Field(
        8, gt=0, description="Prompts sampled per RL iteration (before n samples each). Formerly `prompts_per_step`."
    )
    val_max_prompts: int | None = Field(
        None, gt=0, description="Evaluate on at most this many validation prompts (None = all)."
    )
    max_prompt_tokens: int = Field(256, gt=0, description="Longest prompt, in tokens, after the chat template.")
    overlong_prompt: Literal["error", "filter", "truncate_left"] = Field(
        "error", description="What to do with a prompt longer than `max_prompt_tokens`."
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error", description="A malformed dataset row fails loudly (naming file, row, field) or is skipped and counted."
    )
    apply_chat_template: bool = Field(True, description="Render `prompt` messages with the tokenizer's chat template.")
    shuffle: bool = Field(True, description="Shuffle prompts each epoch (seeded by `trainer.seed`).")
    drop_last: bool = Field(True, description="Drop the last incomplete iteration's prompts of an epoch.")

    @property
    def prompts_per_step(self) -> int:
        """Deprecated name of :attr:`prompts_per_iteration` (read-only; FutureWarning, removed in 0.3.0)."""
        warn_deprecated("DataConfig.prompts_per_step", "DataConfig.prompts_per_iteration")
        return self.prompts_per_iteration
