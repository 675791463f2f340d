"""``rollout.partial: pause`` on the hf engine: new weights loaded in place between two decode steps.

:meth:`workers.rollout.hf.HFRolloutEngine.generate` with ``interrupt=`` and ``pause=`` (capability
``partial_rollout_pause``): when ``interrupt(k)`` says True after the k-th decode step of a chunk of
rows, the engine's own decode loop (:func:`workers.rollout.decode.decode`) calls ``pause(unfinished)``
while no step runs. ``pause`` loads the new weights into the engine's module in place (the streaming
rollout's ``load_newest``: ``load_state_dict`` into the inference module the engine generates on, or
``load_weights``); when it returns True the same rows go on, on the KV cache they hold — the keys and
values of the prompt and of the first k-1 tokens stay those the old weights computed, as in vLLM's
pause (``workers/rollout/vllm_steps.py``), prime-rl, OpenRLHF and SkyRL.

What makes that honest is that no step after the load reads an old copy of the weights. The decode
path keeps these, each rebuilt here from the module right after ``pause`` returns
(:meth:`InPlacePause.refresh`):

* the fused decoder's prepared weights (:class:`workers.rollout.fused_decode.FusedDecoder`: packed
  q/k/v, o, gate/up, down and LM-head products, norms, biases, the embedding in the decode dtype):
  :meth:`~workers.rollout.fused_decode.FusedDecoder.prepare_weights`; its KV cache is kept;
* the oneDNN-packed linear weights (``rollout.packed_weights``, LoRA's adapters included):
  :func:`workers.rollout.packed_weights.repack_linears`;
* autocast's cache of low-precision weight casts (``rollout.dtype: bfloat16`` on float32 weights
  without packing: inside one autocast block a parameter that requires grad is cast once and the
  cast reused, keyed by the tensor, so an in-place copy would not be seen): ``torch.clear_autocast_cache``;
* a compiled step (``rollout.compile``) reads the parameters as graph inputs on every call (inductor
  without ``freezing``), so it needs nothing; with ``torch._inductor.config.freezing`` the weights
  are constants of the graph and pause is refused.

transformers' ``generate`` (``rollout.drop_finished_rows: false``, or a model whose forward takes no
KV cache) has no place between steps to load weights and refresh these: pause is refused there in
one line (the config refuses ``drop_finished_rows: false`` with ``partial: pause`` up front).
``weight_epochs`` of the output counts, per token, the resumed loads before it was sampled.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from workers.rollout.base import RolloutOutput
from workers.rollout.packed_weights import repack_linears
from workers.shared_prefix import forward_kwargs


def why_not_pause(engine: Any) -> str | None:
    """Why ``engine`` (an :class:`~workers.rollout.hf.HFRolloutEngine`) cannot pause in place (one
    line), None when it can."""
    if not engine.drop_finished_rows:
        return ("rollout.partial=pause needs rollout.drop_finished_rows=true: transformers' generate has no "
                "place between decode steps to load weights (use rollout.partial=abort)")
    if forward_kwargs(engine.model)[0] is None:
        return (f"rollout.partial=pause: {type(engine.model).__name__}.forward takes no KV cache, so the engine "
                "decodes with transformers' generate (use rollout.partial=abort)")
    from torch._inductor import config as inductor

    if engine.compiled_step is not None and inductor.freezing:
        return ("rollout.partial=pause with rollout.compile under torch._inductor.config.freezing: the compiled "
                "step holds the weights as constants (use rollout.partial=abort or turn freezing off)")
    return None


class InPlacePause:
    """One ``generate`` call's pauses: the wrapped ``interrupt`` / ``pause`` handed to the decode loop,
    the refresh after each load, and the tokens' ``weight_epochs``.

    engine: the hf engine (raises ValueError with :func:`why_not_pause`'s line where it cannot pause);
    interrupt / pause: the caller's (``pause`` returning False must not have loaded anything: the
    chunk then ends as with ``rollout.partial: abort``). ``epoch``: resumed loads so far in the call.
    """

    def __init__(self, engine: Any, interrupt: Callable[[int], bool] | None, pause: Callable[[int], bool]) -> None:
        if interrupt is None:
            raise ValueError("generate(pause=...) needs interrupt=: pause is asked only when interrupt says True")
        reason = why_not_pause(engine)
        if reason is not None:
            raise ValueError(reason)
        self.engine, self._interrupt, self._pause = engine, interrupt, pause
        self.epoch = 0
        self._base = 0  # epoch when the current chunk of rows started
        self._asked = 0  # the k of the last interrupt(k)
        self._marks: list[int] = []  # per resumed pause of this chunk: tokens each row had before it

    def start_chunk(self) -> None:
        """A new chunk of rows (prefilled under the weights loaded now) starts decoding."""
        self._base, self._marks = self.epoch, []

    def interrupt(self, k: int) -> bool:
        self._asked = k
        return bool(self._interrupt(k))

    def __call__(self, unfinished: int) -> bool:
        """The decode loop's ``pause``: the caller's, then every derived weight form rebuilt (also when
        it returned False, so nothing stale can outlive it)."""
        try:
            resumed = bool(self._pause(unfinished))
        finally:
            self.refresh()
        if resumed:
            self.epoch += 1
            self._marks.append(self._asked)
        return resumed

    def refresh(self) -> None:
        """Rebuild, from the engine's module as it is now, each copy of its weights the decode path
        holds (see the module docstring)."""
        engine = self.engine
        with torch.no_grad():
            if engine._fused is not None:
                engine._fused.prepare_weights()
            if engine.packed_linears:
                repack_linears(engine.model, engine._pack_hint, engine._cast_dtype())
        torch.clear_autocast_cache()

    def with_epochs(self, out: RolloutOutput) -> RolloutOutput:
        """``out`` (one chunk of rows) with ``weight_epochs`` [rows, R] int64: the call's epoch when the
        chunk started plus the resumed pauses before each token (0 outside the mask)."""
        rows, length = out.response_ids.shape
        t = torch.arange(length).unsqueeze(0)
        epochs = torch.full((rows, length), self._base, dtype=torch.int64)
        for k in self._marks:  # token t (0-based) came after a pause at k tokens when t >= k
            epochs += (t >= k).long()
        return dataclasses.replace(out, weight_epochs=epochs.masked_fill(~out.response_mask, 0))


__all__ = ["InPlacePause", "why_not_pause"]
