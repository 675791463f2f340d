"""Progress of a transformers ``generate`` call: how many of its rows have finished."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import StoppingCriteria

from workers.progress import Tick


class FinishedRows(StoppingCriteria):
    """Never stops generation; counts the rows of a ``generate`` call that have produced a stop
    token and reports ``(offset + finished rows, total)`` to ``tick`` after each decode step (the
    tick throttles). One ``isin`` over the newest token column per step; the count is read back
    (a device sync) only when a row finished since the last report."""

    def __init__(self, stop_token_ids: tuple[int, ...], tick: Tick, offset: int, total: int) -> None:
        self.stop = torch.as_tensor(list(stop_token_ids), dtype=torch.int64)
        self.tick, self.offset, self.total = tick, offset, total
        self.finished: Tensor | None = None
        self.reported = -1

    def __call__(self, input_ids: Tensor, scores: Tensor, **kwargs: Any) -> Tensor:
        hit = torch.isin(input_ids[:, -1], self.stop.to(input_ids.device))
        self.finished = hit if self.finished is None else self.finished | hit
        if bool(hit.any()):
            done = int(self.finished.sum())
            if done != self.reported:
                self.reported = done
                self.tick(self.offset + done, self.total)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
