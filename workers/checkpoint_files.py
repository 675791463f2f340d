"""The files of a checkpoint folder: durable and atomic writes, and the manifest.

:func:`write_durable` writes bytes and fsyncs them; :func:`replace_atomic` writes them to
``<path>.tmp`` first and renames it over ``path``, so a reader sees the old content or the new,
never a torn file (``latest`` is written this way). :func:`write_manifest` records what a
checkpoint folder holds; :mod:`workers.checkpoint_integrity` checks a folder against it.

Depends on nothing else in ``workers/``: :mod:`workers.checkpoint` (writing checkpoints) and
:mod:`workers.checkpoint_integrity` (verifying them) both build on it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST = "manifest.json"


def write_durable(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` (created or truncated) and fsync it before returning.

    Not atomic: a crash mid-write leaves a partial file (see :func:`replace_atomic`).
    Raises OSError as ``open``/``write``/``fsync`` do (disk full, permissions)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def replace_atomic(path: str | os.PathLike, data: bytes) -> None:
    """Make ``path`` hold ``data`` atomically: :func:`write_durable` to ``<path>.tmp``, then
    ``os.replace`` it onto ``path`` (atomic on POSIX within one file system). Raises OSError."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp")
    write_durable(tmp, data)
    os.replace(tmp, path)


def file_sha256(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex sha256 of the file at ``path``, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def manifest_files(folder: Path) -> list[str]:
    """Every file under ``folder`` except the manifest, relative to it, sorted."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(folder: str | os.PathLike) -> dict:
    """Hash every file under ``folder`` and write ``folder/manifest.json`` (fsynced). Returns it::

        {"format": 1, "files": {"policy/model.safetensors": {"bytes": 123, "sha256": "..."}, ...}}
    """
    folder = Path(folder)
    manifest = {"format": 1, "files": {rel: {"bytes": (folder / rel).stat().st_size, "sha256": file_sha256(folder / rel)}
                                       for rel in manifest_files(folder)}}
    write_durable(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True).encode())
    return manifest


__all__ = ["MANIFEST", "write_durable", "replace_atomic", "file_sha256", "manifest_files", "write_manifest"]
