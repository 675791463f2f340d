"""Sequence bookkeeping: position ids, response masks, DAPO overlong shaping."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Position ids that ignore left padding: cumsum(mask) − 1, clipped at 0.

    attention_mask: [batch, seq] bool/int (True/1 = real token). Returns [batch, seq] int64.
    Left pads get 0; the first real token gets 0; a right pad repeats the last real position.
    Example: [0, 0, 1, 1, 1] → [0, 0, 0, 1, 2]. So a sequence's positions (and log-probs) do
    not depend on how many pads precede it.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def response_mask_from_ids(
    response_ids: Tensor, stop_token_ids: Iterable[int], response_lengths: Tensor | None = None
) -> Tensor:
    """Which response positions count: up to and including the first stop token.

    response_ids: [batch, response_len] int64, right padded. stop_token_ids: the ids that end a
    response (EOS, and any extra stop ids). response_lengths: optional [batch] int, the number of
    tokens the engine generated; positions at or past it never count (this is what marks the end
    of a response that was truncated at the length limit and so has no stop token). Without it,
    a response with no stop token counts to the end of the row.
    Returns [batch, response_len] bool. Example, stop ids {2, 3}: [11, 12, 3, 0, 0] →
    [T, T, T, F, F]; no stop token, length 3: [5, 7, 9, 0, 0] → [T, T, T, F, F].
    """
    stops = torch.as_tensor(list(stop_token_ids), dtype=response_ids.dtype, device=response_ids.device)
    is_stop = torch.isin(response_ids, stops).long()
    stops_before = is_stop.cumsum(-1) - is_stop  # stop tokens strictly before each position
    mask = stops_before == 0
    if response_lengths is not None:
        positions = torch.arange(response_ids.shape[-1], device=response_ids.device)
        mask &= positions < torch.as_tensor(response_lengths, device=response_ids.device).unsqueeze(-1)
    return mask


def overlong_penalty(
    response_lengths: Tensor, *, max_response_tokens: int, buffer_tokens: int, penalty_factor: float
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, §3.4, Eq. 13).

    response_lengths: [batch] int/float, tokens in each response. With L_max = max_response_tokens
    and L_cache = buffer_tokens the penalty (added to the score) is
    0 for |y| ≤ L_max − L_cache; (L_max − L_cache − |y|) / L_cache · penalty_factor inside the
    buffer; −penalty_factor at |y| ≥ L_max (clamped there). buffer_tokens = 0 gives no penalty
    (no ramp; responses cannot exceed L_max). Returns [batch] float32, ≤ 0.
    Example: L_max 20, buffer 4, factor 1: lengths 16, 18, 20 → 0, −0.5, −1.
    """
    if buffer_tokens < 0 or buffer_tokens > max_response_tokens:
        raise ValueError(f"buffer_tokens={buffer_tokens} must be in [0, max_response_tokens={max_response_tokens}]")
    lengths = torch.as_tensor(response_lengths).to(torch.float32)
    if buffer_tokens == 0:
        return torch.zeros_like(lengths)
    exceed = lengths - (max_response_tokens - buffer_tokens)
    penalty = torch.clamp(-exceed / buffer_tokens * penalty_factor, min=-penalty_factor, max=0.0)
    return penalty + 0.0  # −0.0 → 0.0


__all__ = ["position_ids_from_mask", "response_mask_from_ids", "overlong_penalty"]
