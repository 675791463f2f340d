"""``hybridflow export RUN_DIR [--step N|latest] OUT_DIR [--register NAME]``: a checkpoint's policy
as a plain Hugging Face model folder (:func:`flows.export.export_checkpoint`); ``--register``
also makes it a version of an MLflow registered model (:func:`flows.tracking.register_checkpoint`).
No Ray or Prefect."""

from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (runs/<run_id>)")
    p.add_argument("out_dir", metavar="OUT_DIR", help="the HF model folder to write")
    p.add_argument("--step", default="latest", help="the checkpoint of RL iteration N: N, iter_<N> or 'latest' (default: latest)")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")
    p.add_argument("--no-load-check", action="store_true",
                   help="skip loading the result with transformers (the file checks still run)")
    p.add_argument("--register", metavar="NAME", default=None,
                   help="also register the checkpoint as a new version of MLflow model NAME (in the run's tracking URI)")


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _other_steps(run_dir: str, e: BaseException) -> str:
    from flows.checkpoints import checkpoint_steps
    from workers.checkpoint_integrity import CheckpointDamagedError

    if not isinstance(e, CheckpointDamagedError):
        return ""
    return f"; steps saved: {', '.join(map(str, checkpoint_steps(run_dir)))} (export another with --step N)"


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
    from flows.checkpoints import parse_step
    from flows.export import export_checkpoint
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
