"""A toy call kind for tests/unit/test_procpool.py: the child of a ProcessPool that is neither a
reward nor an environment (``python -m tests.unit.procpool_toy FD``).

Setup: a prefix string ("fail" makes loading raise). Requests: ("echo", x) → ("ok", prefix + x);
("raise", msg) raises ValueError; ("exit", code) ends the process; ("sleep", s) sleeps, then "ok";
("lock",) returns an unpicklable value; ("pid",) → ("ok", the worker's pid). Batched: no. Info: the worker's pid.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from hybridflow.procpool.child import Outcome, serve


class ToyHandler:
    batched = False

    def __init__(self, setup: str) -> None:
        if setup == "fail":
            raise RuntimeError("toy setup refused")
        self.prefix = setup
        self.info = os.getpid()

    def call(self, request: tuple[Any, ...]) -> Outcome:
        op = request[0]
        if op == "raise":
            raise ValueError(request[1])
        if op == "exit":
            os._exit(request[1])
        if op == "sleep":
            time.sleep(request[1])
            return "ok", "slept"
        if op == "lock":
            return "ok", threading.Lock()
        if op == "pid":
            return "ok", os.getpid()
        return "ok", self.prefix + request[1]

    def call_batch(self, requests: list[Any]) -> list[Outcome]:
        raise TypeError("not batched")


if __name__ == "__main__":
    serve(ToyHandler)
