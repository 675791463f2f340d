"""The pieces of one decode step shared by the hf engine's two decode loops, the eager one
(:func:`workers.rollout.decode.decode`) and the compiled one
(:func:`workers.rollout.compiled.decode_static`): picking the next token (:func:`pick_tokens`,
:func:`take_step`), the prompt's prefill (:func:`prefill`) and the result (:class:`DecodeResult`).

Both loops import from here, so neither imports the other's internals (``decode`` calls
``decode_static`` when given a compiled step; ``compiled`` no longer imports ``decode``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from workers.shared_prefix import forward_kwargs


def top_k_top_p_filter(scaled: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k, then outside the top-p nucleus, to -inf (keeps ≥ 1 token).

    scaled: [B, V] float logits already divided by T. top_k ≤ 0 / top_p = 1 disable a filter.
    Semantics of HF's TopK/TopPLogitsWarper and vLLM's sampler (Holtzman et al. 2019).
    """
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum <= 1 - top_p
        drop[:, -1] = False
        scaled = scaled.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return scaled


def pick_tokens(scores: Tensor, sampling, uniforms: Tensor | None) -> tuple[Tensor, Tensor]:
    """One sampling step: (token [B] int64, log softmax(scores / T) [B, V] float32).

    scores: [B, V] float32 logits of the last position. Greedy (``sampling.greedy``) takes the
    argmax and reports log-probs at T = 1. Otherwise temperature, top-k and top-p, then the
    token whose CDF interval holds ``uniforms`` ([B] float in [0, 1), scaled by the kept mass).
    """
    # at T = 1 the division is skipped: x / 1.0 == x exactly, and it cost ~0.4 ms per step at 32 × 49152
    scaled = scores if sampling.greedy or sampling.temperature == 1.0 else scores / sampling.temperature
    log_probs = torch.log_softmax(scaled, dim=-1)
    if sampling.greedy:
        return scores.argmax(-1), log_probs
    if sampling.top_k > 0 or sampling.top_p < 1.0:
        probs = top_k_top_p_filter(scaled, sampling.top_k, sampling.top_p).softmax(-1)
    else:
        probs = log_probs.exp()
    cdf = probs.cumsum(-1)
    u = uniforms.to(cdf.device).unsqueeze(1) * cdf[:, -1:]
    token = torch.searchsorted(cdf, u, right=True).clamp_(max=scores.shape[-1] - 1).squeeze(1)
    return token, log_probs


def take_step(scores: Tensor, sampling, uniforms: Tensor | None, alive: Tensor, t: int, stops: Tensor,
              tokens: Tensor, log_probs: Tensor) -> tuple[Tensor, Tensor]:
    """Pick the live rows' tokens at step ``t`` from ``scores`` ([live, V] float32, the rows
    ``alive`` index), write them and their log-probs into ``tokens`` / ``log_probs`` [N, T] in
    place, and return (token [live] int64, done [live] bool: the token is a stop)."""
    u = None if uniforms is None else uniforms[alive, t]
    token, lp = pick_tokens(scores, sampling, u)
    tokens[alive, t] = token
    log_probs[alive, t] = lp.gather(1, token.unsqueeze(1)).squeeze(1)
    done = torch.isin(token, stops) if len(stops) else torch.zeros_like(token, dtype=torch.bool)
    return token, done


@dataclass
class DecodeResult:
    """response_ids [N, R] int64 (``pad_token_id`` after a row's end), log_probs [N, R] float32
    (0 after a row's end), row_steps: the rows fed to the model summed over decode steps (the
    decode work), useful_row_steps: Σ response lengths (row_steps ≥ useful_row_steps)."""

    response_ids: Tensor
    log_probs: Tensor
    row_steps: int
    useful_row_steps: int


def prefill(model: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor,
            prefix_cache: dict[str, object] | None) -> object | None:
    """The model's KV cache over the first L-1 columns of the N rows ``ids`` / ``mask`` [N, L]
    (positions [N, L] from the mask): ``prefix_cache``'s when given, else one forward; None for
    one-column prompts. Call under ``torch.no_grad``."""
    name, keep_last = forward_kwargs(model)
    if prefix_cache:
        return prefix_cache[name]
    if ids.shape[1] < 2:
        return None
    out = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1].long(), position_ids=positions[:, :-1],
                use_cache=True, **keep_last)  # fmt: skip
    return getattr(out, name)


def useful_row_steps(tokens: Tensor, stops: Tensor) -> int:
    """Σ over rows of the response length (up to and including the first stop token)."""
    if tokens.shape[1] == 0:
        return 0
    hit = torch.isin(tokens, stops) if len(stops) else torch.zeros_like(tokens, dtype=torch.bool)
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(tokens[:, 0], tokens.shape[1]))
    return int(first.sum())


__all__ = ["DecodeResult", "pick_tokens", "prefill", "take_step", "top_k_top_p_filter", "useful_row_steps"]
