"""Whole multi-turn groups for the streaming rollout (``trainer.async_mode: stream`` with
``rollout.tools`` / ``rollout.environment``; docs/async.md "Streaming").

:class:`workers.group_stream.GroupStreamer` hands a multi-turn call's groups to
:class:`MultiTurnGroups`, which runs them through
:meth:`workers.rollout.multi_turn.MultiTurnRollout.generate` — every turn with the environments,
sticky environments kept in their worker — and writes each row's tokens, log-probs, per-token
versions and finish reason, and the group's multi-turn fields (model mask, conversation starts,
per-row non-tensors, metrics), into the streamer's groups. A model turn is never cut: with
``between_turns`` (``rollout.partial: abort``) the newest weights in the inbox load before each
model turn, after the environments' step; the environments are not touched by a load.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hybridflow.batch import Batch


class MultiTurnGroups:
    """See the module docstring. loop: a MultiTurnRollout; between_turns: load newer weights
    between turns; load_newest / version: the streamer's (``() -> int``: load the newest weights in
    the inbox, the loaded version); stopping: ``() -> bool``, the streamer is stopping (no more
    loads); count: ``(stat, by)`` adds to the streamer's counters."""

    def __init__(self, loop: Any, *, between_turns: bool, load_newest: Callable[[], int], version: Callable[[], int],
                 stopping: Callable[[], bool], count: Callable[[str, float], None]) -> None:
        self.loop, self.between_turns = loop, between_turns
        self._load_newest, self._version, self._stopping, self._count = load_newest, version, stopping, count
        self._turn_version, self._started = 0, False

    def generate(self, groups: list[Any], ids: torch.Tensor, mask: torch.Tensor, sampling: Any) -> None:
        """Generate ``groups`` (the streamer's ``_Group``s, prompts ``ids``/``mask`` [G, W] left
        padded) whole, ``sampling.n`` trajectories each, and fill their rows and ``multi_turn``
        records. The caller holds the streamer's lock and has woken the engine."""
        keys = sorted({k for g in groups for k in g.fields})
        batch = Batch.from_dict({"prompt_ids": ids, "prompt_mask": mask},
                                {k: [g.fields.get(k) for g in groups] for k in keys})
        self._turn_version, self._started = self._version(), False
        out = self.loop.generate(batch, sampling, before_turn=self._before_turn, per_prompt_metrics=True)
        n = sampling.n
        real = out.response_mask | out.observation_mask
        for i, g in enumerate(groups):
            span = range(i * n, (i + 1) * n)
            for k, row in zip(span, g.rows, strict=True):
                m = int(real[k].sum())
                row.tokens = out.response_ids[k, :m].tolist()
                row.log_probs = out.rollout_log_probs[k, :m].float().tolist()
                row.versions = out.token_versions[k, :m].tolist()
                row.finish = out.finish_reason[k]
                self._count("tokens", int(out.response_mask[k].sum()))
                self._count("chunks", 1)
            g.multi_turn = {
                "model_mask": [out.response_mask[k, :len(r.tokens)].tolist() for k, r in zip(span, g.rows, strict=True)],
                "prompts": [out.prompt_ids[k][out.prompt_mask[k]].tolist() for k in span],
                "non_tensors": {key: [vals[k] for k in span] for key, vals in out.non_tensors.items()},
                "metrics": out.prompt_metrics[i],
            }

    def _before_turn(self, live: int) -> int:
        """Before each model turn (``live`` trajectories go on): with ``between_turns`` load the
        newest weights in the inbox (a load after the first turn interrupts the ``live`` rows).
        Returns the version the turn is generated with."""
        if self.between_turns and not self._stopping():
            loaded = self._load_newest()
            if loaded != self._turn_version:
                self._count("weight_loads", 1)
                self._count("interrupted_rows", live if self._started else 0)
                self._turn_version = loaded
        self._started = True
        self._count("turns", 1)
        return self._version()


__all__ = ["MultiTurnGroups"]
