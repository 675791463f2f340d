"""A checkpoint's policy as a plain Hugging Face model folder (``hybridflow export``).

The policy part of a checkpoint (``RUN_DIR/checkpoints/iter_<N>/policy``) is already written
as a plain HF folder (safetensors, LoRA merged, tied weights once, tokenizer); export copies it
atomically to ``OUT_DIR``, adds ``generation_config.json`` when the checkpoint lacks one and a
provenance file ``hybridflow_export.json``, then checks that ``transformers`` loads it
(``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` — what vLLM reads too). No Ray or Prefect.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from flows.checkpoints import CheckpointNotFoundError, resolve_checkpoint, step_of

EXPORT_INFO = "hybridflow_export.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


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
