"""Checkpoint layout, atomic commit and pickle-free state files.

A checkpoint is one folder per saved RL iteration under the run's checkpoint root::

    <ckpt_root>/iter_000007/
        policy/                      HF format (safetensors + config + tokenizer), loadable as is
        policy_optim/rank_0.safetensors + rank_0.json   optimizer state + worker state, per rank
        critic/, critic_optim/       when a critic is trained
        trainer_state.json           caller's dict: weights_version per role, RNG, sampler, iteration
        manifest.json                every file's size and sha256, written last (checkpoint_files)
    <ckpt_root>/latest               text file holding "iter_000007"

Runs from before issue 14 named the folders ``step_000007`` (the number was always the
iteration): every reader here takes both names (:func:`list_checkpoints`,
:func:`checkpoint_iteration`, :func:`checkpoint_dir`); :data:`CHECKPOINT_PREFIX` is what new
checkpoints are written with — still ``step_`` until flows/cli_export.py reads both names too
(see the comment at :data:`CHECKPOINT_PREFIX`).

Saving is two-phase so several workers (possibly in several processes) can write one checkpoint:

1. ``tmp = begin_save(root, iteration)`` — a fresh staging folder ``iter_000007.tmp/`` (a
   leftover from an interrupted save is removed); ``staging_dir(root, iteration)`` names it;
2. workers write into ``tmp`` (``PolicyWorker.save_checkpoint(tmp)``, ...);
3. ``commit_save(root, iteration, trainer_state)`` (alias ``finalize_checkpoint``) writes
   ``trainer_state.json``, then ``manifest.json`` (sizes + sha256 of every file), renames the folder to ``iter_000007/`` and replaces ``latest``
   atomically (tmp file + ``os.replace``).

A crash before step 3 finishes leaves the previous checkpoint and ``latest`` untouched.
Nothing is ever read with pickle: tensors are safetensors, everything else is JSON
(:func:`save_state` / :func:`load_state` flatten nested dicts/lists of tensors). Local
filesystem paths only (atomic rename is what makes the commit safe).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from hybridflow.deprecation import deprecated_attributes
from hybridflow.layout import ITERATION_PREFIX, LATEST, LEGACY_CHECKPOINT_PREFIX, iteration_name, iteration_of
from hybridflow.models.checkpoint import WriteError, errno_of, io_error_text
from workers.checkpoint_files import replace_atomic, write_durable, write_manifest

LEGACY_PREFIX = LEGACY_CHECKPOINT_PREFIX  # the same folder as runs before issue 14 named it: always read
CHECKPOINT_PREFIXES = (ITERATION_PREFIX, LEGACY_PREFIX)
# The prefix new checkpoints are written with (every reader takes both).
CHECKPOINT_PREFIX = ITERATION_PREFIX
TRAINER_STATE = "trainer_state.json"
# Deprecated names served with a FutureWarning (removed in 0.3.0).
__getattr__ = deprecated_attributes(__name__, {"STEP_PREFIX": ("workers.checkpoint.LEGACY_PREFIX", lambda: LEGACY_PREFIX)})


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read (names the path and the cause)."""


def checkpoint_name(iteration: int) -> str:
    """The folder name new checkpoints of RL iteration ``iteration`` get (``iter_000007`` for 7;
    ``step_000007`` while :data:`CHECKPOINT_PREFIX` is the legacy prefix). Raises ValueError if < 0."""
    if iteration < 0:
        raise ValueError(f"checkpoint iteration must be >= 0, got {iteration}")
    return iteration_name(iteration, CHECKPOINT_PREFIX)


step_name = checkpoint_name  # deprecated name


def checkpoint_iteration(folder: str | os.PathLike) -> int | None:
    """7 for a folder named ``iter_000007`` or ``step_000007`` (any parent); None for any other name."""
    return iteration_of(Path(folder).name, CHECKPOINT_PREFIXES)


def list_checkpoints(ckpt_root: str | os.PathLike, *, complete: bool = True) -> list[tuple[int, Path]]:
    """(iteration, folder) of the checkpoint folders under ``ckpt_root``, by iteration ascending.

    Both names count (``iter_*`` and the legacy ``step_*``); for an iteration present under both,
    the one named with :data:`CHECKPOINT_PREFIX` wins. complete: only folders holding
    ``trainer_state.json`` (committed). A missing root gives [].
    """
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for p in root.iterdir():
        it = checkpoint_iteration(p)
        if it is None or not p.is_dir() or (complete and not _is_complete(p)):
            continue
        if it not in found or p.name.startswith(CHECKPOINT_PREFIX):
            found[it] = p
    return sorted(found.items())


