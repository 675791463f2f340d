"""verl-format rows: validation and loading (:func:`load_rows`).

A row (verl's ``RLHFDataset`` format; column names from :class:`~hybridflow.config.DataConfig`)::

    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "..."}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "72"},
     "extra_info": {"split": "train", "index": 0}}

A bad row (missing / empty prompt, missing data_source, missing ground truth when the
reward needs one, wrong types) raises :class:`BadRowError` naming the file, the row and the
field, or with ``data.on_bad_row=skip`` is dropped and counted in ``RowSet.skipped``.
Nothing is coerced: a number where a string belongs is a bad row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any, overload

from hybridflow.config import DataConfig
from hybridflow.data.io import UnreadableLine, read_records

MAX_REASONS = 100  # skip reasons kept (the count is exact)


class BadRowError(ValueError):
    """A dataset row violates the row format; the message names file, row and field."""


@dataclass(frozen=True)
class Row:
    """One validated prompt. ``uid`` = "<file stem>-<row index>" is stable across runs."""

    data_source: str
    prompt: list[dict[str, Any]] | str
    ground_truth: Any
    extra_info: dict[str, Any]
    ability: str | None
    reward_style: str | None
    source: str
    index: int
    uid: str


@dataclass
class RowSet(Sequence[Row]):
    """Rows that passed validation, and how many were skipped (with reasons, first 100)."""

    rows: list[Row]
    skipped: int = 0
    skip_reasons: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, i: int) -> Row: ...
    @overload
    def __getitem__(self, i: slice) -> list[Row]: ...
    def __getitem__(self, i: int | slice) -> Row | list[Row]:
        return self.rows[i]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows)


class _Bad(Exception):
    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(field_name, problem)
        self.field_name, self.problem = field_name, problem


def load_rows(files: Sequence[str], data_cfg: DataConfig, *, require_ground_truth: bool = True) -> RowSet:
    """Read and validate rows from parquet / jsonl files or saved HF dataset folders, in order.

    require_ground_truth: rows without ``reward_model.ground_truth`` are bad (rule rewards
    need it; pass False for a custom reward that does not). Raises DataFileError for an
    unreadable file, BadRowError for a bad row unless ``data_cfg.on_bad_row == "skip"``,
    ValueError when ``files`` is empty.
    """
    if not files:
        raise ValueError("no data files given (data.train_files / data.val_files is empty)")
    out = RowSet([])
    stems: dict[str, int] = {}
    for path in files:
        stem = PurePosixPath(path.rstrip("/")).name.split(".")[0]
        stems[stem] = stems.get(stem, 0) + 1
        prefix = stem if stems[stem] == 1 else f"{stem}{stems[stem]}"
        for i, record in enumerate(read_records(path)):
            try:
                out.rows.append(_validate(record, path, i, f"{prefix}-{i}", data_cfg, require_ground_truth))
            except _Bad as bad:
                message = f"{path}: row {i}: field {bad.field_name!r}: {bad.problem}"
                if isinstance(record, UnreadableLine):  # named by its line: the row has no fields
                    message = f"{path}: {record.problem}"
                if data_cfg.on_bad_row == "error":
                    raise BadRowError(message + " (set data.on_bad_row=skip to drop such rows)") from None
                out.skipped += 1
                if len(out.skip_reasons) < MAX_REASONS:
                    out.skip_reasons.append(message)
    return out


def _validate(rec: Any, path: str, i: int, uid: str, cfg: DataConfig, need_truth: bool) -> Row:
    if isinstance(rec, UnreadableLine):
        raise _Bad("<row>", rec.problem)
    if not isinstance(rec, dict):
        raise _Bad("<row>", f"expected an object, got {type(rec).__name__}")
    source = rec.get(cfg.data_source_key)
    if not isinstance(source, str) or not source:
        raise _Bad(cfg.data_source_key, _what(source, "a non-empty string"))
    prompt = _check_prompt(rec.get(cfg.prompt_key), cfg)
    reward_model = rec.get(cfg.reward_model_key)
    truth, style = None, None
    if reward_model is not None:
        if not isinstance(reward_model, dict):
            raise _Bad(cfg.reward_model_key, _what(reward_model, "an object {style, ground_truth}"))
        truth, style = reward_model.get("ground_truth"), reward_model.get("style")
        if style is not None and not isinstance(style, str):
            raise _Bad(f"{cfg.reward_model_key}.style", _what(style, "a string"))
    if truth is not None and not isinstance(truth, str | dict | list):
        raise _Bad(f"{cfg.reward_model_key}.ground_truth", _what(truth, "a string (or a dict/list for structured truths)"))
    if need_truth and (truth is None or truth == ""):
        raise _Bad(f"{cfg.reward_model_key}.ground_truth", "missing, and the reward needs it")
    extra = rec.get(cfg.extra_info_key)
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise _Bad(cfg.extra_info_key, _what(extra, "an object"))
    try:
        json.dumps([extra, truth], allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _Bad(cfg.extra_info_key, f"not JSON-serialisable ({e})") from None
    ability = rec.get("ability")
    if ability is not None and not isinstance(ability, str):
        raise _Bad("ability", _what(ability, "a string"))
    return Row(source, prompt, truth, extra, ability, style, path, i, uid)


def _check_prompt(prompt: Any, cfg: DataConfig) -> list[dict[str, Any]] | str:
    key = cfg.prompt_key
    if prompt is None:
        raise _Bad(key, "missing")
    if isinstance(prompt, str):
        if cfg.apply_chat_template:
            raise _Bad(key, "is a string, but data.apply_chat_template=true needs a list of chat messages")
        if not prompt.strip():
            raise _Bad(key, "is empty")
        return prompt
    if not isinstance(prompt, list):
        raise _Bad(key, _what(prompt, "a list of chat messages"))
    if not cfg.apply_chat_template:
        raise _Bad(key, "is a list of messages, but data.apply_chat_template=false needs a string")
    if not prompt:
        raise _Bad(key, "is empty (no messages)")
    for j, msg in enumerate(prompt):
        if not isinstance(msg, dict):
            raise _Bad(f"{key}[{j}]", _what(msg, "a message {role, content}"))
        for part in ("role", "content"):
            if not isinstance(msg.get(part), str):
                raise _Bad(f"{key}[{j}].{part}", _what(msg.get(part), "a string"))
    if not any(m["content"].strip() for m in prompt):
        raise _Bad(key, "is empty (every message has empty content)")
    return prompt


def _what(value: Any, want: str) -> str:
    if value is None:
        return f"missing; expected {want}"
    return f"expected {want}, got {type(value).__name__} {str(value)[:40]!r}"


__all__ = ["Row", "RowSet", "BadRowError", "load_rows", "MAX_REASONS"]
