"""``hybridflow export RUN_DIR [--step N|latest] OUT_DIR``: a checkpoint's policy as a plain
Hugging Face model folder.

The policy part of a checkpoint (``RUN_DIR/checkpoints/step_<N>/policy``) is already written
as a plain HF folder (safetensors, LoRA merged, tied weights once, tokenizer); export copies it
atomically to ``OUT_DIR``, adds ``generation_config.json`` when the checkpoint lacks one and a
provenance file ``hybridflow_export.json``, then checks that ``transformers`` loads it
(``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` — what vLLM reads too). No Ray or Prefect.

Also home of the checkpoint-step lookup that ``hybridflow eval`` and the ``evaluate`` flow
share (:func:`checkpoint_steps`, :func:`resolve_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

EXPORT_INFO = "hybridflow_export.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


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


def _ensure_generation_config(folder: Path) -> None:
    if (folder / "generation_config.json").is_file():
        return
    from transformers import AutoConfig, GenerationConfig

    GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def check_hf_folder(folder: str | Path, *, load: bool = True) -> dict[str, Any]:
    """Check that ``folder`` is a plain HF causal-LM folder: config.json without a
    quantization_config, safetensors weights, tokenizer files, generation_config.json; with
    ``load`` also load it with ``AutoModelForCausalLM`` and ``AutoTokenizer``.
    Returns {"parameters": int | None, "architectures": [...]}. Raises ValueError naming what is wrong.
    """
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else None
    problems = []
    if config is None:
        problems.append("no config.json")
    elif "quantization_config" in config:
        problems.append("config.json has a quantization_config (not a plain float model)")
    if not list(folder.glob("*.safetensors")):
        problems.append("no .safetensors weights")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        problems.append(f"no tokenizer file ({', '.join(TOKENIZER_FILES)})")
    if not (folder / "generation_config.json").is_file():
        problems.append("no generation_config.json")
    if problems:
        raise ValueError(f"{folder} is not a plain Hugging Face model folder: {'; '.join(problems)}")
    params = None
    if load:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder)
        AutoTokenizer.from_pretrained(folder)
        params = sum(p.numel() for p in model.parameters())
    return {"parameters": params, "architectures": config.get("architectures") if config else None}


def export_checkpoint(
    run_dir: str | Path, step: str | int, out_dir: str | Path, *, overwrite: bool = False, load_check: bool = True
) -> dict[str, Any]:
    """Write checkpoint ``step`` of ``run_dir`` as a plain HF folder ``out_dir`` (atomically).

    Returns the provenance dict written to ``out_dir/hybridflow_export.json`` (run, step,
    weights_version, source folder) plus the check's result. The copy is written to a temporary
    sibling of ``out_dir``, checked there, and renamed into place only when complete: on any
    error nothing is left at ``out_dir``. Raises CheckpointNotFoundError (missing run/step,
    listing the steps), CheckpointDamagedError (the step does not match its manifest),
    FileExistsError (``out_dir`` exists and not ``overwrite``), ValueError (the result is not a
    loadable HF folder), OSError (e.g. the disk is full).
    """
    from hybridflow.models.fsutil import atomic_directory
    from workers.checkpoint import read_trainer_state
    from workers.checkpoint_integrity import verify_checkpoint

    step_dir = resolve_checkpoint(run_dir, step)
    verify_checkpoint(step_dir)  # a truncated or changed file: CheckpointDamagedError, nothing written
    src = step_dir / "policy"
    if not (src / "config.json").is_file():
        raise CheckpointNotFoundError(f"checkpoint {step_dir} has no policy/ HF folder (no {src / 'config.json'})")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass --force to replace it)")
    state = read_trainer_state(step_dir)
    info = {
        "run_dir": str(Path(run_dir).resolve()),
        "run_id": Path(run_dir).resolve().name,
        "step": step_of(step_dir),
        "iteration": state.get("iteration"),
        "weights_version": state.get("policy_version"),
        "source": str(src.resolve()),
        "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    with atomic_directory(out, on_exists="replace" if overwrite else "error") as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        _ensure_generation_config(tmp)
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2))
        info["check"] = check_hf_folder(tmp, load=load_check)  # before the rename: a failed export leaves nothing
    return info


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _other_steps(run_dir: str, e: BaseException) -> str:
    from workers.checkpoint_integrity import CheckpointDamagedError

    if not isinstance(e, CheckpointDamagedError):
        return ""
    return f"; steps saved: {', '.join(map(str, checkpoint_steps(run_dir)))} (export another with --step N)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run_id>)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the HF model folder to write")
    p.add_argument("--step", default="latest", help="checkpoint step: N, step_<N> or 'latest' (default: latest)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--no-load-check", action="store_true",
                   help="skip loading the result with transformers (the file checks still run)")
    add_register_argument(p)


def add_register_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--register", metavar="NAME", default=None,
                   help="also register the checkpoint as a new version of MLflow model NAME (in the run's tracking URI)")


def register(args: argparse.Namespace, info: dict) -> int:
    """``--register NAME``: a new model version from the checkpoint's MLflow model (logged now if
    the run did not log one for that step)."""
    from flows.tracking import register_checkpoint

    try:
        version = register_checkpoint(args.run_dir, info["step"], args.out_dir, args.register)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: --register {args.register}: {e}", file=sys.stderr)
        return 2
    print(f"registered MLflow model {version.name!r} version {version.version} (from {version.source})")
    return 0


def run(args: argparse.Namespace) -> int:
    from workers.checkpoint import CheckpointError

    try:
        parse_step(args.step)
        info = export_checkpoint(args.run_dir, args.step, args.out_dir, overwrite=args.force,
                                 load_check=not args.no_load_check)
    except (FileNotFoundError, FileExistsError, ValueError, CheckpointError) as e:
        print(f"error: {_one_line(e)}{_other_steps(args.run_dir, e)}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, I/O error while writing OUT_DIR
        print(f"error: cannot write {args.out_dir}: {e.strerror or e}; nothing was exported", file=sys.stderr)
        return 1
    params = info["check"]["parameters"]
    size = f", {params / 1e6:.1f}M parameters" if params else ""
    print(f"exported step {info['step']} of {info['run_id']} (weights_version {info['weights_version']}) "
          f"to {args.out_dir}{size}")
    print(f"load it with: AutoModelForCausalLM.from_pretrained({str(args.out_dir)!r}); "
          f"evaluate it with: hybridflow eval --model {args.out_dir} -c CONFIG")
    return register(args, info) if args.register else 0
