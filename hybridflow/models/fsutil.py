"""Atomic publication of a folder: write into a temporary sibling, then rename into place."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

OnExists = Literal["error", "replace", "keep"]


@contextmanager
def atomic_directory(final: str | Path, *, on_exists: OnExists = "error") -> Iterator[Path]:
    """Yield an empty temporary folder next to ``final``; on success rename it to ``final``.

    The rename is atomic on one filesystem, so readers see either no folder or a complete one.
    on_exists: what to do when ``final`` exists at publication time — "error" (FileExistsError),
    "replace" (the old folder is moved aside, then deleted), "keep" (another writer won the race:
    the new copy is discarded). On any exception the temporary folder is deleted.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if on_exists == "error" and final.exists():
        raise FileExistsError(f"{final} already exists")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        _publish(tmp, final, on_exists)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: Path, final: Path, on_exists: OnExists) -> None:
    if not final.exists():
        try:
            os.rename(tmp, final)
            return
        except OSError:
            if not final.exists():
                raise  # a real failure, not a lost race
    if on_exists == "keep":
        shutil.rmtree(tmp, ignore_errors=True)
    elif on_exists == "replace":
        trash = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        raise FileExistsError(f"{final} already exists")
