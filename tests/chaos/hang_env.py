"""Test-only multi-turn environment for the chaos soak's ``tool_hang`` fault: the step of a row whose
``extra_info`` carries ``chaos_hang`` never returns (as a tool or environment stuck on a dead socket
would); every other step ends the episode at once. The hang is the row's, so the uninterrupted run
meets it too, in the same iteration: the soak checks the step is cut at
``rollout.multi_turn.tool_timeout_s``, counted (``env/errors``), and that nothing else changes."""

from __future__ import annotations

import time
from typing import Any

HANG_S = 3600.0


class HangOnce:
    def __init__(self, **_: Any) -> None:
        self.hang = False

    def reset(self, row: dict[str, Any]) -> None:
        self.hang = bool((row.get("extra_info") or {}).get("chaos_hang"))
        return None

    def step(self, text: str) -> tuple[None, None, bool]:
        if self.hang:
            time.sleep(HANG_S)
        return None, None, True
