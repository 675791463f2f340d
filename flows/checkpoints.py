"""Which checkpoints a run holds, and the folder of one step: the lookup that ``hybridflow export``,
``hybridflow eval`` and the ``evaluate`` flow share.

A run's checkpoints live under ``RUN_DIR/checkpoints/step_<N>/`` (complete when they hold
``trainer_state.json``), with a ``latest`` pointer (:mod:`workers.checkpoint`). Nothing heavy is
imported here (no torch, Prefect or Ray).
"""

from __future__ import annotations

from pathlib import Path


class CheckpointNotFoundError(FileNotFoundError):
    """The run or the requested checkpoint step does not exist (names the steps that do)."""


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    """Steps with a complete checkpoint (``checkpoints/step_<N>/trainer_state.json``), ascending."""
    from workers.checkpoint import STEP_PREFIX, TRAINER_STATE

    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    steps = []
    for p in root.iterdir():
        digits = p.name[len(STEP_PREFIX):]
        if p.name.startswith(STEP_PREFIX) and digits.isdigit() and (p / TRAINER_STATE).is_file():
            steps.append(int(digits))
    return sorted(steps)


def parse_step(step: str | int) -> int | str:
    """``"latest"`` → ``"latest"``; ``7``, ``"7"``, ``"step_000007"`` → 7. Raises ValueError otherwise."""
    if isinstance(step, int):
        return step
    text = str(step).strip()
    if text == "latest":
        return "latest"
    digits = text.removeprefix("step_")
    if not digits.isdigit():
        raise ValueError(f"checkpoint step {step!r}: expected a number, step_<N> or 'latest'")
    return int(digits)


def resolve_checkpoint(run_dir: str | Path, step: str | int = "latest") -> Path:
    """The folder of checkpoint ``step`` (an int, ``"step_000007"`` or ``"latest"``) of a run.

    Raises CheckpointNotFoundError when ``run_dir`` is not a run directory, has no checkpoint,
    or lacks that step (the message lists the steps that exist); ValueError for a bad ``step``.
    """
    from workers.checkpoint import final_step_dir, load_latest

    run = Path(run_dir)
    if not run.is_dir():
        raise CheckpointNotFoundError(f"run directory {str(run)!r} does not exist")
    if not (run / "config.yaml").is_file() and not (run / "checkpoints").is_dir():
        raise CheckpointNotFoundError(f"{str(run)!r} is not a run directory (no config.yaml, no checkpoints/)")
    wanted = parse_step(step)
    steps = checkpoint_steps(run)
    if not steps:
        raise CheckpointNotFoundError(f"run {str(run)!r} has no checkpoint (nothing under {run / 'checkpoints'})")
    if wanted == "latest":
        latest = load_latest(run / "checkpoints")
        assert latest is not None  # there are complete steps
        return Path(latest)
    if wanted not in steps:
        raise CheckpointNotFoundError(
            f"run {str(run)!r} has no checkpoint at step {wanted}; steps saved: {', '.join(map(str, steps))}"
        )
    return Path(final_step_dir(run / "checkpoints", wanted))


def step_of(step_dir: str | Path) -> int:
    """7 for ``.../step_000007``."""
    return int(Path(step_dir).name.removeprefix("step_"))
