"""Prompts ready for rollout: chat template, tokenisation, overlong policy, left-padded batches.

:class:`PromptDataset` renders every row once at construction: the tokenizer's chat
template (``add_generation_prompt=True``) gives the prompt text, which is tokenised with
``add_special_tokens=False`` — the template already wrote whatever special tokens it wants,
so a template that emits BOS never gets a second one. When the template does NOT write BOS
but the tokenizer normally prepends one, BOS is prepended once (so the model sees what it was
trained with). Without a chat template (``data.apply_chat_template=false``) the prompt string
is tokenised with the tokenizer's usual special tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from hybridflow.batch import Batch
from hybridflow.config import DataConfig
from hybridflow.data.rows import Row


class OverlongPromptError(ValueError):
    """A prompt is longer than ``data.max_prompt_tokens`` and ``data.overlong_prompt=error``."""


class PromptDataset:
    """Tokenised prompts of ``rows`` (a RowSet or list of Row) for ``tokenizer`` under ``data_cfg``.

    Attributes: ``filtered`` (prompts dropped as overlong, policy ``filter``), ``filtered_uids``,
    ``truncated`` (prompts cut from the left, policy ``truncate_left``), ``pad_token_id``.
    Index ``i`` refers to the kept rows in order (``len(dataset)`` of them).
    Raises OverlongPromptError (policy ``error``) naming the row index, uid, file and length;
    ValueError when the tokenizer has neither a pad nor an EOS token, or no chat template
    while ``data.apply_chat_template`` is on.
    """

    def __init__(self, rows: Sequence[Row], tokenizer: Any, data_cfg: DataConfig) -> None:
        self.tokenizer = tokenizer
        self.cfg = data_cfg
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        if pad is None:
            raise ValueError("the tokenizer has no pad token and no EOS token to pad prompts with")
        self.pad_token_id = int(pad)
        texts = [self._render(r) for r in rows]
        ids = self._tokenize(texts)
        self.rows: list[Row] = []
        self.texts: list[str] = []
        self.ids: list[list[int]] = []
        self.filtered, self.truncated = 0, 0
        self.filtered_uids: list[str] = []
        limit = data_cfg.max_prompt_tokens
        for i, (row, text, tokens) in enumerate(zip(rows, texts, ids, strict=True)):
            if len(tokens) > limit:
                if data_cfg.overlong_prompt == "error":
                    raise OverlongPromptError(
                        f"prompt of row {i} (uid {row.uid}, {row.source} row {row.index}) is {len(tokens)} tokens, "
                        f"longer than data.max_prompt_tokens={limit}; set data.overlong_prompt=filter or truncate_left"
                    )
                if data_cfg.overlong_prompt == "filter":
                    self.filtered += 1
                    self.filtered_uids.append(row.uid)
                    continue
                tokens = tokens[-limit:]
                text = tokenizer.decode(tokens, skip_special_tokens=False)
                self.truncated += 1
            self.rows.append(row)
            self.texts.append(text)
            self.ids.append(tokens)

    def _render(self, row: Row) -> str:
        if isinstance(row.prompt, str):
            return row.prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; set one or data.apply_chat_template=false")
        return self.tokenizer.apply_chat_template(row.prompt, tokenize=False, add_generation_prompt=True)

    def _tokenize(self, texts: list[str]) -> list[list[int]]:
        if not texts:
            return []
        if not self.cfg.apply_chat_template:
            return [list(x) for x in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]
        ids = [list(x) for x in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        bos = self.tokenizer.bos_token_id
        if bos is not None and self._tokenizer_adds_bos():
            ids = [x if x[:1] == [bos] else [bos, *x] for x in ids]
        return ids

    def _tokenizer_adds_bos(self) -> bool:
        probe = self.tokenizer("a", add_special_tokens=True)["input_ids"]
        return len(probe) > 0 and probe[0] == self.tokenizer.bos_token_id

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict[str, Any]:
        row = self.rows[i]
        return {"uid": row.uid, "prompt_ids": self.ids[i], "raw_prompt": self.texts[i], "data_source": row.data_source,
                "ground_truth": row.ground_truth, "extra_info": row.extra_info}  # fmt: skip

    def collate(self, indices: Sequence[int]) -> Batch:
        """A Batch of prompts ``indices``: ``prompt_ids`` [B, P] int64 left-padded with
        ``pad_token_id`` (P = longest prompt among them), ``prompt_mask`` [B, P] bool (True =
        token), non-tensors ``uid``, ``data_source``, ``ground_truth``, ``extra_info``,
        ``raw_prompt`` (the rendered prompt text), ``raw_chat`` (the row's chat messages, or None
        for a plain-text prompt: a reward model re-renders them with its own chat template)."""
        if not indices:
            raise ValueError("collate of no indices")
        width = max(len(self.ids[i]) for i in indices)
        prompt_ids = torch.full((len(indices), width), self.pad_token_id, dtype=torch.int64)
        prompt_mask = torch.zeros((len(indices), width), dtype=torch.bool)
        for r, i in enumerate(indices):
            n = len(self.ids[i])
            prompt_ids[r, width - n :] = torch.tensor(self.ids[i], dtype=torch.int64)
            prompt_mask[r, width - n :] = True
        rows = [self.rows[i] for i in indices]
        non_tensors = {
            "uid": [r.uid for r in rows],
            "data_source": [r.data_source for r in rows],
            "ground_truth": [r.ground_truth for r in rows],
            "extra_info": [r.extra_info for r in rows],
            "raw_prompt": [self.texts[i] for i in indices],
            "raw_chat": [r.prompt if isinstance(r.prompt, list) else None for r in rows],
        }
        return Batch.from_dict({"prompt_ids": prompt_ids, "prompt_mask": prompt_mask}, non_tensors)


__all__ = ["PromptDataset", "OverlongPromptError"]
