"""Sampling inside transformers' ``generate`` for the hf engine's generate path (multi-turn
calls, and single-turn calls with ``rollout.drop_finished_rows: false``): :class:`RolloutSampler`,
the call's only logits processor, :func:`clean_generation_config`, and :class:`Interrupt` (the
``interrupt`` of :meth:`workers.rollout.hf.HFRolloutEngine.generate` as a stopping criterion).

The sampler records log softmax(logits / T) of the *full* distribution (before top-k / top-p)
and gathers the chosen token's value one step later — the quantity the trainer recomputes
(``hybridflow.algorithms.log_probs_from_logits(logits, ids, temperature=T)``); greedy uses T = 1.
It picks the token with :func:`workers.rollout.decode_step.pick_tokens` (temperature, top-k, top-p,
inverse-CDF draw from the call's uniforms) and returns a one-hot score row, so ``generate`` runs
in greedy mode (``do_sample=False``) and takes that token.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from transformers import GenerationConfig, LogitsProcessor, StoppingCriteria

from workers.rollout.base import SamplingParams
from workers.rollout.decode_step import pick_tokens


class RolloutSampler(LogitsProcessor):
    """The only logits processor of a rollout ``generate`` call (see the module docstring).

    uniforms: [N, max_new_tokens] float in [0, 1), row r = trajectory r (None when greedy).
    After ``generate``, :meth:`log_probs` returns [N, R] float32 for the R generated steps.
    """

    def __init__(self, sampling: SamplingParams, prompt_len: int, uniforms: Tensor | None) -> None:
        self.sampling = sampling
        self.prompt_len = prompt_len
        self.uniforms = uniforms
        self._pending: Tensor | None = None  # log-probs of the latest step, awaiting its token
        self._chosen: list[Tensor] = []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        step = input_ids.shape[1] - self.prompt_len
        if step > len(self._chosen):  # the previous step's token is now known
            self._chosen.append(self._pending.gather(1, input_ids[:, -1:]).squeeze(1))
        col = min(step, self.uniforms.shape[1] - 1) if self.uniforms is not None else 0  # a deferred extra step reuses the last
        token, self._pending = pick_tokens(scores, self.sampling, None if self.uniforms is None else self.uniforms[:, col])
        if self.sampling.greedy:
            return scores
        # generate hands us its own float32 copy of the logits (already consumed above): reuse it
        return scores.fill_(float("-inf")).scatter_(1, token.unsqueeze(1), 0.0)

    def log_probs(self, response_ids: Tensor) -> Tensor:
        """[N, R] float32: the chosen tokens' log-probs, R = response_ids.shape[1]."""
        steps = response_ids.shape[1]
        if len(self._chosen) < steps:  # the last step's token was never fed back
            self._chosen.append(self._pending.gather(1, response_ids[:, steps - 1 : steps]).squeeze(1))
        if steps == 0:
            return torch.zeros(response_ids.shape, dtype=torch.float32)
        return torch.stack(self._chosen[:steps], dim=1).float()


@contextmanager
def clean_generation_config(model: nn.Module) -> Iterator[None]:
    """Swap the underlying HF model's generation_config for a default one during the call.

    ``generate`` fills unset fields from ``model.generation_config`` (it may set do_sample,
    top_k, repetition_penalty, ...); those would change the distribution we report.
    """
    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    saved = target.generation_config
    target.generation_config = GenerationConfig()
    try:
        yield
    finally:
        target.generation_config = saved


class Interrupt(StoppingCriteria):
    """transformers' ``generate`` path of :meth:`HFRolloutEngine.generate`'s ``interrupt``: every
    row stops once ``interrupt(new tokens so far)`` says so."""

    def __init__(self, interrupt: Callable[[int], bool], prompt_len: int) -> None:
        self.interrupt, self.prompt_len = interrupt, prompt_len

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        stop = bool(self.interrupt(input_ids.shape[1] - self.prompt_len))
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)


__all__ = ["Interrupt", "RolloutSampler", "clean_generation_config"]
