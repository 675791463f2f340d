"""Appending one JSON line to a run folder's ``*.jsonl`` files (metrics, validation, the execution
log, the update ledgers, the pool events) without ever leaving half a line behind.

A plain ``open(path, "a").write(line)`` that fails part-way (a full disk: ``ENOSPC`` after some of
the bytes went in; a writer SIGKILLed inside its write) leaves a torn last line. The next append
then lands on that line, and every later reader of the file fails with ``JSONDecodeError`` — a
resumed run that got through all its iterations then failed at its summary (found by the chaos
soak, ``tests/chaos``). :func:`append_line` on a local file: one ``write`` of the whole line; on
an OSError the file is cut back to its size before the append, then the error is raised; a torn
tail left by an earlier writer that died (the file does not end in a newline) is cut back to its
last complete line before the new one is appended. Other fsspec file systems (``memory://``,
object stores) append as before.
"""

from __future__ import annotations

import os
from typing import Any

_BLOCK = 1 << 16


def append_line(fs: Any, path: str, line: str) -> None:
    """Append ``line`` (one JSON document, no newline) and a newline to ``path`` on ``fs`` (an
    fsspec file system; a local one gets the all-or-nothing behaviour above).

    Raises the OSError of a failed write (``[Errno 28] No space left on device``) after the file
    has been cut back to its previous size."""
    from fsspec.implementations.local import LocalFileSystem

    data = (line + "\n").encode()
    if not isinstance(fs, LocalFileSystem):
        with fs.open(path, "ab") as f:
            f.write(data)
        return
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = _drop_torn_tail(fd, path)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        except OSError:
            os.ftruncate(fd, size)  # frees what went in: no half line stays behind
            raise
    finally:
        os.close(fd)


def _drop_torn_tail(fd: int, path: str) -> int:
    """Cut the file open as ``fd`` back to just after its last newline when it does not end in one
    (a line an earlier writer did not finish); returns the size after that."""
    size = os.fstat(fd).st_size
    if size == 0:
        return 0
    with open(path, "rb") as r:
        end = size
        while end > 0:
            start = max(0, end - _BLOCK)
            r.seek(start)
            block = r.read(end - start)
            if end == size and block.endswith(b"\n"):
                return size
            cut = block.rfind(b"\n")
            if cut >= 0:
                end = start + cut + 1
                break
            end = start
    os.ftruncate(fd, end)
    return end


__all__ = ["append_line"]
