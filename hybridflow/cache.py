"""Where hybridflow keeps what it makes once per machine and reuses: the plain HF copy of a GGUF
model (``gguf/``), the precision probe's results (``precision/``), the migrated empty Prefect
database a new run's server starts from (``prefect-db/``). No heavy imports, so a command can ask
before it loads torch."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "HYBRIDFLOW_CACHE"


def cache_root() -> Path:
    """``$HYBRIDFLOW_CACHE`` if set, else ``~/.cache/hybridflow``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "hybridflow"