def staging_dir(ckpt_root: str | os.PathLike, iteration: int) -> str:
    """The staging folder workers write iteration ``iteration``'s checkpoint into
    (``<root>/iter_000007.tmp``); it becomes ``<root>/iter_000007`` at :func:`commit_save`. Pure
    path arithmetic: use :func:`begin_save` to (re)create it empty first."""
    return str(Path(ckpt_root) / f"{checkpoint_name(iteration)}.tmp")


step_dir = staging_dir  # deprecated name


def checkpoint_dir(ckpt_root: str | os.PathLike, iteration: int) -> str:
    """The committed folder of iteration ``iteration``: the existing one (``iter_000007``, or a
    legacy ``step_000007``), else where :func:`commit_save` puts it."""
    for it, folder in list_checkpoints(ckpt_root, complete=False):
        if it == iteration:
            return str(folder)
    return str(Path(ckpt_root) / checkpoint_name(iteration))


final_step_dir = checkpoint_dir  # deprecated name, still imported by flows/cli_export.py


def begin_save(ckpt_root: str | os.PathLike, iteration: int) -> str:
    """Create (fresh) the staging folder workers write iteration ``iteration``'s checkpoint into;
    returns its path (= :func:`staging_dir`). A leftover of an interrupted save of it is removed.

    Raises CheckpointError when the root cannot be created or written (e.g. read-only, disk full).
    """
    root = Path(ckpt_root)
    tmp = Path(staging_dir(root, iteration))
    try:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot create checkpoint folder {tmp}: {e}") from e
    return str(tmp)


def commit_save(ckpt_root: str | os.PathLike, iteration: int, trainer_state: dict[str, Any]) -> str:
    """Write ``trainer_state.json``, move the temp folder into place, point ``latest`` at it.

    trainer_state: JSON-serialisable dict (use :func:`capture_rng_state` for RNG states).
    Returns the final folder path. Re-saving an existing iteration replaces it (a legacy
    ``step_*`` folder of the same iteration included).
    Raises CheckpointError if :func:`begin_save` was not called or a write fails; the previous
    checkpoint and ``latest`` stay valid in that case.
    """
    root = Path(ckpt_root)
    name = checkpoint_name(iteration)
    tmp, final = root / f"{name}.tmp", root / name
    if not tmp.is_dir():
        raise CheckpointError(f"commit_save: {tmp} does not exist (call begin_save first)")
    try:
        payload = json.dumps(trainer_state, indent=1, sort_keys=True).encode()
        write_durable(tmp / TRAINER_STATE, payload)
        write_manifest(tmp)  # last: a checkpoint whose files changed after this no longer verifies
        if final.exists():
            old = root / f"{name}.old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        replace_atomic(root / LATEST, name.encode())
        for prefix in CHECKPOINT_PREFIXES:  # the same iteration under its other name
            if prefix != CHECKPOINT_PREFIX:
                shutil.rmtree(root / f"{prefix}{iteration:06d}", ignore_errors=True)
    except (OSError, TypeError, ValueError) as e:
        raise CheckpointError(f"cannot commit checkpoint {final}: {e}") from e
    return str(final)


finalize_checkpoint = commit_save  # the name tasks/checkpoint.py uses


def _is_complete(path: Path) -> bool:
    return path.is_dir() and (path / TRAINER_STATE).is_file()


def load_latest(ckpt_root: str | os.PathLike) -> str | None:
    """Path of the newest complete checkpoint, or None when there is none.

    Follows ``latest`` (which may name a legacy ``step_*`` folder); if it is missing or points at
    a folder that is not complete (no ``trainer_state.json``), falls back to the complete folder
    of the highest iteration (``iter_*`` or ``step_*``).
    """
    root = Path(ckpt_root)
    if not root.is_dir():
        return None
    pointer = root / LATEST
    if pointer.is_file():
        target = root / pointer.read_text().strip()
        if _is_complete(target):
            return str(target)
    complete = list_checkpoints(root)
    return str(complete[-1][1]) if complete else None


def read_trainer_state(folder: str | os.PathLike) -> dict[str, Any]:
    """The dict passed to :func:`commit_save`. Raises CheckpointError if missing or not JSON."""
    path = Path(folder) / TRAINER_STATE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e


# ---- pickle-free nested state ------------------------------------------------------------------


