"""Datasets: verl-format rows (parquet / jsonl / saved HF datasets), chat-templated prompt
batches, a resumable sampler, and task generators (gsm8k, arith, countdown).

Names are imported lazily so that ``hybridflow data --help`` (``hybridflow.data.cli``) does
not import torch or transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "load_rows": "hybridflow.data.rows",
    "Row": "hybridflow.data.rows",
    "RowSet": "hybridflow.data.rows",
    "BadRowError": "hybridflow.data.rows",
    "read_records": "hybridflow.data.io",
    "write_rows": "hybridflow.data.io",
    "DataFileError": "hybridflow.data.io",
    "PromptDataset": "hybridflow.data.dataset",
    "OverlongPromptError": "hybridflow.data.dataset",
    "PromptSampler": "hybridflow.data.sampler",
}

__all__ = [*_EXPORTS, "tasks"]


def __getattr__(name: str) -> Any:
    if name == "tasks":
        return importlib.import_module("hybridflow.data.tasks")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'hybridflow.data' has no attribute {name!r}")
