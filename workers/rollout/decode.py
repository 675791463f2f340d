"""The hf engine's own decode loop: a row leaves the decode batch and its KV cache when it finishes.

transformers' ``generate`` computes every row of a batch until the longest row finishes (a
finished row keeps being fed padding), so with response lengths from 3 to 48 tokens most of a
step's work can go to rows whose output is already fixed. Here each step feeds only the live
rows; when rows finish (a stop token, or the length limit), they are dropped from the input,
the attention mask and every layer's KV cache (one ``index_select`` per layer, the same gather
the shared-prompt cache uses). The loop computes exactly Σ response lengths row-steps, where
``generate`` computes rows × the longest length.

Sampling is :func:`pick_tokens`, the step of the engine's ``RolloutSampler``: the same
temperature / top-k / top-p, the same inverse-CDF draw from a per-trajectory row of uniforms, the
log-prob of the *full* distribution at logits / T. Positions come from the attention mask, as in
``generate``. So greedy tokens are ``generate``'s and log-probs agree to float rounding (the
batch a row is computed in changes, so matrix products may round differently in the last bits;
the equality tests in tests/unit/test_rollout_decode.py bound that).

Prior art: vLLM and SGLang schedule at token level (continuous batching); transformers'
``generate_batch`` does the same but returns no per-token log-probs of the full distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.shared_prefix import forward_kwargs, gather_rows

if TYPE_CHECKING:
    from workers.rollout.compiled import CompiledDecodeStep


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
    scaled = scores if sampling.greedy else scores / sampling.temperature
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


@dataclass
class DecodeResult:
    """response_ids [N, R] int64 (``pad_token_id`` after a row's end), log_probs [N, R] float32
    (0 after a row's end), row_steps: the rows fed to the model summed over decode steps (the
    decode work), useful_row_steps: Σ response lengths (row_steps ≥ useful_row_steps)."""

    response_ids: Tensor
    log_probs: Tensor
    row_steps: int
    useful_row_steps: int


def decode(
    model: nn.Module, ids: Tensor, mask: Tensor, sampling, uniforms: Tensor | None, pad_token_id: int, *,
    prefix_cache: dict[str, object] | None = None, on_finished: Callable[[int], None] | None = None,
    step: CompiledDecodeStep | None = None,
) -> DecodeResult:
    """Generate up to ``sampling.max_new_tokens`` tokens for each of N left-padded rows.

    ids / mask: [N, L] int64 / bool, every row ending in a real token (left padding), on the
    model's device. uniforms: [N, max_new_tokens] (None when greedy). prefix_cache: the model's
    cache kwarg covering the first L-1 columns of all N rows (``workers.shared_prefix.
    shared_prompt_cache``); without it those columns are prefilled here. on_finished(k) is called
    with the number of rows finished so far whenever it grows. Raises ValueError when a row ends
    in padding. Runs under ``torch.no_grad``; the caller sets eval mode. step: run each decode
    step compiled on a static KV cache (:func:`workers.rollout.compiled.decode_static`,
    ``rollout.compile``); ``model`` must then be ``step.model``.
    """
    if not bool(mask[:, -1].all()):
        raise ValueError("decode: every prompt row must end in a real token (left padding)")
    if step is not None:
        if step.model is not model:
            raise ValueError("decode: step was compiled for another model")
        from workers.rollout.compiled import decode_static

        return decode_static(step, ids, mask, sampling, uniforms, pad_token_id, prefix_cache=prefix_cache,
                             on_finished=on_finished)  # fmt: skip
    name, keep_last = forward_kwargs(model)
    if name is None:
        raise ValueError(f"decode: {type(model).__name__}.forward takes no KV cache argument")
    n_rows = ids.shape[0]
    stops = torch.as_tensor(list(sampling.stop_token_ids), dtype=torch.int64, device=ids.device)
    positions = position_ids_from_mask(mask)
    attn = mask.long()
    with torch.no_grad():
        cache = prefill(model, ids, mask, positions, prefix_cache)
        feed, pos = ids[:, -1:], positions[:, -1:]
        alive = torch.arange(n_rows, device=ids.device)  # original row of each live row
        tokens = torch.full((n_rows, sampling.max_new_tokens), pad_token_id, dtype=torch.int64, device=ids.device)
        log_probs = torch.zeros((n_rows, sampling.max_new_tokens), dtype=torch.float32, device=ids.device)
        row_steps, steps, finished = 0, 0, 0
        for step in range(sampling.max_new_tokens):
            kwargs = {name: cache} if cache is not None else {}
            out = model(input_ids=feed, attention_mask=attn, position_ids=pos, use_cache=True, **kwargs, **keep_last)
            cache = getattr(out, name)
            if cache is None:
                raise ValueError(f"decode: {type(model).__name__} returned no KV cache under use_cache=True; set "
                                 "rollout.drop_finished_rows=false to decode with transformers' generate")
            row_steps += len(alive)
            steps = step + 1
            token, done = take_step(out.logits[:, -1].float(), sampling, uniforms, alive, step, stops, tokens, log_probs)
            if step + 1 == sampling.max_new_tokens or bool(done.all()):
                break
            if bool(done.any()):
                stay = (~done).nonzero().squeeze(1)
                alive, token, pos, attn = alive[stay], token[stay], pos[stay], attn[stay]
                gather_rows(cache, stay)
                finished = n_rows - len(alive)
                if on_finished is not None:
                    on_finished(finished)
            attn = torch.cat([attn, attn.new_ones((len(alive), 1))], 1)
            feed, pos = token.unsqueeze(1), pos + 1
    tokens, log_probs = tokens[:, :steps], log_probs[:, :steps]
    return DecodeResult(tokens, log_probs, row_steps, _useful_row_steps(tokens, stops))


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


def _useful_row_steps(tokens: Tensor, stops: Tensor) -> int:
    """Σ over rows of the response length (up to and including the first stop token)."""
    if tokens.shape[1] == 0:
        return 0
    hit = torch.isin(tokens, stops) if len(stops) else torch.zeros_like(tokens, dtype=torch.bool)
    first = torch.where(hit.any(1), hit.int().argmax(1) + 1, torch.full_like(tokens[:, 0], tokens.shape[1]))
    return int(first.sum())


__all__ = ["DecodeResult", "decode", "pick_tokens", "prefill", "take_step", "top_k_top_p_filter"]
