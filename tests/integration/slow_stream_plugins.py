"""Test-only (``trainer.plugins``): each decode step of the streaming rollout takes at least
``STEP_S`` longer, so a response spans the trainer's update and newer weights arrive while rows
are in flight, whatever the machine's speed (a tiny-model response otherwise takes ~0.1 s and
finishes before any update lands). The delay sits in ``GroupStreamer._interrupt``, which the engine
asks after every decode step of an elastic call (completion order); the decision is the original's.
A process that imports this module and streams nothing is unchanged.
"""

from __future__ import annotations

import functools
import time

from workers.group_stream import GroupStreamer

STEP_S = 0.5

_original = GroupStreamer._interrupt


@functools.wraps(_original)
def _slow_interrupt(self: GroupStreamer, k: int) -> bool:
    time.sleep(STEP_S)
    return _original(self, k)


if not getattr(GroupStreamer._interrupt, "__slowed__", False):
    _slow_interrupt.__slowed__ = True  # type: ignore[attr-defined]
    GroupStreamer._interrupt = _slow_interrupt  # type: ignore[method-assign]