def _flatten(obj: Any, tensors: dict[str, torch.Tensor], prefix: str) -> Any:
    if isinstance(obj, torch.Tensor):
        key = f"{len(tensors)}:{prefix}"  # the index keeps keys unique whatever the dict keys hold
        tensors[key] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        items = [[k, _flatten(v, tensors, f"{prefix}/{k}")] for k, v in obj.items()]
        for k, _ in items:
            if not isinstance(k, str | int):
                raise TypeError(f"save_state: dict key {k!r} at {prefix or '/'} is not str or int")
        return {"__dict__": items}
    if isinstance(obj, tuple):
        return {"__tuple__": [_flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_flatten(v, tensors, f"{prefix}/{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"save_state: value of type {type(obj).__name__} at {prefix or '/'} is not storable")


def _unflatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_unflatten(v, tensors) for v in obj]
    if isinstance(obj, dict):
        if "__tensor__" in obj:
            return tensors[obj["__tensor__"]]
        if "__tuple__" in obj:
            return tuple(_unflatten(v, tensors) for v in obj["__tuple__"])
        return {k: _unflatten(v, tensors) for k, v in obj["__dict__"]}
    return obj


def save_state(obj: Any, prefix: str | os.PathLike) -> None:
    """Write nested dicts/lists/tuples of tensors and JSON scalars to ``prefix.safetensors`` +
    ``prefix.json`` (no pickle). Dict keys must be str or int (int keys survive the round trip).

    Raises TypeError for values that are neither tensors nor JSON scalars, WriteError (an
    OSError naming the file and the OS error) when writing fails.
    """
    tensors: dict[str, torch.Tensor] = {}
    structure = _flatten(obj, tensors, "")
    prefix = Path(prefix)
    try:
        prefix.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, f"{prefix}.safetensors")
        write_durable(Path(f"{prefix}.json"), json.dumps(structure).encode())
    except (OSError, SafetensorError) as e:  # disk full, I/O error: safetensors' writer raises its own type
        raise WriteError(errno_of(e) or errno.EIO, f"cannot write {prefix}.safetensors: {io_error_text(e)}") from e


def load_state(prefix: str | os.PathLike) -> Any:
    """Inverse of :func:`save_state`. Raises CheckpointError when a file is missing or corrupt."""
    try:
        tensors = load_file(f"{prefix}.safetensors")
        structure = json.loads(Path(f"{prefix}.json").read_text())
        return _unflatten(structure, tensors)
    except (OSError, json.JSONDecodeError, KeyError, ValueError, SafetensorError) as e:
        raise CheckpointError(f"cannot load state {prefix}: {io_error_text(e)}") from e


# ---- RNG states as JSON ------------------------------------------------------------------------


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.numpy().tobytes()).decode()


def _from_b64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state() -> dict[str, Any]:
    """torch (CPU, and every CUDA device if initialised) as base64, Python ``random`` as lists,
    numpy's global MT19937 as lists (only when numpy is importable)."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": _b64(torch.get_rng_state()),
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state["numpy"] = {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)}
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng_state` (parts that are absent are left alone)."""
    torch.set_rng_state(_from_b64(state["torch"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_from_b64(s) for s in state["cuda"]])
    if "numpy" in state:
        import numpy as np

        n = state["numpy"]
        keys = np.asarray(n["keys"], dtype=np.uint32)
        np.random.set_state((n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))


# ---- model weights from a folder of safetensors -------------------------------------------------


def read_safetensors_folder(folder: str | os.PathLike) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files directly in ``folder`` (HF single or sharded).

    Raises CheckpointError when there is none, or a file cannot be read (naming it).
    """
    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} holds no .safetensors file")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            out.update(load_file(f))
        except (OSError, SafetensorError) as e:  # e.g. a truncated file: "incomplete metadata"
            raise CheckpointError(f"cannot read {f}: {io_error_text(e)}") from e
    return out


def load_weights_strict(module: torch.nn.Module, state: dict[str, torch.Tensor], *, where: str) -> None:
    """``module.load_state_dict(state)`` that tolerates only missing TIED weights.

    HF folders store tied weights once (e.g. ``lm_head.weight`` = ``model.embed_tokens.weight``):
    a missing key is accepted when its tensor shares storage with a loaded one. Any other
    missing or unexpected key raises CheckpointError naming ``where`` and the keys.
    """
    missing, unexpected = module.load_state_dict(state, strict=False)
    current = module.state_dict()
    loaded_ptrs = {current[k].data_ptr() for k in state if k in current}
    untied = [k for k in missing if current[k].data_ptr() not in loaded_ptrs]
    if untied or unexpected:
        raise CheckpointError(f"{where}: weights do not match the model (missing {untied[:5]}, unexpected {unexpected[:5]})")


__all__ = [
    "CheckpointError",
    "ITERATION_PREFIX",
    "LEGACY_PREFIX",
    "CHECKPOINT_PREFIXES",
    "CHECKPOINT_PREFIX",
    "checkpoint_name",
    "checkpoint_iteration",
    "list_checkpoints",
    "staging_dir",
    "checkpoint_dir",
    "step_name",
    "step_dir",
    "final_step_dir",
    "begin_save",
    "commit_save",
    "finalize_checkpoint",
    "load_latest",
    "read_trainer_state",
    "save_state",
    "load_state",
    "capture_rng_state",
    "restore_rng_state",
    "read_safetensors_folder",
    "load_weights_strict",
]
