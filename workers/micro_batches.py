"""Helpers shared by the policy, reference and critic workers: dropout off, micro-batch order by
length, and chunked no-grad inference with trimmed padding."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from hybridflow.batch import Batch
from workers import distributed as D
from workers.shared_prefix import prompt_groups


def disable_dropout(module: nn.Module) -> nn.Module:
    """Set every dropout probability to 0 (as TRL's ``disable_dropout_in_model``), so train-mode
    forward passes equal eval-mode ones and recomputed log-probs match the rollout's."""
    for m in module.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    for name in ("attention_dropout", "hidden_dropout", "resid_pdrop", "attn_pdrop", "embd_pdrop", "dropout"):
        cfg = getattr(module, "config", None)
        if cfg is not None and isinstance(getattr(cfg, name, None), float):
            setattr(cfg, name, 0.0)
    return module


def by_length(batch: Batch, rows: Tensor, *, group_by_prompt: bool = False) -> Tensor:
    """``rows`` reordered by their token count (prompt + response mask), shortest first, ties in
    the given order, so consecutive micro-batches hold similar lengths and trim well.
    group_by_prompt: rows of one prompt stay together (groups in order of first appearance),
    by length within the group."""
    if len(rows) == 0:
        return rows
    counts = torch.as_tensor(batch.token_counts())[rows]
    key = counts
    if group_by_prompt and "prompt_ids" in batch:
        groups = prompt_groups(batch["prompt_ids"][rows], batch["prompt_mask"][rows])
        if groups is not None:
            first, inverse = groups
            key = first[inverse] * (int(counts.max()) + 1) + counts
    return rows[torch.sort(key, stable=True).indices]


def chunked_inference(model: nn.Module, batch: Batch, micro: int, fn: Callable[[Batch], Any]) -> list[Any]:
    """``fn(chunk)`` under ``torch.no_grad`` over consecutive chunks of ``micro`` rows, in order.

    Each chunk is trimmed of its all-padding columns (:meth:`Batch.trim_padding`) before ``fn``
    sees it; ``fn`` returns a response-aligned tensor [rows, chunk response_len] or a tuple of
    them, and each is right-padded with zeros back to the batch's response_len, so the parts
    concatenate to [B, response_len]. Under FSDP2 every forward is a collective, so all ranks
    run the same number of passes: a rank with fewer chunks runs extra passes on its first row
    and drops their results.
    """
    chunks = batch.chunk(micro)
    n = len(chunks)
    if D.is_fsdp(model):
        n = int(D.all_reduce_max(torch.tensor([n], dtype=torch.float64)).item())
    width = batch["response_mask"].shape[1] if "response_mask" in batch else None
    out = []
    with torch.no_grad():
        for i in range(n):
            if i < len(chunks):
                out.append(_pad_response_width(fn(chunks[i].trim_padding()), width))
            else:
                fn(batch.index([0]).trim_padding())
    return out


def _pad_response_width(result: Any, width: int | None) -> Any:
    if isinstance(result, tuple):
        return tuple(_pad_response_width(r, width) for r in result)
    if width is None or not isinstance(result, Tensor) or result.dim() != 2 or result.shape[1] >= width:
        return result
    return torch.nn.functional.pad(result, (0, width - result.shape[1]))


__all__ = ["disable_dropout", "by_length", "chunked_inference"]
