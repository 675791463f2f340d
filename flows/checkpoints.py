"""Which checkpoints a run holds, and the folder of one step: the lookup that ``hybridflow export``,
``hybridflow eval`` and the ``evaluate`` flow share.

A run's checkpoints live under ``RUN_DIR/checkpoints/iter_<N>/`` (``step_<N>/`` in runs from before) (complete when they hold
``trainer_state.json``), with a ``latest`` pointer (:mod:`workers.checkpoint`). Nothing heavy is
imported here (no torch, Prefect or Ray).
"""

from __future__ import annotations

from pathlib import Path

from hybridflow.layout import CHECKPOINTS, CONFIG


class CheckpointNotFoundError(FileNotFoundError):
    """The run or the requested checkpoint step does not exist (names the steps that do)."""


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Iterations with a complete checkpoint (``checkpoints/iter_<N>`` or legacy ``step_<N>``), ascending."""
    from workers.checkpoint import list_checkpoints

    return [it for it, _ in list_checkpoints(Path(run_dir) / CHECKPOINTS)]


def parse_step(step: str | int) -> int | str:
    """``"latest"`` → ``"latest"``; ``7``, ``"7"``, ``"iter_000007"``, ``"step_000007"`` → 7. Raises ValueError otherwise."""
    from workers.checkpoint import checkpoint_iteration

    if isinstance(step, int):
        return step
    text = str(step).strip()
    if text == "latest":
        return "latest"
    n = int(text) if text.isdigit() else checkpoint_iteration(text)
    if n is None:
        raise ValueError(f"checkpoint step {step!r}: expected a number, iter_<N>, step_<N> or 'latest'")
    return n


def resolve_checkpoint(run_dir: str | Path, step: str | int = "latest") -> Path:
    """The folder of checkpoint ``step`` (an int, ``"iter_000007"``, ``"step_000007"`` or ``"latest"``) of a run.

    Raises CheckpointNotFoundError when ``run_dir`` is not a run directory, has no checkpoint,
    or lacks that step (the message lists the steps that exist); ValueError for a bad ``step``.
    """
    from workers.checkpoint import final_step_dir, load_latest

    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointNotFoundError(f"run directory {str(run)!r} does not exist")
    if not (run / CONFIG).is_file() and not (run / CHECKPOINTS).is_dir():
        raise CheckpointNotFoundError(f"{str(run)!r} is not a run directory (no config.yaml, no checkpoints/)")
    wanted = parse_step(step)
    steps = checkpoint_steps(run)
    if not steps:
        raise CheckpointNotFoundError(f"run {str(run)!r} has no checkpoint (nothing under {run / 'checkpoints'})")
    if wanted == "latest":
        latest = load_latest(run / CHECKPOINTS)
        assert latest is not None  # there are complete steps
        return Path(latest)
    if wanted not in steps:
        raise CheckpointNotFoundError(
            f"run {str(run)!r} has no checkpoint at step {wanted}; steps saved: {', '.join(map(str, steps))}"
        )
    return Path(final_step_dir(run / CHECKPOINTS, wanted))


def step_of(step_dir: str | Path) -> int:
    """7 for ``.../iter_000007`` (or a legacy ``.../step_000007``)."""
    from workers.checkpoint import checkpoint_iteration

    n = checkpoint_iteration(step_dir)
    if n is None:
        raise ValueError(f"{step_dir} is not a checkpoint folder (iter_<N> or step_<N>)")
    return n
