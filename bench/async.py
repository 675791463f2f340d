"""``hybridflow bench async``: the asynchronous-training benchmark, bench/async_train.py (``async``
is a Python keyword, so the code lives under an importable name). See that module's docstring."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.async_train import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
