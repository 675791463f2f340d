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
from typing import Protocol

import torch
from torch import Tensor, nn

from hybridflow.algorithms.sequences import position_ids_from_mask
from workers.rollout.compiled import CompiledDecodeStep, decode_static
from workers.rollout.decode_step import (
    DecodeResult,
    pick_tokens,
    prefill,
    take_step,
    top_k_top_p_filter,
    useful_row_steps,
)
from workers.shared_prefix import forward_kwargs, gather_rows


class DecodeSteps(Protocol):
    """What the decode loop runs: one step for the live rows, and dropping finished rows."""

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        """tokens / positions [n] int64 of the n live rows → next-token logits [n, V] float32;
        the tokens join the rows' KV cache."""
        ...

    def keep_rows(self, stay: Tensor) -> None:
        """Keep only the live rows ``stay`` ([k] int64, increasing) from now on."""
        ...


class ModelSteps:
    """Decode steps through the model's own forward on a transformers KV cache.

    ids / mask / positions: [N, L] the prompts (int64 / bool / int64); their first L-1 columns are
    prefilled here (:func:`prefill`) unless ``prefix_cache`` holds them. Each step appends a mask
    column for the fed token. Raises ValueError when the model's forward takes no KV cache, or
    returns none."""

    def __init__(self, model: nn.Module, ids: Tensor, mask: Tensor, positions: Tensor,
                 prefix_cache: dict[str, object] | None = None) -> None:  # fmt: skip
        self.name, self.keep_last = forward_kwargs(model)
        if self.name is None:
            raise ValueError(f"decode: {type(model).__name__}.forward takes no KV cache argument")
        self.model, self.attn = model, mask.long()
        self.cache = prefill(model, ids, mask, positions, prefix_cache)

    def step(self, tokens: Tensor, positions: Tensor) -> Tensor:
        kwargs = {self.name: self.cache} if self.cache is not None else {}
        out = self.model(input_ids=tokens.unsqueeze(1), attention_mask=self.attn, position_ids=positions.unsqueeze(1),
                         use_cache=True, **kwargs, **self.keep_last)  # fmt: skip
        self.cache = getattr(out, self.name)
        if self.cache is None:
            raise ValueError(f"decode: {type(self.model).__name__} returned no KV cache under use_cache=True; set "
                             "rollout.drop_finished_rows=false to decode with transformers' generate")
        self.attn = torch.cat([self.attn, self.attn.new_ones((len(tokens), 1))], 1)
        return out.logits[:, -1].float()

    def keep_rows(self, stay: Tensor) -> None:
        self.attn = self.attn[stay]
        gather_rows(self.cache, stay)


def decode(
    model: nn.Module, ids: Tensor, mask: Tensor, sampling, uniforms: Tensor | None, pad_token_id: int, *,
    prefix_cache: dict[str, object] | None = None, on_finished: Callable[[int], None] | None = None,
    step: CompiledDecodeStep | None = None, steps: DecodeSteps | None = None,
    interrupt: Callable[[int], bool] | None = None, pause: Callable[[int], bool] | None = None,
) -> DecodeResult:
    """Generate up to ``sampling.max_new_tokens`` tokens for each of N left-padded rows.

    ids / mask: [N, L] int64 / bool, every row ending in a real token (left padding), on the
    model's device. uniforms: [N, max_new_tokens] (None when greedy). prefix_cache: the model's
    cache kwarg covering the first L-1 columns of all N rows (``workers.shared_prefix.
    shared_prompt_cache``); without it those columns are prefilled here. on_finished(k) is called
    with the number of rows finished so far whenever it grows. Raises ValueError when a row ends
    in padding. Runs under ``torch.no_grad``; the caller sets eval mode. step: run each decode
    step compiled on a static KV cache (:func:`workers.rollout.compiled.decode_static`,
    ``rollout.compile``); ``model`` must then be ``step.model``. steps: the decode steps to run,
    already holding the KV cache of the first L-1 columns of the N rows (a
    :class:`workers.rollout.fused_decode.FusedDecoder` after its ``prefill``); by default
    :class:`ModelSteps`, the model's own forward after :func:`prefill`. interrupt(k) is called after
    the k-th decode step (k ≥ 1) while rows are still unfinished; True ends the call there: every
    row keeps the k tokens it has (an unfinished row ends without a stop token, shorter than
    ``max_new_tokens``), and its caller may continue it later as a prefix (the streaming rollout,
    :mod:`workers.group_stream`, ends a call so when newer weights arrive). pause(unfinished): asked
    when ``interrupt`` said True, between two steps; True means it loaded new weights into the model
    in place (and the caller refreshed what ``steps`` / ``step`` derive from them), and the live rows
    go on from the KV cache they have (``rollout.partial: pause``); False ends the call as without it.
    """
    if not bool(mask[:, -1].all()):
        raise ValueError("decode: every prompt row must end in a real token (left padding)")
    if step is not None:
        if step.model is not model:
            raise ValueError("decode: step was compiled for another model")
        return decode_static(step, ids, mask, sampling, uniforms, pad_token_id, prefix_cache=prefix_cache,
                             on_finished=on_finished, interrupt=interrupt, pause=pause)  # fmt: skip
    n_rows = ids.shape[0]
    stops = torch.as_tensor(list(sampling.stop_token_ids), dtype=torch.int64, device=ids.device)
    positions = position_ids_from_mask(mask)
    with torch.no_grad():
        if steps is None:
            steps = ModelSteps(model, ids, mask, positions, prefix_cache)
        feed, pos = ids[:, -1], positions[:, -1]
        alive = torch.arange(n_rows, device=ids.device)  # original row of each live row
        tokens = torch.full((n_rows, sampling.max_new_tokens), pad_token_id, dtype=torch.int64, device=ids.device)
        log_probs = torch.zeros((n_rows, sampling.max_new_tokens), dtype=torch.float32, device=ids.device)
        row_steps, done_steps, finished = 0, 0, 0
        for t in range(sampling.max_new_tokens):
            logits = steps.step(feed, pos)
            row_steps += len(alive)
            done_steps = t + 1
            token, done = take_step(logits, sampling, uniforms, alive, t, stops, tokens, log_probs)
            if t + 1 == sampling.max_new_tokens or bool(done.all()):
                break
            if interrupt is not None and interrupt(t + 1) and not (pause is not None and pause(int((~done).sum()))):
                break  # (a pause that resumed loaded new weights in place: the live rows go on, on their KV)
            if bool(done.any()):
                stay = (~done).nonzero().squeeze(1)
                alive, token, pos = alive[stay], token[stay], pos[stay]
                steps.keep_rows(stay)
                finished = n_rows - len(alive)
                if on_finished is not None:
                    on_finished(finished)
            feed, pos = token, pos + 1
    tokens, log_probs = tokens[:, :done_steps], log_probs[:, :done_steps]
    return DecodeResult(tokens, log_probs, row_steps, useful_row_steps(tokens, stops))


__all__ = ["DecodeResult", "DecodeSteps", "ModelSteps", "decode", "pick_tokens", "prefill", "take_step", "top_k_top_p_filter"]
