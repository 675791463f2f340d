"""The environment worker process: the environment call kind's child of :mod:`hybridflow.procpool`.

Runs as ``python -m hybridflow.agents._worker FD`` (the loop, the pipe protocol and the error
outcomes: :mod:`hybridflow.procpool.child`). No setup; requests are
:class:`hybridflow.agents.remote.EnvCall`, an "ok" value is an :class:`~hybridflow.agents.remote.EnvResult`.
"""

from __future__ import annotations

from typing import Any

from hybridflow.agents.remote import EnvCall, env_call
from hybridflow.procpool.child import Outcome, serve


class EnvHandler:
    """Runs one environment call per request (:func:`env_call`); never batched."""

    info = None
    batched = False

    def __init__(self, setup: Any = None) -> None:
        del setup  # nothing to load up front: each call loads its environment (user modules import once)

    def call(self, request: EnvCall) -> Outcome:
        return "ok", env_call(request)

    def call_batch(self, requests: list[EnvCall]) -> list[Outcome]:
        raise TypeError("environment calls are not batched")


def main() -> None:
    serve(EnvHandler)


if __name__ == "__main__":
    main()
