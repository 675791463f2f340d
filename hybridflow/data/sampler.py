"""A resumable prompt sampler: which prompt indices each RL step uses, across epochs.

Epoch ``e``'s order is a permutation seeded by ``(seed, e)`` alone, so it does not depend on
how many steps ran before: restoring :meth:`PromptSampler.state_dict` yields exactly the
batches an uninterrupted run would have produced, across epoch boundaries. Pure Python.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from typing import Any


class PromptSampler:
    """Yields ``prompts_per_step`` indices into ``range(num_prompts)`` per step.

    shuffle: a fresh seeded permutation each epoch (else 0..n-1 in order). drop_last: an
    epoch has ``num_prompts // prompts_per_step`` steps (the remainder is not used that epoch);
    otherwise ``ceil(num_prompts / prompts_per_step)`` steps, the last one smaller.

    Attributes: ``epoch`` (epoch of the next batch), ``step`` (batches produced so far, all
    epochs), ``step_in_epoch`` (batches of the current epoch produced), ``steps_per_epoch``.

    :meth:`next_indices` rolls over into the next epoch; iterating (``for idx in sampler``)
    yields the rest of the current epoch and then stops, like a torch sampler.
    """

    def __init__(self, num_prompts: int, prompts_per_step: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True) -> None:  # fmt: skip
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step={prompts_per_step} must be >= 1")
        if num_prompts < 1 or (drop_last and num_prompts < prompts_per_step):
            raise ValueError(
                f"{num_prompts} prompts cannot fill one step of prompts_per_step={prompts_per_step}"
                + (" with drop_last" if drop_last and num_prompts else "")
            )
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        per = num_prompts / prompts_per_step
        self.steps_per_epoch = math.floor(per) if drop_last else math.ceil(per)
        self.epoch = 0
        self.step = 0
        self.step_in_epoch = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def _epoch_order(self) -> list[int]:
        if self._order_epoch != self.epoch:
            order = list(range(self.num_prompts))
            if self.shuffle:
                random.Random(f"hybridflow-sampler/{self.seed}/{self.epoch}").shuffle(order)
            self._order, self._order_epoch = order, self.epoch
        return self._order

    def next_indices(self) -> list[int]:
        """The next step's prompt indices (rolling over into the next epoch when one ends)."""
        order = self._epoch_order()
        start = self.step_in_epoch * self.prompts_per_step
        indices = order[start : start + self.prompts_per_step]
        self.step += 1
        self.step_in_epoch += 1
        if self.step_in_epoch == self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_indices()

    def __len__(self) -> int:
        return self.steps_per_epoch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state; with the same constructor arguments it restores the position."""
        return {
            "epoch": self.epoch,
            "step": self.step,
            "step_in_epoch": self.step_in_epoch,
            "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position. Raises ValueError when the state was saved by a sampler with
        other arguments (e.g. the dataset changed size), since its batches would differ."""
        for key in ("num_prompts", "prompts_per_step", "shuffle", "seed", "drop_last"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {getattr(self, key)!r}; "
                    "resuming would not reproduce the run's batches"
                )
        if not 0 <= state["step_in_epoch"] < self.steps_per_epoch:
            raise ValueError(f"sampler state step_in_epoch={state['step_in_epoch']} out of range")
        self.epoch, self.step, self.step_in_epoch = state["epoch"], state["step"], state["step_in_epoch"]


__all__ = ["PromptSampler"]
