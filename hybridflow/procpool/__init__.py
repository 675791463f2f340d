"""A crash-proof process pool, generic over a call kind: timeouts (one deadline per call, hung
workers killed), crashes (``os._exit``, segfault, OOM) counted and the worker restarted, every
request answered. Used by the reward executor (:mod:`hybridflow.rewards.executor`) and the
environment runner (:mod:`hybridflow.agents.remote`), each with its own request / response types.

The parent side (:mod:`.pool`) and the child loop (:mod:`.child`) import nothing heavy (no torch).
"""

from hybridflow.procpool.pool import (
    CallKind,
    Outcome,
    ProcessPool,
    Row,
    Unit,
    WorkerLoadError,
    WorkerStartError,
)

__all__ = ["CallKind", "Outcome", "ProcessPool", "Row", "Unit", "WorkerLoadError", "WorkerStartError"]
