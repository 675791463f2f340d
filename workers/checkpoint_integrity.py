"""Checkpoint manifests: what a checkpoint folder held when it was committed, and checking it still does.

``commit_save`` writes ``manifest.json`` (:func:`workers.checkpoint_files.write_manifest`) into the
staging folder last, after every worker's files and ``trainer_state.json``, just before the folder
is renamed into place::

    {"format": 1, "files": {"policy/model.safetensors": {"bytes": 123, "sha256": "..."}, ...}}

:func:`verify_checkpoint` compares a checkpoint folder with its manifest (sizes first, then sha256)
and raises :class:`CheckpointDamagedError` naming the first file that differs, is missing or was
added. :func:`choose_resume_checkpoint` is what a resume loads: the checkpoint ``latest`` names if it
verifies; otherwise (``fallback``) the newest older one that does (by iteration, whether named
``iter_<N>`` or the legacy ``step_<N>``) — the damaged ones are renamed ``<name>.damaged`` (kept,
never loaded) and ``latest`` is pointed at the intact one —
or (no fallback) a CheckpointError. A committed step without a manifest (written before
manifests existed) cannot be verified and counts as damaged.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from workers.checkpoint import LATEST, CheckpointError, checkpoint_iteration, list_checkpoints, load_latest
from workers.checkpoint_files import MANIFEST, file_sha256, manifest_files, replace_atomic, write_manifest

DAMAGED_SUFFIX = ".damaged"


class CheckpointDamagedError(CheckpointError):
    """A step folder does not match its manifest (names the folder, the file and how)."""


def verify_checkpoint(step_dir: str | os.PathLike, *, hashes: bool = True) -> None:
    """Raise CheckpointDamagedError unless ``step_dir`` holds exactly the files of its manifest,
    with the recorded sizes and (``hashes``) sha256. Cost: one read of the checkpoint."""
    folder = Path(step_dir)
    try:
        listed = json.loads((folder / MANIFEST).read_text())["files"]
    except FileNotFoundError:
        raise CheckpointDamagedError(f"checkpoint {folder} has no {MANIFEST} (incomplete, or written before "
                                     "checkpoints carried manifests): it cannot be verified") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointDamagedError(f"checkpoint {folder}: {MANIFEST} is unreadable ({e})") from None
    present = set(manifest_files(folder))
    for rel in sorted(present - set(listed)):
        raise CheckpointDamagedError(f"checkpoint {folder} is damaged: {rel} is not in its manifest")
    for rel, want in sorted(listed.items()):
        path = folder / rel
        if rel not in present:
            raise CheckpointDamagedError(f"checkpoint {folder} is damaged: {rel} is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise CheckpointDamagedError(
                f"checkpoint {folder} is damaged: {rel} is {size} bytes, its manifest says {want['bytes']}")
    if hashes:
        for rel, want in sorted(listed.items()):
            if file_sha256(folder / rel) != want["sha256"]:
                raise CheckpointDamagedError(f"checkpoint {folder} is damaged: {rel} does not match its "
                                             "sha256 in the manifest")


def _older_checkpoints(root: Path, than: Path) -> list[Path]:
    """Complete checkpoints of iterations before ``than``'s, newest first (both folder names)."""
    limit = checkpoint_iteration(than)
    return [p for it, p in reversed(list_checkpoints(root)) if limit is None or it < limit]


def _set_aside(step: Path) -> Path:
    target, n = step.with_name(step.name + DAMAGED_SUFFIX), 1
    while target.exists():
        n += 1
        target = step.with_name(f"{step.name}{DAMAGED_SUFFIX}{n}")
    os.replace(step, target)
    return target


def choose_resume_checkpoint(ckpt_root: str | os.PathLike, *, fallback: bool,
                             warn: Callable[[str], None]) -> str | None:
    """The checkpoint a resume loads (None: there is none), verified.

    The step ``latest`` names (see :func:`~workers.checkpoint.load_latest`) when it verifies.
    Damaged and ``fallback``: the newest older step that verifies; the damaged steps newer than
    it are renamed ``<name>.damaged``, ``latest`` is pointed at it, and ``warn`` gets one line
    saying what was damaged and where the run resumes from. Damaged without ``fallback``, or no
    intact step at all: CheckpointError (one line, naming the damage).
    """
    root = Path(ckpt_root)
    latest = load_latest(root)
    if latest is None:
        return None
    try:
        verify_checkpoint(latest)
        return latest
    except CheckpointDamagedError as e:
        damage = str(e)
    if not fallback:
        raise CheckpointError(f"{damage}; not resuming from an older checkpoint (trainer.resume_fallback=false)")
    newer = [Path(latest)]
    for step in _older_checkpoints(root, Path(latest)):
        try:
            verify_checkpoint(step)
        except CheckpointDamagedError:
            newer.append(step)
            continue
        kept = [_set_aside(p) for p in newer]
        replace_atomic(root / LATEST, step.name.encode())
        warn(f"warning: {damage}; resuming from the newest intact checkpoint {step.name} "
             f"(the damaged one is kept as {kept[0].name})")
        return str(step)
    raise CheckpointError(f"{damage}; there is no older intact checkpoint to resume from")


__all__ = ["MANIFEST", "CheckpointDamagedError", "write_manifest", "verify_checkpoint", "choose_resume_checkpoint"]
